"""Stop-and-resume versus an uninterrupted run, on whatever hardware this runs on; writes JSON and a markdown table.

    python benchmarks/resume_exactness.py --nproc 2 --deepspeed ds_configs/zero3.json --bf16 --out results/

Four runs of the same command on the demo data with a Llama-shaped model built from scratch (attention dropout on):
two uninterrupted runs (to measure run-to-run noise of the hardware), and one that the main process SIGKILLs in the
middle of writing checkpoint `--kill-at` (the test hook of sft.trainer), then the same command again, which resumes
from the previous complete checkpoint. Reported: the largest per-step difference of loss, grad norm and learning
rate, and of the final weights, between each pair.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def model_dir(path: Path, hidden: int, layers: int) -> Path:
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        shutil.copy(f, path)
    config = json.loads((path / "config.json").read_text())
    heads = hidden // 64
    config.update(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        attention_dropout=0.1,
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def train(args, model: Path, out: Path, env_extra: dict | None = None) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd += [str(ROOT / "sft" / "train.py"), "--config", str(ROOT / "recipes" / "demo.yaml")]
    cmd += ["--model_name_or_path", str(model), "--output_dir", str(out), "--deepspeed", args.deepspeed]
    cmd += ["--max_steps", str(args.steps), "--save_strategy", "steps", "--save_steps", str(args.save_every)]
    cmd += ["--logging_steps", "1", "--eval_strategy", "no", "--bf16", str(args.bf16).lower()]
    cmd += ["--dtype", "float32", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    cmd += ["--dataloader_num_workers", "2", "--max_length", "1024", "--learning_rate", "1e-3"]
    start = time.time()
    with open(out.parent / f"{out.name}.log", "a") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env_extra or {})}, stdout=log, stderr=log).returncode
    return rc, time.time() - start


def compare(a: Path, b: Path) -> dict:
    import safetensors.torch

    ra = [r for r in map(json.loads, (a / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    rb = [r for r in map(json.loads, (b / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in ra] == [r["step"] for r in rb], "different steps logged"
    result = {
        f"max_abs_diff_{k}": max(abs(x[k] - y[k]) for x, y in zip(ra, rb, strict=True))
        for k in ("loss", "grad_norm", "learning_rate", "num_tokens")
    }
    result["steps"] = len(ra)
    wa, wb = safetensors.torch.load_file(a / "model.safetensors"), safetensors.torch.load_file(b / "model.safetensors")
    result["max_abs_diff_final_weights"] = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    result["final_weights_bit_identical"] = all(wa[k].equal(wb[k]) for k in wa)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--deepspeed", default="ds_configs/zero3.json")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--keep-logs", action="store_true", help="Copy the training logs next to the results.")
    args = parser.parse_args()

    import torch

    work = Path(tempfile.mkdtemp())
    (work / "model").mkdir()
    model = model_dir(work / "model", args.hidden, args.layers)
    runs = {}
    for name in ("reference_a", "reference_b"):
        runs[name] = train(args, model, work / name)
    killed = train(args, model, work / "resumed", {"SFT_TEST_KILL_DURING_SAVE": str(args.kill_at)})
    resumed = train(args, model, work / "resumed")
    result = {
        "what": f"{args.steps} steps uninterrupted vs killed while writing checkpoint-{args.kill_at} and rerun",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "nproc": args.nproc,
        "deepspeed": args.deepspeed,
        "bf16": args.bf16,
        "model": {"hidden": args.hidden, "layers": args.layers, "attention_dropout": 0.1},
        "versions": {"torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "exit_codes": {"reference_a": runs["reference_a"][0], "reference_b": runs["reference_b"][0]}
        | {"killed": killed[0], "resumed": resumed[0]},
        "seconds": {k: round(v[1], 1) for k, v in runs.items()}
        | {"killed": round(killed[1], 1)}
        | {"resumed": round(resumed[1], 1)},
        "checkpoints_at_end": sorted(p.name for p in (work / "resumed").glob("checkpoint-*")),
        "set_aside_as_incomplete": sorted(p.name for p in (work / "resumed" / "incomplete").glob("*")),
        "run_to_run": compare(work / "reference_a", work / "reference_b"),
        "resume_vs_uninterrupted": compare(work / "reference_a", work / "resumed"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"resume_{Path(args.deepspeed).stem}_{args.nproc}proc_{'bf16' if args.bf16 else 'fp32'}"
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| pair | {' | '.join(k for k in result['run_to_run'] if k != 'steps')} |"]
    rows.append("|" + " --- |" * (len(result["run_to_run"])))
    for pair in ("run_to_run", "resume_vs_uninterrupted"):
        rows.append(f"| {pair} | " + " | ".join(str(v) for k, v in result[pair].items() if k != "steps") + " |")
    header = (
        f"# {result['what']}\n\n{result['device']}, {args.nproc} processes, {args.deepspeed}, bf16={args.bf16}\n\n"
    )
    (args.out / f"{tag}.md").write_text(header + "\n".join(rows) + "\n")
    if args.keep_logs:
        for log in work.glob("*.log"):
            shutil.copy(log, args.out / f"{tag}_{log.name}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
