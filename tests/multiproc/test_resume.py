"""Exact resume, proven with real SIGKILLs of real multi-process runs (2 gloo processes, demo model with dropout on).

The reference is one uninterrupted run; each test kills or stops the same command and runs it again, and compares
per-step loss, learning rate, grad norm and token counts in metrics.jsonl, and the final weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sft.errors import PREEMPTED_EXIT_CODE
from sft.run.checkpoint import KILL_DURING_SAVE_ENV, MARKER
from sft.run.metrics import samples_per_step
from tests.conftest import (
    ROOT,
    cli_env,
    finish,
    free_port,
    run_cli,
    run_cli_in_process,
    run_cli_side_by_side,
    start_cli,
    wait_for,
)
from tests.helpers import assert_ok, kill_after_checkpoint, train_records, weights

STEPS = 12
# per-device batch 1 x accumulation 2 x 2 processes = global batch 4 packed rows
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"),
    "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "2",
    "--logging_steps", "1", "--eval_strategy", "no", "--per_device_train_batch_size", "1",
    "--gradient_accumulation_steps", "2", "--max_length", "256",
    "--trace_data", "true",
]  # fmt: skip
STAGES = {"none": "none", "zero2": "ds_configs/zero2.json", "zero3": "ds_configs/zero3.json"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The demo model directory with attention dropout on, so that RNG restore matters."""
    path = tmp_path_factory.mktemp("model")
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        shutil.copy(f, path)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (path / "config.json").write_text(json.dumps(config))
    return path


def args_for(model_dir: Path, out: Path, stage: str) -> list[str]:
    return ARGS + ["--model_name_or_path", str(model_dir), "--output_dir", str(out), "--deepspeed", STAGES[stage]]


def assert_same_run(reference: Path, resumed: Path) -> None:
    """Bit-identical per-step loss, learning rate, grad norm, token and FLOP counters, and equal final weights."""
    ref, res = train_records(reference), train_records(resumed)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1)), "metrics.jsonl must read as one run"
    for key in ("loss", "learning_rate", "grad_norm", "num_tokens", "num_flops"):
        assert [r[key] for r in ref] == [r[key] for r in res], key
    a, b = weights(reference), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def launched(nproc: int) -> int:
    """The `run_cli` launch of a run on `nproc` processes: one process runs as `python sft/train.py`, without a
    launcher (so the runs on one process below, ZeRO-2 and ZeRO-3, prove that a lone process trains and resumes)."""
    return nproc if nproc > 1 else 0


class SharedRuns:
    """The runs several tests start from, made on first use: uninterrupted references, and runs killed while
    writing checkpoint-8 (checkpoint-4 complete, checkpoint-8 half-written). One-process runs asked for together
    are made two at a time (`prepare`)."""

    def __init__(self, tmp_path_factory, model_dir: Path):
        self.factory, self.model_dir = tmp_path_factory, model_dir
        self.made: dict[tuple[str, str, int], Path] = {}

    def _job(self, kind: str, stage: str, nproc: int) -> tuple[list[str], dict, Path]:
        out = self.factory.mktemp(f"{kind}-{stage}-{nproc}") / "out"
        env = {KILL_DURING_SAVE_ENV: "8"} if kind == "killed" else {}
        return args_for(self.model_dir, out, stage), env, out

    def _check(self, kind: str, result, out: Path) -> None:
        if kind == "reference":
            assert_ok(result)
        else:
            assert result.returncode != 0, "the run was to be killed while writing checkpoint-8"
            assert (out / "checkpoint-4" / MARKER).exists() and not (out / "checkpoint-8" / MARKER).exists()

    def prepare(self, *specs: tuple[str, str, int]) -> None:
        """Make the missing (kind, stage, nproc) runs; those of one process two at a time."""
        missing = [spec for spec in specs if spec not in self.made]
        single = [spec for spec in missing if spec[2] <= 1]
        for spec in [spec for spec in missing if spec[2] > 1]:
            args, env, out = self._job(*spec)
            self._check(spec[0], run_cli(args, nproc=spec[2], env=env), out)
            self.made[spec] = out
        jobs = [self._job(*spec) for spec in single]
        for kind in ("reference", "killed"):  # run_cli_side_by_side takes one environment for all its jobs
            mine = [(spec, job) for spec, job in zip(single, jobs, strict=True) if spec[0] == kind]
            if not mine:
                continue
            results = run_cli_side_by_side([(job[0], launched(spec[2])) for spec, job in mine], env=mine[0][1][1])
            for (spec, job), result in zip(mine, results, strict=True):
                self._check(kind, result, job[2])
                self.made[spec] = job[2]

    def get(self, kind: str, stage: str, nproc: int) -> Path:
        self.prepare((kind, stage, nproc))
        return self.made[kind, stage, nproc]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, model_dir) -> SharedRuns:
    return SharedRuns(tmp_path_factory, model_dir)


@pytest.fixture
def reference(shared):
    """The uninterrupted run: (stage, nproc) -> its output directory (read only)."""
    return lambda stage, nproc=2: shared.get("reference", stage, nproc)


@pytest.fixture
def killed(shared):
    """`killed(stage, nproc, into)`: a copy at `into` of the run killed while writing checkpoint-8 (each test
    resumes, refuses or sets aside its own copy)."""

    def copy(stage: str, nproc: int, into: Path) -> Path:
        shutil.copytree(shared.get("killed", stage, nproc), into)
        return into

    return copy


# DataLoader workers in one case only: the run with them must equal the reference without them. Each fork of a worker
# risks python/cpython#112275 on Python < 3.11.10 (sft warns), which hung a CI run once; fewer forks, fewer chances.
WORKERS = {"zero2": ["--dataloader_num_workers", "2"]}


@pytest.mark.parametrize("stage", ["none", "zero2", "zero3"])
def test_sigkill_then_same_command_is_bit_exact(stage, reference, model_dir, tmp_path):
    out = tmp_path / "out"
    args = args_for(model_dir, out, stage) + WORKERS.get(stage, [])
    kill_after_checkpoint(args, out, step=4)
    result = run_cli(args, nproc=2)
    assert_ok(result)
    assert_same_run(reference(stage), out)
    resumed = re.search(r"Resuming from \S+/(checkpoint-\d+): step", result.stderr).group(1)
    # save_total_limit 2 keeps the newest checkpoint and the one resumed from
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({"checkpoint-12", resumed})
    # the report marks the resume on every curve (and the attempt's discarded steps, if it logged any)
    step = int(resumed.split("-")[1])
    plotted = json.loads((out / "report" / "plotted.json").read_text())
    assert plotted["loss"]["resumed at"][0] == [step] and plotted["grad_norm"]["resumed at"][0] == [step]
    assert f"<th>resumed at step</th><td>{step}</td>" in (out / "report" / "index.html").read_text()


def test_sigkill_during_checkpoint_write(reference, killed, model_dir, tmp_path):
    out = killed("zero2", 2, tmp_path / "out")
    result = run_cli(args_for(model_dir, out, "zero2"), nproc=2)
    assert_ok(result)
    assert "Ignoring" in result.stderr and "checkpoint-8" in result.stderr  # the half-written one was skipped
    assert list((out / "incomplete").glob("checkpoint-8.*")), "the half-written checkpoint is kept aside, not deleted"
    assert_same_run(reference("zero2"), out)


# each direction once: 2 -> 1 under ZeRO-2 (overlap_comm turned off with one process), 1 -> 2 under ZeRO-3 (its
# partitions made anew for two); the other two pairs took 130 s of the suite and test the same resharding
@pytest.mark.parametrize(("stage", "before", "after"), [("zero2", 2, 1), ("zero3", 1, 2)])
def test_different_process_count(stage, before, after, shared, reference, killed, model_dir, tmp_path):
    shared.prepare(("reference", stage, before), ("killed", stage, before))  # with one process: side by side
    out = killed(stage, before, tmp_path / "out")
    result = run_cli(args_for(model_dir, out, stage), nproc=launched(after))
    assert_ok(result)
    assert f"on {after} processes (was {before}): global batch {2 * before} " in result.stderr
    if stage == "zero2":  # ds_configs/zero2.json leaves overlap_comm to sft: on with several processes only
        assert f"overlap_comm: auto -> {str(after > 1).lower()} ({after} process" in result.stderr
    ref, res = train_records(reference(stage, before)), train_records(out)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert [r["learning_rate"] for r in ref] == [r["learning_rate"] for r in res]  # same LR schedule
    assert [r["num_tokens"] for r in ref] == [r["num_tokens"] for r in res]  # same token counts at every step
    trained = samples_per_step(out)
    assert list(trained) == list(range(STEPS)) and trained == samples_per_step(reference(stage, before))
    assert [r["loss"] for r in ref[:4]] == [r["loss"] for r in res[:4]]
    # After the change: other summation order and other dropout masks (per-rank RNG streams differ)
    for a, b in zip(ref[4:], res[4:], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a["step"], a["loss"], b["loss"])


def test_global_batch_that_cannot_be_kept_is_refused(killed, model_dir, tmp_path):
    """Refused before any training: in this process (one process, world size 1), no launch needed."""
    out = killed("zero2", 2, tmp_path / "out")
    result = run_cli_in_process(args_for(model_dir, out, "zero2") + ["--per_device_train_batch_size", "3"])
    assert result.returncode != 0 and "sft: error:" in result.stderr
    assert "global batch of 4" in result.stderr and "per_device_train_batch_size in [1, 2, 4]" in result.stderr


def test_torchrun_max_restarts_continues_by_itself(reference, model_dir, tmp_path):
    out = tmp_path / "out"
    proc = start_cli(args_for(model_dir, out, "zero2"), nproc=2, launcher_args=("--max-restarts=1",))
    wait_for(out / "checkpoint-4" / MARKER, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker to kill"
    os.kill(int(workers[-1]), signal.SIGKILL)  # one worker dies; the agent restarts the group, which resumes
    stderr = finish(proc)
    assert proc.returncode == 0, stderr[-5000:]
    assert "Resuming from" in stderr
    assert_same_run(reference("zero2"), out)


def test_sigterm_saves_and_exits_with_preempted_code(model_dir, tmp_path):
    out = tmp_path / "out"
    args = args_for(model_dir, out, "none")
    # a fresh interpreter, as the user's process gets the signal: forked from the fork server, this run once went on
    # 300 s past its SIGTERM under CI's load (2026-12-01, a9395a2; not reproduced alone, cause not found)
    proc = start_cli(args, fresh=True)
    wait_for(out / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    stderr = finish(proc, timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    complete = [p for p in out.glob("checkpoint-*") if (p / MARKER).exists()]
    assert complete, "no complete checkpoint after SIGTERM"
    stopped_at = max(int(p.name.split("-")[1]) for p in complete)
    assert stopped_at < STEPS and not (out / "model.safetensors").exists()
    reference_out = tmp_path / "ref"
    for result in run_cli_side_by_side([(args_for(model_dir, reference_out, "none"), 0), (args, 0)]):
        assert_ok(result)
    assert_same_run(reference_out, out)


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_continues_exactly(reference, model_dir, tmp_path):
    """A truncated optimizer shard in the newest checkpoint: named, moved to incomplete/, the previous checkpoint used,
    and the run ends bit-identical to the uninterrupted one (through the real CLI, not just sft.run.checkpoint)."""
    out = tmp_path / "out"
    kill_after_checkpoint(args_for(model_dir, out, "zero2"), out, step=8)
    shard = out / "checkpoint-8" / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    result = run_cli(args_for(model_dir, out, "zero2"), nproc=2)
    assert_ok(result)
    assert (
        "checkpoint-8 is damaged: global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt is not a whole torch "
        "file" in result.stderr
    )
    assert re.search(r"Resuming from \S+/checkpoint-4: step 4", result.stderr)
    assert list((out / "incomplete").glob("checkpoint-8.*")), "the damaged checkpoint is kept aside, not deleted"
    assert_same_run(reference("zero2"), out)


def test_stale_checkpoint_of_another_run_is_refused(killed, model_dir, tmp_path):
    out = killed("none", 0, tmp_path / "out")
    result = run_cli_in_process(args_for(model_dir, out, "none") + ["--seed", "7"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "belongs to a different run (seed: checkpoint 42 vs now 7)" in result.stderr


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_checkpoint_without_deepspeeds_model_states_is_refused_and_nothing_changes(killed, model_dir, tmp_path):
    """DeepSpeed's loader would stop at a bare AssertionError: the check knows the files it reads for the stage."""
    out = killed("zero2", 2, tmp_path / "out")  # checkpoint-4 complete, checkpoint-8 half-written
    (out / "checkpoint-4" / "global_step4" / "mp_rank_00_model_states.pt").unlink()
    before = files(out)
    result = run_cli_in_process(args_for(model_dir, out, "zero2"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"sft: error: `output_dir` {str(out)!r}: no checkpoint can be resumed, every complete one is damaged (the "
        "oldest, checkpoint-4: global_step4/mp_rank_00_model_states.pt is missing (DeepSpeed's model and engine "
        "state)). Move the output_dir away and start again, or restore the files."
    )
    assert files(out) == before


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_difference(killed, model_dir, tmp_path):
    """The model's config.json edited between the runs (a layer fewer): refused at the start, before the weights would
    fail to load, with the field named; nothing in output_dir changes."""
    out = killed("none", 0, tmp_path / "out")
    before = files(out)
    config = model_dir / "config.json"
    original = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(original), "num_hidden_layers": 3}))
        result = run_cli_in_process(args_for(model_dir, out, "none"))
    finally:
        config.write_text(original)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "belongs to a different run (architecture.layers: checkpoint 4 vs now 3)" in last, last
    assert files(out) == before


def test_finished_run_is_not_silently_finished_again(killed, model_dir, tmp_path):
    out = killed("none", 0, tmp_path / "out")
    result = run_cli_in_process(args_for(model_dir, out, "none") + ["--max_steps", "4"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is at step 4 and the run asks for max_steps 4: nothing is left to train" in result.stderr


@pytest.mark.full
def test_deepspeed_launcher_resumes_with_the_same_command(reference, model_dir, tmp_path):
    """Under DeepSpeed's own launcher, killed while writing checkpoint-8 and run again with the same command: the run
    of torchrun that was never interrupted, step for step.

    Full tier: its per-commit counterparts are `test_sigkill_during_checkpoint_write` (the same kill during a save,
    resumed under ZeRO-2 on 2 processes) and tests/multiproc/test_sp_runs.py's
    `test_sp2_sigkill_then_resume_under_deepspeed_launcher_and_on_another_dp` (a killed run resumed bit for bit under
    the deepspeed launcher), with tests/multinode's launcher over ssh."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [str(ROOT / "sft" / "train.py"), *args_for(model_dir, out, "zero2")]
    killed = subprocess.run(
        cmd, cwd=ROOT, env={**cli_env(), KILL_DURING_SAVE_ENV: "8"}, capture_output=True, text=True
    )
    assert killed.returncode != 0 and (out / "checkpoint-4" / MARKER).exists()
    resumed = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert_same_run(reference("zero2"), out)


def test_sigusr1_on_one_rank_stops_all_ranks_at_the_same_step(reference, model_dir, tmp_path):
    """SLURM's --signal reaches one process here: the ranks agree, save one complete checkpoint and exit 75."""
    out = tmp_path / "out"
    proc = start_cli(args_for(model_dir, out, "zero2"), nproc=2, fresh=True)  # torchrun's own report, below
    wait_for(out / "metrics.jsonl", proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(workers[-1]), signal.SIGUSR1)  # one rank only
    stderr = finish(proc, timeout=300)
    assert proc.returncode != 0 and f"exitcode  : {PREEMPTED_EXIT_CODE}" in stderr, stderr[-3000:]
    complete = [p for p in out.glob("checkpoint-*") if (p / MARKER).exists()]
    assert len(complete) >= 1 and not (out / "model.safetensors").exists()
    assert_ok(run_cli(args_for(model_dir, out, "zero2"), nproc=2))
    assert_same_run(reference("zero2"), out)
