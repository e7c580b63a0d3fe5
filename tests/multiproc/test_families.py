"""Families other than Llama through the real CLI under ZeRO-3 with 2 gloo processes: a tiny Qwen3-MoE (experts), a
tiny Gemma 3 (sliding-window layers mixed with global ones, windows shorter than the demo's packed samples), a tiny
gpt-oss (sinks, windows, experts through sft's experts implementation), a tiny Gemma 4 and a tiny Qwen3.5 (linear
attention); the MoE and the sliding-window family under FSDP2 too. The loss falls, the log names the family and its
fast paths, and the saved model reloads and generates; Gemma 4 and Qwen3.5 SIGKILLed and run again are
bit-identical."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import DEMO, ROOT, read_jsonl, run_cli
from tests.helpers import kill_after_checkpoint

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
    # Gemma 4: head dim 32 on its full layers, the last two reusing earlier layers' keys and values (MLP twice as
    # wide), per-layer input embeddings
    "gemma4": {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "sliding_window": 16,
               "global_head_dim": 32, "layer_types": ["sliding_attention", "full_attention"] * 2,
               "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
               "vocab_size_per_layer_input": 104},
    # Qwen3.5: Gated DeltaNet linear attention on layers 1 and 3, run one sample at a time over packed rows
    "qwen3_5": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
}  # fmt: skip
STEPS = 16
# the runs: every family under ZeRO-3; the MoE and the sliding-window family under FSDP2 too (`engine: fsdp2`)
RUNS = [(name, "zero3") for name in MODELS] + [("qwen3_moe", "fsdp2"), ("gemma3", "fsdp2")]
ENGINES = {"zero3": ["--deepspeed", "ds_configs/zero3.json"], "fsdp2": ["--engine", "fsdp2", "--deepspeed", "none"]}
# the newest families are also SIGKILLed after their checkpoint-8 and run again with the same command
KILLED = ("gemma4", "qwen3_5")
SAVES = ["--save_strategy", "steps", "--save_steps", "8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, engine in RUNS:
        model = tmp_path_factory.mktemp(f"{name}-{engine}")
        for f in DEMO_MODEL.iterdir():
            if f.name != "config.json":
                shutil.copy(f, model)
        (model / "config.json").write_text(json.dumps({**TOKENS, **WIDTHS, **MODELS[name]}))
        result = run_cli(command(model, engine, model / "out"), nproc=2)
        assert result.returncode == 0, result.stderr[-6000:]
        out[name, engine] = (model / "out", result.stdout + result.stderr)
    return out


def command(model, engine: str, out) -> list[str]:
    return (DEMO + ["--model_name_or_path", str(model), "--output_dir", str(out)] + ENGINES[engine]
            + ["--max_steps", str(STEPS), "--logging_steps", "4", "--eval_strategy", "no", "--report", "false"]
            + SAVES)  # fmt: skip


@pytest.mark.full
@pytest.mark.parametrize("name", KILLED)
def test_the_newest_families_resume_bit_identically_after_a_kill(runs, name, tmp_path):
    """Gemma 4 and Qwen3.5 (2 processes, ZeRO-3): SIGKILLed once checkpoint-8 is complete and run again with the same
    command, the logged losses and the final weights equal the uninterrupted run's bit for bit.

    Full tier: its per-commit counterpart is tests/multiproc/test_resume.py's
    `test_sigkill_then_same_command_is_bit_exact[zero3]` (the same SIGKILL and rerun under ZeRO-3 on 2 processes);
    these families' training under ZeRO-3 is per commit (`test_a_family_trains_under_zero3_and_fsdp2_and_reloads`)."""
    import safetensors.torch

    reference = runs[name, "zero3"][0]
    model, out = reference.parent, tmp_path / "out"
    kill_after_checkpoint(command(model, "zero3", out), out, step=8)
    result = run_cli(command(model, "zero3", out), nproc=2)
    assert result.returncode == 0 and "checkpoint-8" in result.stderr, result.stderr[-5000:]
    losses = [[r["loss"] for r in read_jsonl(o / "metrics.jsonl") if "loss" in r] for o in (reference, out)]
    assert len(losses[0]) == STEPS // 4 and losses[1] == losses[0], losses
    a, b = (safetensors.torch.load_file(o / "model.safetensors") for o in (reference, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
    if name in ("qwen3_moe", "gpt_oss"):  # the router's load, summed over both processes, in every logged step
        assert "Router load: " in log
        load = [r["router_load_max"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        experts = MODELS[name].get("num_experts") or MODELS[name]["num_local_experts"]
        assert len(load) == STEPS // 4 and all(1.0 <= x <= experts for x in load), load
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "count: abc"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        logits = model(**prompt).logits
    assert torch.isfinite(logits).all()
