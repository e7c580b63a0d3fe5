"""Runs that several test modules start from, made once per session on first use (each costs minutes on two cores;
issue #36): README's walk, whose demo is also the trained model `test_eval.py` evaluates, and a short one-process
run (`sft train` without a launcher) that logs to tensorboard and wandb (offline), whose wandb run `test_eval.py` logs
an evaluation into. Tests read them; a test that changes one works on a copy."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ROOT, cli_env
from tests.multiproc import readme


@dataclass
class Step:
    kind: str  # bash or python
    what: str
    expected: str | None  # what a python block must print
    result: subprocess.CompletedProcess
    seconds: float


@dataclass
class Walk:
    root: Path  # the copy of the repository the commands ran in
    steps: list[Step] = field(default_factory=list)  # in README's order, up to and with the first that failed

    @property
    def demo(self) -> Path:
        return self.root / "outputs" / "demo"


@pytest.fixture(scope="session")
def readme_walk(tmp_path_factory) -> Walk:
    """README's commands in order, as written, in a copy of the repository; the walk stops at the first command that
    does not exit as README says (test_readme.py reports it)."""
    walk = Walk(readme.copy_repository(tmp_path_factory.mktemp("readme") / "repo"))
    for kind, what, expected in readme.plan():
        if kind == "skip" or what == readme.TEST_COMMAND:
            continue
        started = time.time()
        result = readme.run(walk.root, kind, what)
        walk.steps.append(Step(kind, what, expected, result, time.time() - started))
        if result.returncode != readme.expected_code(what):
            break
    return walk


@dataclass
class Logged:
    out: Path  # the run's output directory
    wandb_dir: Path  # WANDB_DIR of the run
    result: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def tensorboard_wandb_run(tmp_path_factory) -> Logged:
    """The demo as one process started by `sft train` without `--nproc-per-node` (no launcher: sft gives the process
    the variables of a one-process launch), under the demo's ZeRO-2 config, 6 steps, logging every 2 to tensorboard
    and wandb (offline)."""
    work = tmp_path_factory.mktemp("logged")
    recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    recipe["report_to"] = ["tensorboard", "wandb"]  # a list: the command line takes one value only
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = work / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sft", "train", "--config", str(work / "recipe.yaml"), "--output_dir", str(out)]
        + ["--max_steps", "6", "--logging_steps", "2", "--eval_strategy", "no", "--peak_tflops", "0.01"],
        cwd=ROOT, env=cli_env(work), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return Logged(out, work, result)


@pytest.fixture(scope="module")
def init_model(tmp_path_factory) -> Path:
    """One fixed random init on disk: ZeRO-3 would otherwise initialise inside `zero.Init` in its own RNG order."""
    path = tmp_path_factory.mktemp("init")
    torch.manual_seed(0)
    demo = ROOT / "recipes" / "demo" / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo)).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo).save_pretrained(path)
    return path
