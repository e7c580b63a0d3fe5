"""The memory plan against the measured peaks of a throughput result file (1-GPU runs of sft's default).

    python -m benchmarks.plan_vs_measured benchmarks/results/zero3_levers/throughput.json

For each successful `<model>-1gpu-<stage>-sft` run: the plan of its setting (stage, the micro batch the run's plan
chose, seq 4096, Liger, FP8 as the run resolved it) against its `peak_memory_gib`, and the relative error.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from benchmarks.common import LLAMA_SHAPES
from sft.model import shapes
from sft.plan import memory as plan


def rows(path: Path) -> list[str]:
    out = ["| run | micro batch | FP8 | plan GiB | measured GiB | error |", "| --- | --- | --- | --- | --- | --- |"]
    for name, run in json.loads(path.read_text())["runs"].items():
        m = re.fullmatch(r"(\d+)b-1gpu-zero(\d)-sft", name)
        if not m or run["exit_code"] != 0:
            continue
        auto = next(line for line in run["plan"] if line.startswith("auto settings"))
        micro = int(re.search(r"per_device_train_batch_size = (\d+)", auto).group(1))
        fp8 = "fp8 = True" in auto
        config = Path(tempfile.mkdtemp()) / "config.json"
        config.write_text(json.dumps(LLAMA_SHAPES[f"llama-{m[1]}b"]))
        setting = plan.Setting(gpus=1, zero_stage=int(m[2]), micro_batch=micro, seq_len=4096, liger=True, fp8=fp8)
        planned = plan.estimate(shapes.load_shape(str(config)), setting).peak / plan.GiB
        measured = run["peak_memory_gib"]
        out.append(
            f"| {name} | {micro} | {fp8} | {planned:.1f} | {measured:.1f} | {(planned - measured) / measured:+.1%} |"
        )
    return out


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
