"""Selective activation checkpointing (`sft.model.checkpointing`): the same gradients as full checkpointing, with the
attention kernel run once per layer instead of twice."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from sft.errors import ConfigError
from sft.model import checkpointing
from sft.plan.arguments import parse_args
from tests.conftest import ROOT


class CountOps(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.calls = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.ops
        return func(*args, **(kwargs or {}))


def gradients(model, ids, keep: bool) -> tuple[float, dict, int]:
    model.zero_grad()
    if keep:
        checkpointing.keep_attention_outputs(model)
    else:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with CountOps(checkpointing.attention_ops()) as counter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, counter.calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_attention_outputs_give_the_same_gradients_with_one_attention_call_per_layer(dtype):
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "demo" / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    ids = torch.randint(10, config.vocab_size, (2, 96))
    full_loss, full, full_calls = gradients(model, ids, keep=False)
    kept_loss, kept, kept_calls = gradients(model, ids, keep=True)
    layers = config.num_hidden_layers
    assert (full_calls, kept_calls) == (2 * layers, layers)  # forward + recomputation, or the forward alone
    assert kept_loss == full_loss
    for name, grad in full.items():
        assert torch.equal(kept[name], grad), name


def test_kept_attention_outputs_need_checkpointing_on_the_gpu():
    recipe = ["--config", str(ROOT / "recipes" / "demo.yaml")]
    with pytest.raises(ConfigError, match="`keep_attention_outputs: true` chooses what activation checkpointing"):
        parse_args([*recipe, "--keep_attention_outputs", "true", "--activation_checkpointing", "false"])
    with pytest.raises(ConfigError, match="set one of them to false"):
        parse_args([*recipe, "--keep_attention_outputs", "true", "--offload_checkpoints", "true"])
