"""Model changes as converters, applied by one container in one declared order (torchtitan's `ModelConverter`).

Each change sft makes to a model is a converter: whether the run plan turns it on, and what it does. They run in the
order of `ORDER`, in the phase where each must run:

- `build`: right after the model is built (`sft.model.build.load_model`), on the bare model;
- `trainer`: applied by the library inside the trainer's construction, not by sft: PEFT's LoRA adapters (TRL's
  SFTTrainer wraps the model), then Liger's kernels (transformers' Trainer patches the model, LoRA's too);
- `prepare`: after those, before the engine wraps the model (`Trainer._prepare_for_training`): the tiled MLP wraps
  the MLP Liger patched, checkpointing keeps the attention outputs;
- `wrapped`: after the engine wrapped the model: its hooks kept out of the compiled layers.

A new model change is a converter here plus its line in the plan (`sft.plan.preflight`), not an edit in the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PHASES = ("build", "trainer", "prepare", "wrapped")


@dataclass(frozen=True)
class Converter:
    name: str
    phase: str
    enabled: Callable  # (plan) -> bool
    apply: Callable | None  # (model, plan) -> None; None: the library applies it in that phase


def _experts(model, plan) -> None:
    from sft.model import experts

    experts.apply(model, experts.decide(plan.arch, plan.training_args.model_init_kwargs)[0])


def _router_load(model, plan) -> None:
    from sft.model import experts

    model.sft_router_load = experts.RouterLoad(model)
    logger.info("Router load: %d MoE layers' expert choices counted for the log (router_load_max, "
                "router_idle_experts)", len(model.sft_router_load.layers))  # fmt: skip


def _fp8(model, plan) -> None:
    from sft.model import fp8

    recipe = plan.training_args.fp8_recipe
    traits = plan.engine.traits
    mixed = bool(plan.training_args.bf16 or plan.training_args.fp16)  # FSDP2 then keeps fp32 master weights
    converted = fp8.convert(model, recipe, size_filter=torch.cuda.is_available(), fsdp2=traits.layer_units,
                            fp32_master=traits.layer_units and mixed)  # fmt: skip
    gathered = ""
    if traits.float8_all_gather and fp8.all_gathers_float8(recipe):
        gathered = f", all-gathered by {traits.label} in float8"
    logger.info("FP8: %d decoder linear layers in torchao float8 (%s scaling%s)", converted, recipe, gathered)


def compile_decoder_layers(model) -> None:
    """`torch.compile` each decoder layer (one graph, reused by every layer), not the whole model.

    transformers' `torch_compile` compiles the whole model, loss and LM head included, and breaks the graph at every
    DeepSpeed hook; the decoder layers are where the elementwise work between the matmuls is.
    """
    from sft.errors import ConfigError
    from sft.model import architectures

    layers = architectures.decoder_layers(model)
    if layers is None:
        raise ConfigError(
            f"`compile_decoder_layers`: {type(model).__name__} has no decoder layers to compile. Set it to false."
        )
    for layer in layers:
        layer.compile()
    logger.info("Compiling %d decoder layers with torch.compile", len(layers))


def _compile(model, plan) -> None:
    compile_decoder_layers(model)


def _tiled_mlp(model, plan) -> None:
    from sft.model import fp8, tiling

    args = plan.training_args
    hidden = model.config.get_text_config().hidden_size
    tiles = tiling.tiles_for(args.max_length, plan.dims.sp, hidden)
    changed = tiling.apply_tiled_mlp(model, tiles, fp8.token_multiple(args.fp8))
    if changed:
        logger.info("Tiled MLP: %d decoder-layer MLPs run in %d tiles per row", changed, tiles)


def _keep(model, plan) -> None:
    from sft.model import checkpointing

    checkpointing.keep_attention_outputs(model, plan.training_args.activation_checkpointing_kwargs)
    logger.info("Activation checkpointing keeps the attention kernels' outputs (sft.model.checkpointing): the "
                "recomputation skips the attention kernel")  # fmt: skip


def _offloaded_checkpoints(model, plan) -> None:
    """transformers offloads the checkpoints itself; said here, with the allocator setting long rows need."""
    from sft.model import checkpointing

    offloaded = (plan.training_args.activation_checkpointing_kwargs or {}).get("offload")
    logger.info(
        "Activation checkpoints %s",
        "offloaded to pinned CPU memory" if offloaded else "not offloaded: no GPU, they are in host memory",
    )
    if offloaded and checkpointing.expandable_segments():
        logger.info("GPU memory in expandable segments from here on (long rows; %s sets it otherwise)",
                    checkpointing.ALLOC_CONF_ENV)  # fmt: skip


def _compiled_hooks(model, plan) -> None:
    from sft.model import architectures

    wrapped = plan.engine.compiled_layers_ready(architectures.decoder_layers(model))
    if wrapped:
        logger.info("Compiled decoder layers under ZeRO-3: %d DeepSpeed hooks run eagerly in between", wrapped)


def _vision_positions(model, plan) -> None:
    from sft.model import vision_hooks

    vision_hooks.join_positions(model)


def _vision_masks(model, plan) -> None:
    from sft.model import vision_hooks

    vision_hooks.block_masks(model)


def _vision_varlen(model, plan) -> None:
    from sft.model import attention

    if attention.vision_encoder_on_varlen(model):
        logger.info("Vision encoder on %s: every image's patches in one varlen call per layer, each image (and "
                    "window) attending only to itself", attention.VARLEN)  # fmt: skip


def _freeze_vision_tower(model, plan) -> None:
    from sft.model import architectures

    frozen = architectures.vision_tower_parameters(model)
    for _, param in frozen:
        param.requires_grad_(False)
    # transformers' activation checkpointing makes every sub-model's input embeddings require grad
    # (`enable_input_require_grads`, for adapters): the frozen encoder's patch embedding too, which puts its blocks in
    # the backward, checkpointed, recomputed and backpropagated for no gradient (Qwen2-VL, Qwen2.5-VL: every block's
    # input kept; tests/test_vision_run.py). Without input embeddings the encoder's activations need no gradient; its
    # projector's weights still get theirs.
    encoder = architectures.vision_encoder(model)
    if encoder is not None:
        encoder.get_input_embeddings = lambda: None
    logger.info("Vision encoder frozen (train_vision_tower: false): %d tensors, %.1fM parameters; its projector and "
                "the language model train", len(frozen), sum(p.numel() for _, p in frozen) / 1e6)  # fmt: skip


def _freeze_unbuilt_inputs(model, plan) -> None:
    from sft.model import architectures

    frozen = architectures.unbuilt_input_parameters(model)
    for _, param in frozen:
        param.requires_grad_(False)
    if frozen:
        logger.info("Audio encoder frozen (sft builds image and text rows, no audio): %d tensors, %.1fM parameters",
                    len(frozen), sum(p.numel() for _, p in frozen) / 1e6)  # fmt: skip


def _linear_attention(model, plan) -> None:
    from sft.model import linear_attention

    count = linear_attention.by_sample(model)
    if linear_attention.path() == "varlen":
        logger.info("Linear attention (%s): %d Gated DeltaNet layers over packed rows through flash-linear-attention's"
                    " varlen kernels on GPU (each sample from a zero state; one sample at a time on CPU)%s",
                    plan.arch.family, count, linear_attention.fla_note())  # fmt: skip
    else:
        logger.info("Linear attention (%s): %d Gated DeltaNet layers over packed rows, each sample from a zero state, "
                    "on transformers' torch kernels, the recurrence batched over samples of similar length on GPU "
                    "(one sample at a time on CPU), not flash-linear-attention's varlen ones: %s", plan.arch.family,
                    count, linear_attention.fla_cannot_train())  # fmt: skip


def _args(*names: str) -> Callable:
    """On where every one of these training arguments is (as the plan resolved them)."""
    return lambda plan: all(getattr(plan.training_args, name) for name in names)


ORDER = (
    Converter("sft experts", "build", lambda plan: plan.arch.is_moe, _experts),
    # counted outside compiled layers only (a hook's side effect inside one would break its graph), and not where
    # expert parallelism gives each rank part of the experts
    Converter(
        "router load",
        "build",
        lambda plan: (
            plan.arch.is_moe
            and (plan.dims is None or plan.dims.ep == 1)
            and not plan.training_args.compile_decoder_layers
        ),
        _router_load,
    ),
    Converter(
        "linear attention by sample",
        "build",
        lambda plan: (
            bool(plan.arch.attention.per_sample)
            and (plan.training_args.padding_free_batches or plan.vision is not None)
        ),  # image rows are always packed
        _linear_attention,
    ),
    Converter(
        "packed image+text positions",
        "build",
        lambda plan: plan.vision is not None and plan.vision.packing == "mrope",
        _vision_positions,
    ),
    Converter(
        "packed image+text masks",
        "build",
        lambda plan: plan.vision is not None and plan.vision.packing == "masks",
        _vision_masks,
    ),
    Converter(
        "vision encoder on varlen",
        "build",
        lambda plan: (
            plan.vision is not None and plan.vision.packing == "mrope" and plan.attn_implementation == "sft_varlen"
        ),
        _vision_varlen,
    ),
    Converter(
        "frozen vision encoder",
        "build",
        lambda plan: plan.vision is not None and not plan.vision.train_tower,
        _freeze_vision_tower,
    ),
    Converter(
        "unbuilt audio encoder",
        "build",
        lambda plan: getattr(plan.model_config, "audio_config", None) is not None,  # text runs build it too (Gemma 4)
        _freeze_unbuilt_inputs,
    ),
    Converter("FP8", "build", _args("fp8"), _fp8),
    Converter("compiled layers", "build", _args("compile_decoder_layers"), _compile),
    Converter("LoRA", "trainer", lambda plan: plan.lora, None),  # TRL's SFTTrainer: PEFT's get_peft_model
    Converter("Liger", "trainer", _args("use_liger_kernel"), None),  # transformers' Trainer: Liger's patches
    Converter("tiled MLP", "prepare", _args("tiled_mlp"), _tiled_mlp),
    Converter("kept attention outputs", "prepare", _args("activation_checkpointing", "keep_attention_outputs"), _keep),
    Converter("offloaded checkpoints", "prepare", _args("offload_checkpoints"), _offloaded_checkpoints),
    Converter("compiled layers' engine hooks", "wrapped", _args("compile_decoder_layers"), _compiled_hooks),
)


def apply(phase: str, model: torch.nn.Module, plan) -> list[str]:
    """Apply the converters of `phase` that the plan turns on, in their order; returns their names."""
    applied = []
    for converter in ORDER:
        if converter.phase == phase and converter.apply is not None and converter.enabled(plan):
            converter.apply(model, plan)
            applied.append(converter.name)
    return applied


def apply_at_build(model: torch.nn.Module, plan) -> list[str]:
    """After the model is built: the `build` converters, with the KV cache off for packed rows (a KV cache in training
    skips the packed-sequence mask of sdpa/eager)."""
    if plan.training_args.padding_free_batches or plan.vision is not None:  # image+text rows come packed
        from sft.model import architectures

        # the text model reads its own config's (a multimodal model's text_config); a cache there drops the mask
        model.config.use_cache = architectures.text_config(model.config).use_cache = False
    return apply("build", model, plan)
