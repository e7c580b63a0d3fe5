"""sft's experts implementation (`sft.experts`, `sft_grouped`) against transformers' per-expert loop (`eager`), for
every mixture-of-experts family of the model matrix transformers ships: every token's output and every gradient (the
layer's input, the routing weights, each expert weight and bias) equal in fp32 within 1e-5; the same through the whole
model; and what sft picks by default, per family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sft import architectures, experts
from tests.test_architectures import config_of

MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3")
TOL = 1e-5


def _model(name: str):
    torch.manual_seed(0)
    config = config_of(name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    for p in model.parameters():  # zero-initialised biases and sinks: non-trivial values
        if not p.abs().sum():
            torch.nn.init.normal_(p, std=0.5)
    return model


def _grads(module, x, index, weights, implementation: str):
    module.config._experts_implementation = implementation
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    module.zero_grad()
    out = module(x, index, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {"input": x.grad, "routing weights": weights.grad,
                          **{n: p.grad.clone() for n, p in module.named_parameters()}}  # fmt: skip


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_sft_experts_equal_the_per_expert_loop_per_token(name):
    model = _model(name)
    layer = architectures.experts_modules(model)[0]
    tokens, hidden = 37, model.config.hidden_size
    k = model.config.num_experts_per_tok
    count = layer.num_experts
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden)
    index = torch.stack([torch.randperm(count)[:k] for _ in range(tokens)])
    index[:5] = torch.arange(k)  # one expert many tokens take; the last expert may get none
    weights = torch.rand(tokens, k).softmax(-1)

    want, want_grads = _grads(layer, x, index, weights, "eager")
    got, got_grads = _grads(layer, x, index, weights, experts.NAME)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert set(got_grads) == set(want_grads) and len(got_grads) >= 4
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=TOL, atol=TOL, msg=f"{name}: {key}")
        assert want_grads[key].abs().sum() > 0, key


@pytest.mark.parametrize("name", ("qwen3_moe", "gpt_oss"))
def test_a_model_with_sft_experts_trains_as_with_transformers_grouped_mm(name):
    """The whole model, loss and every parameter's gradient: `sft_grouped` against transformers' `grouped_mm` (its
    default), switched on the same built model through `sft.experts.apply`; the config written to disk does not name
    sft's implementation (a saved model loads anywhere)."""
    model = _model(name)
    torch.manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))

    def step(implementation):
        experts.apply(model, implementation)
        assert model.config._experts_implementation == implementation
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = step("grouped_mm")
    got_loss, got = step(experts.NAME)
    torch.testing.assert_close(got_loss, want_loss, rtol=TOL, atol=TOL)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=TOL, atol=TOL, msg=key)
    assert "sft_grouped" not in model.config.to_json_string()


def test_the_default_per_family_and_what_a_user_asks_is_kept():
    for name in MOE_FAMILIES:
        arch = architectures.of(config_of(name))
        chosen, reason = experts.decide(arch, None)
        assert chosen == (experts.NAME if arch.kernel("experts").on else None), name
        assert reason
    qwen = architectures.of(config_of("qwen3_moe"))
    assert experts.decide(qwen, {"experts_implementation": "batched_mm"}) == (
        "batched_mm",
        "model_init_kwargs.experts_implementation: batched_mm",
    )
