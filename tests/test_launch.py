"""launch/: the scripts' own checks, their command lines, and real multi-process runs through them on CPU."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, read_jsonl

from sft.checkpoint import MARKER

SCRIPTS = ["launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sbatch"]
# 8 optimizer steps of the demo, 2 processes x micro batch 1 x accumulation 2, ZeRO-2, a checkpoint every 4 steps
TRAIN = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--max_steps", "8", "--logging_steps", "1",
    "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "4", "--per_device_train_batch_size", "1",
    "--gradient_accumulation_steps", "2", "--max_length", "256", "--deepspeed", "ds_configs/zero2.json",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict[str, str]:
    return {**cli_env(), "PYTHON": sys.executable, **{k: str(v) for k, v in extra.items()}}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_checks(script):
    text = (ROOT / script).read_text()
    assert "set -euo pipefail" in text
    assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
    help_text = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert help_text.returncode == 0 and help_text.stdout.startswith("Usage:")
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, script], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def dry_run(script: str, *args: str, **variables) -> str:
    result = subprocess.run(["bash", script, *args], cwd=ROOT, env=env(DRY_RUN=1, **variables),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_torchrun_command_lines():
    static = dry_run("launch/torchrun.sh", "--config", "r.yaml", NNODES=2, NODE_RANK=1, MASTER_ADDR="node0",
                     MASTER_PORT=1234, NPROC_PER_NODE=8)  # fmt: skip
    assert (
        "--nnodes 2 --nproc_per_node 8 --max-restarts 0 --node-rank 1 --master-addr node0 --master-port 1234" in static
    )
    assert static.rstrip().endswith("sft/train.py --config r.yaml")
    elastic = dry_run("launch/torchrun.sh", NNODES="1:4", RDZV_ENDPOINT="node0:29400", MAX_RESTARTS=3)
    assert "--nnodes 1:4" in elastic and "--max-restarts 3" in elastic
    assert "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id sft" in elastic and "--node-rank" not in elastic


def test_deepspeed_command_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode7 slots=8\nnode8 slots=8\n")
    line = dry_run("launch/deepspeed.sh", "--deepspeed", "ds_configs/zero3.json", HOSTFILE=hostfile, NUM_NODES=2)
    assert f"--hostfile {hostfile} --master_addr node7 --master_port 29500 --num_nodes 2" in line
    assert line.rstrip().endswith("sft/train.py --deepspeed ds_configs/zero3.json") and "--no_ssh" not in line
    hostfile.write_text("localhost slots=2\n")
    assert "--master_addr localhost --master_port 29500 --no_ssh_check " in dry_run(
        "launch/deepspeed.sh", HOSTFILE=hostfile
    )
    no_ssh = dry_run("launch/deepspeed.sh", HOSTFILE=hostfile, NO_SSH=1, NODE_RANK=1)
    assert "--no_ssh --node_rank 1 " in no_ssh
    missing = subprocess.run(["bash", "launch/deepspeed.sh"], cwd=ROOT, env=env(HOSTFILE=tmp_path / "none"),
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def slurm_shims(tmp_path: Path) -> Path:
    """Stand-ins for SLURM's commands (SLURM does not run here): `srun` runs its command here, `scancel --signal`
    signals every process of the step as SLURM's cgroup does, `scontrol` answers hostnames and records a requeue."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "srun").write_text(
        '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\necho $$ > "$SHIM_STATE/step.pid"\nexec "$@"\n'
    )
    (shims / "scancel").write_text(
        "#!/usr/bin/env bash\n"
        'echo "scancel $*" >> "$SHIM_STATE/calls"\n'
        'sig="${1#--signal=}"\n'
        'tree() { echo "$1"; for c in $(pgrep -P "$1"); do tree "$c"; done; }\n'
        'for p in $(tree "$(cat "$SHIM_STATE/step.pid")"); do kill -s "$sig" "$p" 2>/dev/null || true; done\n'
    )
    (shims / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == show ]]; then echo 127.0.0.1; else echo "scontrol $*" >> "$SHIM_STATE/calls"; fi\n'
    )
    for f in shims.iterdir():
        f.chmod(0o755)
    return shims


def slurm_env(tmp_path: Path, **extra) -> dict[str, str]:
    shims = slurm_shims(tmp_path) if not (tmp_path / "shims").exists() else tmp_path / "shims"
    variables = dict(PATH=f"{shims}:{os.environ['PATH']}", SHIM_STATE=tmp_path, SLURM_JOB_ID=4242, SLURM_NNODES=1,
                     SLURM_JOB_NODELIST="localhost", GPUS_PER_NODE=2, SLURM_SUBMIT_DIR=ROOT)  # fmt: skip
    return env(**{**variables, **extra})


def test_slurm_command_line(tmp_path):
    variables = slurm_env(tmp_path, DRY_RUN=1, SLURM_NNODES=4)
    result = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "r.yaml"], cwd=ROOT, env=variables,
                            capture_output=True, text=True)  # fmt: skip
    line = result.stdout
    assert line.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1")
    assert "NNODES=4 NPROC_PER_NODE=2 RDZV_ENDPOINT=127.0.0.1:24242 RDZV_ID=4242" in line
    assert 'trap\\ \\"\\"\\ USR1' in line and line.rstrip().endswith("launch/torchrun.sh --config r.yaml")
    outside = subprocess.run(["bash", "launch/slurm.sbatch"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert outside.returncode != 0 and "submit it with sbatch" in outside.stderr


@pytest.mark.multiproc
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
    variables = env(NNODES=2, NODE_RANK=rank, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return subprocess.Popen(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(out), *extra], cwd=ROOT,
                            env=variables, stdout=log, stderr=log)  # fmt: skip


@pytest.mark.multiproc
def test_two_nodes_on_one_machine_train_like_one_node(tmp_path):
    one = subprocess.run(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(tmp_path / "one")], cwd=ROOT,
                         env=env(NPROC_PER_NODE=2, MASTER_PORT=free_port()), capture_output=True,
                         text=True)  # fmt: skip
    assert one.returncode == 0, one.stderr[-4000:]
    port = free_port()
    nodes = [start_node(tmp_path, f"node{r}", r, port, tmp_path / "two", "--trace_data") for r in (0, 1)]
    for r, node in enumerate(nodes):
        assert node.wait(timeout=600) == 0, (tmp_path / f"node{r}.log").read_text()[-4000:]
    assert len(losses(tmp_path / "one")) == 8
    assert losses(tmp_path / "two") == losses(tmp_path / "one")
    traces = [read_jsonl(tmp_path / "two" / "data_trace" / f"rank{r}.jsonl") for r in (0, 1)]
    assert all(a["sha1"] != b["sha1"] for a, b in zip(*traces, strict=True))  # each node trained on other samples


@pytest.mark.multiproc
def test_nodes_that_disagree_are_refused(tmp_path):
    port = free_port()
    nodes = [start_node(tmp_path, "node0", 0, port, tmp_path / "out"),
             start_node(tmp_path, "node1", 1, port, tmp_path / "out", "--learning_rate", "0.001")]  # fmt: skip
    codes = [node.wait(timeout=600) for node in nodes]
    log = (tmp_path / "node0.log").read_text()
    assert codes[0] != 0 and codes[1] != 0
    assert "sft: error: The ranks disagree: rank 1 on" in log
    assert "learning_rate: rank 0 '0.003' vs rank 1 '0.001'" in log and "Traceback" not in log.split("sft: error")[0]


@pytest.mark.multiproc
def test_elastic_restart_finishes_by_itself(tmp_path):
    out = tmp_path / "out"
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(["bash", "launch/torchrun.sh", *TRAIN, "--output_dir", str(out)], cwd=ROOT,
                             env=env(NPROC_PER_NODE=2, MAX_RESTARTS=1, MASTER_PORT=free_port()), stdout=log,
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


@pytest.mark.multiproc
def test_deepspeed_launcher_with_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "out"
    result = subprocess.run(["bash", "launch/deepspeed.sh", *TRAIN, "--output_dir", str(out), "--trace_data"],
                            cwd=ROOT, env=env(HOSTFILE=hostfile, MASTER_PORT=free_port()), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(losses(out)) == 8 and (out / "model.safetensors").exists()
    traces = [read_jsonl(out / "data_trace" / f"rank{r}.jsonl") for r in (0, 1)]
    assert len(traces[0]) == len(traces[1]) == 16  # 8 steps x 2 micro-batches on each of the 2 ranks
    assert all(a["sha1"] != b["sha1"] for a, b in zip(*traces, strict=True))


LEAVE = """
import atexit, os, sys
from sft.distributed import leave
atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
class Teardown:
    def __del__(self, write=os.write):  # runs only if the interpreter tears down its objects
        write(2, b"interpreter teardown\\n")
kept = Teardown()
print("buffered line", end="")
leave(3)
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_leave_runs_the_exit_handlers_and_skips_the_teardown_of_multiprocess_runs(world_size, tmp_path):
    marker = tmp_path / "atexit.txt"
    result = subprocess.run([sys.executable, "-c", LEAVE, str(marker)], cwd=ROOT, capture_output=True, text=True,
                            env={**cli_env(), "WORLD_SIZE": world_size}, timeout=60)  # fmt: skip
    assert result.returncode == 3
    assert result.stdout == "buffered line"  # flushed before the hard exit
    assert marker.read_text() == "exit handlers ran"  # logging, wandb, tensorboard, temporary files
    assert ("interpreter teardown" in result.stderr) == (world_size == "1")
