"""The tests' forked runs (tests/forkserver.py) against fresh interpreters: the same run both ways gives the same
losses and weights, bit for bit; a forked child is a process of its own (environment, folder, streams, pid, exit
code, signals), and a forked multi-process launch stops the other workers when one fails, as torchrun does."""

from __future__ import annotations

import os
import signal
import time

import pytest
import safetensors.torch
import torch

from tests import forkserver
from tests.conftest import DEMO, cli_env, read_jsonl, run_cli

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="SFT_TEST_FRESH=1: the fork path is off")

PROBE = r"""
import json, os, signal, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROBE")
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
                  "env": {k: os.environ.get(k) for k in keys}}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "fail-rank-1" and os.environ.get("RANK") == "1":
    sys.exit(3)
if mode in ("wait", "fail-rank-1"):
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), os._exit(75)))
    time.sleep(120)
sys.exit(int(mode) if mode.isdigit() else 0)
"""


def _start(tmp_path, name: str, mode: str, nproc: int = 0):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out, err = open(tmp_path / f"{name}.out", "w+"), open(tmp_path / f"{name}.err", "w+")  # noqa: SIM115
    proc = forkserver.start([str(script), mode], {**cli_env(), "PROBE": name}, tmp_path, out.fileno(), err.fileno(),
                            nproc=nproc, server_env=cli_env())  # fmt: skip
    out.close(), err.close()
    return proc


def _lines(tmp_path, name: str) -> list[dict]:
    import json

    return [json.loads(line) for line in (tmp_path / f"{name}.out").read_text().splitlines() if line.startswith("{")]


def test_a_forked_child_is_a_process_of_its_own(tmp_path):
    one = _start(tmp_path, "one", "7")
    assert one.wait(timeout=300) == 7
    (seen,) = _lines(tmp_path, "one")
    assert seen["pid"] == one.pid and seen["pid"] != os.getpid() and seen["cwd"] == str(tmp_path)
    assert seen["argv"] == [str(tmp_path / "probe.py"), "7"] and seen["env"]["PROBE"] == "one"
    assert seen["env"]["RANK"] is None  # no launcher: as `python script.py`
    assert (tmp_path / "one.err").read_text().startswith("to stderr")

    two = _start(tmp_path, "two", "0", nproc=2)
    assert two.wait(timeout=300) == 0
    ranks = sorted(_lines(tmp_path, "two"), key=lambda s: s["env"]["RANK"])
    assert [s["env"]["RANK"] for s in ranks] == ["0", "1"] and {s["ppid"] for s in ranks} == {two.pid}
    assert {s["env"]["WORLD_SIZE"] for s in ranks} == {"2"} and len({s["env"]["MASTER_PORT"] for s in ranks}) == 1
    assert len({s["pid"] for s in ranks}) == 2

    killed = _start(tmp_path, "killed", "wait")
    deadline = time.time() + 60
    while not _lines(tmp_path, "killed") and time.time() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL


def test_a_failed_worker_stops_the_others_and_the_launch_fails(tmp_path):
    """Rank 1 exits 3; the leader sends rank 0 SIGTERM (its handler prints and exits 75) and exits 1, naming both."""
    proc = _start(tmp_path, "failed", "fail-rank-1", nproc=2)
    started = time.time()
    assert proc.wait(timeout=120) == 1
    assert time.time() - started < 60, "rank 0 was left to sleep"
    assert "terminated" in (tmp_path / "failed.out").read_text()
    err = (tmp_path / "failed.err").read_text()
    assert "rank 1 failed with exit code 3" in err and "rank 0 failed with exit code 75" in err


def test_a_forked_run_equals_a_fresh_interpreter_bit_for_bit(tmp_path):
    """The demo on 2 processes under ZeRO-2 (attention dropout of the recipe's model, so RNG state matters), 6 steps:
    under torchrun in fresh interpreters and forked from the zygote, every step's loss, grad norm, learning rate and
    token count equal, and the saved weights equal."""
    args = DEMO + ["--max_steps", "6", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
                   "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_length", "256",
                   "--report", "false"]  # fmt: skip
    outs = {}
    for fresh in (True, False):
        outs[fresh] = tmp_path / f"fresh-{fresh}"
        result = run_cli([*args, "--output_dir", str(outs[fresh])], nproc=2, fresh=fresh)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.forked is not fresh
    runs = {fresh: [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] for fresh, out in outs.items()}
    assert len(runs[True]) == 6
    for key in ("loss", "grad_norm", "learning_rate", "num_tokens"):
        assert [r[key] for r in runs[True]] == [r[key] for r in runs[False]], key
    fresh, forked = (safetensors.torch.load_file(outs[f] / "model.safetensors") for f in (True, False))
    assert fresh.keys() == forked.keys() and all(torch.equal(fresh[k], forked[k]) for k in fresh)
