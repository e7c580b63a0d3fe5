"""The committed demo assets are exactly what `python -m sft.tools.demo` builds, and they do what the demo needs."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from sft.tools.demo import write_demo
from tests.conftest import ROOT, read_jsonl

DEMO = ROOT / "recipes" / "demo"


def test_committed_assets_match_a_fresh_build(tmp_path):
    write_demo(tmp_path)
    for rel in (
        "model/config.json",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "data/train.jsonl",
        "data/eval.jsonl",
    ):
        assert (tmp_path / rel).read_bytes() == (DEMO / rel).read_bytes(), rel


def test_eval_prompts_are_held_out():
    train = {r["messages"][0]["content"] for r in read_jsonl(DEMO / "data" / "train.jsonl")}
    held_out = [r["messages"][0]["content"] for r in read_jsonl(DEMO / "data" / "eval.jsonl")]
    assert len(held_out) == 200 and len(train) == 6000
    assert not train.intersection(held_out)


def test_tokenizer_round_trip_and_assistant_mask():
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "model")
    text = "reverse: Hello, World! 123"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "upper: abc"}, {"role": "assistant", "content": "ABC"}]
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    # the loss covers exactly the answer and the end-of-turn token, so the model learns to stop
    assert tokenizer.decode(trained) == "ABC<|end|>"
    assert tokenizer.eos_token == "<|end|>"


def test_model_config_is_tiny_llama_with_gqa():
    config = AutoConfig.from_pretrained(DEMO / "model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "model")
    assert config.model_type == "llama"
    assert 2 <= config.num_hidden_layers <= 4 and 64 <= config.hidden_size <= 256
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == len(tokenizer)
    assert json.loads((DEMO / "model" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
