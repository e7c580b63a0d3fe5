"""QLoRA's bitsandbytes settings (`sft.model.quantization`) and `max_gpu_memory_gib`: parsed and checked in-process."""

from __future__ import annotations

import pytest
import torch

from sft.errors import ConfigError
from sft.model import quantization
from sft.plan.arguments import parse_args
from sft.plan.preflight import preflight
from tests.conftest import ROOT
from tests.tiny_models import config_of


def args(tmp_path, *extra):
    return parse_args([
        "--config", str(ROOT / "recipes" / "demo-lora.yaml"), "--model_name_or_path", str(ROOT / "recipes" / "demo" /
        "model"), "--output_dir", str(tmp_path / "out"), *extra,
    ])  # fmt: skip


def planned(tmp_path, *extra):
    """The plan of the demo LoRA recipe with `extra`: quantized base weights are checked against the engine decided."""
    _, _, training_args, model_args = args(tmp_path, *extra)
    return preflight(training_args, model_args)


def test_quantized_weights_without_lora_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`load_in_4bit: true` quantizes the base weights.*set `use_peft: true`"):
        planned(tmp_path, "--load_in_4bit", "true", "--use_peft", "false")


def test_zero3_refuses_8bit_and_a_storage_it_cannot_partition(tmp_path):
    zero3 = ("--deepspeed", "ds_configs/zero3.json")
    with pytest.raises(ConfigError, match=r"`load_in_8bit: true` under ZeRO-3.*Use `load_in_4bit: true`"):
        planned(tmp_path, *zero3, "--load_in_8bit", "true")
    with pytest.raises(ConfigError, match=r"`bnb_4bit_quant_storage: uint8` under ZeRO-3.*as float32"):
        planned(tmp_path, *zero3, "--load_in_4bit", "true", "--bnb_4bit_quant_storage", "uint8")
    assert planned(tmp_path, *zero3, "--load_in_4bit", "true", "--bnb_4bit_quant_storage", "float32")  # the same: fine
    assert planned(tmp_path, "--load_in_8bit", "true")  # 8-bit under ZeRO-2: fine
    fsdp2 = ("--engine", "fsdp2", "--deepspeed", "none")
    with pytest.raises(ConfigError, match=r"`load_in_8bit: true` under FSDP2.*Use `load_in_4bit: true`"):
        planned(tmp_path, *fsdp2, "--load_in_8bit", "true")
    with pytest.raises(ConfigError, match=r"`bnb_4bit_quant_storage: uint8` under FSDP2.*as float32"):
        planned(tmp_path, *fsdp2, "--load_in_4bit", "true", "--bnb_4bit_quant_storage", "uint8")


def test_load_kwargs_place_the_weights_by_stage(tmp_path):
    """Under ZeRO-3 no device_map and the 4-bit weights packed in ZeRO-3's dtype; otherwise this rank's device."""
    _, _, training_args, model_args = args(tmp_path, "--load_in_4bit", "true")
    assert quantization.load_kwargs(model_args, training_args, partitioned=False)["device_map"] == {"": "cpu"}
    kwargs = quantization.load_kwargs(model_args, training_args, partitioned=True)
    assert "device_map" not in kwargs
    assert kwargs["quantization_config"].bnb_4bit_quant_storage == torch.float32  # the demo trains in fp32
    _, _, training_args, model_args = args(tmp_path, "--load_in_4bit", "true", "--bf16", "true", "--dtype", "bfloat16")
    kwargs = quantization.load_kwargs(model_args, training_args, partitioned=True)
    assert kwargs["quantization_config"].bnb_4bit_quant_storage == torch.bfloat16
    sharded = quantization.load_kwargs(model_args, training_args, partitioned=False, sharded=True)  # FSDP2
    assert sharded["device_map"] == {"": "cpu"}
    assert sharded["quantization_config"].bnb_4bit_quant_storage == torch.bfloat16
    _, _, training_args, model_args = args(tmp_path)
    assert quantization.load_kwargs(model_args, training_args, partitioned=True) == {}  # a 16/32-bit base


def test_max_gpu_memory_is_what_the_plan_plans_for(tmp_path):
    with pytest.raises(ConfigError, match=r"`max_gpu_memory_gib` must be > 0 \(or unset\), got 0"):
        args(tmp_path, "--max_gpu_memory_gib", "0")
    _, _, training_args, model_args = args(tmp_path, "--max_gpu_memory_gib", "0.001")
    with pytest.raises(  # not even QLoRA's 4-bit weights fit 0.001 GiB: the advice names no lever that would not help
        ConfigError, match=r"does not fit: .*LoRA r=16 .* over the 0\.00 GiB usable.*micro batch 1: add GPUs\."
    ):
        preflight(training_args, model_args)
    _, _, training_args, model_args = args(tmp_path, "--max_gpu_memory_gib", "0.001", "--plan_gpu_memory_gib", "80")
    assert preflight(training_args, model_args)  # plan_gpu_memory_gib, when given, is what the plan plans for


def test_qlora_on_a_mixture_of_experts_is_refused_and_parameter_adapters_need_no_dropout(tmp_path):
    """bitsandbytes leaves a MoE's fused 3-D experts in 16-bit (sft.model.quantization.check_experts): refused before
    the model loads, with the share of weights and what to do; PEFT's parameter adapters refuse dropout inside the
    model build, so sft refuses it at parse time."""

    config_of("qwen3_moe").save_pretrained(tmp_path / "moe")
    moe = ("--model_name_or_path", str(tmp_path / "moe"))
    _, _, training_args, model_args = args(tmp_path, *moe, "--load_in_4bit", "true")
    with pytest.raises(ConfigError, match=r"`load_in_4bit: true` on qwen3_moe: bitsandbytes quantizes nn.Linear "
                       r"layers.*4 experts per layer.*about \d+% of the weights.*remove `load_in_4bit`"):  # fmt: skip
        preflight(training_args, model_args)
    experts = ("--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    with pytest.raises(ConfigError, match=r"`lora_target_parameters: .*gate_up_proj.*` with `lora_dropout: 0.05`.*"
                       r"Set `lora_dropout: 0`"):  # fmt: skip
        args(tmp_path, *moe, *experts, "--lora_dropout", "0.05")
    _, _, _, model_args = args(tmp_path, *moe, *experts, "--lora_dropout", "0")
    assert model_args.lora_target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_lora_target_parameters_that_match_nothing_are_refused_with_the_models_parameters(tmp_path):
    """PEFT only warns when `lora_target_parameters` matches no parameter and then trains an adapter without it: sft
    refuses before the model loads, naming the target, the model's parameters per layer and the fix. On a MoE whose
    experts are 3-D parameters the same targets are what PEFT adapts, and the plan takes them."""

    experts = ("--lora_target_parameters", "mlp.experts.gate_up_proj", "--lora_dropout", "0")
    _, _, training_args, model_args = args(tmp_path, *experts)  # the demo: a dense Llama
    with pytest.raises(ConfigError, match=r"`lora_target_parameters`: mlp.experts.gate_up_proj matches no parameter "
                       r"of .*demo/model \(llama\).* Its parameters \(per layer\): .*mlp.gate_proj.weight.*"
                       r"self_attn.q_proj.weight.*`lora_target_modules`"):  # fmt: skip
        preflight(training_args, model_args)
    config_of("qwen3_moe").save_pretrained(tmp_path / "moe")
    _, _, training_args, model_args = args(tmp_path, "--model_name_or_path", str(tmp_path / "moe"), *experts)
    assert preflight(training_args, model_args).lora
