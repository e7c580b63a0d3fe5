"""The plan `sft train` decides for a model on a GPU it plans for, from two trees of sft: this one and another (an
earlier commit, `git archive <rev> sft | tar -x -C DIR`), each in its own process, the GPU made the one named (this
machine need have none: Liger, FP8 and compiled layers decided as on that card). Prints and writes the training
arguments each plan emits (every field `auto` resolved) and whether they are equal: what a refactor of the plan must
leave unchanged (issue #80: the GPU defaults before and after).

    python -m benchmarks.plan_before_after --before /tmp/before --out benchmarks/results/plan_before_after.json \
        --model meta-llama/Llama-3.2-1B --model Qwen/Qwen3-4B
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = "NVIDIA H100 80GB HBM3"
# The emitted fields a plan decides (the `auto` ones and what they set)
FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "activation_checkpointing",
          "offload_checkpoints", "tiled_mlp", "keep_attention_outputs", "use_liger_kernel", "fp8",
          "compile_decoder_layers", "optim", "optim_args", "engine", "sequence_parallel_size",
          "packing_check")  # fmt: skip

# Run in the child, with the tree under test first on the path
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[5])  # the tree under test ahead of the working directory and the installed sft
import torch
from sft import config as sft_config
from sft.model import fp8
from sft.plan import kernels, search
from sft.plan.arguments import parse_args
from sft.plan.preflight import preflight
gpu, model, memory, fields = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
search.gpu_name = lambda: gpu
kernels.on_gpu = lambda: True
fp8.fp8_gpu = lambda: gpu
if hasattr(sft_config, "cuda_here"):
    sft_config.cuda_here = lambda: True
else:  # before `cuda_here`: the parser's own check of a CUDA GPU for Liger, seen through a torch with one
    class _Cuda:
        def __getattr__(self, name):
            return (lambda: True) if name == "is_available" else getattr(torch.cuda, name)
    class _Torch:
        cuda = _Cuda()
        def __getattr__(self, name):
            return getattr(torch, name)
    sft_config.torch = _Torch()
args = parse_args(["--config", "recipes/demo.yaml", "--output_dir", "/tmp/plan_before_after", "--model_name_or_path",
                   model, "--from_scratch", "false", "--dtype", "bfloat16", "--bf16", "true", "--use_cpu", "true",
                   "--per_device_train_batch_size", "auto", "--activation_checkpointing", "auto", "--optim", "auto",
                   "--engine", "auto", "--plan_gpu_memory_gib", memory, "--global_batch_size", "32", "--max_length",
                   "4096", "--eval_strategy", "no"])
from sft.errors import ConfigError
try:
    plan = preflight(args[2], args[3])
except ConfigError as e:  # a refusal is a plan too: its first sentence compared
    print(json.dumps({"refused": str(e).split(". ")[0]}))
    sys.exit(0)
emitted = {k: getattr(plan.training_args, k, None) for k in fields}
emitted["deepspeed"] = plan.training_args.deepspeed is not None  # `engine: auto` -> none drops the config
import sft
assert sft.__file__.startswith(sys.argv[5]), sft.__file__
print(json.dumps({k: getattr(v, "value", v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                  for k, v in emitted.items()}))
"""


def plan_of(tree: Path, model: str, memory: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, GPU, model, memory, json.dumps(FIELDS), str(tree.resolve())],
                         cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{tree} {model}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a tree holding the other commit's sft/")
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--gpu-memory", default="79.18")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for model in args.model:
        before, after = plan_of(args.before, model, args.gpu_memory), plan_of(ROOT, model, args.gpu_memory)
        rows.append({"model": model, "equal": before == after, "before": before, "after": after})
        print(f"{model}: {'equal' if before == after else 'DIFFERENT'}\n  before {before}\n  after  {after}")
    if args.out:
        args.out.write_text(json.dumps({"gpu": GPU, "gpu_memory_gib": args.gpu_memory, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
