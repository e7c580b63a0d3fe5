"""sft.core.dims (the one owner of the parallel sizes) and the components that read it: batch arithmetic and the
`sft` command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sft.core.batch import keep_global_batch
from sft.core.dims import ParallelDims
from sft.errors import ConfigError
from tests.conftest import ROOT


def test_data_parallel_fills_what_sequence_parallel_leaves():
    assert ParallelDims.build(8) == ParallelDims(world_size=8, dp=8, sp=1)
    dims = ParallelDims.build(8, sp=4, gpus_per_node=4, rank=6)
    assert (dims.dp, dims.sp, dims.gpus_per_node) == (2, 4, 4)
    assert (dims.dp_rank, dims.sp_rank) == (1, 2)  # the sequence-parallel ranks of one replica are neighbours
    assert dims.describe() == "8 processes: data-parallel 2 x sequence-parallel 4"


def test_the_product_must_be_the_world_size():
    with pytest.raises(ConfigError) as e:
        ParallelDims(world_size=8, dp=3, sp=2)
    assert "data-parallel 3 x sequence-parallel 2 = 6, but the run has 8 processes" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ParallelDims.build(6, sp=4)
    assert "`sequence_parallel_size: 4` does not divide the 6 processes" in str(e.value) and "[1, 2, 3, 6]" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="`sequence_parallel_size` must be a whole number >= 1, got 0"):
        ParallelDims.build(4, sp=0)


def test_the_run_reads_its_dimensions_from_the_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")
    assert ParallelDims.from_env() == ParallelDims(world_size=4, dp=4, sp=1, gpus_per_node=2, rank=3)


def test_a_resume_keeps_the_checkpoints_global_batch_on_the_data_parallel_size():
    plan = keep_global_batch(8, dp_size=1, per_device_batch_size=2, trained_with="ckpt (2 processes x 2 x 2)")
    assert (plan.gradient_accumulation_steps, plan.global_batch_size) == (4, 8)
    with pytest.raises(ConfigError) as e:
        keep_global_batch(4, dp_size=1, per_device_batch_size=3, trained_with="checkpoint-4 was trained with a 4")
    assert str(e.value).startswith("checkpoint-4 was trained with a 4; data-parallel size 1 x")
    assert "per_device_train_batch_size in [1, 2, 4]" in str(e.value)


def test_sft_command_runs_each_tool():
    def sft(*args):
        return subprocess.run([sys.executable, "-m", "sft", *args], cwd=ROOT, capture_output=True, text=True)

    listing = sft()
    assert listing.returncode == 2 and all(f"  {c} " in listing.stdout for c in ("train", "plan", "batch", "merge"))
    batch = sft("batch", "--global-batch-size", "528", "--world-size", "8", "--per-device-batch-size", "2")
    assert batch.returncode == 0 and batch.stdout.splitlines()[0] == "gradient_accumulation_steps: 33"
    assert "usage: sft plan" in sft("plan", "--help").stdout
    assert "usage: sft eval" in sft("eval", "--help").stdout
    wrong = sft("trian")
    assert wrong.returncode == 2 and "did you mean 'train'?" in wrong.stderr
    train = sft("train", "--config", "nope.yaml")  # the training entry point, in-process argument checks first
    assert train.returncode == 2 and "`--config`: no such file 'nope.yaml'" in train.stderr
    # the recipe is read before any library: a typo in its path costs no import of torch
    probe = ("import sys, sft.train\ntry:\n    sft.train.run(['--config', 'nope.yaml'])\nexcept SystemExit as e:\n"
             "    print(e.code, 'torch' in sys.modules)")  # fmt: skip
    said = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert said.stdout.split() == ["2", "False"] and "no such file 'nope.yaml'" in said.stderr, said.stderr


def test_no_sft_module_shadows_an_installed_one():
    """`python sft/train.py` puts sft/ first on sys.path (there is no path hack in the package), so a module there
    named like an installed or standard-library module would be imported in its place by any library."""
    import pkgutil

    ours = {m.name for m in pkgutil.iter_modules([str(ROOT / "sft")])}
    others = {m.name for m in pkgutil.iter_modules() if "site-packages" in str(getattr(m.module_finder, "path", ""))}
    clash = ours & (others | set(sys.stdlib_module_names))
    assert not clash, f"sft modules named like installed ones: {sorted(clash)}"


def test_every_axis_is_validated_once_and_read_through_properties():
    """Context and tensor parallelism and replicas of the sharded states beside dp and sp (issue #80's dims, which
    #81 builds on): one constructor checks that they multiply to the world size and that replicas and experts divide
    the data-parallel size; a rank's coordinates lay tp innermost, then sp, cp, dp (torchtitan's order), so with cp =
    tp = 1 they are the sp-only layout above."""
    dims = ParallelDims.build(32, sp=2, cp=2, tp=2, gpus_per_node=8, rank=27, dp_replicate=2)
    assert (dims.dp, dims.dp_shard, dims.non_data_parallel_size, dims.seq_len_divisor) == (4, 2, 8, 16)
    assert (dims.dp_rank, dims.cp_rank, dims.sp_rank, dims.tp_rank) == (3, 0, 1, 1)  # 27 = 3*8 + 0*4 + 1*2 + 1
    enabled = [dims.dp_enabled, dims.cp_enabled, dims.sp_enabled, dims.tp_enabled, dims.ep_enabled]
    assert enabled == [True, True, True, True, False]
    assert dims.describe() == ("32 processes: data-parallel 4 (2 replicas of 2 sharded) x context-parallel 2 x "
                               "sequence-parallel 2 x tensor-parallel 2")  # fmt: skip
    plain = ParallelDims.build(8, sp=4, rank=6)
    assert (plain.dp_rank, plain.cp_rank, plain.sp_rank, plain.tp_rank, plain.seq_len_divisor) == (1, 0, 2, 0, 4)
    with pytest.raises(ConfigError, match=r"data-parallel 2 x tensor-parallel 3 = 6, but the run has 8 processes"):
        ParallelDims.build(8, tp=3)
    with pytest.raises(ConfigError, match=r"`dp_replicate` 3 does not divide the 4 data-parallel processes"):
        ParallelDims.build(4, dp_replicate=3)
    with pytest.raises(ConfigError, match=r"`expert_parallel_size` 3 does not divide the 4 data-parallel"):
        ParallelDims.build(8, tp=2, ep=3)
    with pytest.raises(ConfigError, match=r"Parallel size `cp` must be a whole number >= 1, got 0"):
        ParallelDims.build(4, cp=0)
