"""Expert parallelism on two GPUs (issue #41): AutoEP ep=2 against ep=1 data parallelism, and its resume.

    python -m benchmarks.expert_parallel --part speed --layers 4 --out $OUT    # ep=1 vs ep=2, 20 steps each
    python -m benchmarks.expert_parallel --part resume --layers 1 --out $OUT   # killed under ep=2, resumed on 2 and 1
    python -m benchmarks.expert_parallel --part speed --tiny --out /tmp/ep     # CPU smoke test (2 gloo processes)

Every run is the real CLI (`sft train --nproc-per-node N`, sft's defaults under ds_configs/zero2.json) on Qwen3-MoE
at Qwen3-30B-A3B's widths (128 experts, 8 active, expert width 768, hidden 2048; `--layers` decoder layers, the
vocabulary cut to 32,768 as in benchmarks/architectures.py), random weights, `benchmarks.common.make_sft_data`'s
data packed into rows of 4096, 16 rows per optimizer step. The runs differ only in `expert_parallel_size`.

`speed`: per-step loss and grad norm of ep=2 against ep=1 (bf16: within a relative 2e-2), tokens/s per GPU and MFU
on active parameters averaged over steps 6-20, peak memory against the memory plan's peak (the `Memory plan` lines
the run logged). `resume`: ep=2 uninterrupted; ep=2 killed while writing checkpoint-8 (checkpoint-4 complete) and
the same command again (loss, grad norm, learning rate, tokens of every step and the final weights must be
bit-identical); the killed run resumed on one GPU (AutoEP at size 1: the learning rate, tokens and samples of every
step equal, the loss within bf16 tolerance). Output: `<part>.json` and `<part>.md`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import ROOT, environment, make_sft_data, model_dir, read_jsonl, run
from benchmarks.throughput import COMMON

GLOBAL = 16  # packed rows of 4096 per optimizer step
STEPS = {"speed": 20, "resume": 8, "determinism": 8}
WARMUP = 5  # logged steps left out of the averages
PLAN = re.compile(r"peak per GPU \(([^)]*)\)\s+([\d.]+) GiB")


def shape(args) -> dict:
    from benchmarks.architectures import config_for

    config = config_for("qwen3_moe", args.layers, args.tiny).to_dict()
    config.update(dtype="float32" if args.tiny else "bfloat16")
    return config


def recipe(work: Path, name: str, model: Path, data: Path, args, **extra) -> Path:
    r = {**COMMON, "model_name_or_path": str(model), "datasets": [{"path": str(data)}], "global_batch_size": GLOBAL,
         "packing": True, "output_dir": str(work / name), "max_steps": STEPS[args.part], "report": False,
         "dataloader_num_workers": 0, "deepspeed": str(ROOT / "ds_configs" / "zero2.json")}  # fmt: skip
    if args.part != "speed":
        r.update(save_strategy="steps", save_steps=4, save_total_limit=1)
    if args.tiny:
        r.update(bf16=False, dtype="float32", max_length=512, peak_tflops=1.0, global_batch_size=4)
    r.update(extra)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def train(work: Path, name: str, path: Path, nproc: int, env: dict | None = None) -> dict:
    """One `sft train` run of recipe `path` (its output_dir: `work / path.stem`); `name` names its log."""
    cmd = [sys.executable, "-m", "sft", "train", "--nproc-per-node", str(nproc), "--config", str(path)]
    log = work / "logs" / f"{name}.log"
    rc, seconds = run(cmd, log, env)
    text = log.read_text()
    plans = PLAN.findall(text)
    metrics = work / path.stem / "metrics.jsonl"
    steps = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
    planned = float(plans[-1][1]) if plans else None
    return {"name": name, "exit_code": rc, "wall_s": round(seconds, 1), "steps": steps, "planned_peak_gib": planned,
            "log_tail": text[-2500:] if rc else ""}  # fmt: skip


def summary(result: dict) -> dict:
    timed = result["steps"][WARMUP:]
    out = {k: result[k] for k in ("name", "exit_code", "wall_s", "planned_peak_gib")}
    if timed:
        out.update(
            tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
            mfu=float(np.mean([r["mfu"] for r in timed])) if "mfu" in timed[0] else None,
            peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in result["steps"]),
        )
    return out


def per_step(a: dict, b: dict, keys=("loss", "grad_norm")) -> list[dict]:
    return [{"step": x["step"], **{f"{k}_a": x[k] for k in keys}, **{f"{k}_b": y[k] for k in keys}}
            for x, y in zip(a["steps"], b["steps"], strict=False)]  # fmt: skip


def speed(work: Path, model: Path, data: Path, args) -> tuple[dict, str]:
    runs = {ep: train(work, f"ep{ep}", recipe(work, f"ep{ep}", model, data, args, expert_parallel_size=ep), 2)
            for ep in (1, 2)}  # fmt: skip
    rows = per_step(runs[1], runs[2])
    worst = {k: max((abs(r[f"{k}_b"] - r[f"{k}_a"]) / abs(r[f"{k}_a"]) for r in rows), default=None)
             for k in ("loss", "grad_norm")}  # fmt: skip
    result = {"runs": [summary(r) for r in runs.values()], "per_step": rows, "worst_relative_difference": worst}
    a, b = (summary(runs[ep]) for ep in (1, 2))
    ratio = (
        b.get("tokens_per_second_per_gpu", 0) / a["tokens_per_second_per_gpu"]
        if "tokens_per_second_per_gpu" in a
        else None
    )
    result["ep2_over_ep1_tokens_per_second"] = ratio
    md = ["| run | exit | tokens/s/GPU | MFU (active) | peak GiB | planned GiB |", "|---|---|---|---|---|---|"]
    for s in result["runs"]:
        tps, mfu, peak = s.get("tokens_per_second_per_gpu", 0), s.get("mfu") or 0, s.get("peak_memory_gib", 0)
        md.append(
            f"| {s['name']} | {s['exit_code']} | {tps:,.0f} | {mfu:.3f} | {peak:.2f} | {s['planned_peak_gib']} |"
        )
    md.append(f"\nep=2 / ep=1 tokens/s per GPU: {ratio}; worst relative difference over {len(rows)} steps: {worst}")
    return result, "\n".join(md)


def resume(work: Path, model: Path, data: Path, args) -> tuple[dict, str]:
    from sft.run.checkpoint import KILL_DURING_SAVE_ENV

    path = recipe(work, "ep2", model, data, args, expert_parallel_size=2)
    reference = train(work, "ep2", path, 2)
    shutil.rmtree(work / "ep2" / "checkpoint-8", ignore_errors=True)  # disk: only metrics and the model are compared
    killed = recipe(work, "killed", model, data, args, expert_parallel_size=2)
    first = train(work, "killed-first", killed, 2, {KILL_DURING_SAVE_ENV: "8"})
    shutil.copytree(work / "killed", work / "one", ignore=shutil.ignore_patterns("checkpoint-8"))
    again = train(work, "killed", killed, 2)
    one = train(work, "one", recipe(work, "one", model, data, args, expert_parallel_size=1), 1)
    keys = ("loss", "grad_norm", "learning_rate", "num_tokens")
    same = {k: [r[k] for r in reference["steps"]] == [r[k] for r in again["steps"]] for k in keys}
    import safetensors.torch
    import torch

    def weights(name: str) -> dict:
        path = work / name / "model.safetensors"
        return safetensors.torch.load_file(path) if path.exists() else {}

    w_ref, w_again = weights("ep2"), weights("killed")
    same["weights"] = (
        bool(w_ref) and w_ref.keys() == w_again.keys() and all(torch.equal(w_ref[k], w_again[k]) for k in w_ref)
    )
    one_same = {
        k: [r[k] for r in reference["steps"]] == [r[k] for r in one["steps"]] for k in ("learning_rate", "num_tokens")
    }
    losses = [(r["loss"], s["loss"]) for r, s in zip(reference["steps"], one["steps"], strict=False)]
    one_worst = max((abs(b - a) / abs(a) for a, b in losses), default=None)
    result = {
        "runs": [summary(r) for r in (reference, first, again, one)],
        "killed_then_same_command_bit_identical": same,
        "one_gpu_resume_equal": one_same,
        "one_gpu_resume_worst_relative_loss_difference": one_worst,
        "per_step_one_gpu": per_step(reference, one, ("loss", "learning_rate", "num_tokens")),
    }
    md = [f"ep=2 killed at checkpoint-8, same command again: {same}",
          f"resumed on 1 GPU (AutoEP size 1): {one_same}, worst relative loss difference {one_worst}"]  # fmt: skip
    md += [f"{s['name']}: exit {s['exit_code']}, {s['wall_s']} s" for s in result["runs"]]
    return result, "\n".join(md)


def same_weights(a: Path, b: Path) -> bool:
    import safetensors.torch
    import torch

    if not (a / "model.safetensors").exists() or not (b / "model.safetensors").exists():
        return False
    x, y = (safetensors.torch.load_file(p / "model.safetensors") for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def determinism(work: Path, model: Path, data: Path, args) -> tuple[dict, str]:
    """Two identical ep=2 runs with sft's defaults, then with transformers' `full_determinism` (deterministic torch
    algorithms): are they bit-identical? With full_determinism, also killed while writing checkpoint-8 and run
    again, against the uninterrupted run."""
    from sft.run.checkpoint import KILL_DURING_SAVE_ENV

    runs = {}
    for name, extra in (("default-a", {}), ("default-b", {}), ("determ-a", {"full_determinism": True})):
        runs[name] = train(work, name, recipe(work, name, model, data, args, expert_parallel_size=2, **extra), 2)
        shutil.rmtree(work / name / "checkpoint-8", ignore_errors=True)
    killed = recipe(work, "determ-b", model, data, args, expert_parallel_size=2, full_determinism=True)
    runs["determ-b-killed"] = train(work, "determ-b-killed", killed, 2, {KILL_DURING_SAVE_ENV: "8"})
    runs["determ-b"] = train(work, "determ-b", killed, 2)
    keys = ("loss", "grad_norm", "aux_loss", "learning_rate", "num_tokens")

    def same(a: str, b: str, upto: int | None = None) -> dict:
        x, y = runs[a]["steps"][:upto], runs[b]["steps"][:upto]
        return {k: bool(x) and [r[k] for r in x] == [r[k] for r in y] for k in keys}

    result = {
        "runs": [summary(r) for r in runs.values()],
        "default_run_to_run": same("default-a", "default-b"),
        "full_determinism_run_to_run_before_the_kill": same("determ-a", "determ-b-killed", 7),
        "full_determinism_killed_and_rerun_vs_uninterrupted": same("determ-a", "determ-b"),
        "full_determinism_final_weights_bit_identical": same_weights(work / "determ-a", work / "determ-b"),
        "per_step": {n: [{k: r.get(k) for k in keys} for r in runs[n]["steps"]] for n in runs},
    }
    md = [f"{k}: {v}" for k, v in result.items() if k not in ("runs", "per_step")]
    for s in result["runs"]:
        md.append(
            f"{s['name']}: exit {s['exit_code']}, {s['wall_s']} s, {s.get('tokens_per_second_per_gpu', 0):,.0f} tok/s"
        )
    return result, "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=sorted(STEPS), default="speed")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--tiny", action="store_true", help="Demo-sized widths in fp32 on CPU: a smoke test")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ep-"))
    (work / "logs").mkdir()
    config = shape(args)
    model = model_dir(work / "model", config)
    data = work / "data.jsonl"
    make_sft_data(data, args.records, config["vocab_size"], 512 if args.tiny else 4096)
    result, md = {"speed": speed, "resume": resume, "determinism": determinism}[args.part](work, model, data, args)
    result.update(environment=environment(), layers=args.layers, tiny=args.tiny)
    (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.part}.md").write_text(md + "\n")
    shutil.make_archive(str(args.out / f"{args.part}-logs"), "gztar", work, "logs")
    print(md, flush=True)


if __name__ == "__main__":
    main()
