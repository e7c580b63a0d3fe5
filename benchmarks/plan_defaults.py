"""sft's defaults on this GPU: the micro batch the memory plan chose against the memory the run used, and what the
out-of-memory retry did (`sft.run.failsafe`); JSON + markdown out.

    python -m benchmarks.plan_defaults --out $OUT/plan_defaults [--cases 3b-zero2 ...] [--steps 6]

Each case is one `sft train --nproc-per-node 1` run of the real CLI with the defaults a user gets (`auto` micro batch
and memory tools, FP8, Liger and compiled layers as the plan decides for the GPU), packing, rows of 4,096 tokens, a
global batch of 32 rows, pre-tokenised SFT-like data (LoRA: random base weights saved first), no checkpoints (a 3B
ZeRO-2 checkpoint is 45 GB; a retry starts over). Per case: exit code, what the plan chose and estimated (`Memory
plan ... fits: X GiB of Y GiB usable`), the retries after an out-of-memory error, and per step `peak_memory_gib`
(`torch.cuda.max_memory_allocated`) and `peak_reserved_gib` (the allocator's reserve).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import LLAMA_SHAPES, ROOT, make_sft_data, model_dir

# name -> (shape, decoder layers, DeepSpeed config, recipe overrides)
CASES = {
    "3b-zero2": ("llama-3b", None, "zero2", {}),  # issue #37's run: planned micro 2, OOM at step 4 on H100
    "3b-zero2-fp8off": ("llama-3b", None, "zero2", {"fp8": False}),
    "1b-zero2": ("llama-1b", None, "zero2", {}),
    "3b-zero3": ("llama-3b", None, "zero3", {}),
    "8b-8l-zero2": ("llama-8b", 8, "zero2", {}),
    "8b-zero2-lora": ("llama-8b", None, "zero2", {"use_peft": True, "lora_target_modules": "all-linear"}),
    "3b-zero3-fp8off": ("llama-3b", None, "zero3", {"fp8": False}),
}
LINE = re.compile(r"Batch plan|Memory plan|fits:|auto settings|out of (GPU )?memory|Micro batch|Resuming|Model:|rror")


def run_case(name: str, work: Path, steps: int) -> dict:
    shape, layers, stage, overrides = CASES[name]
    config = dict(LLAMA_SHAPES[shape])
    if layers:
        config["num_hidden_layers"] = layers
    model = model_dir(work / name / "model", config)
    lora = overrides.get("use_peft", False)
    if lora and not (model / "model.safetensors.index.json").exists():  # LoRA needs base weights on disk: random
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("cuda"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.bfloat16)
        base.save_pretrained(model)
        del base
        torch.cuda.empty_cache()
    data = work / "data.jsonl"
    if not data.exists():
        make_sft_data(data, 3000, 32000, 4096)
    out = work / name / "out"
    recipe = {
        "model_name_or_path": str(model), "from_scratch": not lora, "dtype": "bfloat16", "bf16": True,
        "datasets": [{"path": str(data)}], "packing": True, "max_length": 4096, "global_batch_size": 32,
        "max_steps": steps, "logging_steps": 1, "save_strategy": "no", "eval_strategy": "no",
        "report": False, "report_to": "none", "learning_rate": 1e-5, "seed": 0, "output_dir": str(out),
        "deepspeed": str(ROOT / "ds_configs" / f"{stage}.json"), **overrides,
    }  # fmt: skip
    (work / name / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "sft", "train", "--nproc-per-node", "1", "--config", str(work / name / "recipe.yaml")]
    start = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=560)
    log = done.stdout + done.stderr
    metrics = out / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if "loss" in r]
    plan = re.findall(r"fits: ([\d.]+) GiB of ([\d.]+) GiB usable|does NOT fit: ([\d.]+) GiB of ([\d.]+)", log)
    return {
        "exit_code": done.returncode,
        "seconds": round(time.time() - start, 1),
        "said": [line[:400] for line in log.splitlines() if LINE.search(line)][:40],
        "planned_peak_gib": [float(a or c) for a, _, c, _ in plan],
        "usable_gib": [float(b or d) for _, b, _, d in plan],
        "retries": log.count("running again with micro batch"),
        "steps": [r["step"] for r in train],
        "peak_memory_gib": [round(r.get("peak_memory_gib", 0), 2) for r in train],
        "peak_reserved_gib": [round(r.get("peak_reserved_gib", 0), 2) for r in train],
        "tokens_per_second_per_gpu": [round(r.get("tokens_per_second_per_gpu", 0)) for r in train],
        "losses": [r["loss"] for r in train],
        "log_tail": log[-3000:] if done.returncode else "",
    }


def markdown(results: dict) -> str:
    rows = [
        "| case | exit | retries | planned peak GiB (per attempt) | usable GiB | measured peak GiB (max) "
        "| reserved GiB (max) | steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results["cases"].items():
        rows.append(
            f"| {name} | {r['exit_code']} | {r['retries']} | {', '.join(f'{p:.2f}' for p in r['planned_peak_gib'])} "
            f"| {', '.join(f'{u:.2f}' for u in r['usable_gib'][:1])} | {max(r['peak_memory_gib'], default=0):.2f} "
            f"| {max(r['peak_reserved_gib'], default=0):.2f} | {len(r['steps'])} |"
        )
    return f"GPU: {results['gpu']}\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_defaults")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="plan_defaults_"))
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "cases": {}}
    for name in args.cases:
        results["cases"][name] = run_case(name, work, args.steps)
        shutil.rmtree(work / name, ignore_errors=True)  # the models and saves: 64 GB of disk fill up otherwise
        print(name, json.dumps({k: v for k, v in results["cases"][name].items() if k != "log_tail"}), flush=True)
        (args.out / "plan_defaults.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "plan_defaults.md").write_text(markdown(results))


if __name__ == "__main__":
    main()
