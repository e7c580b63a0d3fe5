"""The checkpoint bookkeeping of sft.run.checkpoint on its own: which checkpoint is picked, what rotation keeps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sft.errors import ConfigError
from sft.run import checkpoint as ckpt
from tests.helpers import make_checkpoint


def args(out: Path, resume="auto"):
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume, max_steps=40, num_train_epochs=3.0)


def test_auto_picks_newest_complete_and_sets_aside_newer_incomplete(tmp_path):
    make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 8)
    make_checkpoint(tmp_path, 12, complete=False)
    (tmp_path / "metrics.jsonl").write_text("")
    assert ckpt.resolve_resume(args(tmp_path)) == str(newest)
    ckpt.set_aside_incomplete(str(tmp_path), str(newest))
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]
    assert [p.name.split(".")[0] for p in (tmp_path / ckpt.INCOMPLETE_DIR).iterdir()] == ["checkpoint-12"]


def test_auto_starts_fresh_in_an_empty_or_checkpointless_run_dir(tmp_path):
    assert ckpt.resolve_resume(args(tmp_path / "new")) is None
    make_checkpoint(tmp_path, 4, complete=False)
    assert ckpt.resolve_resume(args(tmp_path)) is None


@pytest.mark.parametrize("resume", ["auto", "none", None])
def test_foreign_files_are_never_written_over(tmp_path, resume):
    make_checkpoint(tmp_path, 4)
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
    make_checkpoint(tmp_path, 20)
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
    half = make_checkpoint(tmp_path, 12, complete=False)
    with pytest.raises(ConfigError, match="may be half-written"):
        ckpt.resolve_resume(args(tmp_path / "elsewhere", str(half)))
    mine = tmp_path / "my-favourite"  # any name: the step comes from sft_state.json
    make_checkpoint(tmp_path, 8).rename(mine)
    assert ckpt.resolve_resume(args(tmp_path / "elsewhere", str(mine))) == str(mine)
    ckpt.set_aside_incomplete(str(tmp_path), str(mine))
    assert not half.exists()  # newer-than-resume-point incomplete ones move aside, whatever the resume dir's name


def test_rotation_keeps_newest_and_resumed_from(tmp_path):
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 10, complete=False)
    ckpt.rotate(str(tmp_path), limit=1, keep={str((tmp_path / "checkpoint-4").resolve())})
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8", "checkpoint-10"]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("harm", "named"),
    [
        (lambda c: truncate(c / f"global_step{8}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
         "global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt is not a whole torch file"),
        (lambda c: (c / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink(),
         "global_step8/ lacks the optim states of rank(s) [0] (1 of 2 present)"),
        (lambda c: (c / ckpt.STATE).write_text('{"global_step": 8,'), f"{ckpt.STATE} is not valid JSON"),
        (lambda c: (c / ckpt.STATE).write_text('{"global_step": 8, "fingerprint": {"world_size": "2"}}'),
         f"{ckpt.STATE} has no fingerprint of the run's geometry (world_size, per_device_train_batch_size"),
        (lambda c: (c / "rng_state_1.pth").unlink(), "rng_state_1.pth is missing"),
        (lambda c: (c / "latest").write_text("global_step9"), "`latest` names 'global_step9', which is not in"),
        (lambda c: truncate(c / "model.safetensors"), "model.safetensors is 68 bytes where its header says 136"),
        (lambda c: (c / "scheduler.pt").write_bytes(b""), "scheduler.pt is empty"),
        (lambda c: (c / "global_step8" / "mp_rank_00_model_states.pt").unlink(),
         "global_step8/mp_rank_00_model_states.pt is missing (DeepSpeed's model and engine state)"),
        (lambda c: (c / "latest").write_text("\n"), "`latest` is empty"),
    ],
    ids=["truncated-optimizer", "deleted-shard", "corrupt-state", "state-without-geometry", "deleted-rng",
         "dangling-latest", "truncated-weights", "empty-file", "deleted-model-states", "empty-latest"],
)  # fmt: skip
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_used(tmp_path, caplog, harm, named):
    make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 8)
    assert ckpt.damage(newest) is None
    harm(newest)
    assert named in ckpt.damage(newest)
    with caplog.at_level("WARNING"):
        resumed = ckpt.resolve_resume(args(tmp_path))
    assert resumed == str(tmp_path / "checkpoint-4")
    assert "checkpoint-8 is damaged" in caplog.text and named in caplog.text
    ckpt.set_aside_incomplete(str(tmp_path), resumed)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-4"]
    moved = list((tmp_path / ckpt.INCOMPLETE_DIR).iterdir())
    assert [p.name.split(".")[0] for p in moved] == ["checkpoint-8"]  # moved whole, not deleted


def test_no_usable_checkpoint_is_an_error(tmp_path):
    only = make_checkpoint(tmp_path, 4)
    (only / "rng_state_0.pth").unlink()
    with pytest.raises(ConfigError, match="no checkpoint can be resumed, every complete one is damaged"):
        ckpt.resolve_resume(args(tmp_path))
    with pytest.raises(ConfigError, match="is damaged: rng_state_0.pth is missing"):
        ckpt.resolve_resume(args(tmp_path / "elsewhere", str(only)))


def test_zero3_checkpoints_need_every_ranks_model_states_and_optimizer_shards(tmp_path):
    """ZeRO-3 writes no mp_rank_00_model_states.pt but one model-states file and one optimizer shard per rank."""
    newest = make_checkpoint(tmp_path, 8, zero3=True)
    assert ckpt.damage(newest) is None
    (newest / "global_step8" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert ckpt.damage(newest) == "global_step8/ lacks the model states of rank(s) [1] (1 of 2 present)"
    other = make_checkpoint(tmp_path / "other", 8, zero3=True)
    for rank in (0, 1):
        (other / "global_step8" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").unlink()
    assert ckpt.damage(other) == (
        "global_step8/ has no optimizer shard (zero_pp_rank_<rank>_mp_rank_00_optim_states.pt) of any rank"
    )
    with pytest.raises(ConfigError, match="no checkpoint can be resumed, every complete one is damaged"):
        ckpt.resolve_resume(args(tmp_path / "other"))


def test_fsdp2_checkpoints_need_their_shard_index_and_every_shard_it_names(tmp_path):
    """FSDP2's torch.distributed.checkpoint folders (written here by one process): a complete one passes; its
    `.metadata` missing or unreadable, a shard it names missing or cut short, each named (what `resolve_resume`
    sets a checkpoint aside for, as for DeepSpeed's shards)."""
    import torch.distributed.checkpoint as dcp

    def fsdp2(out: Path) -> Path:
        path = make_checkpoint(out, 8, world=1)
        shutil.rmtree(path / "global_step8")
        (path / "latest").unlink()
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
            dcp.save({"w": torch.arange(4096.0), "b": torch.ones(8)}, checkpoint_id=str(path / folder), no_dist=True)
        return path

    assert ckpt.damage(fsdp2(tmp_path / "ok")) is None
    harms = {
        "index": (lambda p: (p / "optimizer_0" / ".metadata").unlink(),
                  "optimizer_0/.metadata is missing (torch.distributed.checkpoint's index of the shards)"),
        "garbage": (lambda p: (p / "optimizer_0" / ".metadata").write_bytes(b"xx"),
                    "optimizer_0/.metadata cannot be read (UnpicklingError"),
        "gone": (lambda p: (p / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink(),
                 "pytorch_model_fsdp_0/__0_0.distcp is missing (one process's shard)"),
        "cut": (lambda p: os.truncate(p / "pytorch_model_fsdp_0" / "__0_0.distcp", 100),
                "pytorch_model_fsdp_0/__0_0.distcp is cut short (100 of "),
    }  # fmt: skip
    for name, (harm, named) in harms.items():
        path = fsdp2(tmp_path / name)
        harm(path)
        assert ckpt.damage(path).startswith(named), name


def test_another_model_or_adapter_is_named_field_by_field_and_old_checkpoints_are_not_refused_for_it():
    arch = {"family": "llama", "layers": 4, "hidden": 128, "vocab": 104, "experts": None}
    saved = {"seed": 42, "fp8": False, "architecture": arch, "lora": None}
    with pytest.raises(ConfigError) as e:
        ckpt.compare_fingerprints(saved, {**saved, "architecture": {**arch, "layers": 3}}, "out/checkpoint-4")
    assert "out/checkpoint-4 belongs to a different run (architecture.layers: checkpoint 4 vs now 3)" in str(e.value)
    lora = {"lora_r": 8, "lora_target_modules": ["q_proj"]}
    with pytest.raises(ConfigError, match=r"\(lora.lora_r: checkpoint 8 vs now 16\)"):
        ckpt.compare_fingerprints({**saved, "lora": lora}, {**saved, "lora": {**lora, "lora_r": 16}}, "c")
    with pytest.raises(ConfigError, match=r"\(lora: checkpoint None vs now \{'lora_r': 8"):
        ckpt.compare_fingerprints(saved, {**saved, "lora": lora}, "c")
    # written before sft fingerprinted the model: the model path and the rest still compare, this cannot
    ckpt.compare_fingerprints({"seed": 42, "fp8": False}, {**saved, "lora": lora}, "c")
