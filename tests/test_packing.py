"""Padding-free packing is exact: a packed row gives the same per-sample logits, losses and gradients as the samples
run one at a time (fp32, tiny GQA models, sdpa with the block mask transformers derives from position_ids)."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.errors import ConfigError
from sft.model.attention import PACKING_SAFE, check_batch, check_packing, resolve_attn_implementation
from tests.conftest import ROOT
from tests.tiny_models import DEMO_MODEL, SHAPES, tiny_model


def samples(completion_only: bool) -> list[dict]:
    """Three samples of different lengths; with completion_only, the first tokens of each are not trained."""
    torch.manual_seed(1)
    out = []
    for length, prompt in ((7, 3), (12, 5), (5, 2)):
        ids = torch.randint(10, 100, (length,)).tolist()
        labels = [-100] * prompt + ids[prompt:] if completion_only else list(ids)
        out.append({"input_ids": ids, "labels": labels, "seq_lengths": [length]})
    return out


def per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="none", ignore_index=-100)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])  # eager too: transformers gives it the same block mask
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("completion_only", [False, True], ids=["all-tokens", "completion-only"])
def test_packed_row_equals_samples_one_at_a_time(shape, completion_only, backend):
    model = tiny_model(shape, backend=backend)
    batch = samples(completion_only)
    packed = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(batch)
    assert "attention_mask" not in packed and packed["input_ids"].shape[0] == 1
    # the first token of every sample is never trained from the previous sample's last token
    starts = packed["cu_seq_lens_q"][:-1].long()
    assert (packed["labels"][0, starts] == -100).all()

    logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
    packed_loss = torch.nn.functional.cross_entropy(
        logits, packed["labels"][0].roll(-1), ignore_index=-100, reduction="sum"
    )
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    single_loss = 0.0
    bounds = packed["cu_seq_lens_q"].tolist()
    for sample, (lo, hi) in zip(batch, zip(bounds, bounds[1:], strict=False), strict=True):
        ids = torch.tensor([sample["input_ids"]])
        alone = model(input_ids=ids).logits[0]
        torch.testing.assert_close(logits[lo:hi], alone, atol=1e-5, rtol=1e-5)
        labels = torch.tensor(sample["labels"])
        torch.testing.assert_close(
            per_token_loss(logits[lo:hi], labels), per_token_loss(alone, labels), atol=1e-5, rtol=1e-5
        )
        single_loss = single_loss + per_token_loss(alone, labels).sum()
    single_loss.backward()
    torch.testing.assert_close(packed_loss, single_loss, atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_a_kv_cache_in_training_would_mix_samples():
    """Why sft turns use_cache off: with a cache, transformers skips the packed mask and samples attend across."""
    batch = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(samples(False))
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    safe = tiny_model("llama", use_cache=False)(**inputs).logits
    mixed = tiny_model("llama", use_cache=True)(**inputs).logits
    first = int(batch["cu_seq_lens_q"][1])
    torch.testing.assert_close(safe[0, :first], mixed[0, :first])  # the first sample sees nothing before it
    assert not torch.allclose(safe[0, first:], mixed[0, first:], atol=1e-3)  # the others see their predecessors


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU choice; tests/test_gpu.py checks the GPU one")
def test_auto_backend_on_cpu_is_sdpa():
    assert resolve_attn_implementation("auto") == "sdpa"
    assert resolve_attn_implementation("eager") == "eager"


def test_unsafe_settings_are_refused():
    with pytest.raises(ConfigError, match="cannot keep packed samples apart"):
        check_packing("paged|eager", padding_free=True, model_init_kwargs=None)
    check_packing("paged|eager", padding_free=False, model_init_kwargs=None)  # fine without packing
    with pytest.raises(ConfigError, match="use_cache"):
        check_packing("sdpa", padding_free=True, model_init_kwargs={"use_cache": True})
    packed = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(samples(False))
    check_batch(packed)
    with pytest.raises(ConfigError, match="came with an `attention_mask`"):
        check_batch({**packed, "attention_mask": torch.ones_like(packed["input_ids"])})
    assert {"sdpa", "flash_attention_2", "sft_varlen"} <= PACKING_SAFE


def test_assistant_only_mask_survives_packing(tmp_path):
    """Through sft's data path and TRL's packing: in every packed row, exactly the answers and their end tokens
    are trained, sample by sample."""
    import json

    from transformers import AutoTokenizer
    from trl import ScriptArguments
    from trl.scripts.utils import DatasetConfig

    from sft.config import DataArguments, ModelArguments
    from sft.data.load import load_datasets
    from sft.plan.preflight import preflight
    from sft.run.trainer import Trainer

    records = [json.loads(line) for line in (ROOT / "recipes/demo/data/eval.jsonl").read_text().splitlines()[:40]]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    from sft.plan.arguments import RunArguments

    args = RunArguments(
        output_dir=str(tmp_path / "out"), packing=True, max_length=128, assistant_only_loss=True, report_to="none"
    )
    train, _ = load_datasets(ScriptArguments(), DataArguments(datasets=[DatasetConfig(path=str(path))]), args)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path / "model")
    plan = preflight(args, ModelArguments(model_name_or_path=str(tmp_path / "model")))
    trainer = Trainer(model=model, args=plan.training_args, train_dataset=train, processing_class=tokenizer, plan=plan)
    rows = trainer.train_dataset
    assert len(rows) < len(records)  # packed
    answers = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            ids, labels = row["input_ids"][start : start + length], row["labels"][start : start + length]
            trained = tokenizer.decode([t for t in labels if t != -100])
            assert tokenizer.decode(ids).startswith("<|user|>") and trained.endswith("<|end|>")
            answers.append(trained.removesuffix("<|end|>"))
            start += length
    assert sorted(answers) == sorted(r["messages"][1]["content"] for r in records)
