"""DeepSeek-V4's compressed sparse attention and GLM-5's indexed sparse attention (transformers' `deepseek_v4`,
`glm_moe_dsa`): refused for packing with the reason, because a packed row leaks; trained on padded rows where those are
exact (DeepSeek-V4), on one unpadded row per micro batch where they are not (GLM-5, whose indexer selects its keys
before the padding mask). fp32, CPU, random weights, index top-k and compression smaller than the rows."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sft.errors import ConfigError
from sft.model import architectures
from sft.model.attention import check_backend
from tests.tiny_models import BASE, GROUPED, packed_batch

MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
       "head_dim": 8, "num_key_value_heads": 4, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}  # fmt: skip
FAMILIES = {
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
    "glm_moe_dsa": {},
}


def config_of(family: str):
    return AutoConfig.for_model(family, **{**BASE, **GROUPED, **MLA, **FAMILIES[family]})


@pytest.fixture(scope="module")
def runs():
    """Per family: each sample alone, the samples packed in one row (positions restarting), and padded on the right
    in one batch (with the attention mask)."""
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_of(family), attn_implementation="eager", dtype=torch.float32)
        model.config.use_cache = False
        batch = packed_batch(model.config.vocab_size)
        ids, bounds = batch["input_ids"][0], list(itertools.pairwise(batch["cu_seq_lens_q"].tolist()))
        samples = [ids[lo:hi] for lo, hi in bounds]
        padded = torch.zeros(len(samples), max(map(len, samples)), dtype=torch.long)
        mask = torch.zeros_like(padded)
        for row, sample in enumerate(samples):
            padded[row, : len(sample)], mask[row, : len(sample)] = sample, 1
        with torch.no_grad():
            alone = [model.eval()(input_ids=s[None]).logits[0] for s in samples]
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
            rows = model(input_ids=padded, attention_mask=mask).logits
        out[family] = {
            "packed": [float((packed[lo:hi] - a).abs().max()) for (lo, hi), a in zip(bounds, alone, strict=True)],
            "padded": [
                float((rows[i, : len(s)] - a).abs().max()) for i, (s, a) in enumerate(zip(samples, alone, strict=True))
            ],
        }
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_packing_is_refused_because_a_packed_row_leaks(runs, family):
    arch = architectures.of(config_of(family))
    assert arch.attention.other_layers  # compressed / indexed attention: not softmax attention over each sample
    why = r"keys compressed or selected over the whole row.*Set packing: false and padding_free: false"
    with pytest.raises(ConfigError, match=rf"Packing: {family} has .*attention layers.*{why}"):
        check_backend(arch, "eager", padding_free=True, on_gpu=False)
    assert max(runs[family]["packed"][1:]) > 1e-2, runs[family]  # what packing would have trained


def test_deepseek_v4_trains_exactly_on_padded_rows(runs):
    assert max(runs["deepseek_v4"]["padded"]) < 1e-5, runs["deepseek_v4"]


def test_glm5_trains_one_unpadded_row_per_micro_batch(runs, tmp_path):
    """transformers' GLM-5 indexer takes its top-k keys before the padding mask: a right-padded row's tokens differ
    from the same tokens alone (if a release fixes it, this fails and the cap can go). The plan takes micro batch 1
    for `auto` and refuses a larger one, naming the fix."""
    padded = dict(zip((13, 21, 5, 17), runs["glm_moe_dsa"]["padded"], strict=True))  # sample length -> difference
    assert padded[21] < 1e-5 and max(padded[13], padded[17]) > 1e-2, padded  # the longest row has no padding
    from sft.config import ModelArguments
    from sft.plan.arguments import RunArguments
    from sft.plan.preflight import preflight

    config_of("glm_moe_dsa").save_pretrained(tmp_path / "model")
    model_args = ModelArguments(model_name_or_path=str(tmp_path / "model"))

    def plan(micro, **fields):
        args = RunArguments(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, packing=False,
                           padding_free=False, per_device_train_batch_size=micro, **fields)  # fmt: skip
        return preflight(args, model_args)

    assert plan("auto").batch.per_device_batch_size == 1
    with pytest.raises(ConfigError, match="`per_device_train_batch_size: 2` with glm_moe_dsa: .* Set "
                                          "per_device_train_batch_size: 1"):  # fmt: skip
        plan(2)
    with pytest.raises(ConfigError, match="`pad_to_multiple_of: 8` with glm_moe_dsa: .* Remove it"):
        plan(1, pad_to_multiple_of=8)
