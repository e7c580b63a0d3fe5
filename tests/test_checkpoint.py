"""The checkpoint bookkeeping of sft.checkpoint on its own: which checkpoint is picked, what rotation keeps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from sft import checkpoint as ckpt
from sft.errors import ConfigError


def make(out: Path, step: int, complete: bool = True) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / ckpt.STATE).write_text(json.dumps({"global_step": step}))
    if complete:
        (path / ckpt.MARKER).write_text("{}")
    return path


def args(out: Path, resume="auto"):
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume, max_steps=40, num_train_epochs=3.0)


def test_auto_picks_newest_complete_and_sets_aside_newer_incomplete(tmp_path):
    make(tmp_path, 4)
    newest = make(tmp_path, 8)
    make(tmp_path, 12, complete=False)
    (tmp_path / "metrics.jsonl").write_text("")
    assert ckpt.resolve_resume(args(tmp_path)) == str(newest)
    ckpt.set_aside_incomplete(str(tmp_path), str(newest))
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]
    assert [p.name.split(".")[0] for p in (tmp_path / ckpt.INCOMPLETE_DIR).iterdir()] == ["checkpoint-12"]


def test_auto_starts_fresh_in_an_empty_or_checkpointless_run_dir(tmp_path):
    assert ckpt.resolve_resume(args(tmp_path / "new")) is None
    make(tmp_path, 4, complete=False)
    assert ckpt.resolve_resume(args(tmp_path)) is None


@pytest.mark.parametrize("resume", ["auto", "none", None])
def test_foreign_files_are_never_written_over(tmp_path, resume):
    make(tmp_path, 4)
    (tmp_path / "model.safetensors").write_text("someone's model")
    with pytest.raises(ConfigError, match="already holds model.safetensors"):
        ckpt.resolve_resume(args(tmp_path, resume))


@pytest.mark.parametrize("name", ["README.md", "metrics.jsonl"])
def test_a_users_file_with_sfts_name_is_the_users(tmp_path, name):
    """README.md and metrics.jsonl are sft's only in a directory sft claimed (its run manifest, or checkpoints)."""
    (tmp_path / name).write_text("mine")
    with pytest.raises(ConfigError, match=f"already holds {name}"):
        ckpt.resolve_resume(args(tmp_path))
    assert (tmp_path / name).read_text() == "mine"
    ckpt.claim_output_dir(str(tmp_path / "claimed"))
    (tmp_path / "claimed" / name).write_text("sft's")  # the same name in a claimed directory is the run's own
    assert ckpt.resolve_resume(args(tmp_path / "claimed")) is None


def test_a_finished_run_is_recognised_and_continues_only_to_a_raised_target(tmp_path):
    ckpt.claim_output_dir(str(tmp_path))
    make(tmp_path, 20)
    before = {p.name for p in tmp_path.iterdir()}
    (tmp_path / "model.safetensors").write_text("final")
    (tmp_path / "README.md").write_text("model card")
    ckpt.mark_finished(str(tmp_path), 40, 40, 3.0, before)
    assert ckpt.read_manifest(tmp_path)["files"] == ["model.safetensors"]
    with pytest.raises(ConfigError, match=r"holds a finished sft run \(step 40.*resumes from checkpoint-20"):
        ckpt.resolve_resume(args(tmp_path))
    raised = args(tmp_path)
    raised.max_steps = 60
    assert ckpt.resolve_resume(raised) == str(tmp_path / "checkpoint-20")
    shutil.rmtree(tmp_path / "checkpoint-20")
    with pytest.raises(ConfigError, match="no complete checkpoint to continue from"):
        ckpt.resolve_resume(raised)


def test_explicit_path_must_be_complete(tmp_path):
    half = make(tmp_path, 12, complete=False)
    with pytest.raises(ConfigError, match="may be half-written"):
        ckpt.resolve_resume(args(tmp_path / "elsewhere", str(half)))
    mine = tmp_path / "my-favourite"  # any name: the step comes from sft_state.json
    make(tmp_path, 8).rename(mine)
    assert ckpt.resolve_resume(args(tmp_path / "elsewhere", str(mine))) == str(mine)
    ckpt.set_aside_incomplete(str(tmp_path), str(mine))
    assert not half.exists()  # newer-than-resume-point incomplete ones move aside, whatever the resume dir's name


def test_rotation_keeps_newest_and_resumed_from(tmp_path):
    for step in (2, 4, 6, 8):
        make(tmp_path, step)
    make(tmp_path, 10, complete=False)
    ckpt.rotate(str(tmp_path), limit=1, keep={str((tmp_path / "checkpoint-4").resolve())})
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8", "checkpoint-10"]
