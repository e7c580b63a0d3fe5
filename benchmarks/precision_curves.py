"""Loss curves of the ways a one-GPU run steps its weights (issue #65): sft's default without a sharding engine (bf16
weights, torchao's 8-bit AdamW with stochastic rounding) against fp32 master weights (DeepSpeed ZeRO-2's copy, torch's
fused fp32 AdamW; and the same with torchao's 8-bit moments) and against pure bf16 steps (the default's run with
`optim: adamw_torch_fused`: what transformers does with bf16 weights and no engine).

    python -m benchmarks.precision_curves --out $OUT           # Llama-3.2-1B widths on GPU 0, the four runs in turn
    python -m benchmarks.precision_curves --tiny --out /tmp/p  # the demo's widths on the CPU (fp32: a smoke test)
    python -m benchmarks.precision_curves --plot DIR           # draw DIR/precision_curves.png from its json

Every run is the real `sft train` on the same model (random weights, the same seed), the same data and order, a
constant learning rate of 1e-5 (the issue's: an update of 1e-5 is below half a bf16 ulp of most weights). The data are
learnable: each record a walk on a fixed random graph of `--states` tokens with 4 successors each, so the loss can fall
from ln(vocabulary) towards ln(4); random tokens would leave every curve flat. The check: the mean absolute difference
between the default's loss and the fp32 master's over the last half of the steps, beside pure bf16's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import LLAMA_SHAPES, ROOT, environment, model_dir, read_jsonl, sft_command, start, stop

ARMS = {
    "default": {"deepspeed": "none"},  # optim auto -> 8-bit AdamW with bf16_stochastic_round
    "fp32_master": {
        "deepspeed": str(ROOT / "ds_configs" / "zero2.json"),
        "engine": "deepspeed",
        "optim": "adamw_torch_fused",
    },  # fmt: skip
    "pure_bf16": {"deepspeed": "none", "optim": "adamw_torch_fused"},
    # fp32 master weights with torchao's 8-bit moments (what `optim: auto` takes under ZeRO-1/2): which of the
    # default's two differences from fp32 master (8-bit moments, stochastic rounding) moves its curve
    "master_8bit": {
        "deepspeed": str(ROOT / "ds_configs" / "zero2.json"),
        "engine": "deepspeed",
        "optim": "adamw_torch_8bit",
    },  # fmt: skip
}
COMMON = {"from_scratch": True, "learning_rate": 1e-5, "lr_scheduler_type": "constant", "warmup_steps": 0,
          "weight_decay": 0.0, "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none",
          "seed": 0, "packing": True, "dataloader_num_workers": 2}  # fmt: skip


def make_walks(path: Path, n: int, vocab: int, states: int, length: int, seed: int = 0) -> None:
    """`n` records of `length` tokens: walks on a fixed random graph over `states` token ids (4 successors each)."""
    rng = np.random.default_rng(seed)
    tokens = rng.choice(np.arange(10, vocab), size=states, replace=False)
    successors = rng.integers(0, states, size=(states, 4))
    with open(path, "w") as f:
        for _ in range(n):
            state, walk = int(rng.integers(states)), []
            for _ in range(length):
                walk.append(int(tokens[state]))
                state = int(successors[state, rng.integers(4)])
            f.write(json.dumps({"input_ids": walk}) + "\n")


def run_arm(name: str, args, work: Path, model: Path, data: Path) -> dict:
    recipe = {**COMMON, **ARMS[name], "model_name_or_path": str(model), "datasets": [{"path": str(data)}],
              "output_dir": str(work / name), "max_steps": args.steps, "max_length": args.seq_len,
              "global_batch_size": args.rows}  # fmt: skip
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", peak_tflops=1.0, dataloader_num_workers=0)
        if name != "fp32_master":  # fp32 weights: nothing to round; the smoke test runs the mechanics only
            recipe.pop("optim", None)
    else:
        recipe.update(bf16=True, dtype="bfloat16")
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(recipe))
    log = work / "logs" / f"{name}.log"
    began = time.time()
    proc = start(sft_command(1, ["--config", str(config)]), log)
    try:
        rc = proc.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:  # stopped and reported, its steps kept
        stop(proc)
        rc = "timeout"
    metrics = work / name / "metrics.jsonl"
    steps = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
    text = log.read_text()
    said = [line.split(": ", 1)[1] for line in text.splitlines()
            if "Precision:" in line or "auto settings" in line or "optim: auto" in line]  # fmt: skip
    result = {"arm": name, "exit_code": rc, "wall_s": round(time.time() - began, 1), "plan": said,
              "loss": [r["loss"] for r in steps], "peak_memory_gib": max((r.get("peak_memory_gib") or 0) for r in
                                                                          steps) if steps else None}  # fmt: skip
    if rc != 0 or not steps:
        result["log_tail"] = text[-3000:]
    print(f"  {name}: exit {rc}, {result['wall_s']} s, loss {steps[0]['loss'] if steps else '-'} -> "
          f"{steps[-1]['loss'] if steps else '-'}", flush=True)  # fmt: skip
    return result


def compare(runs: dict) -> dict:
    """Over the last half of the steps: each arm's mean absolute loss difference from the fp32 master's, and its
    final loss."""
    ref = runs.get("fp32_master", {}).get("loss") or []
    out = {}
    for name, r in runs.items():
        loss = r.get("loss") or []
        n = min(len(loss), len(ref))
        if not n or name == "fp32_master":
            continue
        half = slice(n // 2, n)
        diff = np.abs(np.array(loss[:n]) - np.array(ref[:n]))[half]
        out[name] = {"mean_abs_diff_last_half": float(diff.mean()),
                     "relative_to_master": float(diff.mean() / np.mean(ref[:n][half])),
                     "final_loss": loss[n - 1], "master_final_loss": ref[n - 1]}  # fmt: skip
    return out


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads((out / "precision_curves.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in result["runs"].items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], marker=".", label=name.replace("_", " "))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{result['model']}: bf16 weights without an engine, lr 1e-5")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "precision_curves.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=8, help="Packed rows per optimizer step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--records", type=int, default=1200)
    parser.add_argument("--states", type=int, default=4096, help="Token ids the walks visit")
    parser.add_argument("--only", nargs="*", default=list(ARMS))
    parser.add_argument("--run-timeout", type=float, default=240)
    parser.add_argument("--tiny", action="store_true", help="The demo's widths on the CPU: a smoke test")
    parser.add_argument("--plot", type=Path, help="Draw <dir>/precision_curves.png from its json; run nothing")
    args = parser.parse_args()
    if args.plot:
        return plot(args.plot)
    if args.out is None:
        sys.exit("--out is needed to measure")
    if args.tiny:
        args.steps, args.rows, args.seq_len, args.records, args.states = min(args.steps, 3), 2, 256, 40, 64
    work = Path(tempfile.mkdtemp(prefix="precision-curves-"))  # the model's data and runs; the logs come back tarred
    (work / "logs").mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    config = None if args.tiny else LLAMA_SHAPES["llama-1b"]
    model = model_dir(work / "model", config)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    data = work / "walks.jsonl"
    make_walks(data, args.records, vocab, min(args.states, vocab - 10), args.seq_len // 2)
    runs = {name: run_arm(name, args, work, model, data) for name in args.only}
    result = {"model": "demo" if args.tiny else "Llama-3.2-1B widths", "steps": args.steps, "rows": args.rows,
              "seq_len": args.seq_len, "environment": environment(), "runs": runs,
              "against_master": compare(runs)}  # fmt: skip
    (args.out / "precision_curves.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.make_archive(str(args.out / "precision_logs"), "gztar", work, "logs")
    print(json.dumps(result["against_master"], indent=2))


if __name__ == "__main__":
    main()
