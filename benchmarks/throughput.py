"""Tokens/s per GPU, MFU, peak memory and scaling: TRL's defaults, TRL packing (varlen), sft's default; one matrix.

    python -m benchmarks.throughput --out $OUT                       # the whole matrix (needs 4 GPUs)
    python -m benchmarks.throughput --only 1b --out $OUT             # a subset: names containing any of the words
    python -m benchmarks.throughput --report DIR [DIR ...] --out benchmarks/results   # merge runs into one table
    python -m benchmarks.throughput --tiny --out /tmp/t              # CPU smoke test: demo-sized model

benchmarks/results/throughput.{json,md} were made by four calls (a device call runs at most 10 minutes):
`--only 1b` on 1 x H100 (throughput_h100/), then on 4 x H200 `--only 8b-4gpu-zero3-sft 8b-4gpu-zero3-trl_packing
8b-4gpu-zero2 8b-2gpu`, `--only 3b-4gpu-zero3 3b-4gpu-zero2-sft 3b-2gpu 3b-1gpu 8b-4gpu-zero3-trl_defaults` and
`--only 8b-4gpu-zero3-sft_buckets 3b-4gpu-zero2-trl_packing` (throughput_h200x4/call2..4), merged with `--report`.

Every run is the real CLI (`sft/train.py` under torchrun) on random-initialised Llama shapes (1B, 3B, 8B from their
public configs), seq 4096, pre-tokenised records with an SFT-like length distribution
(`benchmarks.common.make_sft_data`: log-normal, median 300 tokens, 16..4096, so tens to thousands with a long tail).
Numbers are read back from each run's metrics.jsonl (`sft.run.trainer`: real tokens per second per GPU; MFU from
linear- layer FLOPs + causal attention over the real sample lengths, against the GPU's dense bf16 peak), averaged over
the steps after the warm-up.

Settings (same data, max_length and DeepSpeed config within a cell; packed runs also the same global batch):
- `trl_defaults`: TRL's SFTConfig defaults: no packing (padded rows), sdpa attention, activation checkpointing on,
  8 rows per GPU, 1 accumulation step, no Liger.
- `trl_packing`: the same plus `packing: true` (TRL's padding-free BFD packing) on PyTorch's varlen FlashAttention-2,
  8 rows per GPU, accumulation to the global batch.
- `sft`: sft's defaults, nothing tuned by hand: `packing: true`, `attn_implementation: auto`, micro batch and
  checkpointing from the memory plan (`auto`), Liger on (the default with a GPU), the global batch.
- variants of `sft` with one change, to decide defaults: `sft_no_liger`, `sft_compile` (decoder layers compiled),
  `sft_ckpt` (checkpointing forced on), `sft_buckets` (DeepSpeed bucket sizes 5e8 instead of transformers' `auto`);
  for ZeRO-3 (issue #23) `sft_deepcompile` (DeepSpeed's DeepCompile: `"compile": {"deepcompile": true}` and
  `torch_compile`, which makes accelerate call `engine.compile()`), `sft_prefetch` (`stage3_prefetch_bucket_size`
  5e8), `sft_persist` (`stage3_param_persistence_threshold` 5e6: the k and v projections of these shapes kept whole).

Runs are grouped in waves that use disjoint GPUs and run at the same time (two 2-GPU runs, or 1-GPU runs, side by
side); the report says which. The baselines run through sft's `Trainer`, i.e. TRL's SFTTrainer plus sft's
per-micro-batch packed-batch check and FLOP count, which the sft rows pay too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import LLAMA_SHAPES, ROOT, environment, make_sft_data, model_dir, sft_command, start, stop

SHAPES = {"1b": LLAMA_SHAPES["llama-1b"], "3b": LLAMA_SHAPES["llama-3b"], "8b": LLAMA_SHAPES["llama-8b"]}
GLOBAL_BATCH = 32  # packed rows of 4096 tokens per optimizer step (131,072 tokens); divisible by 8 rows x 1, 2, 4 GPUs
COMMON = {"bf16": True, "dtype": "bfloat16", "learning_rate": 1e-5, "lr_scheduler_type": "constant",
          "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "seed": 0,
          "dataloader_num_workers": 2, "from_scratch": True, "max_length": 4096}  # fmt: skip
SETTINGS = {
    "trl_defaults": {"packing": False, "padding_free": False, "attn_implementation": "sdpa",
                     "activation_checkpointing": True, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "use_liger_kernel": False},
    "trl_packing": {"packing": True, "attn_implementation": "sft_varlen", "activation_checkpointing": True,
                    "per_device_train_batch_size": 8, "global_batch_size": GLOBAL_BATCH, "use_liger_kernel": False},
    "sft": {"packing": True, "global_batch_size": GLOBAL_BATCH},
    "sft_no_liger": {"packing": True, "global_batch_size": GLOBAL_BATCH, "use_liger_kernel": False},
    "sft_compile": {"packing": True, "global_batch_size": GLOBAL_BATCH, "compile_decoder_layers": True},
    "sft_ckpt": {"packing": True, "global_batch_size": GLOBAL_BATCH, "activation_checkpointing": True},
    "sft_buckets": {"packing": True, "global_batch_size": GLOBAL_BATCH,
                    "ds": {"zero_optimization": {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8}}},
    # DeepSpeed's levers for ZeRO-3 (issue #23); `ds` is merged into the stage's config
    "sft_deepcompile": {"packing": True, "global_batch_size": GLOBAL_BATCH, "torch_compile": True,
                        "compile_decoder_layers": False, "ds": {"compile": {"deepcompile": True}}},
    "sft_deepcompile_fp8": {"packing": True, "global_batch_size": GLOBAL_BATCH, "torch_compile": True,
                            "compile_decoder_layers": False, "fp8": True, "ds": {"compile": {"deepcompile": True}}},
    "sft_fp8": {"packing": True, "global_batch_size": GLOBAL_BATCH, "fp8": True},
    "sft_prefetch": {"packing": True, "global_batch_size": GLOBAL_BATCH,
                     "ds": {"zero_optimization": {"stage3_prefetch_bucket_size": 5e8}}},
    "sft_persist": {"packing": True, "global_batch_size": GLOBAL_BATCH,
                    "ds": {"zero_optimization": {"stage3_param_persistence_threshold": 5e6}}},
}  # fmt: skip
STAGES = {"zero2": "ds_configs/zero2.json", "zero3": "ds_configs/zero3.json"}


def _named(word: str, name: str) -> bool:
    return word[:-1] == name if word.endswith("$") else word in name


def cell(model: str, gpus: int, stage: str, setting: str) -> dict:
    return {"name": f"{model}-{gpus}gpu-{stage}-{setting}", "model": model, "gpus": gpus, "stage": stage,
            "setting": setting}  # fmt: skip


# Waves: the runs of a wave start together on disjoint GPUs; waves run one after another.
MATRIX = [
    *[[cell("1b", 1, "zero2", s)] for s in ("trl_defaults", "trl_packing", "sft", "sft_no_liger", "sft_compile")],
    *[[cell(m, 4, st, s)] for m in ("8b", "3b") for st in ("zero3", "zero2") for s in ("sft", "trl_packing")],
    [cell("8b", 2, "zero3", "sft"), cell("8b", 2, "zero2", "sft")],
    [cell("8b", 4, "zero3", "trl_defaults")],
    [cell("8b", 4, "zero3", "sft_buckets")],
    [cell("3b", 2, "zero3", "sft"), cell("3b", 2, "zero2", "sft")],
    [cell("3b", 1, "zero2", "sft"), cell("3b", 1, "zero3", "sft")],
    *[[cell("3b", 1, "zero3", s)] for s in ("sft_deepcompile", "sft_deepcompile_fp8", "sft_fp8")],
    *[[cell(m, 2, "zero3", s)] for m in ("8b", "3b") for s in ("sft_prefetch", "sft_persist")],
    [cell("1b", 1, "zero3", "sft")],
]


def ds_config(work: Path, stage: str, name: str, overrides: dict | None) -> str:
    """The stage's config from ds_configs/, with a variant's `ds` values merged in (one level deep)."""
    if not overrides:
        return str(ROOT / STAGES[stage])
    config = json.loads((ROOT / STAGES[stage]).read_text())
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path = work / f"{name}-ds.json"
    path.write_text(json.dumps(config, indent=2))
    return str(path)


def launch(run: dict, gpu_ids: list[int], args, work: Path, data: Path):
    settings = dict(SETTINGS[run["setting"]])
    overrides = settings.pop("ds", None)
    model = model_dir(work / f"model-{run['model']}", None if args.tiny else SHAPES[run["model"]])
    recipe = {**COMMON, **settings, "model_name_or_path": str(model)}
    recipe.update(datasets=[{"path": str(data)}], output_dir=str(work / run["name"]), max_steps=args.steps)
    recipe["deepspeed"] = ds_config(work, run["stage"], run["name"], overrides)
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", max_length=512, attn_implementation="auto", peak_tflops=1.0)
        recipe.pop("use_liger_kernel", None)
    (work / f"{run['name']}.yaml").write_text(yaml.safe_dump(recipe))
    nproc = min(run["gpus"], 2) if args.tiny else run["gpus"]
    env = {} if args.tiny else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}
    cmd = sft_command(nproc, ["--config", str(work / f"{run['name']}.yaml")])
    return start(cmd, work / "logs" / f"{run['name']}.log", env)


def collect(run: dict, proc, args, work: Path, wave: list[str], rc=None) -> dict:
    """A run's result from its metrics.jsonl and log, once it ended (waited for here unless `rc` says how it ended;
    `"stopped"`: ended by the caller after its last step was logged, which counts as a success)."""
    import subprocess

    if rc is None:
        try:
            rc = proc.wait(timeout=max(args.run_timeout - (time.time() - proc.started), 1))
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = "timeout"
    proc.log.close()
    result = {**run, "exit_code": rc, "wall_s": round(time.time() - proc.started, 1), "wave": wave, "gpu": args.gpu}
    metrics = work / run["name"] / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in lines if "loss" in r and "tokens_per_second_per_gpu" in r]
    timed = steps[args.warmup :]
    log_text = (work / "logs" / f"{run['name']}.log").read_text()
    plan = [
        line.split("sft.plan.preflight: ", 1)[1] for line in log_text.splitlines() if "sft.plan.preflight: " in line
    ]
    result["plan"] = [p for p in plan if p.startswith(("auto settings", "Batch plan"))]
    if rc not in (0, "stopped") or not timed:
        result["log_tail"] = log_text[-3000:]
        return result
    result.update(
        steps_timed=len(timed),
        losses=[r["loss"] for r in steps],
        tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
        tflops_per_gpu=float(np.mean([r["tflops_per_gpu"] for r in timed])),
        mfu=float(np.mean([r["mfu"] for r in timed])) if "mfu" in timed[0] else None,
        tokens_per_step=float(np.mean([r["tokens_per_step"] for r in timed])),
        peak_memory_gib=max((r.get("peak_memory_gib", 0.0) for r in steps), default=0.0),
        packing_efficiency=float(np.mean([r["packing_efficiency"] for r in timed]))
        if "packing_efficiency" in timed[0]
        else None,
    )
    return result


def run_matrix(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="throughput-"))
    (work / "logs").mkdir(parents=True)
    data = work / "data.jsonl"
    vocab = 104 if args.tiny else SHAPES["1b"]["vocab_size"]
    make_sft_data(data, args.records, vocab, 512 if args.tiny else 4096)
    waves = [[r for r in wave if not args.only or any(_named(w, r["name"]) for w in args.only)] for wave in MATRIX]
    room = args.gpus_on_machine or 2  # --tiny: 2 CPU processes per run, one run at a time
    waves = [part for w in waves if w for part in _fit(w, room)]
    for i, wave in enumerate(waves):
        names = [r["name"] for r in wave]
        print(f"wave {i + 1}/{len(waves)}: {', '.join(names)}", flush=True)
        procs, first = [], 0
        for run in wave:
            procs.append(launch(run, list(range(first, first + run["gpus"])), args, work, data))
            first += run["gpus"]
        for run, proc in zip(wave, procs, strict=True):
            result = collect(run, proc, args, work, names)
            with open(args.out / "runs.jsonl", "a") as f:  # few files: the device returns a limited number
                f.write(json.dumps(result) + "\n")
            mfu = f"{result['mfu']:.3f}" if result.get("mfu") is not None else "-"
            print(f"  {run['name']}: exit {result['exit_code']}, {result['wall_s']} s, "
                  f"{result.get('tokens_per_second_per_gpu', 0):.0f} tokens/s/GPU, MFU {mfu}", flush=True)  # fmt: skip
        shutil.make_archive(str(args.out / "logs"), "gztar", work, "logs")
    report(args, [args.out])


def _fit(wave: list[dict], gpus: int) -> list[list[dict]]:
    """A wave split into consecutive waves that each fit on this machine's GPUs."""
    parts, used = [[]], 0
    for run in wave:
        if parts[-1] and used + run["gpus"] > gpus:
            parts.append([])
            used = 0
        parts[-1].append(run)
        used += run["gpus"]
    return parts


def report(args, dirs: list[Path]) -> None:
    runs = {}
    for d in dirs:
        if (d / "runs.jsonl").exists():
            for line in (d / "runs.jsonl").read_text().splitlines():
                runs[json.loads(line)["name"]] = json.loads(line)
        elif (d / "throughput.json").exists():
            runs.update(json.loads((d / "throughput.json").read_text())["runs"])
    env_files = [d / "environment.json" for d in dirs if (d / "environment.json").exists()]
    env = json.loads(env_files[0].read_text()) if env_files else environment()
    gpus = sorted({r.get("gpu", env["gpu"]) for r in runs.values()})
    lines = [f"# Throughput: TRL defaults vs TRL packing (varlen) vs sft default — {', '.join(gpus)}", ""]
    lines += [f"Date {time.strftime('%Y-%m-%d')}; seq 4096; global batch {GLOBAL_BATCH} packed rows for the packed "
              "settings; random-init Llama shapes; MFU against 989 TFLOP/s dense bf16 (spec) per GPU; "
              f"{args.warmup} warm-up steps left out. Versions: "
              + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), ""]  # fmt: skip
    lines += ["| run | GPU | exit | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | tokens/step | packing eff. | plan | "
              "side by side with |", "|" + " --- |" * 11]  # fmt: skip
    for name, r in runs.items():
        others = ", ".join(n for n in r.get("wave", []) if n != name) or "-"
        if "tokens_per_second_per_gpu" not in r:
            lines.append(f"| {name} | {r.get('gpu', env['gpu'])} | {r['exit_code']} | failed | | | | | | | {others} |")
            continue
        chosen = next((p.removeprefix("auto settings: ") for p in r["plan"] if p.startswith("auto settings")), "-")
        eff = f"{r['packing_efficiency']:.3f}" if r["packing_efficiency"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(
            f"| {name} | {r.get('gpu', env['gpu'])} | 0 | {r['tokens_per_second_per_gpu']:.0f} | "
            f"{r['tflops_per_gpu']:.0f} | {mfu} | "
            f"{r['peak_memory_gib']:.1f} | {r['tokens_per_step']:.0f} | {eff} | {chosen} | {others} |"
        )
    lines += ["", "## Ratios", ""]
    ratios = {}
    for name, r in runs.items():
        if r.get("setting") != "sft" or "tokens_per_second_per_gpu" not in r:
            continue
        base = name.rsplit("-", 1)[0]
        for other in ("trl_packing", "trl_defaults"):
            o = runs.get(f"{base}-{other}")
            if o and "tokens_per_second_per_gpu" in o:
                ratio = r["tokens_per_second_per_gpu"] / o["tokens_per_second_per_gpu"]
                ratios[f"{base}: sft / {other}"] = ratio
                lines.append(f"- {base}: sft / {other} tokens/s = {ratio:.2f}x")
        if r["stage"] == "zero3":
            z2 = runs.get(name.replace("zero3", "zero2"))
            if z2 and "tokens_per_second_per_gpu" in z2:
                ratio = r["tokens_per_second_per_gpu"] / z2["tokens_per_second_per_gpu"]
                ratios[f"{base}: zero3 / zero2"] = ratio
                lines.append(f"- {base}: ZeRO-3 / ZeRO-2 tokens/s = {ratio:.3f}")
    lines += ["", "## Scaling (sft default; efficiency = tokens/s/GPU at N GPUs / at the fewest GPUs measured)", ""]
    scaling = {}
    for model in SHAPES:
        for stage in STAGES:
            points = {r["gpus"]: r["tokens_per_second_per_gpu"] for r in runs.values()
                      if r["model"] == model and r["stage"] == stage and r["setting"] == "sft"
                      and "tokens_per_second_per_gpu" in r}  # fmt: skip
            if len(points) > 1:
                low = min(points)
                scaling[f"{model}-{stage}"] = {n: points[n] / points[low] for n in sorted(points)}
                lines.append(f"- {model} {stage}: " + ", ".join(
                    f"{n} GPU {points[n]:.0f} tokens/s/GPU ({100 * points[n] / points[low]:.0f}%)"
                    for n in sorted(points)))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"environment": env, "global_batch": GLOBAL_BATCH, "date": time.strftime("%Y-%m-%d"),
               "warmup_steps": args.warmup, "runs": runs, "ratios": ratios, "scaling": scaling}  # fmt: skip
    (args.out / "throughput.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--only",
        nargs="*",
        help="Run only the runs whose name contains one of these words (a word ending in $: the whole name)",
    )
    parser.add_argument("--report", nargs="*", type=Path, help="Merge the runs of these output dirs; run nothing")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4, help="Logged steps left out of the averages")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--run-timeout", type=float, default=420, help="Seconds before a run is killed")
    parser.add_argument("--tiny", action="store_true", help="Demo-sized model in fp32 on CPU: a smoke test")
    args = parser.parse_args()
    if args.report:
        report(args, args.report)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    args.gpu, args.gpus_on_machine = env["gpu"], 0 if args.tiny else env["gpus_on_machine"]
    (args.out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    run_matrix(args)


if __name__ == "__main__":
    main()
