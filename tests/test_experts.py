"""sft's experts implementation (`sft.model.experts`, `sft_grouped`) against transformers' per-expert loop (`eager`),
for every mixture-of-experts family of the model matrix transformers ships: every token's output and every gradient
(the layer's input, the routing weights, each expert weight and bias) equal in fp32 within 1e-5; the same through the
whole model; and what sft picks by default, per family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sft.model import architectures, experts
from tests.tiny_models import config_of

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


def _grads(module, x, index, weights, implementation: str, align: int = 1):
    module.config._experts_implementation = implementation
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    module.zero_grad()
    out = module(x, index, weights) if align == 1 else experts.experts_forward(module, x, index, weights, align=align)
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
    for align in (1, 16):  # 16: each expert's rows padded to a multiple of 16, as the float8 grouped GEMMs take them
        got, got_grads = _grads(layer, x, index, weights, experts.NAME, align)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        assert set(got_grads) == set(want_grads) and len(got_grads) >= 4
        for key in want_grads:
            torch.testing.assert_close(got_grads[key], want_grads[key], rtol=TOL, atol=TOL, msg=f"{name}: {key}")
            assert want_grads[key].abs().sum() > 0, key


def test_the_aligned_layout_pads_each_experts_rows_to_a_multiple():
    index = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 2]])  # expert 0: 3 slots, 1: 1, 2: 4; expert 3: none
    plain, aligned = experts.layout(index, 4), experts.layout(index, 4, align=4)
    assert plain.offsets.tolist() == [3, 4, 8, 8]
    rows = (8 + 3) // 4 * 4 + 4 * 4
    assert aligned.offsets.tolist() == [4, 8, 12, rows] and aligned.row_token.numel() == rows
    assert aligned.row_token[:12].tolist() == [0, 1, 3, 4, 2, 4, 4, 4, 0, 1, 2, 3]  # 4: the zero row
    assert aligned.slot_row.tolist() == [0, 8, 9, 1, 10, 4, 2, 11]
    assert torch.equal(aligned.row_token[aligned.slot_row], torch.arange(8) // 2)
    assert torch.equal(aligned.row_slot[aligned.slot_row], torch.arange(8))


@pytest.mark.parametrize("name", ("qwen3_moe", "gpt_oss"))
def test_a_model_with_sft_experts_trains_as_with_transformers_grouped_mm(name):
    """The whole model, loss and every parameter's gradient: `sft_grouped` against transformers' `grouped_mm` (its
    default), switched on the same built model through `sft.model.experts.apply`; the config written to disk does not
    name sft's implementation (a saved model loads anywhere)."""
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


def test_lora_on_attention_and_experts_trains_and_merges(tmp_path):
    """LoRA on a tiny Qwen3-MoE's attention (`lora_target_modules`) and experts (`lora_target_parameters`, PEFT's
    parameter adapters), built from TRL's ModelConfig as sft's train.py builds it: the experts' adapter gradients are
    the same through sft's experts implementation as through transformers' grouped_mm; a few AdamW steps lower the loss
    and change the expert adapters and nothing of the base; `sft.tools.merge` writes a model whose logits equal the
    adapted model's."""
    import shutil

    from peft import get_peft_model
    from trl import ModelConfig, get_peft_config

    from sft.tools.merge import merge
    from tests.conftest import ROOT

    _model("qwen3_moe").save_pretrained(tmp_path / "base")
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        if f.name != "config.json":
            shutil.copy(f, tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    targets = ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                          lora_target_modules=["q_proj", "v_proj"],
                          lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    model = get_peft_model(base, get_peft_config(targets))
    experts_adapters = [n for n, p in model.named_parameters() if p.requires_grad and "experts" in n]
    assert len(experts_adapters) == 2 * 2 * base.config.num_hidden_layers, experts_adapters  # A and B, 2 weights
    torch.manual_seed(2)
    ids = torch.randint(3, base.config.vocab_size, (2, 24))

    def grads(implementation):
        experts.apply(base, implementation)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads("grouped_mm"), grads(experts.NAME)
    assert set(want) == set(got) and any("experts" in n and want[n].abs().sum() > 0 for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=TOL, atol=TOL, msg=n)

    start = {n: p.detach().clone() for n, p in model.named_parameters() if n in experts_adapters}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(not torch.equal(p, start[n]) for n, p in model.named_parameters() if n in start)
    base_now = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
                for n, p in model.named_parameters() if "lora_" not in n}  # fmt: skip
    assert all(torch.equal(base_now[n], frozen[n]) for n in frozen)

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    merged_dir = merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ("qwen3_moe", "gpt_oss"))
def test_the_router_load_is_each_layers_expert_choices_counted_in_training_forwards(name):
    """`RouterLoad` against the routers' own choices: each layer's top-k of its router logits (transformers'
    `output_router_logits`) counted by hand over two training forwards (a checkpoint's recompute counts again, so it
    reads shares), the busiest expert's share over an even share and the idle experts' fraction; an eval forward and
    a summary reset count nothing more."""
    model = _model(name).train()
    load = experts.RouterLoad(model)
    assert len(load.layers) == model.config.num_hidden_layers
    k, count = model.config.num_experts_per_tok, load.layers[0].num_experts
    torch.manual_seed(3)
    hand = torch.zeros(len(load.layers), count)
    for _ in range(2):
        ids = torch.randint(3, model.config.vocab_size, (2, 24))
        logits = model(input_ids=ids, output_router_logits=True).router_logits
        for layer, router in enumerate(logits):
            hand[layer] += torch.bincount(router.topk(k, dim=-1).indices.reshape(-1), minlength=count)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    got = load.summary()
    shares = hand / hand.sum(-1, keepdim=True) * count
    assert got["router_load_max"] == pytest.approx(float(shares.max()), rel=1e-6)
    assert got["router_idle_experts"] == pytest.approx(float((hand == 0).float().mean()))
    assert got["router_load_max"] > 1.0 and load.summary() == {}  # counted once, then reset
