"""What the test modules share besides conftest's CLI runners (issue #78: each was defined in several modules, or
imported from another test module): reading a run's output directory (its logged steps, losses, weights), the checks
several modules make of a run, killing a run after a checkpoint, merging an adapter, the demo's parsed arguments, a
checkpoint's layout on disk, and the launch scripts' environments. A test module imports these from here (or
tests/tiny_models.py), never from another test module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch
from safetensors.torch import save_file

from sft.plan.arguments import parse_args
from sft.run import checkpoint as ckpt
from sft.run.checkpoint import MARKER
from tests.conftest import ROOT, cli_env, finish, kill_tree, read_jsonl, start_cli, wait_for


def train_records(out: Path) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (those with a loss)."""
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def weights(out: Path) -> dict[str, torch.Tensor]:
    """A run's saved weights (its output directory's model.safetensors)."""
    return safetensors.torch.load_file(out / "model.safetensors")


def assert_ok(result) -> None:
    """The run exited 0; else the end of what it printed."""
    assert result.returncode == 0, result.stderr[-6000:]


def kill_after_checkpoint(args: list[str], out: Path, step: int, nproc: int = 2, env: dict | None = None) -> None:
    """Start the CLI and SIGKILL the launcher and every worker once checkpoint-<step> is complete."""
    proc = start_cli(args, nproc=nproc, env=env)
    marker = out / f"checkpoint-{step}" / MARKER
    wait_for(marker, proc)
    kill_tree(proc.pid)
    finish(proc)
    assert marker.exists(), "the run never completed the checkpoint it was to be killed after"
    assert not (out / "model.safetensors").exists(), "the run finished before the kill; the test proves nothing"


def losses(out: Path) -> list[float]:
    """The training loss of each logged step."""
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def merge(adapter: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    """`sft merge` of an adapter into float32 weights, as a process."""
    return subprocess.run(
        [sys.executable, "-m", "sft.tools.merge", "--adapter", str(adapter), "--output", str(output), "--dtype",
         "float32", *extra], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
    )  # fmt: skip


def merge_side_by_side(*jobs: tuple[Path, Path]) -> list[subprocess.CompletedProcess]:
    """`merge` of each (adapter, output), two at a time (one process each; CI has two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: merge(*job), jobs))


def demo_args(tmp_path, *extra):
    """The demo recipe parsed (with `extra` flags): (script, data, training, model) arguments."""
    return parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(tmp_path / "out"), *extra])


def make_checkpoint(out: Path, step: int, complete: bool = True, world: int = 2, zero3: bool = False) -> Path:
    """A checkpoint laid out as transformers + DeepSpeed ZeRO-2 (or ZeRO-3: model states per rank) write it for
    `world` processes (tiny tensors)."""
    path = out / f"checkpoint-{step}"
    shards = path / f"global_step{step}"
    shards.mkdir(parents=True)
    geometry = {"world_size": world, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                "global_batch": 2 * world}  # fmt: skip
    (path / ckpt.STATE).write_text(json.dumps({"global_step": step, "fingerprint": geometry}))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    save_file({"w": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    torch.save({"lr": 1.0}, path / "scheduler.pt")
    for rank in range(world):
        torch.save({"python": rank}, path / (f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth"))
        torch.save({"state": torch.zeros(8)}, shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if zero3:
            torch.save({"module": {}}, shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    if not zero3:
        torch.save({"module": {}}, shards / "mp_rank_00_model_states.pt")
    (path / "latest").write_text(shards.name)
    if complete:
        (path / ckpt.MARKER).write_text("{}")
    return path


def launch_env(**extra) -> dict[str, str]:
    """The environment of a launch/ script: the CLI's, the interpreter to use, and `extra` as strings."""
    return {**cli_env(), "PYTHON": sys.executable, **{k: str(v) for k, v in extra.items()}}


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
    """launch/slurm.sh's environment inside a SLURM job of one node, its commands the shims."""
    shims = slurm_shims(tmp_path) if not (tmp_path / "shims").exists() else tmp_path / "shims"
    variables = dict(PATH=f"{shims}:{os.environ['PATH']}", SHIM_STATE=tmp_path, SLURM_JOB_ID=4242, SLURM_NNODES=1,
                     SLURM_JOB_NODELIST="localhost", GPUS_PER_NODE=2, SLURM_SUBMIT_DIR=ROOT)  # fmt: skip
    return launch_env(**{**variables, **extra})
