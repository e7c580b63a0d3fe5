"""Families other than Llama through the real CLI under ZeRO-3 with 2 gloo processes: a tiny Qwen3-MoE (experts), a
tiny Gemma 3 (sliding-window layers mixed with global ones, windows shorter than the demo's packed samples) and a tiny
gpt-oss (sinks, windows, experts through sft's experts implementation); the MoE and the sliding-window family under
FSDP2 too. The loss falls, the log names the family and its fast paths, and the saved model reloads and generates."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import DEMO, ROOT, read_jsonl, run_cli

DEMO_MODEL = ROOT / "recipes" / "demo" / "model"
TOKENS = {"vocab_size": 104, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3, "max_position_embeddings": 1024}
WIDTHS = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "dtype": "float32", "tie_word_embeddings": False}  # fmt: skip
MODELS = {
    "qwen3_moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "sliding_window": 16,
               "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    # sinks, windows on alternate layers, experts with biases and a clamped gate through sft's experts
    # (`sft.model.experts`)
    "gpt_oss": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 16},
}  # fmt: skip
STEPS = 16
# the runs: every family under ZeRO-3; the MoE and the sliding-window family under FSDP2 too (`engine: fsdp2`)
RUNS = [(name, "zero3") for name in MODELS] + [("qwen3_moe", "fsdp2"), ("gemma3", "fsdp2")]
ENGINES = {"zero3": ["--deepspeed", "ds_configs/zero3.json"], "fsdp2": ["--engine", "fsdp2", "--deepspeed", "none"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, engine in RUNS:
        model = tmp_path_factory.mktemp(f"{name}-{engine}")
        for f in DEMO_MODEL.iterdir():
            if f.name != "config.json":
                shutil.copy(f, model)
        (model / "config.json").write_text(json.dumps({**TOKENS, **WIDTHS, **MODELS[name]}))
        result = run_cli(
            DEMO + ["--model_name_or_path", str(model), "--output_dir", str(model / "out")]
            + ENGINES[engine] + ["--max_steps", str(STEPS), "--logging_steps", "4"]
            + ["--eval_strategy", "no", "--report", "false"],
            nproc=2,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-6000:]
        out[name, engine] = (model / "out", result.stdout + result.stderr)
    return out


@pytest.mark.parametrize(("name", "engine"), RUNS)
def test_a_family_trains_under_zero3_and_fsdp2_and_reloads(runs, name, engine):
    out, log = runs[name, engine]
    if engine == "fsdp2":
        assert "Starting FSDP2" in log
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == STEPS // 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    family = MODELS[name]["model_type"]
    assert f"Model: {family}" in log and "Liger off" in log  # the one line: features and fast paths, with reasons
    if name == "gemma3":
        assert "a sliding window of 16 tokens on 2 of 4 layers" in log
    if name == "gpt_oss":  # sft's experts by default for gpt-oss (its measured reason in the line)
        assert "attention sinks" in log and "sft experts on (sft_grouped: equal to the per-expert loop" in log
    if name == "qwen3_moe":  # the config's router_aux_loss_coef (transformers' default 0.001), trained and logged
        assert "router load-balancing loss x0.001 trained (aux_loss in the logs)" in log
        aux = [r["aux_loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        assert len(aux) == STEPS // 4 and all(math.isfinite(a) and a > 0 for a in aux), aux
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "count: abc"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        logits = model(**prompt).logits
    assert torch.isfinite(logits).all()
