"""CPU-seconds a training worker spends before its first step (issue "one plan", point 5).

Runs the demo recipe in this process (`sft.train.run`, as `python sft/train.py` does) and stops it at the first
training step: the user and system CPU-seconds of the process up to there, and the modules imported by then, for
`--deepspeed none` and ZeRO-2, each in a fresh process, `--repeat` times (the median is reported).

    python benchmarks/startup_cpu.py --out benchmarks/results/startup_cpu/after.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROBE = r"""
import os, resource, sys, json
import transformers.trainer as hf_trainer
step = hf_trainer.Trainer.training_step
def first_step(*args, **kwargs):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    heavy = ["deepspeed", "peft", "bitsandbytes", "torchao", "liger_kernel", "trl", "datasets", "lm_eval", "wandb"]
    out = {"user": usage.ru_utime, "system": usage.ru_stime, "cpu": usage.ru_utime + usage.ru_stime,
           "imported": [m for m in heavy if m in sys.modules]}
    print("STARTUP " + json.dumps(out), flush=True)
    os._exit(0)
hf_trainer.Trainer.training_step = first_step
sys.argv = ["sft/train.py"] + sys.argv[1:]
from sft.train import run
run()
"""

SETTINGS = {"none": "none", "zero2": "ds_configs/zero2.json"}


def measure(deepspeed: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-c", PROBE, "--config", "recipes/demo.yaml", "--deepspeed", deepspeed,
               "--output_dir", out, "--report_to", "none", "--eval_strategy", "no"]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    for line in result.stdout.splitlines():
        if line.startswith("STARTUP "):
            return json.loads(line[len("STARTUP ") :])
    raise RuntimeError(f"no first step (exit {result.returncode}):\n{result.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    results = {}
    for name, deepspeed in SETTINGS.items():
        runs = [measure(deepspeed) for _ in range(args.repeat)]
        results[name] = {
            "cpu_seconds_median": round(statistics.median(r["cpu"] for r in runs), 2),
            "user_median": round(statistics.median(r["user"] for r in runs), 2),
            "system_median": round(statistics.median(r["system"] for r in runs), 2),
            "runs": [round(r["cpu"], 2) for r in runs],
            "heavy_modules_imported": runs[0]["imported"],
        }
        print(f"{name}: {results[name]}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"python": sys.version.split()[0], "cpus": os.cpu_count(), "settings": results}, f, indent=2)


if __name__ == "__main__":
    main()
