"""The packing check (`sft.run.packing_check`, `packing_check`): packed rows against their samples alone, before the
first step; a model whose packing leaks is refused with the figures, an exact one trains."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from transformers import AttentionInterface, AutoConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.errors import ConfigError
from sft.model.attention import VARLEN, register_varlen
from sft.run import packing_check
from tests.conftest import ROOT
from tests.tiny_models import DEMO_MODEL, tiny_model

LEAKY = "sft_test_leaky"


def leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """Causal attention over the whole flattened row, blind to the samples' boundaries: a packed sample sees the ones
    before it (what a backend or a recurrent layer that ignores the boundaries does)."""
    kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def leaky_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **_):
    """`sft_varlen`'s CPU kernel blind to the boundaries: causal attention over the whole flattened row."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(0, 1)


def long_rows_doubled(module, query, key, value, attention_mask, **kwargs):
    """sdpa with the row's own mask (no sample sees another), its output doubled in a sequence longer than 64 tokens:
    a packed sample computes something else than alone without reading any other sample."""
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out * (2.0 if query.shape[-2] > 64 else 1.0), weights


AttentionInterface.register(LEAKY, leaky_attention)
AttentionInterface.register("sft_test_long_rows_doubled", long_rows_doubled)
ALL_MASK_ATTENTION_FUNCTIONS.register("sft_test_long_rows_doubled", sdpa_mask)  # the packed row's mask, as sdpa's
register_varlen()


def rows_batch(vocab: int) -> dict:
    torch.manual_seed(1)
    rows = [{"input_ids": torch.randint(3, vocab, (sum(n),)).tolist(), "seq_lengths": list(n)}
            for n in ((13, 21, 5), (17, 30))]  # fmt: skip
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_passes_exact_backends_and_catches_a_leak(dtype):
    """Per sample, the mean relative difference of the last hidden states from the sample alone, and for the later
    samples their move when the first sample's tokens change: sdpa (positions) and sft_varlen within the dtype's
    noise, and not moved at all; attention blind to the boundaries far above both for every sample after the first,
    and the first (nothing before it) equal. The blind backend is refused by its influence alone in 16 bits, where
    the tolerance of the difference is loose (rounding with flipping experts: benchmarks/results/packing_check_gpu)."""
    model = tiny_model("llama").to(dtype)
    batch = rows_batch(model.config.vocab_size)
    for backend in ("sdpa", VARLEN):
        model.set_attn_implementation(backend)
        result = packing_check.compare(model, batch, rows=2)
        assert result.samples == 5 and len(result.influence) == 4 and not result.leaks, (backend, result.sentence())
        assert result.worst < (1e-6 if dtype == torch.float32 else 5e-3), result.sentence()
        assert max(result.influence) == 0.0, result.sentence()  # a later sample does not read the first one's tokens
    model.set_attn_implementation(LEAKY)
    result = packing_check.compare(model, batch, rows=2)
    assert result.leaks and result.tolerance == packing_check.TOLERANCE.get(dtype, packing_check.TOLERANCE_16BIT)
    # padding-free, both rows are one flattened sequence: only its first sample has nothing before it
    first, *later = result.differences
    assert first < 1e-2 and min(later) > 0.1 and min(result.influence) > 0.05, result.sentence()
    assert max(result.influence) > result.influence_tolerance * 50
    assert model.training  # put back as it was


def test_a_sample_unlike_itself_alone_without_a_leak_is_refused_as_such():
    """A backend that keeps the samples apart but computes a long row differently: no later sample moves when the
    first one's tokens change, every sample is far from itself alone: refused, saying that no sample reads another."""
    from types import SimpleNamespace

    model = tiny_model("llama")
    model.set_attn_implementation("sft_test_long_rows_doubled")
    torch.manual_seed(1)
    rows = [{"input_ids": torch.randint(3, model.config.vocab_size, (sum(n),)).tolist(), "seq_lengths": list(n)}
            for n in ((13, 21, 5), (17, 30))]  # fmt: skip
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    result = packing_check.compare(model, collator(rows), rows=2)
    assert result.leaks and max(result.influence) == 0.0 and min(result.differences) > 0.1, result.sentence()
    args = SimpleNamespace(device="cpu", bf16=False, fp16=False)
    with pytest.raises(ConfigError, match="No sample reads another, but a packed sample computes something other "
                                          "than itself alone .*Set packing: false"):  # fmt: skip
        packing_check.check(model, model, rows, collator, args, "packing_check: true")


def plan_for(tmp_path, model_type: str | None = None, **fields):
    from sft.config import ModelArguments
    from sft.plan.arguments import RunArguments
    from sft.plan.preflight import preflight

    config = AutoConfig.from_pretrained(DEMO_MODEL)
    if model_type:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    config.save_pretrained(tmp_path / f"model-{model_type}")
    args = RunArguments(output_dir=str(tmp_path / "out"), report_to="none", max_length=128, **fields)
    return preflight(args, ModelArguments(model_name_or_path=str(tmp_path / f"model-{model_type}")))


def test_the_plan_checks_a_family_outside_the_table(tmp_path, caplog):
    """`auto`: on for a family the architecture table does not hold (the suite does not check it packed), off for
    one it holds; `true` and `false` as asked; off without packed rows; under ZeRO-3 off, and refused if asked."""
    with caplog.at_level("INFO", logger="sft"):
        unknown = plan_for(tmp_path, "starcoder2", packing=True, padding_free=True)
    assert unknown.packing_check.on and "starcoder2 is not in sft's architecture table" in unknown.packing_check.reason
    assert "Packing check: on (starcoder2 is not in sft's architecture table" in caplog.text
    known = plan_for(tmp_path, packing=True, padding_free=True)
    assert not known.packing_check.on and "checked packed by sft's suite" in known.packing_check.reason
    assert plan_for(tmp_path, packing=True, padding_free=True, packing_check="true").packing_check.on
    assert not plan_for(tmp_path, "starcoder2", packing=True, padding_free=True, packing_check=False).packing_check.on
    assert plan_for(tmp_path, "starcoder2", packing=False).packing_check == (False, "no packed rows")
    with pytest.raises(ConfigError, match="`packing_check` must be true, false or `auto`, got 'sometimes'"):
        plan_for(tmp_path, packing_check="sometimes")
    zero3 = {"packing": True, "padding_free": True, "deepspeed": str(ROOT / "ds_configs/zero3.json")}
    assert plan_for(tmp_path, "starcoder2", **zero3).packing_check == (False, "not built for DeepSpeed's ZeRO-3")
    with pytest.raises(ConfigError, match="`packing_check: true` with DeepSpeed's ZeRO-3: .* Set packing_check: auto"):
        plan_for(tmp_path, packing_check=True, **zero3)


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory):
    from trl import ScriptArguments
    from trl.scripts.utils import DatasetConfig

    from sft.config import DataArguments, TrainConfig
    from sft.data.load import load_datasets

    tmp = tmp_path_factory.mktemp("rows")
    records = [json.loads(line) for line in (ROOT / "recipes/demo/data/eval.jsonl").read_text().splitlines()[:40]]
    (tmp / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = TrainConfig(output_dir=str(tmp / "out"), packing=True, max_length=128, report_to="none")
    data = DataArguments(datasets=[DatasetConfig(path=str(tmp / "d.jsonl"))])
    return load_datasets(ScriptArguments(), data, args)[0]


@pytest.mark.parametrize("backend", ["sdpa", LEAKY])
def test_a_leaking_model_is_refused_before_its_first_step(tmp_path, demo_rows, backend):
    """Through the trainer (`packing_check: true`): the demo's packed rows through a model blind to the boundaries
    stop the run at its start with the figures and the fix, no step taken and nothing saved; the same model on sdpa
    trains its step."""
    from transformers import AutoTokenizer

    from sft.run.trainer import Trainer

    plan = plan_for(tmp_path, packing=True, padding_free=True, packing_check=True, max_steps=1, save_strategy="no",
                    per_device_train_batch_size=2, gradient_accumulation_steps=1)  # fmt: skip
    model = tiny_model("llama", backend=backend)
    trainer = Trainer(model=model, args=plan.training_args, train_dataset=demo_rows,
                      processing_class=AutoTokenizer.from_pretrained(DEMO_MODEL), plan=plan)  # fmt: skip
    check = next(c for c in trainer.callback_handler.callbacks if isinstance(c, packing_check.Callback))
    if backend == "sdpa":
        trainer.train()
        assert trainer.state.global_step == 1 and check.result.samples >= 2 and not check.result.leaks
        return
    before = model.model.embed_tokens.weight.clone()
    said = (
        r"Packing check \(packing_check: true\): packed samples do not compute what they compute alone: \d+ "
        r"samples of \d+ packed rows.*tolerance 2e-01.*moved by changing the first one's tokens: .*tolerance "
        r"1e-03.*lets a packed sample see the one before it.*Set packing: false and padding_free: false"
    )
    with pytest.raises(ConfigError, match=said):
        trainer.train()
    assert trainer.state.global_step == 0 and torch.equal(model.model.embed_tokens.weight, before)


def test_a_streamed_training_set_is_not_checked_and_said(caplog):
    """An iterable dataset has no first rows to read without consuming them: the check says it did not run."""
    import datasets

    streamed = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}).to_iterable_dataset()
    args = type("Args", (), {"device": "cpu", "bf16": False, "fp16": False})()
    with caplog.at_level("WARNING", logger="sft"):
        assert packing_check.check(None, None, streamed, None, args, "packing_check: true") is None
    assert "not run: the training set is streamed (IterableDataset)" in caplog.text


@pytest.fixture
def small_recipe(tmp_path):
    """The demo's model and chat records (40 of them), packed to 128 tokens, with an output directory the check must
    not create."""
    records = (ROOT / "recipes/demo/data/eval.jsonl").read_text().splitlines()[:40]
    (tmp_path / "d.jsonl").write_text("\n".join(records) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {DEMO_MODEL}\nfrom_scratch: true\ndtype: float32\n"
                      f"datasets:\n  - path: {tmp_path / 'd.jsonl'}\noutput_dir: {tmp_path / 'out'}\n"
                      "deepspeed: ds_configs/zero3.json\nbf16: false\nmax_length: 128\n"
                      "assistant_only_loss: true\n")  # fmt: skip
    return recipe


def test_sft_check_runs_the_check_on_a_recipe_and_trains_nothing(small_recipe, monkeypatch, capsys):
    """`sft check --config recipe`: the recipe's own model and rows, packed against each sample alone, in one
    process without its sharding engine (a ZeRO-3 recipe here): exit 0 with the figures for the demo's model; exit 2
    with the figures and the fix when its attention leaks (sft_varlen's CPU kernel replaced by one blind to the
    boundaries). The recipe's output directory is never created."""
    import sft.model.attention
    from sft.tools import check

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the one-process launch's variables it sets, put back
    assert check.main(["--config", str(small_recipe)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sft check: packing is exact: \d+ samples of \d+ packed rows .*\(tolerance 1e-04\)", out), out
    monkeypatch.setattr(sft.model.attention, "per_sample_sdpa", leaky_varlen)
    assert check.main(["--config", str(small_recipe), "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"sft check: error: Packing check \(sft check\): packed samples do not compute what they compute "
                     r"alone: \d+ samples .*Set packing: false and padding_free: false", err), err  # fmt: skip
    assert not (small_recipe.parent / "out").exists()
    assert check.main([]) == 2 and "usage: sft check [--config] RECIPE.yaml" in capsys.readouterr().out
