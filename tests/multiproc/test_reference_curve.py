"""The demo's loss curve against a committed reference: a change to the training path that moves it is caught.

`tests/references/demo_losses.json` holds the training loss of every one of the first 100 steps of the demo recipe
(`--max_steps 100`, so the learning-rate schedule spans those 100 steps) on CPU, fp32, ZeRO-2, 2 gloo processes, with
the committed model config, tokenizer, data and seed. A fresh run must match every step within `RTOL` (relative):
far below what a real change does (with the demo's learning rate 10% higher, 95 of the 100 steps were off by more
than that, from step 3 on), far above the last-bit differences of another CPU.
After a change that is meant to move the curve, write a new reference and commit it with the change:

    python -m tests.multiproc.test_reference_curve --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.conftest import ROOT, read_jsonl, run_cli

REFERENCE = ROOT / "tests" / "references" / "demo_losses.json"
STEPS = 100
RTOL = 1e-3
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--deepspeed", "ds_configs/zero2.json",
    "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
    "--report_to", "none",
]  # fmt: skip


def demo_losses(out: Path, extra: list[str] = ()) -> list[float]:
    result = run_cli([*ARGS, "--output_dir", str(out), *extra], nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_demo_loss_curve_matches_the_reference(tmp_path):
    reference = json.loads(REFERENCE.read_text())
    losses = demo_losses(tmp_path / "out")
    assert len(losses) == len(reference["losses"]) == STEPS
    off = [
        (step, ref, got)
        for step, (ref, got) in enumerate(zip(reference["losses"], losses, strict=True), start=1)
        if abs(got - ref) > RTOL * abs(ref)
    ]
    assert not off, f"{len(off)} of {STEPS} steps off by more than {RTOL:.0e} (step, reference, now): {off[:5]}"


def main() -> None:
    import torch

    if "--write" not in sys.argv:
        sys.exit("usage: python -m tests.multiproc.test_reference_curve --write   (writes " + str(REFERENCE) + ")")
    losses = demo_losses(Path(tempfile.mkdtemp()) / "out")
    REFERENCE.write_text(
        json.dumps({"what": "demo recipe, --max_steps 100, CPU fp32, ZeRO-2, 2 gloo processes", "command": ARGS,
                    "torch": torch.__version__, "losses": losses}, indent=1) + "\n"
    )  # fmt: skip
    print(f"wrote {len(losses)} losses to {REFERENCE}")


if __name__ == "__main__":
    main()
