"""LoRA and QLoRA (bitsandbytes 4-bit) under ZeRO-2 on 2 GPUs, then merge and lm-eval; JSON + markdown out.

    python -m benchmarks.lora_gpu train --work /tmp/lora_gpu --out $OUT   # needs bitsandbytes
    python -m benchmarks.lora_gpu eval --work /tmp/lora_gpu --out $OUT    # needs lm-eval (a second call: the GPU
                                                                          # machine cannot carry both at once)

The base is the demo model trained for 150 steps (so it is partly trained); LoRA and QLoRA then train 150 steps on
the demo data from it with recipes/demo-lora.yaml (QLoRA: `load_in_4bit`, bf16 compute). Each adapter is merged with
`python -m sft.tools.merge`, and `sft eval` (`sft.tools.evaluation`) scores the base and both merged models on
`sft_demo` (exact match).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, torchrun
from benchmarks.common import run as run_logged

TORCHRUN = torchrun(2)
COMMON = [
    "--max_steps",
    "150",
    "--eval_strategy",
    "no",
    "--save_strategy",
    "no",
    "--logging_steps",
    "10",
    "--dtype",
    "bfloat16",
    "--bf16",
    "true",
]


def run(cmd: list[str], log: Path) -> int:
    return run_logged(cmd, log)[0]


def train(work: Path, out: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "runs": {}}
    steps = {
        "base": [*TORCHRUN, "sft/train.py", "--config", "recipes/demo.yaml", "--output_dir", str(work / "base"),
                 *COMMON],
        "lora": [*TORCHRUN, "sft/train.py", "--config", "recipes/demo-lora.yaml", "--model_name_or_path",
                 str(work / "base"), "--output_dir", str(work / "lora"), *COMMON],
        "qlora": [*TORCHRUN, "sft/train.py", "--config", "recipes/demo-lora.yaml", "--model_name_or_path",
                  str(work / "base"), "--output_dir", str(work / "qlora"), "--load_in_4bit", "true", "--dtype",
                  "bfloat16", "--bf16", "true", *COMMON],
    }  # fmt: skip
    for name, cmd in steps.items():
        start = time.time()
        rc = run(cmd, out / f"{name}.log")
        metrics = work / name / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        log = (out / f"{name}.log").read_text()
        report["runs"][name] = {
            "command": " ".join(cmd[1:]), "exit_code": rc, "wall_s": round(time.time() - start, 1),
            "losses": [r["loss"] for r in rows if "loss" in r],
            "quantized_log": [line for line in log.splitlines() if "quantized by bitsandbytes" in line][:1],
        }  # fmt: skip
        if name != "base":
            merged = work / f"{name}-merged"
            mrc = run([sys.executable, "-m", "sft.tools.merge", "--adapter", str(work / name), "--output", str(merged),
                       "--dtype", "float32"], out / f"{name}-merge.log")  # fmt: skip
            report["runs"][name]["merge_exit_code"] = mrc
        print(name, report["runs"][name]["exit_code"], report["runs"][name]["losses"][:1],
              report["runs"][name]["losses"][-1:], flush=True)  # fmt: skip
    import torch

    report["device"] = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    import bitsandbytes

    report["versions"] = {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__}
    (out / "lora_gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")
    (work / "lora_gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")


def evaluate(work: Path, out: Path) -> None:
    report = json.loads((work / "lora_gpu_train.json").read_text())
    scores = {}
    for name, model in (("base", "base"), ("lora", "lora-merged"), ("qlora", "qlora-merged")):
        rc = run([sys.executable, "-m", "sft", "eval", "--model", str(work / model), "--tasks", "sft_demo", "--device",
                  "cuda", "--batch-size", "32"], out / f"eval-{name}.log")  # fmt: skip
        files = sorted((work / model / "eval").glob("results_*.json"))
        scores[name] = {"exit_code": rc}
        if files:
            scores[name]["exact_match"] = json.loads(files[-1].read_text())["results"]["sft_demo"]["exact_match,none"]
    report["eval"] = scores
    (out / "lora_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# LoRA and QLoRA, ZeRO-2, {report['device']} ({report['versions']})", "",
             "| run | exit | first loss | last loss | merge | sft_demo exact match |", "|" + " --- |" * 6]  # fmt: skip
    for name in ("base", "lora", "qlora"):
        r, s = report["runs"][name], scores[name]
        first, last = (f"{r['losses'][0]:.3f}", f"{r['losses'][-1]:.3f}") if r["losses"] else ("-", "-")
        lines.append(f"| {name} | {r['exit_code']} | {first} | {last} | {r.get('merge_exit_code', '-')} | "
                     f"{s.get('exact_match', 'failed')} |")  # fmt: skip
    lines += ["", "QLoRA: " + (report["runs"]["qlora"]["quantized_log"] or ["no 4-bit log line"])[0]]
    (out / "lora_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["train", "eval"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora_gpu"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (train if args.phase == "train" else evaluate)(args.work, args.out)


if __name__ == "__main__":
    main()
