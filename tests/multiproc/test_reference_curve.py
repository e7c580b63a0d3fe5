"""The demo's loss curve against a committed reference: a change to the training path that moves it is caught.

The run is the README walk's demo (`readme_walk`, tests/multiproc/conftest.py): README's first command, `sft train
--nproc-per-node 2 --config recipes/demo.yaml`, to its end (325 steps; CPU, fp32, ZeRO-2, 2 gloo processes, the
committed model config, tokenizer, data and seed), so no run of its own. `tests/references/demo_losses.json` holds
the training loss it logs (every 10 steps, each the mean of those 10 steps). A fresh run must match each of the first
`STRICT_LOGS` logged losses (steps 1-20) within `RTOL` (relative) and the mean of the last 8 logged (steps 241-320)
within `TAIL_RTOL`. A real change moves the early steps far more (with the demo's learning rate 10% higher, 95 of the
first 100 steps were off by more than 1e-3, from step 3 on). The steps between are not compared: at this learning
rate the last-bit differences of another CPU or another attention kernel grow by about 10x every two steps (measured
on a CPU with AVX-512 FP16 against the reference's: equal to step 6, 6e-8 at step 7, 1e-7 at 20, 1e-6 at 25, 6e-4 at
32, up to 2e-2 after), so that the mean of steps 51-100 moved by 2.7% between two runs on one AMD EPYC, one with sdpa
over the block mask and one with sdpa over the padded samples (2026-12-07), and by 1.4% between that first run and the
reference of an Intel Xeon with AMX. As the learning rate decays the runs come back together: the mean of steps
241-320 was 2.4403 (the Xeon's), 2.4495 and 2.4415 (the EPYC's two), within 0.4%. The demo's end point differs
between CPUs (README). After a change that is meant to move the curve, write a new reference and commit it with the
change:

    python -m tests.multiproc.test_reference_curve --write
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import ROOT, cli_env, read_jsonl

REFERENCE = ROOT / "tests" / "references" / "demo_losses.json"
COMMAND = ["sft", "train", "--nproc-per-node", "2", "--config", "recipes/demo.yaml"]  # README's first command
LOG_EVERY, STEPS = 10, 325
STRICT_LOGS, RTOL = 2, 1e-4  # the logged means of steps 1-10 and 11-20
TAIL = slice(24, 32)  # the logged means of steps 241-250 ... 311-320
TAIL_RTOL = 1e-2  # two CPUs and two attention kernels within 0.4% there (the module's docstring)


def logged_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_demo_loss_curve_matches_the_reference(readme_walk):
    reference = json.loads(REFERENCE.read_text())
    losses = logged_losses(readme_walk.demo)
    assert len(losses) == len(reference["losses"]) == STEPS // LOG_EVERY
    pairs = list(zip(reference["losses"], losses, strict=True))
    off = [(LOG_EVERY * i, a, b) for i, (a, b) in enumerate(pairs[:STRICT_LOGS], 1) if abs(b - a) > RTOL * a]
    assert not off, f"{len(off)} of the first {STRICT_LOGS} logged losses off by more than {RTOL:.0e}: {off}"
    tail = pairs[TAIL]
    ref_tail, tail = sum(r for r, _ in tail) / len(tail), sum(g for _, g in tail) / len(tail)
    assert abs(tail - ref_tail) <= TAIL_RTOL * ref_tail, (ref_tail, tail)


STARTUP = ROOT / "tests" / "references" / "demo_startup_log.txt"
MODULE_PATH = re.compile(r"\bsft(\.[a-z_]+)+")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR) (sft[\w.]*): (.*)$")


def startup_lines(console: str) -> list[str]:
    """sft's log lines from a run's console up to the engine's start (or the first training log), as `LEVEL: message`
    (their continuation lines kept): the timestamp and the logger's name (the module path) dropped, and module paths
    in the text written `sft.*`, so that moving a module is not a change of the start-up log."""
    lines, inside = [], False
    for line in console.splitlines():
        if line.startswith("{'loss'"):
            break
        match = LOG_LINE.match(line)
        if match:
            inside = True
            lines.append(f"{match.group(1)}: {MODULE_PATH.sub('sft.*', match.group(3))}")
            if match.group(3).startswith("Starting the DeepSpeed engine"):
                break
        elif inside and line.startswith("  "):
            lines.append(line)
        else:
            inside = False
    return lines


def test_demo_startup_log_is_unchanged(readme_walk):
    """What the demo says before its first step, line by line, as before the package was split into folders and the
    run was decided once (issue "one plan": no behaviour change); the reference was written from the demo's console
    at 34f3f38 (`python -m tests.multiproc.test_reference_curve --write-startup CONSOLE`), its changes since made by
    hand where a later issue changed what the start says (`optim: auto`; `engine: auto`'s line and setting)."""
    demo = next(step for step in readme_walk.steps if step.what.startswith(" ".join(COMMAND)))
    assert startup_lines(demo.result.stderr) == STARTUP.read_text().splitlines()


def main() -> None:
    if "--write-startup" in sys.argv:
        console = Path(sys.argv[sys.argv.index("--write-startup") + 1]).read_text()
        STARTUP.write_text("\n".join(startup_lines(console)) + "\n")
        sys.exit(f"wrote {STARTUP}")
    import torch

    if "--write" not in sys.argv:
        sys.exit("usage: python -m tests.multiproc.test_reference_curve --write   (writes " + str(REFERENCE) + ")")
    out = Path(tempfile.mkdtemp()) / "demo"
    subprocess.run([*COMMAND, "--output_dir", str(out)], cwd=ROOT, env=cli_env(), check=True)
    losses = logged_losses(out)
    REFERENCE.write_text(
        json.dumps({"what": f"README's demo, {STEPS} steps, CPU fp32, ZeRO-2, 2 gloo processes; the loss logged every "
                    f"{LOG_EVERY} steps", "command": COMMAND, "torch": torch.__version__, "losses": losses},
                   indent=1) + "\n"
    )  # fmt: skip
    print(f"wrote {len(losses)} losses to {REFERENCE}")


if __name__ == "__main__":
    main()
