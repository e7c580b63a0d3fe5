"""Global-batch arithmetic (sft.core.batch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sft.core.batch import plan_batch
from sft.errors import ConfigError
from tests.conftest import ROOT


def test_accumulation_from_global_batch():
    plan = plan_batch(dp_size=8, per_device_batch_size=2, global_batch_size=528)
    assert plan.gradient_accumulation_steps == 33 and plan.global_batch_size == 528


def test_same_target_same_global_batch_on_any_world_size():
    for world, gas in ((1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (64, 1)):
        plan = plan_batch(dp_size=world, per_device_batch_size=2, global_batch_size=128)
        assert (plan.gradient_accumulation_steps, plan.global_batch_size) == (gas, 128)


def test_tokens_per_step_with_packing():
    plan = plan_batch(16, 4, tokens_per_step=1_048_576, max_length=4096)
    assert (plan.global_batch_size, plan.gradient_accumulation_steps, plan.tokens_per_step) == (256, 4, 1_048_576)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dp_size=8, per_device_batch_size=4, global_batch_size=528),
         "global batch 528 cannot be reached with data-parallel size 8 x per_device_train_batch_size 4 = 32 rows per "
         "accumulation step. Nearest reachable: 512 (accumulation 16), 544 (accumulation 17). Or keep the target with "
         "per_device_train_batch_size x accumulation = 1 x 66, 2 x 33, 3 x 22, 6 x 11, 11 x 6."),
        (dict(dp_size=8, per_device_batch_size=2, global_batch_size=100),
         "Nearest reachable: 96 (accumulation 6), 112 (accumulation 7). Or keep the target with a data-parallel size "
         "(GPU count) that divides 100: [5, 10, 20, 25, 50, 100]."),
        (dict(dp_size=16, per_device_batch_size=4, tokens_per_step=1_000_000, max_length=4096),
         "`tokens_per_step` 1,000,000 is not a whole number of rows of max_length 4096; nearest: 999,424 (244 rows) "
         "or 1,003,520 (245 rows)."),
        (dict(dp_size=2, per_device_batch_size=4, tokens_per_step=65536),
         "`tokens_per_step` (65536) needs `max_length`"),
        (dict(dp_size=2, per_device_batch_size=4, tokens_per_step=65536, global_batch_size=8, max_length=512),
         "give one target"),
        (dict(dp_size=3, per_device_batch_size=4, global_batch_size=48, max_length=512),
         None),
    ],
)  # fmt: skip
def test_infeasible_targets_name_the_alternatives(kwargs, message):
    if message is None:
        assert plan_batch(**kwargs).gradient_accumulation_steps == 4
        return
    with pytest.raises(ConfigError) as e:
        plan_batch(**kwargs)
    assert message in str(e.value)


def test_cli():
    ok = subprocess.run(
        [sys.executable, "-m", "sft.core.batch", "--global-batch-size", "528", "--world-size", "8",
         "--per-device-batch-size", "2"], cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "gradient_accumulation_steps: 33"
    bad = subprocess.run(
        [sys.executable, "-m", "sft.core.batch", "--global-batch-size", "528", "--world-size", "8",
         "--per-device-batch-size", "4"], cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "Nearest reachable: 512 (accumulation 16), 544" in bad.stderr
