"""GPU tier: skipped without CUDA. The full GPU evidence is benchmarks/*.py with its committed results."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.attention import VARLEN, resolve_attn_implementation
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_backend_is_varlen_or_flash_and_matches_sdpa_per_sample():
    chosen = resolve_attn_implementation("auto")
    assert chosen in {VARLEN, "flash_attention_2"}
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "demo" / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    rows = [{"input_ids": torch.randint(10, 100, (n,)).tolist(), "seq_lengths": [n]} for n in (7, 300, 45)]
    batch = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(rows)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items() if k not in ("labels", "seq_idx")}
    with torch.no_grad():
        model.set_attn_implementation(chosen)
        packed = model(**batch).logits[0].float()
        model.set_attn_implementation("sdpa")
        bounds = batch["cu_seq_lens_q"].tolist()
        alone = torch.cat(
            [model(input_ids=batch["input_ids"][:, lo:hi]).logits[0].float() for lo, hi in itertools.pairwise(bounds)]
        )
    assert (packed - alone).abs().max().item() < 0.1  # bf16 rounding; fp32 would be ~1e-5
