"""Shared helpers: run the real CLI (one process or torchrun with 2 gloo processes) on the bundled demo."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["--config", str(ROOT / "recipes" / "demo.yaml")]


# Inductor's CPU kernels in scalar C++, for this process and every process the tests start (they inherit it): the
# compile path is the same (dynamo, AOT autograd, Inductor's lowering and C++ code generation, g++), without the
# SIMD templates, whose compiling took most of the suite's compile time. On this 2-core machine, cold cache,
# 2026-12-03: ZeRO-2's 8-bit step test 134 s -> 28 s, a compiled Llama decoder layer forward and backward 45 -> 22 s.
# GPU kernels are Triton's and unaffected; a value set outside the suite is kept.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

MULTIPROC_DIR = Path(__file__).resolve().parent / "multiproc"
MULTINODE_DIR = Path(__file__).resolve().parent / "multinode"


# Three test groups at a time (pytest-xdist, `-n 3` in pyproject.toml), one group per worker at a time: a test module
# is one group (its module fixtures are made once); the modules that share session fixtures (tests/multiproc/
# conftest.py, made once per worker) are one group; the two-node tests are one group (one pair of namespaces).
SHARED_SESSION = {
    "test_readme.py": "demo-walk", "test_eval.py": "demo-walk", "test_reference_curve.py": "demo-walk",
    "test_vision_demo.py": "demo-walk",
}  # fmt: skip
# The longest groups first (measured, `--durations=0` of the whole suite, 2026-12-02), so that the workers end together
LONGEST_FIRST = [
    "demo-walk", "test_resume.py", "test_sp_runs.py", "multinode", "test_lora.py", "test_train.py", "test_failsafe.py",
    "test_fp8_runs.py", "test_families.py", "test_fsdp2.py", "test_launch.py", "test_vision_runs.py",
    "test_optimizer_groups.py", "test_expert_parallel_runs.py",
]  # fmt: skip


def group(nodeid: str) -> str:
    """The xdist group of a test, from its node id (`tests/multiproc/test_x.py::test_y[...]`)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/multinode/"):
        return "multinode"
    return SHARED_SESSION.get(path.rsplit("/", 1)[-1], path)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, with `group` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tiers: every test under tests/multiproc/ runs training in launched processes and is marked `multiproc`
    (`pytest -m "not multiproc"` is the quick loop); those under tests/multinode/ run it on two network namespaces
    as two nodes and are marked `multinode` too. The folder, not a decorator per test, decides. The longest groups
    are put first."""
    for item in items:
        parents = Path(item.fspath).parents
        if MULTIPROC_DIR in parents or MULTINODE_DIR in parents:
            item.add_marker(pytest.mark.multiproc)
        if MULTINODE_DIR in parents:
            item.add_marker(pytest.mark.multinode)

    def rank(item) -> int:
        name = group(item.nodeid)
        name = name if name in LONGEST_FIRST else name.rsplit("/", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a group and among the rest is kept


def pytest_unconfigure(config):
    """The last hook of each pytest process (each xdist worker too): what is alive now is kept out of the
    interpreter's last garbage collections, which walk every object of ~5,000 imported modules and the models the
    fixtures built (a pytest process running tests/test_vision_run.py left in 2.9 s, in 0.65 s with this)."""
    import gc

    gc.freeze()


def free_port() -> int:
    """A TCP port nobody listens on now (for launchers given a fixed master port; tests run two at a time)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What torchrun gives its workers besides sft's LAUNCH_VARIABLES
TORCHRUN_VARIABLES = ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_RESTART_COUNT")  # fmt: skip


def cli_env(tmp_path: Path | None = None) -> dict[str, str]:
    """The environment of a CLI the tests start: this process's, offline, one thread, without the launch variables
    an in-process `sft check` or one-process run may have set here."""
    from sft.parallel.distributed import LAUNCH_VARIABLES  # here: conftest itself imports no torch

    launched = (*LAUNCH_VARIABLES, *TORCHRUN_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in launched}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    if tmp_path is not None:
        env["WANDB_DIR"] = str(tmp_path)
    return env


def cli_command(nproc: int = 0, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """`python sft/train.py` (nproc=0), else torchrun with nproc processes and `launcher_args`."""
    script = str(ROOT / "sft" / "train.py")
    if not nproc:
        return [sys.executable, script]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, *launcher_args, script]


def _forked(launcher_args: tuple[str, ...], fresh: bool) -> bool:
    """Whether a run starts as a fork of the pre-imported server (tests/forkserver.py): unless the test asks for a
    fresh interpreter, gives launcher flags (the launcher is then what it checks) or SFT_TEST_FRESH=1 is set."""
    from tests import forkserver

    return forkserver.enabled() and not fresh and not launcher_args


def _start_forked(args: list[str], nproc: int, env: dict, stdout: int, stderr: int):
    from tests import forkserver

    script = str(ROOT / "sft" / "train.py")
    return forkserver.start([script, *args], env, ROOT, stdout, stderr, nproc=nproc, server_env=cli_env())


def start_cli(
    args: list[str], nproc: int = 0, launcher_args: tuple[str, ...] = (), env: dict | None = None, fresh: bool = False
):
    """Start the CLI in the background (a `subprocess.Popen`, or `tests.forkserver.Forked` with the same methods).
    Its stderr goes to a file, not a pipe: nobody reads a pipe while the test polls, and a full pipe would block the
    training processes."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (outlives this function: `finish` reads and closes it)
    if _forked(launcher_args, fresh):
        with open(os.devnull, "w") as devnull:
            proc = _start_forked(args, nproc, {**cli_env(), **(env or {})}, devnull.fileno(), log.fileno())
    else:
        proc = subprocess.Popen(
            cli_command(nproc, launcher_args) + list(args),
            cwd=ROOT,
            env={**cli_env(), **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    proc.log = log
    return proc


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers and their DataLoader workers included), so that a
    run that timed out leaves nothing behind."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for a process from `start_cli`; return its stderr. On timeout the whole process tree is killed first."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    proc.log.seek(0)
    text = proc.log.read()
    proc.log.close()
    return text


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll until `path` exists, the process ends, or the time is up."""
    deadline = time.time() + timeout
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def run_cli(
    args: list[str],
    nproc: int = 0,
    tmp_path: Path | None = None,
    timeout: int = 600,
    env: dict | None = None,
    fresh: bool = False,
):
    """Run sft/train.py to the end: nproc=0 as `python sft/train.py`, else N workers (under torchrun when `fresh`,
    else forked, `_forked`)."""
    cmd = cli_command(nproc) + list(args)
    if _forked((), fresh):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = _start_forked(args, nproc, {**cli_env(tmp_path), **(env or {})}, out.fileno(), err.fileno())
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                raise
            out.seek(0), err.seek(0)
            result = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
            result.forked = True
            return result
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**cli_env(tmp_path), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # subprocess.run would kill torchrun's agent only, leaving its workers running
            raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.forked = False
    return result


def run_cli_side_by_side(jobs: list[tuple[list[str], int]], env: dict | None = None) -> list:
    """Several `run_cli` runs of one process each (`(args, nproc)` with nproc 0 or 1), two at a time: each uses one
    core (OMP_NUM_THREADS=1), so two together take the time of one on CI's two cores. Results in the jobs' order."""
    from concurrent.futures import ThreadPoolExecutor

    assert all(nproc <= 1 for _, nproc in jobs), "only one-process runs share the machine"
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: run_cli(job[0], nproc=job[1], env=env), jobs))


def run_cli_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`sft.train.cli(args)` in this process, for runs that stop before training (bad input): its exit code and what
    it wrote to stdout/stderr, as `run_cli` returns them. An exception other than sft's own errors propagates (it
    would have been a traceback)."""
    import contextlib
    import io

    from sft.train import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(list(args))
        except SystemExit as e:  # argparse's own refusal of a flag value
            code = e.code
    return subprocess.CompletedProcess(["sft", "train", *args], code, out.getvalue(), err.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def no_deepspeed_config_left():
    """transformers keeps the DeepSpeed config of the last training arguments made in a process (a weak reference,
    alive as long as they are): after a test that parsed a ZeRO-3 config in-process, the next test's
    `from_config` would build its model inside `deepspeed.zero.Init`. Dropped after every test."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.fixture
def demo_args():
    return list(DEMO)


@pytest.fixture(scope="session")
def saved_demo_model(tmp_path_factory) -> Path:
    """The demo model with saved random weights (seed 0) and the demo tokenizer: a base that exists on disk, for LoRA
    and for an untrained baseline."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("saved_demo_model")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "demo" / "model")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        if f.name != "config.json":
            shutil.copy(f, path)
    return path
