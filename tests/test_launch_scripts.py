"""launch/: the scripts' own checks and the command lines they build, without training (the real runs through them:
tests/multiproc/test_launch.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env
from tests.helpers import launch_env, slurm_env

SCRIPTS = ["launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sbatch"]


def dry_run(script: str, *args: str, **variables) -> str:
    result = subprocess.run(["bash", script, *args], cwd=ROOT, env=launch_env(DRY_RUN=1, **variables),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


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


def test_torchrun_command_lines():
    static = dry_run("launch/torchrun.sh", "--config", "r.yaml", NNODES=2, NODE_RANK=1, MASTER_ADDR="node0",
                     MASTER_PORT=1234, NPROC_PER_NODE=8, RDZV_TIMEOUT=30)  # fmt: skip
    assert static.startswith(f"{sys.executable} -m sft train --nnodes 2 --nproc-per-node 8 --max-restarts 0 "
                             "--rdzv-timeout 30 --node-rank 1 --master-addr node0 --master-port 1234 ")  # fmt: skip
    assert static.rstrip().endswith("--master-port 1234 --config r.yaml")
    elastic = dry_run("launch/torchrun.sh", NNODES="1:4", RDZV_ENDPOINT="node0:29400", MAX_RESTARTS=3)
    assert "--nnodes 1:4" in elastic and "--max-restarts 3" in elastic and "--rdzv-timeout 600" in elastic
    assert "--rdzv-endpoint node0:29400 --rdzv-id sft" in elastic and "--node-rank" not in elastic
    one = dry_run("launch/torchrun.sh", NPROC_PER_NODE=2)  # one node, no MASTER_PORT: a free port (standalone)
    assert "--nnodes 1 --nproc-per-node 2" in one and "--master-port" not in one
    # each line is one `sft train` accepts: its launcher flags split off whole
    from sft.parallel.launch import split_args

    launcher, rest = split_args(static.split()[4:])
    assert rest == ["--config", "r.yaml"] and launcher[-2:] == ["--master-port", "1234"]


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
    missing = subprocess.run(["bash", "launch/deepspeed.sh"], cwd=ROOT, env=launch_env(HOSTFILE=tmp_path / "none"),
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_slurm_command_line(tmp_path):
    variables = slurm_env(tmp_path, DRY_RUN=1, SLURM_NNODES=4)
    result = subprocess.run(["bash", "launch/slurm.sbatch", "--config", "r.yaml"], cwd=ROOT, env=variables,
                            capture_output=True, text=True)  # fmt: skip
    line = result.stdout
    assert line.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1")
    assert "NNODES=4 NPROC_PER_NODE=2 RDZV_ENDPOINT=127.0.0.1:24242 RDZV_ID=4242" in line
    assert 'trap\\ \\"\\"\\ USR1' in line and line.rstrip().endswith("launch/torchrun.sh --config r.yaml")
    outside = subprocess.run(
        ["bash", "launch/slurm.sbatch"], cwd=ROOT, env=launch_env(), capture_output=True, text=True
    )
    assert outside.returncode != 0 and "submit it with sbatch" in outside.stderr


LEAVE = """
import atexit, os, sys
from sft.core.leave import leave
atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
class Teardown:
    def __del__(self, write=os.write):  # runs only if the interpreter tears down its objects
        write(2, b"interpreter teardown\\n")
kept = Teardown()
print("buffered line", end="")
leave(3)
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_leave_runs_the_exit_handlers_and_skips_the_teardown(world_size, tmp_path):
    marker = tmp_path / "atexit.txt"
    result = subprocess.run([sys.executable, "-c", LEAVE, str(marker)], cwd=ROOT, capture_output=True, text=True,
                            env={**cli_env(), "WORLD_SIZE": world_size}, timeout=60)  # fmt: skip
    assert result.returncode == 3
    assert result.stdout == "buffered line"  # flushed before the hard exit
    assert marker.read_text() == "exit handlers ran"  # logging, wandb, tensorboard, temporary files
    assert "interpreter teardown" not in result.stderr
