"""The loss every sft run trains on never builds the full logits, for every family, Liger patch or not (issue #79, item
3): TRL's SFTTrainer adds its fused LM head to the model (`trl.trainer.utils.add_fused_lm_head`: the head projected in
tiles over the labelled positions only, the family's final soft cap and logit scale applied) and takes the loss from
its log-probabilities. Here, per family of the model matrix (tiny random models, fp32 on the CPU), that loss and its
gradients against the model's own loss from its full logits (transformers' cross-entropy after the family's cap)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tests.tiny_models import BASE, FAMILIES

LINEAR = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LINEAR_WIDTHS = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     layer_types=["linear_attention", "full_attention"] * 2)  # fmt: skip
CAP = 0.2  # Gemma's final soft cap, small enough to change a tiny random model's loss (the public ones use 30)


def config_for(name: str, cap: float | None = CAP):
    if name in LINEAR:
        widths = {**BASE, **LINEAR_WIDTHS}
        if name == "qwen3_5_moe":  # every layer is experts: no dense width
            widths.pop("intermediate_size")
        return AutoConfig.for_model(LINEAR[name], **widths)
    model_type, extra = FAMILIES[name]
    capped = {"final_logit_softcapping": cap} if model_type.startswith("gemma") else {}
    return AutoConfig.for_model(model_type, **{**BASE, **extra, **capped})


def model_for(name: str, cap: float | None = CAP):
    torch.manual_seed(0)
    config = config_for(name, cap)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt
    labels[1, 15:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", [*FAMILIES, *LINEAR])
def test_the_fused_heads_loss_is_the_full_logits_loss(name):
    plain, fused = model_for(name), model_for(name)
    inputs = batch(plain.config.get_text_config().vocab_size)
    reference = plain(**inputs).loss
    reference.backward()

    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    out = fused(**inputs, use_cache=False, fused_lm_head=True)
    assert getattr(out, "logits", None) is None  # no full logits were made
    loss = -out.log_probs.sum() / out.label_mask.sum()  # TRL's SFTTrainer.compute_loss
    loss.backward()

    assert int(out.label_mask.sum()) == int((inputs["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for (key, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
    if name.startswith("gemma"):  # the cap is applied: without it the loss differs
        assert plain.config.get_text_config().final_logit_softcapping == CAP
        assert not torch.allclose(model_for(name, cap=None)(**inputs).loss, reference, rtol=1e-4)
