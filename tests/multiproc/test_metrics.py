"""The metrics of a real run (sft.run.metrics, sft.model.flops): one epoch of known samples, packed and not."""

from __future__ import annotations

import json
import random

import pytest
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from sft.model.flops import linear_flops_per_token
from tests.conftest import ROOT, read_jsonl, run_cli

DEMO_MODEL = ROOT / "recipes" / "demo" / "model"


def write_tokenized(path, lengths: list[int]) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for n in lengths:
            f.write(json.dumps({"input_ids": [rng.randrange(10, 100) for _ in range(n)]}) + "\n")


def test_one_epoch_counts_every_sample_once_packed_or_not(tmp_path):
    """One epoch of known sample lengths: logged FLOPs == linear x tokens + 6 x layers x width x sum(len^2), the same
    with packing (several samples per row) and without (one padded sample per row); MFU = TFLOP/s / peak_tflops."""
    lengths = [random.Random(1).randrange(4, 120) for _ in range(48)]
    data = tmp_path / "data.jsonl"
    write_tokenized(data, lengths)
    config = AutoConfig.from_pretrained(DEMO_MODEL)
    per_token = linear_flops_per_token(AutoModelForCausalLM.from_config(config))
    width = config.num_attention_heads * config.head_dim
    runs = {}
    for packing in (True, False):
        out = tmp_path / f"packing-{packing}"
        recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
        recipe.update(datasets=[{"path": str(data)}], eval_datasets=[], eval_strategy="no", num_train_epochs=1,
                      logging_steps=1, packing=packing, padding_free=packing, max_length=128, deepspeed=None,
                      assistant_only_loss=False, per_device_train_batch_size=2, peak_tflops=0.002,
                      output_dir=str(out))  # fmt: skip
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        result = run_cli(["--config", str(tmp_path / "recipe.yaml")])
        assert result.returncode == 0, result.stderr[-5000:]
        runs[packing] = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(runs[True]) < len(runs[False])  # packed: fewer rows, fewer steps
    for records in runs.values():
        tokens = records[-1]["num_tokens"]
        extra = (tokens - sum(lengths)) // len(lengths)  # tokens the tokenizer adds per sample (EOS), 0 or 1
        assert tokens == sum(n + extra for n in lengths)
        expected = per_token * tokens + 6 * config.num_hidden_layers * width * sum((n + extra) ** 2 for n in lengths)
        assert records[-1]["num_flops"] == pytest.approx(expected, rel=1e-12)
        for r in records:
            assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 0.002) and r["peak_tflops"] == 0.002
            assert 0 < r["tflops_per_gpu"] < 1 and r["tokens_per_second_per_gpu"] > 0
    assert runs[True][-1]["num_flops"] == runs[False][-1]["num_flops"]
