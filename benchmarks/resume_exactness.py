"""Stop-and-resume versus an uninterrupted run, on whatever hardware this runs on; writes JSON and a markdown table.

    python -m benchmarks.resume_exactness --nproc 2 --deepspeed ds_configs/zero3.json --bf16 --out results/

Four runs of the same command on the demo data with a Llama-shaped model built from scratch (attention dropout on):
two uninterrupted runs (to measure run-to-run noise of the hardware), and one that the main process SIGKILLs in the
middle of writing checkpoint `--kill-at` (the test hook of sft.run.trainer), then the same command again, which resumes
from the previous complete checkpoint. Reported: the largest per-step difference of loss, grad norm and learning
rate, and of the final weights, between each pair.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, environment, llama_shape, model_dir, run, sft_command, write_results


def train(args, model: Path, out: Path, env_extra: dict | None = None) -> tuple[int, float]:
    cmd = sft_command(args.nproc, ["--config", str(ROOT / "recipes" / "demo.yaml")])
    cmd += ["--model_name_or_path", str(model), "--output_dir", str(out), "--deepspeed", args.deepspeed]
    cmd += ["--max_steps", str(args.steps), "--save_strategy", "steps", "--save_steps", str(args.save_every)]
    cmd += ["--logging_steps", "1", "--eval_strategy", "no", "--bf16", str(args.bf16).lower()]
    cmd += ["--dtype", "float32", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    cmd += ["--dataloader_num_workers", "2", "--max_length", "1024", "--learning_rate", "1e-3"]
    return run(cmd, out.parent / f"{out.name}.log", env_extra)


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

    work = Path(tempfile.mkdtemp())
    model = model_dir(work / "model", **llama_shape(args.hidden, args.layers, attention_dropout=0.1))
    env = environment()
    runs = {}
    for name in ("reference_a", "reference_b"):
        runs[name] = train(args, model, work / name)
    killed = train(args, model, work / "resumed", {"SFT_TEST_KILL_DURING_SAVE": str(args.kill_at)})
    resumed = train(args, model, work / "resumed")
    result = {
        "what": f"{args.steps} steps uninterrupted vs killed while writing checkpoint-{args.kill_at} and rerun",
        "device": env["device"],
        "nproc": args.nproc,
        "deepspeed": args.deepspeed,
        "bf16": args.bf16,
        "model": {"hidden": args.hidden, "layers": args.layers, "attention_dropout": 0.1},
        "versions": env["versions"],
        "date": env["date"],
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
    tag = f"resume_exactness_{Path(args.deepspeed).stem}_{args.nproc}proc_{'bf16' if args.bf16 else 'fp32'}"
    rows = [f"| pair | {' | '.join(k for k in result['run_to_run'] if k != 'steps')} |"]
    rows.append("|" + " --- |" * (len(result["run_to_run"])))
    for pair in ("run_to_run", "resume_vs_uninterrupted"):
        rows.append(f"| {pair} | " + " | ".join(str(v) for k, v in result[pair].items() if k != "steps") + " |")
    header = (
        f"# {result['what']}\n\n{result['device']}, {args.nproc} processes, {args.deepspeed}, bf16={args.bf16}\n\n"
    )
    write_results(args.out, tag, result, header + "\n".join(rows))
    if args.keep_logs:
        for log in work.glob("*.log"):
            shutil.copy(log, args.out / f"{tag}_{log.name}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
