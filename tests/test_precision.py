"""bf16 weights without a sharding engine (issue #65): no engine keeps an fp32 master copy there, so a plain optimizer
steps the bf16 weights in place and an update under half a bf16 ulp is rounded away. `optim: auto` takes torchao's
8-bit AdamW with stochastic rounding (`sft.plan.preflight._precision`), any other optimizer is said in a warning, and
the memory plan counts what that run holds (no fp32 master, no fp32 gradient)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import Trainer

from sft.model import shapes
from sft.plan import memory as plan
from sft.plan.arguments import parse_args
from sft.plan.preflight import STOCHASTIC_ROUNDING, preflight
from tests.conftest import ROOT


def _planned(tmp_path, caplog, *extra):
    _, _, training_args, model_args = parse_args(
        ["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(tmp_path / "out"), *extra]
    )
    with caplog.at_level(logging.INFO, logger="sft.plan"):
        caplog.clear()
        return preflight(training_args, model_args).training_args, caplog.text


@pytest.fixture(scope="module")
def regression():
    """A linear regression whose fp32 Adam steps of lr 1e-4 are below half a bf16 ulp of most weights."""
    generator = torch.Generator().manual_seed(0)
    teacher = 0.5 * torch.randn(256, 256, generator=generator)
    x = torch.randn(4096, 256, generator=generator)
    start = teacher + 0.05 * torch.randn(256, 256, generator=generator)
    return x, x @ teacher.T, start


def _train(regression, dtype, make_optimizer, steps: int = 150) -> float:
    """The full-data loss after `steps` steps of batches of 256 from weights `start` held in `dtype`."""
    x, y, start = regression
    weight = torch.nn.Parameter(start.clone().to(dtype))
    optimizer = make_optimizer([weight])
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = torch.randint(0, len(x), (256,), generator=generator)
        loss = ((x[rows].to(dtype) @ weight.T).float() - y[rows]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return ((x @ weight.float().T - y) ** 2).mean().item()


def test_bf16_weights_without_an_engine_get_stochastic_rounding_and_train_as_fp32_master_does(
    tmp_path, caplog, regression
):
    """`--deepspeed none` with bf16 weights: `optim: auto` becomes torchao's 8-bit AdamW with stochastic rounding,
    logged. The optimizer transformers builds from those arguments trains the regression to fp32 Adam's loss (within
    3%), where torch's AdamW on the same bf16 weights leaves it where it started (most updates rounded away)."""
    args, log = _planned(tmp_path, caplog, "--deepspeed", "none", "--dtype", "bfloat16")
    assert (str(args.optim.value), args.optim_args) == (plan.EIGHT_BIT_OPTIM, STOCHASTIC_ROUNDING)
    assert "Precision: bf16 weights without an fp32 master copy" in log
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls.__name__ == "AdamW8bit" and bool(kwargs["bf16_stochastic_round"])
    settings = {"lr": 1e-4, "weight_decay": 0.0}
    _, y, start = regression
    initial = ((regression[0] @ start.T - y) ** 2).mean().item()
    fp32 = _train(regression, torch.float32, lambda p: torch.optim.AdamW(p, **settings))
    pure = _train(regression, torch.bfloat16, lambda p: torch.optim.AdamW(p, **settings))
    rounded = _train(regression, torch.bfloat16, lambda p: cls(p, **{**kwargs, **settings}))
    assert fp32 < 0.8 * initial  # fp32 master training moves the loss
    assert pure > 0.97 * initial  # pure bf16 steps barely do
    assert rounded == pytest.approx(fp32, rel=0.03)


def test_other_optimizers_on_bf16_weights_are_warned_and_engines_keep_their_master(tmp_path, caplog):
    """An optimizer the recipe names keeps its choice with a warning that names the fix; ZeRO (the demo's default) and
    fp32 weights keep the optimizer as it was, without a word."""
    args, log = _planned(tmp_path, caplog, "--deepspeed", "none", "--dtype", "bfloat16", "--optim", "adamw_torch")
    assert str(args.optim.value) == "adamw_torch" and "update under half a bf16 ulp is rounded away" in log
    assert "optim: auto (8-bit AdamW with stochastic rounding), dtype: float32, or a DeepSpeed config" in log
    for extra in (["--dtype", "bfloat16"], ["--deepspeed", "none"]):
        args, log = _planned(tmp_path, caplog, *extra)
        assert str(args.optim.value) != plan.EIGHT_BIT_OPTIM and "Precision:" not in log


def test_the_memory_plan_counts_no_master_copy_for_bf16_weights_stepped_in_place():
    """No sharding engine, bf16 weights: 2 bytes of weights, 2 of gradients and the moments a weight (8-bit: 2 + 8/256;
    torch's AdamW keeps them in bf16: 4), where an fp32 master copy would add 4 + an fp32 gradient of 4."""
    shape = shapes.load_shape("Qwen/Qwen3-4B")
    master = plan.Setting(gpus=1, zero_stage=None, seq_len=4096, liger=True)
    rounded = dataclasses.replace(master, master_weights=False, moment_bytes=plan.moment_bytes_of("adamw_torch_8bit"))
    pure = dataclasses.replace(master, master_weights=False, moment_bytes=4)
    assert "no fp32 master" in rounded.describe() or "no fp32 master" in plan.estimate(shape, rounded).table()
    held = {s: plan.model_states(shape, s)[0] / shape.n_params for s in (master, rounded, pure)}
    assert held[rounded] == pytest.approx(4 + 2 + 8 / 256) and held[pure] == pytest.approx(8)
    assert held[master] == pytest.approx(16)
    assert plan.estimate(shape, rounded).at_step < plan.estimate(shape, master).at_step - 12 * shape.n_params
