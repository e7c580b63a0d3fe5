"""Expert parallelism (DeepSpeed AutoEP, `expert_parallel_size: 2`) through the real CLI with 2 gloo processes on a
tiny Qwen3-MoE (4 experts, 2 active, fp32), ZeRO-2, 8 steps with a checkpoint every 4.

Against data parallelism with every expert on each rank (ep=1, transformers' own grouped experts): the same loss and
gradient norm at every step and the same final weights, within fp32 tolerance; the saved model is a Hugging Face one.
Killed while writing checkpoint-8 and run again with the same command: bit-identical to the uninterrupted ep=2 run.
The same killed run resumed on one process: the learning rate, tokens and samples of every step equal."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from sft.run.checkpoint import KILL_DURING_SAVE_ENV, MARKER
from sft.run.metrics import samples_per_step
from tests.conftest import DEMO, ROOT, read_jsonl, run_cli
from tests.helpers import weights

STEPS = 8
MODEL = {"vocab_size": 104, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3, "max_position_embeddings": 1024,
         "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "dtype": "float32", "tie_word_embeddings": False, "model_type": "qwen3_moe",
         "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 48}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ep=1 and ep=2 uninterrupted; ep=2 killed while writing checkpoint-8, then resumed with the same command; a copy
    of the killed run resumed on one process."""
    model = tmp_path_factory.mktemp("qwen3_moe")
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        if f.name != "config.json":
            shutil.copy(f, model)
    (model / "config.json").write_text(json.dumps(MODEL))
    root = tmp_path_factory.mktemp("runs")

    def args(name: str, ep: int) -> list[str]:
        return DEMO + ["--model_name_or_path", str(model), "--output_dir", str(root / name)] + [
            "--deepspeed", "ds_configs/zero2.json", "--max_steps", str(STEPS), "--save_steps", "4", "--logging_steps",
            "1", "--eval_strategy", "no", "--report", "false", "--expert_parallel_size", str(ep),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--trace_data", "true",
        ]  # fmt: skip

    logs = {}
    for name, ep in (("ep1", 1), ("ep2", 2)):
        result = run_cli(args(name, ep), nproc=2)
        assert result.returncode == 0, result.stderr[-5000:]
        logs[name] = result.stderr
    killed = run_cli(args("killed", 2), nproc=2, env={KILL_DURING_SAVE_ENV: "8"})
    assert killed.returncode != 0 and (root / "killed" / "checkpoint-4" / MARKER).exists()
    assert not (root / "killed" / "checkpoint-8" / MARKER).exists()
    shutil.copytree(root / "killed", root / "one")
    for name, nproc, ep in (("killed", 2, 2), ("one", 1, 1)):
        result = run_cli(args(name, ep), nproc=nproc)
        assert result.returncode == 0, result.stderr[-5000:]
        logs[name] = result.stderr
    return root, logs


def steps(out) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_experts_split_over_two_ranks_train_as_every_expert_on_each(runs):
    root, logs = runs
    assert "experts split over 2 of the data-parallel ranks" in logs["ep2"]
    one, two = steps(root / "ep1"), steps(root / "ep2")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
        assert a["num_tokens"] == b["num_tokens"] and a["learning_rate"] == b["learning_rate"]
        assert math.isfinite(b["aux_loss"]) and b["aux_loss"] > 0  # the router's load-balancing loss, under AutoEP too
    assert two[-1]["loss"] < two[0]["loss"] - 0.1
    # the saved model is in Hugging Face's layout (experts gathered from both ranks: transformers writes its fused
    # experts back as the hub's one tensor per expert) and equals ep=1's
    a, b = weights(root / "ep1"), weights(root / "ep2")
    assert a.keys() == b.keys() and {f"model.layers.3.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert weights(root / "ep2" / "checkpoint-8").keys() == b.keys()  # each checkpoint's model too
    model = AutoModelForCausalLM.from_pretrained(root / "ep2")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 96, 64)
    for e in range(4):  # the experts of the second rank (2, 3) too, each where ep=1 has it
        assert torch.equal(
            model.model.layers[3].mlp.experts.down_proj[e], b[f"model.layers.3.mlp.experts.{e}.down_proj.weight"]
        )
    # the ZeRO checkpoint holds AutoEP's expert files, and the fingerprint says so
    files = {p.name for p in (root / "ep2" / "checkpoint-8" / "global_step8").iterdir()}
    assert {f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt" for i in range(4) for e in range(4)} <= files
    state = json.loads((root / "ep2" / "checkpoint-8" / "sft_state.json").read_text())
    assert state["fingerprint"]["parallel"] == {"dp": 2, "sp": 1, "ep": 2, "autoep": True}


def test_killed_under_expert_parallelism_and_run_again_is_bit_identical(runs):
    root, logs = runs
    ref, res = steps(root / "ep2"), steps(root / "killed")
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "aux_loss"):
        assert [r[key] for r in ref] == [r[key] for r in res], key
    a, b = weights(root / "ep2"), weights(root / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "Resuming from" in logs["killed"] and "checkpoint-4: step 4" in logs["killed"]


def test_resumed_on_one_process_keeps_the_schedule_tokens_and_samples(runs):
    root, logs = runs
    assert "on 1 processes (was 2, experts split 2 ways)" in logs["one"]
    assert "AutoEP stays on, every expert on each GPU" in logs["one"]
    ref, res = steps(root / "ep2"), steps(root / "one")
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert [r["learning_rate"] for r in ref] == [r["learning_rate"] for r in res]
    assert [r["num_tokens"] for r in ref] == [r["num_tokens"] for r in res]
    trained = samples_per_step(root / "one")
    assert list(trained) == list(range(STEPS)) and trained == samples_per_step(root / "ep2")
    for a, b in zip(ref, res, strict=True):  # fp32, no dropout: one process sums the same rows in another order
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    a, b = weights(root / "ep2"), weights(root / "one")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_mixtral_experts_split_over_two_ranks_train_as_every_expert_on_each(tmp_path):
    """AutoEP's Mixtral preset (no shared experts, its own router): 4 steps, ep=2 against ep=1."""
    model = tmp_path / "mixtral"
    shutil.copytree(ROOT / "recipes" / "demo" / "model", model)
    config = {k: v for k, v in MODEL.items() if k not in ("num_experts", "moe_intermediate_size")}
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4, num_hidden_layers=2,
                  intermediate_size=48)  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    for ep in (1, 2):
        result = run_cli(
            DEMO + ["--model_name_or_path", str(model), "--output_dir", str(tmp_path / f"ep{ep}")]
            + ["--deepspeed", "ds_configs/zero2.json", "--max_steps", "4", "--logging_steps", "1", "--save_strategy",
               "no", "--eval_strategy", "no", "--report", "false", "--expert_parallel_size", str(ep)],
            nproc=2,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-5000:]
    one, two = steps(tmp_path / "ep1"), steps(tmp_path / "ep2")
    assert len(two) == 4 and "Model: mixtral" in result.stderr and "experts split over 2" in result.stderr
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and math.isclose(
            a["grad_norm"], b["grad_norm"], rel_tol=1e-4
        )
    a, b = weights(tmp_path / "ep1"), weights(tmp_path / "ep2")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
