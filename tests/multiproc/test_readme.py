"""README.md's commands, run as written, in order, on a copy of the repository (the first hour of a new user).

Every fenced `bash` block runs, command by command, unless its first line says what it needs that this machine
lacks (`# needs: ...`: GPUs, several nodes, the hub). The two set-up commands at the top run without their install
steps (this suite runs inside the environment they make), and the test command is this suite itself: it is checked
against `.ci/run` instead. A `python` block runs too, and the `text` block that follows it is what it must print.
One demo run (README's first command, in full) serves every later command that reads `outputs/demo`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env

README = ROOT / "README.md"
INSTALL = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate|pip install)")
TEST_COMMAND = "python -m pytest -q"


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comment lines dropped, install steps removed."""
    joined = re.sub(r"\\\n\s*", "", body)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        steps = [step for step in line.split(" && ") if not INSTALL.match(step.strip())]
        if steps:
            out.append(" && ".join(steps))
    return out


def plan() -> list[tuple[str, str, str | None]]:
    """(kind, what to run, expected output or None) for the whole README; kind is bash, python or skip."""
    found = blocks(README.read_text())
    steps = []
    for i, (language, body) in enumerate(found):
        if language == "bash":
            first = body.splitlines()[0]
            if first.startswith("# needs:"):
                steps.append(("skip", first, None))
                continue
            steps += [("bash", command, None) for command in commands(body)]
        elif language == "python":
            follows = found[i + 1] if i + 1 < len(found) else ("", "")
            steps.append(("python", body, follows[1].strip() if follows[0] == "text" else None))
    return steps


def test_readme_plan_is_what_we_think():
    """Without running anything: the set-up commands are first, the test command is CI's, every block that does
    not run says why, and the python snippet has its expected output."""
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


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files: README's commands write outputs/ there, not into the checkout."""
    root = tmp_path_factory.mktemp("readme") / "repo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    return root


def run(sandbox: Path, kind: str, what: str) -> subprocess.CompletedProcess:
    env = cli_env(sandbox)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # python, sft, torchrun, lm_eval
    cmd = [sys.executable, "-c", what] if kind == "python" else ["bash", "-c", what]
    return subprocess.run(cmd, cwd=sandbox, env=env, capture_output=True, text=True, timeout=1200)


def test_every_cpu_command_of_the_readme_runs_as_written(sandbox):
    """README's commands in order (one demo run; the rest use its output): each exits 0, and the figures README
    states next to them are what they print."""
    done = []
    for kind, what, expected in plan():
        if kind == "skip" or what == TEST_COMMAND:
            continue
        result = run(sandbox, kind, what)
        said = re.search(r"# exits (\d+)", what)  # README says when a command is meant to fail
        code = int(said.group(1)) if said else 0
        assert result.returncode == code, f"README: {what}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        assert "Traceback" not in result.stderr and "Setting accelerator to CPU" not in result.stdout + result.stderr
        if expected is not None:
            assert result.stdout.strip() == expected, f"{what}\nprinted: {result.stdout!r}"
        if "sft.batch --global-batch-size 528" in what:
            assert result.stdout.splitlines()[0] == "gradient_accumulation_steps: 33"
        if "sft.plan" in what:
            assert "peak per GPU" in result.stdout
        done.append(what)
    out = sandbox / "outputs"
    metrics = [json.loads(line) for line in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert metrics[-1]["step"] == 520 and losses[0] > 4.0 and 1.6 < evals[-1] < 2.4  # README: 4.2 -> eval 2.1-2.3
    assert (out / "demo-lora" / "adapter_model.safetensors").is_file()
    assert (out / "demo-lora-merged" / "config.json").is_file()
    results = sorted((out / "demo" / "eval").glob("results_*.json"))
    assert len(results) == 1  # sft eval's (the lm_eval CLI prints its table only)
    assert json.loads(results[0].read_text())["results"]["sft_demo"]["exact_match,none"] > 0.2  # README: 0.30
    assert len(done) >= 10
