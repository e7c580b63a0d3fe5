"""Where the time of an optimizer step goes: tokens/s of short runs plus a torch.profiler trace of one step each.

    python -m benchmarks.profile_step --out $OUT                      # every variant below (1 GPU)
    python -m benchmarks.profile_step --only sft sft_nods --out $OUT  # a subset
    python -m benchmarks.profile_step --tiny --out /tmp/p             # CPU smoke test: demo-sized model
    python -m benchmarks.profile_step --shape qwen3_moe --layers 4 --out $OUT   # issue #38: MoE against plain TRL

Each variant is the real CLI (`sft/train.py` under torchrun, one process) on the random-initialised Llama-3.2-1B shape
with `benchmarks/throughput.py`'s data, recipe and global batch. Steps `--warmup`+1 .. `--profile-step`-1 give
tokens/s and MFU (from metrics.jsonl); step `--profile-step` runs under torch.profiler, and its GPU kernel time is
summed by kernel class (matmul, attention, Triton, optimizer, copies, ...) against the step's wall time: the gap is
time the GPU waited for the host. Output: runs.jsonl (one record per variant) and profile.md (the tables).

Variants (sft's defaults as in throughput.py, under ZeRO-2, with one change each):
- `sft`: ds_configs/zero2.json as it is.
- `sft_overlap`, `sft_no_overlap`: ZeRO-2 with `overlap_comm` true / false.
- `sft_autoep1` (MoE shape): DeepSpeed AutoEP's MoE layer at expert-parallel size 1 (`sft.engines.deepspeed.autoep`).
- `sft_nods`: no DeepSpeed: transformers' own loop with fp32 weights and bf16 autocast (the same mixed precision as
  DeepSpeed's bf16 with fp32 master weights) and its fused AdamW.

With `--shape qwen3_moe` or `gpt_oss` (Qwen3-30B-A3B's widths: 128 experts, 8 active, expert width 768, hidden
2048; gpt-oss-20b's: 32 experts, 4 active, width 2880; `--layers` decoder layers; the vocabulary cut to 32,768 as in
benchmarks/architectures.py) the global batch is 16 rows and the variants are MoE_VARIANTS: `trl` is what plain TRL
runs (transformers' defaults: its grouped_mm experts, packing on sft's varlen attention, no Liger, no FP8, no
compile, no DeepSpeed, bf16 weights, micro batch 4 x 4 accumulation), `sft` sft's defaults, and one change each (the
experts implementation, `sft.model.experts`; compiled layers; FP8 expert GEMMs; DeepSpeed's fp32 master weights) to
find which of sft's choices costs or gains what. `--shape dense:<moe>` is the dense Llama of the same widths with its
MLP as wide as the active experts (`trl` and `sft` only): the MFU a MoE is compared against.
benchmarks/results/moe_h100/ holds the runs of issue #38 (1 x H100).

benchmarks/results/profile_step_1b_h100/ was run (1 x H100, `--only sft sft_nods sft_no_overlap`) while zero2.json
still had `overlap_comm: true`, so its `sft` row is what `sft_overlap` is now; that run is why zero2.json now says
`"auto"` (off on one process, see `sft.engines.deepspeed.prepare_config`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from benchmarks.architectures import FAMILIES
from benchmarks.common import LLAMA_SHAPES, ROOT, environment, make_sft_data, model_dir, run, torchrun
from benchmarks.throughput import COMMON, GLOBAL_BATCH, SETTINGS
from sft.model import architectures

VARIANTS = {
    "sft": {"deepspeed": "ds_configs/zero2.json"},
    "sft_overlap": {"deepspeed": {"zero_optimization": {"overlap_comm": True}}},
    "sft_no_overlap": {"deepspeed": {"zero_optimization": {"overlap_comm": False}}},
    "sft_nods": {"deepspeed": None, "dtype": "float32"},
}
MOE_SHAPES = ("qwen3_moe", "gpt_oss")  # Qwen3-30B-A3B's and gpt-oss-20b's widths (benchmarks/architectures.py)
HF_EXPERTS = {"model_init_kwargs": {"experts_implementation": "grouped_mm"}}  # transformers' default, pinned
GLOBAL_MOE = 16  # rows of 4096 per optimizer step for the MoE shape: plain TRL's micro batch 4 x 4 accumulation
TRL = {"deepspeed": None, "use_liger_kernel": False, "fp8": False, "compile_decoder_layers": False,
       "per_device_train_batch_size": 4, "global_batch_size": GLOBAL_MOE}  # fmt: skip
MOE_VARIANTS = {
    "trl": {**TRL, **HF_EXPERTS},
    "sft": {"deepspeed": "ds_configs/zero2.json"},
    # one change each of the experts implementation (`sft.model.experts`): sft's defaults with transformers' own, and
    # plain TRL's settings with sft's
    "sft_hf_experts": {"deepspeed": "ds_configs/zero2.json", **HF_EXPERTS},
    "trl_sft_experts": {**TRL, "model_init_kwargs": {"experts_implementation": "sft_grouped"}},
    # sft's defaults with compiled decoder layers, and without
    "sft_compile": {"deepspeed": "ds_configs/zero2.json", "compile_decoder_layers": True},
    "sft_eager": {"deepspeed": "ds_configs/zero2.json", "compile_decoder_layers": False},
    # sft's experts with torchao's float8 grouped GEMMs (`sft.model.experts.NAME_FP8`), compiled layers (the default)
    # or not
    "sft_fp8_experts": {"deepspeed": "ds_configs/zero2.json",
                        "model_init_kwargs": {"experts_implementation": "sft_grouped_fp8"}},
    "sft_fp8_experts_eager": {"deepspeed": "ds_configs/zero2.json", "compile_decoder_layers": False,
                              "model_init_kwargs": {"experts_implementation": "sft_grouped_fp8"}},
    "sft_nods": {"deepspeed": None},
    "sft_micro4": {"deepspeed": "ds_configs/zero2.json", "per_device_train_batch_size": 4},
    "sft_no_liger": {"deepspeed": "ds_configs/zero2.json", "use_liger_kernel": False},
    "sft_nods_micro4": {"deepspeed": None, "per_device_train_batch_size": 4},
    # without DeepSpeed but with its precision: fp32 weights and optimizer, bf16 autocast (transformers' loop)
    "sft_nods_fp32": {"deepspeed": None, "dtype": "float32"},
    # DeepSpeed AutoEP's MoE layer (its router, grouped experts and combine) at size 1 instead of transformers' own
    "sft_autoep1": {"deepspeed": {"expert_parallel": {"enabled": True, "autoep_size": 1}}},
}  # fmt: skip
# the dense model of a MoE shape's active width: plain TRL's settings and sft's (no experts implementation to choose)
DENSE_VARIANTS = {"trl": TRL, "sft": MOE_VARIANTS["sft"]}
CLASSES = [  # first match wins; matched against the CUDA kernel name
    ("attention", r"flash|fmha|attn"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm100_|wgmma"),
    ("optimizer", r"multi_tensor|adam|fused_adamw"),
    ("nccl", r"nccl"),
    ("memcpy/memset", r"memcpy|memset|Memcpy|Memset"),
    ("copy/cast", r"copy|(?<!no)cast|Cat|to_copy"),  # not "gpu_kernel_impl_nocast" (any elementwise kernel)
    ("triton (Liger, TRL fused head)", r"^_|triton|liger|kernel_[0-9]"),
    ("reduction", r"reduce|Reduce|sum|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def kernel_class(name: str) -> str:
    return next((label for label, pattern in CLASSES if re.search(pattern, name)), "other")


def ds_config(work: Path, spec) -> str | None:
    if spec is None or isinstance(spec, str):
        return None if spec is None else str(ROOT / spec)
    config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    for key, value in spec.items():
        config[key] = {**config.get(key, {}), **value}
    path = work / f"zero2-{len(list(work.glob('zero2-*.json')))}.json"
    path.write_text(json.dumps(config, indent=2))
    return str(path)


def shape_config(args) -> dict | None:
    """The model's config.json values: Llama-3.2-1B's, or Qwen3-30B-A3B's widths at `--layers` layers (tiny with
    `--tiny`); None: the demo's."""
    if args.shape == "llama-1b":
        return None if args.tiny else LLAMA_SHAPES["llama-1b"]
    from benchmarks.architectures import config_for

    if args.shape.startswith("dense:"):  # Llama at the MoE's widths, its MLP as wide as the active experts
        moe = config_for(args.shape.removeprefix("dense:"), args.layers, args.tiny)
        dense = config_for("llama", args.layers, args.tiny).to_dict()
        keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        dense.update({key: getattr(moe, key) for key in keys}, intermediate_size=architectures.of(moe).mlp_width)
        dense.update(dtype="bfloat16" if not args.tiny else "float32")
        return dense
    config = config_for(args.shape, args.layers, args.tiny).to_dict()
    config.update(dtype="bfloat16" if not args.tiny else "float32")
    return config


def variants(args) -> dict:
    if args.shape == "llama-1b":
        return VARIANTS
    return DENSE_VARIANTS if args.shape.startswith("dense:") else MOE_VARIANTS


def recipe(name: str, args, work: Path, data: Path) -> Path:
    variant = dict(variants(args)[name])
    model = model_dir(work / f"model-{args.shape}", shape_config(args))
    r = {**COMMON, **SETTINGS["sft"], "model_name_or_path": str(model)}
    if args.shape != "llama-1b":
        r["global_batch_size"] = GLOBAL_MOE
    r.update(datasets=[{"path": str(data)}], output_dir=str(work / name), max_steps=args.profile_step + 1)
    deepspeed = ds_config(work, variant.pop("deepspeed"))
    if deepspeed:
        r["deepspeed"] = deepspeed
    r.update(variant)
    if args.gpu_memory:
        r["max_gpu_memory_gib"] = args.gpu_memory
    if args.tiny:
        r.update(bf16=False, dtype="float32", max_length=512, peak_tflops=1.0, global_batch_size=4)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def profile(name: str, args, work: Path, data: Path) -> dict:
    path = recipe(name, args, work, data)
    trace = work / f"{name}.profile.json"
    cmd = [*torchrun(1), "-m", "benchmarks.profile_step", "--inner", str(path)]
    cmd += ["--profile-step", str(args.profile_step), "--out", str(trace)]
    rc, seconds = run(cmd, work / "logs" / f"{name}.log")
    result = {"name": name, "exit_code": rc, "wall_s": round(seconds, 1)}
    metrics = work / name / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in steps if "loss" in r and "tokens_per_second_per_gpu" in r]
    timed = steps[args.warmup : args.profile_step - 1]
    if rc != 0 or not timed or not trace.exists():
        result["log_tail"] = (work / "logs" / f"{name}.log").read_text()[-3000:]
        return result
    result.update(
        steps_timed=len(timed),
        losses=[r["loss"] for r in steps],
        tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
        mfu=float(np.mean([r["mfu"] for r in timed])) if "mfu" in timed[0] else None,
        peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in steps),
        profile=json.loads(trace.read_text()),
    )
    return result


def step_profiler(step: int, out: Path):
    """A TrainerCallback that runs optimizer step `step` (1-based) under torch.profiler and writes `summarize`'s
    figures to `out` (rank 0 only)."""
    import os

    import torch
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            if state.global_step + 1 == step:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()
                self.start = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step == step:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = time.perf_counter() - self.start
                self.prof.__exit__(None, None, None)
                if int(os.environ.get("RANK", "0")) == 0:
                    out.write_text(json.dumps(summarize(self.prof, wall)))

    return StepProfiler()


def inner(args) -> None:
    """Inside torchrun: sft's CLI (`--config` plus any further flags) with a callback that profiles one step."""
    import sft.run.trainer
    from sft.train import main

    init = sft.run.trainer.Trainer.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self.add_callback(step_profiler(args.profile_step, args.out))

    sft.run.trainer.Trainer.__init__ = patched
    main(["--config", str(args.inner), *args.rest])


def _union(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals (kernels of several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def summarize(prof, wall: float) -> dict:
    from torch.autograd import DeviceType

    kernels, by_class, cpu = defaultdict(float), defaultdict(float), defaultdict(float)
    intervals, names = [], []
    for evt in prof.events():
        # c10d's `nccl:<collective>` annotation is a GPU-side range over the same span as the NCCL kernel it launches:
        # counted once, as the kernel
        if evt.device_type == DeviceType.CUDA and not evt.name.startswith("nccl:"):
            us = evt.time_range.end - evt.time_range.start
            kernels[evt.name] += us
            by_class[kernel_class(evt.name)] += us
            intervals.append((evt.time_range.start, evt.time_range.end))
            names.append(evt.name.lower())
        else:
            cpu[evt.name] += evt.self_cpu_time_total
    busy, compute = (
        _union(intervals),
        _union([i for i, name in zip(intervals, names, strict=True) if "nccl" not in name]),
    )
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    top_cpu = sorted(cpu.items(), key=lambda kv: -kv[1])[:25]
    return {
        "step_wall_s": wall,
        "gpu_busy_s": busy / 1e6,
        "gpu_busy_fraction": busy / 1e6 / wall,
        # kernels other than NCCL's: wall minus this is what the step waited for the host or for collectives
        "compute_busy_s": compute / 1e6,
        "by_class_s": {k: v / 1e6 for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels_s": [[k, v / 1e6] for k, v in top],
        "top_cpu_self_s": [[k, v / 1e6] for k, v in top_cpu],
    }


def report(runs: list[dict], out: Path, env: dict, args) -> None:
    shape = "Llama-3.2-1B shape" if args.shape == "llama-1b" else f"{args.shape} shape, {args.layers} layers"
    batch = GLOBAL_BATCH if args.shape == "llama-1b" else GLOBAL_MOE
    lines = [f"# One-step profiles, {shape}, 1 x {env['gpu']}", "",
             f"Date {time.strftime('%Y-%m-%d')}; seq 4096; global batch {batch} packed rows; versions: "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), "",
             "| variant | exit | tokens/s/GPU | MFU | peak GiB | step wall s | GPU busy | " + " | ".join(
                 label for label, _ in CLASSES) + " | other |",
             "|" + " --- |" * (8 + len(CLASSES))]  # fmt: skip
    for r in runs:
        if "profile" not in r:
            lines.append(f"| {r['name']} | {r['exit_code']} | failed |" + " |" * (5 + len(CLASSES)))
            continue
        p = r["profile"]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        classes = " | ".join(f"{p['by_class_s'].get(label, 0.0):.3f}" for label, _ in [*CLASSES, ("other", "")])
        lines.append(f"| {r['name']} | 0 | {r['tokens_per_second_per_gpu']:.0f} | {mfu} | "
                     f"{r['peak_memory_gib']:.1f} | {p['step_wall_s']:.3f} | {100 * p['gpu_busy_fraction']:.1f}% | "
                     f"{classes} |")  # fmt: skip
    for r in runs:
        if "profile" in r:
            lines += ["", f"## {r['name']}: top kernels (s in the profiled step)", ""]
            lines += [f"- {v:.4f} {k[:150]}" for k, v in r["profile"]["top_kernels_s"][:25]]
            lines += ["", f"## {r['name']}: top host ops by self CPU time (s)", ""]
            lines += [f"- {v:.4f} {k[:150]}" for k, v in r["profile"]["top_cpu_self_s"][:15]]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 12 + len(runs)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", choices=sorted({*VARIANTS, *MOE_VARIANTS}))
    parser.add_argument("--shape", choices=["llama-1b", *FAMILIES, *(f"dense:{s}" for s in MOE_SHAPES)],
                        default="llama-1b", help="Llama-3.2-1B, or a family of benchmarks/architectures.py at its "
                        "widths and --layers layers (MOE_VARIANTS apply to any of them)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the MoE shape")
    parser.add_argument("--gpu-memory", type=float, help="GiB each run is planned for and capped at (79.18: an H100)")
    parser.add_argument("--warmup", type=int, default=4, help="Logged steps left out of the averages")
    parser.add_argument("--profile-step", type=int, default=9, help="The optimizer step to profile (1-based)")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--tiny", action="store_true", help="Demo-sized model in fp32 on CPU: a smoke test")
    parser.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if rest and not args.inner:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.inner:
        inner(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="profile-"))
    (work / "logs").mkdir()
    data = work / "data.jsonl"
    vocab = (shape_config(args) or {}).get("vocab_size", 104)
    make_sft_data(data, args.records, vocab, 512 if args.tiny else 4096)
    runs = []
    for name in args.only or variants(args):
        result = profile(name, args, work, data)
        runs.append(result)
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{name}: exit {result['exit_code']}, {result['wall_s']} s, "
              f"{result.get('tokens_per_second_per_gpu', 0):.0f} tokens/s/GPU", flush=True)  # fmt: skip
    shutil.make_archive(str(args.out / "logs"), "gztar", work, "logs")
    report(runs, args.out, environment(), args)


if __name__ == "__main__":
    main()
