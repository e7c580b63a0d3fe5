"""README.md's commands and those of its docs/ pages, run as written, in order, on a copy of the repository (the first
hour of a new user).

The walk itself is a session fixture (`readme_walk`, tests/multiproc/conftest.py; what runs:
tests/multiproc/readme.py): one demo run (README's first command, in full) serves every later command that reads
`outputs/demo`, and test_eval.py evaluates the same demo.
"""

from __future__ import annotations

import json
import re

from tests.conftest import ROOT
from tests.multiproc.readme import README, TEST_COMMAND, expected_code, pages, plan


def test_readme_plan_is_what_we_think():
    """Without running anything: README fits on a screen or three (issue #39) and lists every docs/ page, whose
    commands the walk runs too; the set-up commands are first, the test command is CI's, every block that does not
    run says why, and the python snippet has its expected output."""
    assert len(README.read_text().splitlines()) <= 150
    assert sorted(p.name for p in pages()[1:]) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    steps = plan()
    run = [s for s in steps if s[0] != "skip"]
    assert run[0] == ("bash", "sft train --nproc-per-node 2 --config recipes/demo.yaml", None)
    assert run[1] == ("bash", TEST_COMMAND, None)
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()
    skipped = [s[1] for s in steps if s[0] == "skip"]
    assert len(skipped) >= 4 and all(re.match(r"# needs: .*(GPU|node)", line) for line in skipped)
    snippets = [s for s in steps if s[0] == "python"]
    assert len(snippets) == 1 and snippets[0][2]
    assert len([s for s in run if s[0] == "bash"]) >= 10


def test_every_cpu_command_of_the_readme_runs_as_written(readme_walk):
    """README's commands in order (one demo run; the rest use its output): each exits 0, and the figures README
    states next to them are what they print."""
    to_run = [(kind, what) for kind, what, _ in plan() if kind != "skip" and what != TEST_COMMAND]
    assert [(s.kind, s.what) for s in readme_walk.steps] == to_run[: len(readme_walk.steps)]
    for step in readme_walk.steps:
        result, what = step.result, step.what
        said = f"README: {what}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        assert result.returncode == expected_code(what), said
        assert "Traceback" not in result.stderr and "Setting accelerator to CPU" not in result.stdout + result.stderr
        if step.expected is not None:
            assert result.stdout.strip() == step.expected, f"{what}\nprinted: {result.stdout!r}"
        if "sft.core.batch --global-batch-size 528" in what:
            assert result.stdout.splitlines()[0] == "gradient_accumulation_steps: 33"
        if "-m sft.plan " in what:  # the memory plan (not `sft.core.batch`)
            assert "peak per GPU" in result.stdout
    assert len(readme_walk.steps) == len(to_run) >= 10
    print("\n".join(f"{s.seconds:6.1f} s  {s.what.splitlines()[0][:100]}" for s in readme_walk.steps))
    out = readme_walk.root / "outputs"
    metrics = [json.loads(line) for line in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert metrics[-1]["step"] == 325 and losses[0] > 4.0 and 2.0 < evals[-1] < 2.7  # README: 4.2 -> eval 2.42
    assert (out / "demo-lora" / "adapter_model.safetensors").is_file()
    assert (out / "demo-lora-merged" / "config.json").is_file()
    results = sorted((out / "demo" / "eval").glob("results_*.json"))
    assert len(results) == 1  # sft eval's (the lm_eval CLI prints its table only)
    assert json.loads(results[0].read_text())["results"]["sft_demo"]["exact_match,none"] > 0.2  # README: 0.29
