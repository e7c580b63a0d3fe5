"""Expert parallelism (sft.engines.deepspeed.autoep, DeepSpeed AutoEP) in one process: the refusals before the model
loads, the DeepSpeed section, the optimizer groups, transformers' registry made to answer AutoEP, and the plan's split
of the experts' states. The 2-process runs (ep=2 against ep=1, resume):
tests/multiproc/test_expert_parallel_runs.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoConfig, AutoModelForCausalLM

from sft.core.dims import ParallelDims
from sft.engines import deepspeed as ds_engine
from sft.engines.deepspeed import autoep as expert_parallel
from sft.errors import ConfigError
from sft.model import shapes
from sft.plan import memory as plan
from tests.conftest import DEMO, ROOT, run_cli_in_process

MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "vocab_size": 100}  # fmt: skip


def tiny_moe() -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**MOE))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"family": "llama", "is_moe": False}, "llama is a dense model"),
        ({"family": "gpt_oss"}, "AutoEP has no preset for gpt_oss"),
        ({"zero_stage": None}, "not `--deepspeed none`"),
        ({"zero_stage": 3}, "Use ds_configs/zero2.json"),
        ({"offload": True}, "with ZeRO offload"),
        ({"sp": 2}, "sequence_parallel_size 2"),
        ({"lora": True}, "Train LoRA with expert_parallel_size: 1"),
    ],
)
def test_a_setting_autoep_cannot_run_is_refused_naming_the_field(kwargs, says):
    setting = {"ep": 2, "sp": 1, "zero_stage": 2, "offload": False, "family": "qwen3_moe", "is_moe": True,
               "lora": False, **kwargs}  # fmt: skip
    with pytest.raises(ConfigError, match="`expert_parallel_size: 2`") as e:
        expert_parallel.check(**setting)
    assert says in str(e.value)
    expert_parallel.check(**{**setting, "ep": 1})  # without expert parallelism nothing is asked of AutoEP


def test_the_families_with_an_autoep_preset_are_deepspeeds():
    assert expert_parallel.preset_for("qwen3_moe") == "qwen3_moe" and expert_parallel.preset_for("mixtral")
    assert expert_parallel.preset_for("llama") is None
    assert {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"} <= set(expert_parallel.preset_families())


def test_ep_must_divide_the_data_parallel_ranks():
    assert ParallelDims.build(4, sp=1, ep=2).describe().endswith("experts split over 2 of the data-parallel ranks")
    with pytest.raises(ConfigError, match=r"`expert_parallel_size` 4 does not divide the 2 data-parallel .*\[1, 2\]"):
        ParallelDims.build(4, sp=2, ep=4)
    result = run_cli_in_process(DEMO + ["--expert_parallel_size", "2", "--output_dir", "/nonexistent/never"])
    assert result.returncode == 2 and "`expert_parallel_size` 2 does not divide the 1 data-parallel" in result.stderr
    result = run_cli_in_process(DEMO + ["--expert_parallel_size", "0", "--output_dir", "/nonexistent/never"])
    assert result.returncode == 2 and "`expert_parallel_size` must be a whole number >= 1" in result.stderr


def test_the_deepspeed_section_comes_from_the_recipe_field(tmp_path):
    config, _ = ds_engine.prepare_config("ds_configs/zero2.json", processes=2, ep=2)
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    path = tmp_path / "own.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 4}})
    )
    with pytest.raises(ConfigError, match="autoep_size 4.*expert_parallel_size 2. Set the size once"):
        ds_engine.prepare_config(str(path), processes=4, ep=2)
    config, _ = ds_engine.prepare_config(str(path), processes=4, ep=4)  # agreeing: kept, with its other keys
    assert config["expert_parallel"]["autoep_size"] == 4
    kept = expert_parallel.keep_layout(
        ds_engine.read_config("ds_configs/zero2.json")
    )  # resuming an AutoEP checkpoint at size 1
    assert kept["expert_parallel"] == {"enabled": True, "autoep_size": 1}
    assert "expert_parallel" not in json.loads((ROOT / "ds_configs" / "zero2.json").read_text())  # the file unchanged


def test_a_checkpoint_without_autoep_is_not_resumed_with_it():
    with pytest.raises(ConfigError, match="was written without expert parallelism.*Hugging Face's layout"):
        expert_parallel.check_resume(False, 2, "out/checkpoint-4")
    expert_parallel.check_resume(True, 2, "out/checkpoint-4")
    expert_parallel.check_resume(True, 1, "out/checkpoint-4")
    expert_parallel.check_resume(False, 1, "out/checkpoint-4")


def test_the_experts_go_to_deepspeeds_moe_groups_with_their_group_hyperparameters():
    model = tiny_moe()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert expert_parallel.group_experts(optimizer, model, 2) == len(experts) == 2 * MOE["num_hidden_layers"]
    groups = optimizer.param_groups
    assert len(groups) == 3 and [g.get("moe", False) for g in groups] == [False, False, True]
    assert {id(p) for p in groups[2]["params"]} == {id(p) for p in experts}
    assert groups[2]["name"] == "ep_size_2" and groups[2]["weight_decay"] == 0.1 and groups[2]["lr"] == groups[0]["lr"]
    assert not {id(p) for p in experts} & {id(p) for g in groups[:2] for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_transformers_registry_answers_autoep_and_transformers_alike(monkeypatch):
    from transformers.utils import output_capturing

    monkeypatch.setattr(output_capturing, "_CAN_RECORD_REGISTRY", output_capturing._CAN_RECORD_REGISTRY)
    model = tiny_moe()
    before = output_capturing._CAN_RECORD_REGISTRY.get(model)
    with pytest.raises(TypeError):  # what DeepSpeed 0.19.8's AutoEP meets in transformers 5.24
        output_capturing._CAN_RECORD_REGISTRY.get(str(model.__class__), None)
    expert_parallel.compatible_output_registry()
    registry = output_capturing._CAN_RECORD_REGISTRY
    assert registry.get(model) == before and "router_logits" in before
    assert registry.get(str(model.__class__), "missing") == before and registry.get("nothing", "missing") == "missing"
    expert_parallel.compatible_output_registry()  # a second call changes nothing
    assert output_capturing._CAN_RECORD_REGISTRY is registry


def test_the_plan_splits_the_experts_states_over_the_expert_ranks(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE))
    shape = shapes.load_shape(str(path))
    e = MOE["num_hidden_layers"] * MOE["num_experts"] * 3 * MOE["hidden_size"] * MOE["moe_intermediate_size"]
    assert shape.expert_params == e
    base = plan.Setting(gpus=4, zero_stage=2, micro_batch=1, seq_len=64)
    dense = shape.n_params - e
    split = plan.model_states(shape, dataclasses.replace(base, ep=2))[0]
    # the rest as DeepSpeed estimates it on 4 GPUs; each GPU: half the experts, 16-bit weights and gradients whole,
    # fp32 master weights and Adam moments (16 bytes) over the 2 GPUs holding the same experts
    assert split == pytest.approx(
        estimate_zero2_model_states_mem_needs(dense, 4, 1, False)[1] + 4 * e / 2 + 16 * e / 2 / 2
    )
    whole = plan.model_states(shape, base)[0]
    assert whole == estimate_zero2_model_states_mem_needs(shape.n_params, 4, 1, False)[1] and split < whole
    assert "experts split 2 ways" in dataclasses.replace(base, ep=2).describe()
