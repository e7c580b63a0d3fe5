"""Train the same random-initialised model under several settings, side by side in one run; JSON + markdown out.

    python -m benchmarks.train_matrix --matrix liger --nproc 2 --out benchmarks/results

(Throughput against TRL, MFU and scaling: `benchmarks/throughput.py`.)
Results: `train_matrix_<matrix>_<N>gpu.{json,md}`.

Data: pre-tokenised records with an SFT-like length distribution (log-normal, median about 300 tokens, clipped to
16..4096, so tens to thousands of tokens with a long tail), random token ids. Model: Llama-3.2-1B shape (hidden 2048,
16 layers, 32/8 heads, vocab 128256, tied embeddings), built from its config; `--tiny` swaps in the demo shape for a
CPU smoke test. Every setting runs the real CLI (`sft/train.py`) and is read back from its metrics.jsonl.

Matrix:
- liger (issue 3b): Liger off vs on, under ZeRO-2 and ZeRO-3, 20 steps; per-step loss difference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    make_sft_data,
    model_dir,
    run,
    sft_command,
    write_results,
)

COMMON = {"bf16": True, "dtype": "bfloat16", "learning_rate": 1e-4, "lr_scheduler_type": "constant",
          "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "seed": 0,
          "dataloader_num_workers": 2, "from_scratch": True}  # fmt: skip
LIGER = {
    f"{stage}_liger_{'on' if on else 'off'}": {"packing": True, "attn_implementation": "auto", "use_liger_kernel": on,
                                               "deepspeed": f"ds_configs/{stage}.json",
                                               "per_device_train_batch_size": 2}
    for stage in ("zero2", "zero3") for on in (False, True)
}  # fmt: skip


def train(name: str, settings: dict, args, work: Path, model: Path, data: Path) -> dict:
    recipe = {**COMMON, **settings, "model_name_or_path": str(model), "datasets": [{"path": str(data)}]}
    recipe.update(output_dir=str(work / name), max_steps=args.steps, max_length=args.max_length)
    recipe.setdefault("deepspeed", args.deepspeed)
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", use_liger_kernel=False)
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    rc, seconds = run(sft_command(args.nproc, ["--config", str(work / f"{name}.yaml")]), work / f"{name}.log")
    result = {"exit_code": rc, "wall_s": round(seconds, 1), "settings": settings}
    metrics = work / name / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        result["log_tail"] = (work / f"{name}.log").read_text()[-3000:]
        return result
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    timed = steps[args.warmup :]
    result.update(
        losses=[r["loss"] for r in steps],
        tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
        tokens_per_step=float(np.mean([r["tokens_per_step"] for r in timed])),
        peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in steps),
        packing_efficiency=float(np.mean([r["packing_efficiency"] for r in timed]))
        if "packing_efficiency" in timed[0]
        else None,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", choices=["liger"], required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--deepspeed", default="none", help="DeepSpeed config for settings that name none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="Logged steps left out of the timing")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--tiny", action="store_true", help="Demo-sized model in fp32: a CPU smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    model = model_dir(work / "model", None if args.tiny else LLAMA_SHAPES["llama-1b"])
    data = work / "data.jsonl"
    make_sft_data(data, args.records, json.loads((model / "config.json").read_text())["vocab_size"], args.max_length)
    matrix = LIGER
    results = {name: train(name, settings, args, work, model, data) for name, settings in matrix.items()}
    env = environment()
    report = {
        "matrix": args.matrix,
        "device": env["gpu"],
        "nproc": args.nproc,
        "model": "demo (tiny)" if args.tiny else "Llama-3.2-1B shape, random init",
        "max_length": args.max_length,
        "steps": args.steps,
        "timed_steps": f"steps {args.warmup + 1}..{args.steps}",
        "versions": env["versions"],
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    tag = f"train_matrix_{args.matrix}_{args.nproc}gpu" + ("_tiny" if args.tiny else "")
    lines = [f"# {args.matrix}: {report['model']}, {report['device']} x {args.nproc}, seq {args.max_length}", ""]
    lines += [
        "| setting | exit | tokens/s/GPU | tokens/step | peak GiB | packing eff. | final loss |",
        "|" + " --- |" * 7,
    ]
    for name, r in results.items():
        if r["exit_code"] != 0:
            lines.append(f"| {name} | {r['exit_code']} | failed | | | | |")
            continue
        eff = f"{r['packing_efficiency']:.3f}" if r["packing_efficiency"] is not None else "-"
        lines.append(
            f"| {name} | 0 | {r['tokens_per_second_per_gpu']:.0f} | {r['tokens_per_step']:.0f} | "
            f"{r['peak_memory_gib']:.1f} | {eff} | {r['losses'][-1]:.4f} |"
        )
    if args.matrix == "liger":
        for stage in ("zero2", "zero3"):
            off, on = results[f"{stage}_liger_off"], results[f"{stage}_liger_on"]
            if off["exit_code"] == on["exit_code"] == 0:
                diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"], strict=True))
                report[f"{stage}_max_abs_loss_diff"] = diff
                lines.append(f"\n{stage}: max |loss(Liger on) - loss(off)| over {args.steps} steps = {diff:.4g}")
    write_results(args.out, tag, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
