"""Resume on another GPU count: a ZeRO checkpoint written by N processes, continued on M, against uninterrupted runs.

    python -m benchmarks.resume_geometry --stage zero2 --out $OUT        # 2 -> 1 and 1 -> 2 GPUs, default optimizer
    python -m benchmarks.resume_geometry --stage zero3 --out $OUT
    python -m benchmarks.resume_geometry --stage zero2 --optimizers --out $OUT   # 2 -> 1 with other optimizers

Needs 2 GPUs. Every run is the real CLI on the demo data with a Llama-shaped model built from scratch (bf16 mixed
precision, no dropout), global batch 8 packed rows of 1024 tokens (micro batch 2: accumulation 2 on 2 GPUs, 4 on 1),
`--trace_data` on. A resumed run is killed by sft's test hook while writing checkpoint `--kill-at` and the same command
is run again on the other GPU count, so it resumes from the checkpoint before (a universal-checkpoint load).

Runs: two uninterrupted 2-GPU runs (run-to-run noise), one uninterrupted 1-GPU run (what the GPU count alone changes),
2 -> 1 and 1 -> 2; with `--optimizers`, 2 -> 1 with `optim: adamw_torch`, DeepSpeed's own optimizer block (FusedAdam)
and ZeRO offload (DeepSpeed's CPU Adam), each against the default optimizer's uninterrupted run. Reported per pair:
learning rate and tokens equal at every step, the samples of every step equal (data trace, all ranks), and the largest
loss and grad-norm differences before and after the resume point.
Results: `resume_geometry_<stage>[_optimizers].{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import (
    ROOT,
    environment,
    llama_shape,
    model_dir,
    read_jsonl,
    run,
    sft_command,
    start,
    write_results,
)
from sft.run.metrics import samples_per_step

KILL_ENV = "SFT_TEST_KILL_DURING_SAVE"


def train_args(args, model: Path, out: Path, ds_config: str, extra: list[str]) -> list[str]:
    return [
        "--config", str(ROOT / "recipes" / "demo.yaml"), "--model_name_or_path", str(model), "--from_scratch", "true",
        "--output_dir", str(out), "--deepspeed", ds_config, "--max_steps", str(args.steps),
        "--save_strategy", "steps", "--save_steps", str(args.save_every), "--save_total_limit", "3",
        "--logging_steps", "1", "--eval_strategy", "no", "--report_to", "none", "--bf16", "true",
        "--per_device_train_batch_size", "2", "--global_batch_size", "8", "--max_length", "1024",
        "--learning_rate", "3e-4", "--dataloader_num_workers", "2", "--trace_data", "true", *extra,
    ]  # fmt: skip


def on_gpus(nproc: int, gpu: int = 0) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu + i) for i in range(nproc))}


def ds_op_build_env() -> dict:
    """DeepSpeed 0.19.8 JIT-builds FusedAdam/CPU Adam; its op builder cannot parse an arch list with a suffix such as
    torch 2.11+cu13's "10.0a" (`compute_capability_args`: "invalid literal for int() ... '0a'"). Building for this
    GPU's own capability avoids it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    major, minor = torch.cuda.get_device_capability()
    return {"TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}


def compare(ref: Path, other: Path, resumed_at: int) -> dict:
    a = [r for r in read_jsonl(ref / "metrics.jsonl") if "loss" in r]
    b = [r for r in read_jsonl(other / "metrics.jsonl") if "loss" in r]
    result = {"steps": [len(a), len(b)], "same_steps": [r["step"] for r in a] == [r["step"] for r in b]}
    if not result["same_steps"]:
        return result
    result["learning_rate_equal"] = [r["learning_rate"] for r in a] == [r["learning_rate"] for r in b]
    result["num_tokens_equal"] = [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    result["samples_equal_every_step"] = samples_per_step(ref) == samples_per_step(other)
    for key in ("loss", "grad_norm"):
        for part, rows in (("before", range(resumed_at)), ("after", range(resumed_at, len(a)))):
            diffs = [abs(a[i][key] - b[i][key]) for i in rows]
            rel = [abs(a[i][key] - b[i][key]) / abs(a[i][key]) for i in rows if a[i][key]]
            result[f"{key}_max_abs_diff_{part}"] = max(diffs, default=0.0)
            result[f"{key}_max_rel_diff_{part}"] = max(rel, default=0.0)
    result["final_loss"] = [a[-1]["loss"], b[-1]["loss"]]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["zero2", "zero3"], default="zero2")
    parser.add_argument("--optimizers", action="store_true", help="2 -> 1 with the other optimizers instead")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, help="Where the runs write (default: a new temporary directory)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    resumed_at = args.kill_at - args.save_every
    ds = f"ds_configs/{args.stage}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix=f"resume_geometry_{args.stage}_"))
    model = model_dir(work / "model", **llama_shape(args.hidden, args.layers, attention_dropout=0.0))
    logs = args.out / "logs"
    exits: dict[str, list[int]] = {}
    seconds: dict[str, float] = {}

    def train(name: str, nproc: int, gpu: int = 0, ds_config: str = ds, extra=(), env=None, background=False):
        cmd = sft_command(nproc, train_args(args, model, work / name, ds_config, list(extra)))
        environment_ = {**on_gpus(nproc, gpu), **(env or {})}
        if background:
            return start(cmd, logs / f"{name}.log", environment_)
        rc, took = run(cmd, logs / f"{name}.log", environment_)
        exits.setdefault(name, []).append(rc)
        seconds[name] = round(seconds.get(name, 0.0) + took, 1)
        return rc

    def resumed(name: str, before: int, after: int, ds_config: str = ds, extra=(), env=None) -> None:
        train(name, before, ds_config=ds_config, extra=extra, env={KILL_ENV: str(args.kill_at), **(env or {})})
        train(name, after, ds_config=ds_config, extra=extra, env=env)

    train("uninterrupted_2gpu_a", 2)
    pairs: dict[str, tuple[str, str]] = {}
    if not args.optimizers:
        train("uninterrupted_2gpu_b", 2)
        # the 1-GPU reference and the first half of 1 -> 2 side by side, one GPU each
        side = train("resumed_1to2", 1, gpu=1, env={KILL_ENV: str(args.kill_at)}, background=True)
        train("uninterrupted_1gpu", 1, gpu=0)
        exits.setdefault("resumed_1to2", []).append(side.wait())
        train("resumed_1to2", 2)
        resumed("resumed_2to1", 2, 1)
        pairs = {
            "run_to_run (2 GPUs, uninterrupted)": ("uninterrupted_2gpu_a", "uninterrupted_2gpu_b"),
            "GPU count alone (2 vs 1, uninterrupted)": ("uninterrupted_2gpu_a", "uninterrupted_1gpu"),
            "2 -> 1 vs uninterrupted 2 GPUs": ("uninterrupted_2gpu_a", "resumed_2to1"),
            "1 -> 2 vs uninterrupted 1 GPU": ("uninterrupted_1gpu", "resumed_1to2"),
        }
    else:
        ds_optimizer = json.loads((ROOT / ds).read_text())
        ds_optimizer["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
        (work / "ds_optimizer_block.json").write_text(json.dumps(ds_optimizer))
        variants = {
            "adamw_torch": (ds, ["--optim", "adamw_torch"]),
            "deepspeed_optimizer_block": (str(work / "ds_optimizer_block.json"), []),
            "offload_cpu_adam": (f"ds_configs/{args.stage}_offload.json", []),
        }
        for name, (ds_config, extra) in variants.items():
            resumed(f"resumed_2to1_{name}", 2, 1, ds_config, extra, env=ds_op_build_env())
            pairs[f"2 -> 1 {name} vs uninterrupted 2 GPUs (default optimizer)"] = (
                "uninterrupted_2gpu_a",
                f"resumed_2to1_{name}",
            )

    placed = {}
    for name in exits:
        text = (logs / f"{name}.log").read_text()
        placed[name] = [line.split(": ", 1)[-1] for line in text.splitlines() if "optimizer-state tensors" in line]
    comparisons = {
        label: compare(work / a, work / b, resumed_at)
        for label, (a, b) in pairs.items()
        if (work / a / "metrics.jsonl").is_file() and (work / b / "metrics.jsonl").is_file()
    }
    result = {
        "what": f"{args.steps} steps; resumed runs killed writing checkpoint-{args.kill_at}, resumed from "
        f"checkpoint-{resumed_at} on the other GPU count",
        **environment(),
        "stage": args.stage,
        "model": {"hidden": args.hidden, "layers": args.layers, "attention_dropout": 0.0},
        "exit_codes": exits,
        "seconds": seconds,
        "placement_log": placed,
        "comparisons": comparisons,
    }
    cols = ["learning_rate_equal", "num_tokens_equal", "samples_equal_every_step", "loss_max_rel_diff_before",
            "loss_max_rel_diff_after", "grad_norm_max_rel_diff_after", "final_loss"]  # fmt: skip
    rows = [f"| pair | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
    for label, c in comparisons.items():
        cells = [
            (f"{c[k]:.2e}" if isinstance(c.get(k), float) else str(c.get(k, "-")).replace(", ", " / ")) for k in cols
        ]
        rows.append(f"| {label} | {' | '.join(cells)} |")
    head = (
        f"# Resume on another GPU count, {args.stage}{' (other optimizers)' if args.optimizers else ''}\n\n"
        f"{result['device']}, {result['date']}; {result['what']}. Exit codes (killed run, then resume): {exits}\n\n"
    )
    tag = f"resume_geometry_{args.stage}{'_optimizers' if args.optimizers else ''}"
    write_results(args.out, tag, result, head + "\n".join(rows))
    print((args.out / f"{tag}.md").read_text())


if __name__ == "__main__":
    main()
