"""launch/: real multi-process runs through the scripts on CPU (their checks and command lines:
tests/test_launch_scripts.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sft.run.checkpoint import MARKER
from tests.conftest import ROOT, free_port, read_jsonl
from tests.helpers import launch_env, losses, slurm_env

# 8 optimizer steps of the demo, 2 processes x micro batch 1 x accumulation 2, ZeRO-2, a checkpoint every 4 steps
TRAIN = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--max_steps", "8", "--logging_steps", "1",
    "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "4", "--per_device_train_batch_size", "1",
    "--report", "false",
    "--gradient_accumulation_steps", "2", "--max_length", "256", "--deepspeed", "ds_configs/zero2.json",
]  # fmt: skip


def test_slurm_signal_checkpoints_requeues_and_resumes(tmp_path):
    """SIGUSR1 to the batch script (SLURM's --signal=B:USR1): the training processes save a complete checkpoint and
    stop, the script requeues the job; the requeued job (the same script again) finishes the run."""
    out = tmp_path / "out"
    args = ["bash", "launch/slurm.sbatch", *TRAIN, "--output_dir", str(out), "--save_steps", "2"]
    log = open(tmp_path / "job1.log", "w")  # noqa: SIM115
    job = subprocess.Popen(args, cwd=ROOT, env=slurm_env(tmp_path), stdout=log, stderr=log)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=300) == 0, (tmp_path / "job1.log").read_text()[-4000:]
    calls = (tmp_path / "calls").read_text()
    assert "scancel --signal=USR1 4242" in calls and "scontrol requeue 4242" in calls
    complete = [p for p in out.glob("checkpoint-*") if (p / MARKER).exists()]
    assert complete and not (out / "model.safetensors").exists()
    stopped = max(int(p.name.split("-")[1]) for p in complete)
    assert stopped < 8
    second = subprocess.run(args, cwd=ROOT, env=slurm_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"Resuming from {out}/checkpoint-{stopped}" in second.stderr
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9)) and (out / "model.safetensors").exists()


def start_node(tmp_path: Path, name: str, rank: int, port: int, out: Path, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115
    variables = launch_env(NNODES=2, NODE_RANK=rank, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return subprocess.Popen(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(out), *extra], cwd=ROOT,
                            env=variables, stdout=log, stderr=log)  # fmt: skip


def test_nodes_that_disagree_are_refused(tmp_path):
    port = free_port()
    nodes = [start_node(tmp_path, "node0", 0, port, tmp_path / "out"),
             start_node(tmp_path, "node1", 1, port, tmp_path / "out", "--learning_rate", "0.001")]  # fmt: skip
    codes = [node.wait(timeout=600) for node in nodes]
    log = (tmp_path / "node0.log").read_text()
    assert codes[0] != 0 and codes[1] != 0
    assert "sft: error: The ranks disagree: rank 1 on" in log
    assert "learning_rate: rank 0 '0.003' vs rank 1 '0.001'" in log and "Traceback" not in log.split("sft: error")[0]


@pytest.mark.full
def test_elastic_restart_finishes_by_itself(tmp_path):
    """`full` tier: launch/torchrun.sh with MAX_RESTARTS=1, a worker SIGKILLed after checkpoint-4, the restarted group
    resumes and finishes. Per commit: the same restart through torchrun's own `--max-restarts`, bit-identical to the
    uninterrupted run (`test_resume.py::test_torchrun_max_restarts_continues_by_itself`), and the script's command
    line with MAX_RESTARTS (`test_launch_scripts.py::test_torchrun_command_lines`)."""
    out = tmp_path / "out"
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(out)], cwd=ROOT,
                             env=launch_env(NPROC_PER_NODE=2, MAX_RESTARTS=1, MASTER_PORT=free_port()), stdout=log,
                             stderr=log)  # fmt: skip
    deadline = time.time() + 300
    while not (out / "checkpoint-4" / MARKER).exists() and agent.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker to kill"
    os.kill(int(workers[-1]), signal.SIGKILL)
    assert agent.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-4000:]
    text = (tmp_path / "job.log").read_text()
    assert "Resuming from" in text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == list(range(1, 9))


def test_deepspeed_launcher_with_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "out"
    result = subprocess.run(["bash", "launch/deepspeed.sh", *TRAIN, "--output_dir", str(out), "--trace_data"],
                            cwd=ROOT, env=launch_env(HOSTFILE=hostfile, MASTER_PORT=free_port()), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(losses(out)) == 8 and (out / "model.safetensors").exists()
    traces = [read_jsonl(out / "data_trace" / f"rank{r}.jsonl") for r in (0, 1)]
    assert len(traces[0]) == len(traces[1]) == 16  # 8 steps x 2 micro-batches on each of the 2 ranks
    assert all(a["sha1"] != b["sha1"] for a, b in zip(*traces, strict=True))
