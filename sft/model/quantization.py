"""bitsandbytes base weights for QLoRA (4-bit NF4) and 8-bit LoRA: checked at parse time, placed at load time.

TRL's `ModelConfig` flags (`load_in_4bit`, `load_in_8bit`, `bnb_4bit_quant_type`, `use_bnb_nested_quant`,
`bnb_4bit_quant_storage`) make the `BitsAndBytesConfig` (TRL's `get_quantization_config`). What sft adds is where the
weights go:

- ZeRO-0/1/2 or no DeepSpeed: each rank loads the whole quantized model onto its own GPU (`device_map`), or onto the
  CPU on a machine without one (bitsandbytes 0.46+ runs 4-bit on the CPU).
- ZeRO-3: no `device_map` (transformers refuses one under ZeRO-3), and the weights load into host memory, each
  quantized on this rank's GPU on its way there (`loading`): transformers' bitsandbytes loader alone would put the
  whole 4-bit model on every GPU first (measured at the 70B widths, 40 layers: 20.78 GiB per GPU before DeepSpeed's
  engine partitioned it, benchmarks/results/qlora_70b), so the load, not training, set the peak and a 70B could not
  load on a 24 GB GPU at all. Then `partition` hands the loaded model to `deepspeed.zero.Init`, which moves each
  weight to the GPU and cuts it to this rank's share (or keeps it in host memory with parameter offload) one at a
  time; the quantization constants follow to the GPU once the engine runs (`place_quant_states`). Without a GPU,
  bitsandbytes quantizes on the CPU (a rank of two keeps half of each packed weight). ZeRO-3 keeps one flat buffer
  per dtype, so the 4-bit weights are packed into the dtype it partitions in (`bnb_4bit_quant_storage` =
  bf16/fp16/fp32, as PEFT's DeepSpeed guide sets it by hand); a `bnb_4bit_quant_storage` that differs is refused.
  8-bit weights (LLM.int8 keeps row statistics outside the parameter) cannot be partitioned and are refused under
  ZeRO-3.
- FSDP2: `fully_shard` shards only floating-point parameters (accelerate leaves `uint8`-packed 4-bit weights out, whole
  on every GPU), so the 4-bit weights are packed in the run's precision as under ZeRO-3 (the FSDP-QLoRA recipe), and
  each rank holds its share of them; 8-bit weights are refused as under ZeRO-3. On a GPU the model loads into host
  memory as under ZeRO-3 (`loading`), and `fully_shard` moves each layer to the GPU and cuts it to this rank's share
  one layer at a time (bitsandbytes moves the quantization constants with the weight): loaded whole onto each GPU
  first, the load would set the peak as it did under ZeRO-3.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from sft.errors import ConfigError


def quantized(model_args) -> bool:
    return bool(model_args.load_in_4bit or model_args.load_in_8bit)


def zero3_storage(training_args) -> str:
    """The dtype ZeRO-3 partitions parameters in (`zero.Init`'s): the run's mixed-precision dtype, else fp32."""
    return "bfloat16" if training_args.bf16 else "float16" if training_args.fp16 else "float32"


def packed(engine) -> bool:
    """Whether the engine shards the 4-bit weights, which must then be packed in a floating dtype: ZeRO-3, FSDP2."""
    return engine.shards_weights


def check(model_args, training_args, engine) -> None:
    """Refuse quantized base weights that cannot train here, before any work."""
    if not quantized(model_args):
        return
    flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
    if not model_args.use_peft:
        raise ConfigError(
            f"`{flag}: true` quantizes the base weights, which then cannot be trained: set `use_peft: true` to train "
            f"LoRA adapters on them (QLoRA), or remove `{flag}` for full fine-tuning."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"`{flag}: true` needs bitsandbytes: pip install bitsandbytes (or remove `{flag}`).")
    if not packed(engine):
        return
    under = engine.traits.label if engine.traits.shards_weights_always else "ZeRO-3"
    if model_args.load_in_8bit:
        raise ConfigError(
            f"`load_in_8bit: true` under {under}: 8-bit (LLM.int8) weights cannot be partitioned. Use `load_in_4bit: "
            "true` (QLoRA), or a ZeRO-2 config (ds_configs/zero2.json)."
        )
    storage = model_args.bnb_4bit_quant_storage
    wanted = zero3_storage(training_args)
    if storage is not None and str(storage).removeprefix("torch.") != wanted:
        raise ConfigError(
            f"`bnb_4bit_quant_storage: {storage}` under {under}, which partitions every parameter as {wanted} (the "
            f"run's precision): the 4-bit weights must be packed in {wanted}. Remove the field (sft sets it) or set "
            f"it to {wanted}."
        )


def check_experts(model_args, arch, trust_remote_code: bool = False) -> None:
    """Refuse quantized base weights for a mixture of experts: bitsandbytes replaces `nn.Linear` layers, and the
    experts of every MoE family transformers ships are 3-D parameters of one fused module (checked on a tiny Qwen3-MoE
    with `load_in_4bit`: attention projections became `Params4bit`, `mlp.experts.gate_up_proj` stayed 16/32-bit), so
    most of the weights would not be quantized and QLoRA's memory would not be what it promises."""
    if not quantized(model_args) or not arch.is_moe:
        return
    from sft.model import shapes

    flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
    shape = shapes.load_shape(model_args.model_name_or_path, trust_remote_code)  # the weights counted on a meta model
    share, count = shape.expert_params / shape.n_params, arch.experts.count
    raise ConfigError(
        f"`{flag}: true` on {arch.family}: bitsandbytes quantizes nn.Linear layers, and this model's {count} "
        f"experts per layer are 3-D parameters of one module, which it leaves in 16-bit: about {share:.0%} of the "
        f"weights would not be quantized. Train LoRA on the 16-bit weights instead (remove `{flag}`; LoRA reaches the "
        "experts through `lora_target_parameters`, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj])."
    )


def load_kwargs(model_args, training_args, partitioned: bool, sharded: bool = False) -> dict:
    """`from_pretrained` keyword arguments for quantized base weights (empty for a 16/32-bit base). `partitioned`:
    built under ZeRO-3's `zero.Init`; `sharded`: the engine shards the weights later (FSDP2's `fully_shard`)."""
    from trl import get_quantization_config

    config = get_quantization_config(model_args)
    if config is None:
        return {}
    if partitioned or sharded:  # packed in the dtype the engine shards (zero.Init's flat buffers; FSDP2's floats)
        config.bnb_4bit_quant_storage = getattr(torch, zero3_storage(training_args))
    if partitioned or (sharded and torch.cuda.is_available()):  # loaded in host memory (`loading`), then placed
        return {"quantization_config": config}
    device = training_args.local_process_index if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}  # each rank loads onto its own GPU


@contextlib.contextmanager
def loading(partitioned: bool):
    """While `from_pretrained` runs under ZeRO-3 or FSDP2 on a GPU: the model loads into host memory (transformers'
    quantizer would pick this rank's GPU), each weight quantized on the GPU one at a time (fast) and moved back to host
    memory with its constants. Elsewhere nothing changes."""
    if not partitioned or not torch.cuda.is_available():
        yield
        return
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    gpu = torch.device("cuda", torch.cuda.current_device())
    update_device_map, convert = Bnb4BitHfQuantizer.update_device_map, Bnb4bitQuantize.convert

    def to_host(self, device_map):
        return {"": "cpu"}

    def quantize_on_gpu(self, input_dict, *args, **kwargs):
        on_gpu = {k: [v.to(gpu) for v in x] if isinstance(x, list) else x.to(gpu) for k, x in input_dict.items()}
        return {k: v.to("cpu") for k, v in convert(self, on_gpu, *args, **kwargs).items()}

    Bnb4BitHfQuantizer.update_device_map, Bnb4bitQuantize.convert = to_host, quantize_on_gpu
    try:
        yield
    finally:
        Bnb4BitHfQuantizer.update_device_map, Bnb4bitQuantize.convert = update_device_map, convert


def place_quant_states(model: torch.nn.Module) -> int:
    """After the engine has placed the 4-bit weights: their quantization constants (bitsandbytes keeps them
    beside the parameter, whole on every rank) onto this rank's GPU, where the weights are used; the number moved."""
    if not torch.cuda.is_available():
        return 0
    gpu = torch.device("cuda", torch.cuda.current_device())
    moved = 0
    for module in model.modules():  # FSDP2's sharded weight has none: bitsandbytes keeps a copy on the module
        state = getattr(getattr(module, "weight", None), "quant_state", None) or getattr(module, "quant_state", None)
        if state is not None and state.absmax.device != gpu:
            state.to(gpu)
            moved += 1
    return moved
