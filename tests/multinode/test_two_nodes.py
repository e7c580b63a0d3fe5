"""Two nodes on their own addresses (tests/multinode/conftest.py): torchrun's static and elastic rendezvous through
launch/torchrun.sh, DeepSpeed's launcher over ssh through launch/deepspeed.sh, a node lost, wrong addresses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sft.run.checkpoint import MARKER
from tests.conftest import ROOT, cli_env, read_jsonl
from tests.helpers import losses

# 8 optimizer steps of the demo at a global batch of 4 rows (world 2 x micro batch 1 x accumulation 2), ZeRO-2,
# a checkpoint every 4 steps
TRAIN = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--max_steps", "8", "--logging_steps", "1",
    "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "4", "--per_device_train_batch_size", "1",
    "--gradient_accumulation_steps", "2", "--max_length", "256", "--deepspeed", str(ROOT / "ds_configs/zero2.json"),
    "--report", "false", "--trace_data", "true",
]  # fmt: skip
PORT = 29400 + os.getpid() % 500


def env(**extra) -> dict[str, str]:
    return {**cli_env(), "PYTHON": sys.executable, **{k: str(v) for k, v in extra.items()}}


def torchrun_sh(node, out: Path, log: Path, *extra: str, **variables) -> subprocess.Popen:
    return node.start(["bash", str(ROOT / "launch/torchrun.sh"), *TRAIN, "--output_dir", str(out), *extra], log,
                      env=env(NPROC_PER_NODE=1, DIST_TIMEOUT=120, **variables), cwd=ROOT)  # fmt: skip


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[int]:
    codes = [p.wait(timeout=timeout) for p in procs]
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text()[-4000:]
    return codes


def node_table(log: Path) -> list[tuple[str, str, str, str, str]]:
    """(host, address, interface, ranks, timeout) of every node line the run logged."""
    return re.findall(r"sft:   (\S+)  (\S+) via (\S+)  ranks (\S+)  collective timeout (\d+) s", log.read_text())


@pytest.fixture(scope="module")
def static_runs(hosts, tmp_path_factory):
    """The same run on one host (2 processes) and on two nodes (1 process each, static rendezvous at node 0)."""
    d = tmp_path_factory.mktemp("static")
    one = subprocess.run(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(d / "one")], cwd=ROOT,
                         env=env(NPROC_PER_NODE=2), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-4000:]
    logs = [d / f"node{i}.log" for i in (0, 1)]
    started = time.time()
    procs = [torchrun_sh(node, d / "two", logs[i], NNODES=2, NODE_RANK=i, MASTER_ADDR=hosts[0].address,
                         MASTER_PORT=PORT) for i, node in enumerate(hosts)]  # fmt: skip
    wait_all(procs, logs)
    return {"one": d / "one", "two": d / "two", "logs": logs, "seconds": time.time() - started}


def test_torchrun_static_on_two_nodes_trains_as_one_host(hosts, static_runs):
    """launch/torchrun.sh on both nodes (NNODES=2, NODE_RANK 0/1, MASTER_ADDR = node 0's address): each node trains
    on other samples, and the run equals the one-host run of the same world size and global batch."""
    one, two = static_runs["one"], static_runs["two"]
    assert len(losses(two)) == 8 and losses(two) == losses(one)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # bit-identical: same gloo reductions
    traces = [read_jsonl(two / "data_trace" / f"rank{r}.jsonl") for r in (0, 1)]
    assert all(x["sha1"] != y["sha1"] for x, y in zip(*traces, strict=True))
    # the start of the run names each node: host name, address, the interface gloo uses, its ranks
    assert node_table(static_runs["logs"][0]) == [
        (node.name, node.address, node.interface, str(i), "120") for i, node in enumerate(hosts)
    ]


def test_wrong_addresses_fail_within_the_timeout_and_say_what_to_check(hosts, tmp_path):
    """No hang: node 1 given an address nobody has, node 0 given node 1's address, node 0 whose peer never
    comes; each fails within its rendezvous timeout with one message naming the address."""
    d = tmp_path
    nobody = hosts[0].address.rsplit(".", 1)[0] + ".9"
    runs = {
        "unreachable": torchrun_sh(hosts[1], d / "o1", d / "unreachable.log", NNODES=2, NODE_RANK=1,
                                   MASTER_ADDR=nobody, MASTER_PORT=PORT + 1, RDZV_TIMEOUT=4),
        "not_mine": torchrun_sh(hosts[0], d / "o2", d / "not_mine.log", NNODES=2, NODE_RANK=0,
                                MASTER_ADDR=hosts[1].address, MASTER_PORT=PORT + 2, RDZV_TIMEOUT=4),
        "alone": torchrun_sh(hosts[0], d / "o3", d / "alone.log", NNODES=2, NODE_RANK=0,
                             MASTER_ADDR=hosts[0].address, MASTER_PORT=PORT + 3, RDZV_TIMEOUT=4),
    }  # fmt: skip
    started = time.time()
    codes = {name: p.wait(timeout=120) for name, p in runs.items()}
    assert time.time() - started < 90
    text = {name: (d / f"{name}.log").read_text() for name in runs}
    last = {name: t.strip().splitlines()[-1] for name, t in text.items()}
    assert codes["unreachable"] == 2 and last["unreachable"].startswith(
        f"sft: error: This node (node1, {hosts[1].address} on {hosts[1].interface}) could not reach the rendezvous "
        f"at {nobody} port {PORT + 1} within 4 s"
    ), text["unreachable"][-2000:]
    assert (
        codes["not_mine"] == 2
        and last["not_mine"].startswith(
            f"sft: error: MASTER_ADDR={hosts[1].address} is not an address of this node (node0, node rank 0)"
        )
        and f"{hosts[0].interface} {hosts[0].address}" in last["not_mine"]
    ), text["not_mine"][-2000:]
    assert codes["alone"] == 1 and "1/2 clients joined" in last["alone"], text["alone"][-2000:]
    assert last["alone"].startswith(f"sft: error: the rendezvous of 2 nodes at {hosts[0].address}:{PORT + 3} failed")
    assert all("Traceback" not in t for t in text.values())


def test_elastic_node_lost_then_back(hosts, tmp_path):
    """c10d rendezvous at node 0, NNODES=1:2, MAX_RESTARTS=1. Node 1 dies (every process SIGKILLed) after step 4:
    node 0's agent restarts its worker, which resumes from checkpoint-4 on the world of 1 with the global batch kept
    (accumulation 2 -> 4). Node 1 started again joins while that runs: torchrun's rule is that a node waiting to
    join restarts the group (not counted against MAX_RESTARTS), so both resume from the newest checkpoint on the
    world of 2 and finish together."""
    out = tmp_path / "out"
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    variables = dict(NNODES="1:2", RDZV_ENDPOINT=f"{hosts[0].address}:{PORT + 4}", RDZV_ID="elastic",
                     MAX_RESTARTS=1, RDZV_TIMEOUT=60)  # fmt: skip
    extra = ["--max_steps", "60", "--save_steps", "2"]
    procs = [torchrun_sh(node, out, logs[i], *extra, **variables) for i, node in enumerate(hosts)]
    deadline = time.time() + 300
    while not (out / "checkpoint-4" / MARKER).exists():
        assert time.time() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.1)
    assert hosts[1].kill_all() >= 2  # the agent and its worker
    procs[1].wait(timeout=60)
    while logs[0].read_text().count("Resuming from") < 1:
        assert time.time() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.2)
    procs[1] = torchrun_sh(hosts[1], out, logs[1], *extra, **variables)
    wait_all(procs, logs)
    text = logs[0].read_text()
    resumes = re.findall(r"Resuming (\S+) on (\d) process(?:es)? \(was (\d)\)", text)
    assert resumes[0] == (str(out / "checkpoint-4"), "1", "2")
    assert len(resumes) == 2 and resumes[1][1:] == ("2", "1")
    assert "global batch 4 = 1 x 1 x 4 accumulation" in text and [n for n, *_ in node_table(logs[0])] == [
        "node0", "node1", "node0", "node0", "node1"]  # fmt: skip
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 61)) and (out / "model.safetensors").exists()


def test_deepspeed_launcher_over_ssh_then_a_lost_node_resumes_bit_identically(hosts, sshd, static_runs, tmp_path):
    """launch/deepspeed.sh from node 0 with a hostfile of both addresses: DeepSpeed's runner reaches both nodes by
    ssh (pdsh), the environment reaches them through the launcher's file and `.deepspeed_env` (a comment line in
    it too, which DeepSpeed's own reader fails on). Node 1's training processes SIGKILLed after step 4, the same
    command again resumes and ends bit-identical to the uninterrupted torchrun run of the same world."""
    (tmp_path / "hostfile").write_text(f"{hosts[0].address} slots=1\n{hosts[1].address} slots=1\n")
    (tmp_path / ".deepspeed_env").write_text(
        "# read by DeepSpeed's launcher on every host\nHF_HUB_OFFLINE=1\nHF_DATASETS_OFFLINE=1\nWANDB_MODE=offline\n"
        "OMP_NUM_THREADS=1\n"
    )
    out = tmp_path / "out"
    # HOME: where DeepSpeed's launcher reads .deepspeed_env (its other place is the working directory, the repository)
    variables = env(HOSTFILE=tmp_path / "hostfile", MASTER_PORT=PORT + 5, DIST_TIMEOUT=77, HOME=tmp_path,
                    PATH=f"{sshd}:{os.environ['PATH']}")  # fmt: skip
    command = ["bash", str(ROOT / "launch/deepspeed.sh"), *TRAIN, "--output_dir", str(out)]
    first = hosts[0].start(command, tmp_path / "first.log", env=variables, cwd=ROOT)
    deadline = time.time() + 300
    while not (out / "checkpoint-4" / MARKER).exists():
        assert time.time() < deadline and first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.1)
    sshd_pids = {int(p.read_text()) for p in sshd.parent.glob("*.pid")}
    killed = [pid for pid in hosts[1].pids() if pid not in sshd_pids]
    for pid in killed:
        os.kill(pid, 9)
    assert first.wait(timeout=300) != 0
    first_log = (tmp_path / "first.log").read_text()
    assert node_table(tmp_path / "first.log") == [
        (node.name, node.address, node.interface, str(i), "77") for i, node in enumerate(hosts)
    ], first_log[-3000:]
    # what DeepSpeed's runner sends each host: the launcher's timeout and the lines of .deepspeed_env
    assert "export SFT_DIST_TIMEOUT=77;" in first_log and "export HF_HUB_OFFLINE=1;" in first_log
    assert not (out / "model.safetensors").exists()
    second = hosts[0].start(command, tmp_path / "second.log", env=variables, cwd=ROOT)
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-4000:]
    assert f"Resuming from {out}/checkpoint-4" in (tmp_path / "second.log").read_text()
    reference = static_runs["two"]
    assert losses(out) == losses(reference)
    a, b = load_file(reference / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)
