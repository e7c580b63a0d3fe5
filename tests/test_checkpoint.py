"""The checkpoint bookkeeping of sft.checkpoint on its own: which checkpoint is picked, what rotation keeps."""

from __future__ import annotations

import json
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
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume)


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
