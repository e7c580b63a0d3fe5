"""Before anything expensive: the global batch, the memory plan, the resume geometry and the `auto` values they set.

`preflight` runs right after the configuration is parsed and the resume point is known, before data or model are
loaded. It resolves `per_device_train_batch_size: auto` and the `auto` memory levers (`activation_checkpointing`,
`keep_attention_outputs`, `offload_checkpoints`, `tiled_mlp`, and ZeRO's offload where the DeepSpeed config's device
is `"auto"`) through the plan's search (`sft.plan.search`: the memory plan's fit and the speed model's ranking; the
kernels from `sft.plan.kernels`), turns the global-batch target into `gradient_accumulation_steps` with
`sft.core.batch` (on a resume the target is the checkpoint's global batch, kept on any number of processes), sets
DeepSpeed to load a ZeRO checkpoint of another process count as a universal checkpoint, logs the plan, and refuses a
run whose planned peak does not fit the GPU (unless `plan_check: false`). The training arguments are then rebuilt
once, with every change.

The decisions are `STEPS`, one declared order: the batch target, the model, the engine, the kernels, the memory plan,
the attention backend, the parallel sizes (and an image+text run's packing), the packing check, the engine's
configuration, the batch, the resume; each a function from the frozen `Decided` so far to a new one, and `_emit` builds
the training arguments and the `RunPlan` once. A new decision is a step and its place in `STEPS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sft import engines
from sft.core.batch import BatchPlan, keep_global_batch, plan_batch
from sft.core.dims import ParallelDims
from sft.core.retry import Retry
from sft.core.run import Check, MemoryDecision, Resume, RunPlan
from sft.errors import ConfigError
from sft.model import architectures, quantization, shapes
from sft.model.attention import check_packing, resolve_attn_implementation
from sft.parallel import sequence as seqpar
from sft.plan import fits as fitting
from sft.plan import kernels as family_kernels
from sft.plan import levers, search
from sft.plan import memory as memplan

logger = logging.getLogger(__name__)


def preflight(training_args, model_args, resume: Resume | None = None, sources=None) -> RunPlan:
    """Decide the run: resolve `auto` values, derive accumulation from the global-batch target (the checkpoint's on a
    resume), check the memory plan, set up a resume on another process count; returns the RunPlan, whose training
    arguments are rebuilt once if anything changed. `model_args` is not changed. `sources`: the recipe's `datasets`,
    whose records holding images make a run of a multimodal config that trains on text too an image+text run. The
    decisions are `STEPS`, in their order, each from what is decided so far to a new frozen `Decided`."""
    decided = Decided(training_args, model_args, resume, sources)
    for step in STEPS:
        decided = step(decided)
    return _emit(decided)


@dataclass(frozen=True)
class Decided:
    """What the plan has decided so far: the inputs, then each step's fields (None until it ran); `changes` the
    training-argument values decided, emitted once at the end (`_emit`)."""

    training_args: Any  # sft.config.TrainConfig as parsed (or as `engine: auto` rebuilt it for another engine)
    model_args: Any
    resume: Resume | None
    sources: Any
    retry: Retry | None = None  # `_target_step`
    target: int | None = None
    micro_cap: int | None = None
    model_config: Any = None  # `_model_step`
    arch: Any = None
    image_text: bool = False
    shape_of: Any = None  # () -> ModelShape, built once when first asked
    dims: ParallelDims | None = None  # `_engine_step`
    engine: Any = None
    kernels: dict = field(default_factory=dict)  # `_kernels_step`, completed by `_memory_step`
    memory: MemoryDecision | None = None  # `_memory_step`
    attn: str | None = None  # `_attention_step`
    vision: Any = None  # `_parallel_step`
    packing_check: Check | None = None  # `_packing_check_step`
    config: Any = None  # `_engine_config_step`: the engine's configuration as written
    buckets: tuple = ()
    batch: BatchPlan | None = None  # `_batch_step`
    changes: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def with_changes(self, changes: dict, **fields) -> Decided:
        return dataclasses.replace(self, changes=MappingProxyType(dict(changes)), **fields)


def _target_step(d: Decided) -> Decided:
    """The global-batch target (the checkpoint's on a resume) and a micro batch cap after running out of memory."""
    args = d.training_args
    seqpar.check(args.parallel, args.run_engine, args, args.padding_free_batches)
    retry = Retry.from_env() if "per_device_train_batch_size" in args.auto_settings else None
    return dataclasses.replace(d, retry=retry, target=_target(args, d.resume, retry),
                               micro_cap=retry.micro_cap if retry else None)  # fmt: skip


def _model_step(d: Decided) -> Decided:
    """The model's config and Architecture, read once; whether the run trains on images and text."""
    remote = bool(getattr(d.model_args, "trust_remote_code", False))
    model_config = shapes.load_config(d.model_args.model_name_or_path, remote)
    arch = architectures.of(model_config)
    image_text = _image_text(model_config, d.sources)
    arch = _image_text_kernels(arch) if image_text else arch  # the family's fast paths were measured on text rows
    shape_of = _shape_of(d.model_args, d.training_args, model_config, arch, remote, image_text)
    if image_text and d.training_args.train_vision_tower:
        logger.warning("train_vision_tower: true: the memory plan counts the encoder's weights, gradients and "
                       "optimizer states, not yet its activations, which every image patch keeps in each encoder "
                       "block while it trains: the planned peak is low by those (activation checkpointing, or a "
                       "smaller micro batch, if the run goes out of memory)")  # fmt: skip
    micro_cap = _unpadded_rows(d.training_args, arch, d.micro_cap)
    return dataclasses.replace(d, model_config=model_config, arch=arch, image_text=image_text, shape_of=shape_of,
                               micro_cap=micro_cap)  # fmt: skip


def _unpadded_rows(args, arch, micro_cap: int | None) -> int | None:
    """A family whose attention changes with padding (`architectures.PADDING_CHANGES_ATTENTION`) trains one unpadded
    row per micro batch: the micro batch capped at 1 (`auto`), or a larger one refused."""
    if arch.family not in architectures.PADDING_CHANGES_ATTENTION or args.padding_free_batches:
        return micro_cap
    micro = args.per_device_train_batch_size
    if (args.pad_to_multiple_of or 1) > 1:
        raise ConfigError(
            f"`pad_to_multiple_of: {args.pad_to_multiple_of}` with {arch.family}: its sparse attention's indexer "
            "takes its top-k keys before the padding mask, so padding changes what the row's tokens attend to. "
            "Remove it."
        )
    if "per_device_train_batch_size" not in args.auto_settings and micro > 1:
        raise ConfigError(
            f"`per_device_train_batch_size: {micro}` with {arch.family}: its sparse attention's indexer takes its "
            "top-k keys before the padding mask, so a padded row's tokens attend to other keys than alone. Set "
            "per_device_train_batch_size: 1 (the global batch comes from gradient accumulation)."
        )
    logger.info("%s: one unpadded row per micro batch (its indexer selects keys before the padding mask)", arch.family)
    return 1


def _engine_step(d: Decided) -> Decided:
    """The engine (`engine: auto` weighs them), and what it must support here: the resume, quantized weights, experts,
    LoRA targets."""
    args, model_args, arch = d.training_args, d.model_args, d.arch
    remote = bool(getattr(model_args, "trust_remote_code", False))
    if "engine" in args.auto_settings:
        args = search.choose_engine(
            args, model_args, arch, d.shape_of, d.target, d.micro_cap, d.resume, d.model_config
        )
    dims, engine = args.parallel, args.run_engine
    check_resume_engine(engine.name, d.resume)
    quantization.check(model_args, args, engine)  # quantized base weights against the engine decided
    engine.check_experts(dims.ep, dims.sp, arch.family, arch.is_moe, bool(model_args.use_peft), d.resume)
    quantization.check_experts(model_args, arch, remote)
    check_lora_parameters(model_args, d.model_config, remote)
    return dataclasses.replace(d, training_args=args, dims=dims, engine=engine)


def _kernels_step(d: Decided) -> Decided:
    """Liger, FP8 and compiled layers as the family's measurements and the engine allow."""
    kernels, changes = family_kernels.decide(d.training_args, d.model_args, d.arch, d.engine)
    return d.with_changes({**d.changes, **changes}, kernels=kernels)


def _memory_step(d: Decided) -> Decided:
    """The micro batch, the memory levers, the sequence-parallel size and the optimizer states that fit (fastest
    first where the speed model ranks them), and the kernels the ranking chose."""
    args, kernels, changes = d.training_args, dict(d.kernels), dict(d.changes)
    micro, tools, sp, sentence, ratio, bf16, optimizer, liger = _plan_memory(
        args, d.model_args, d.model_config, d.target, kernels, d.micro_cap, d.shape_of, d.arch, d.resume
    )
    family_kernels.ranked_changes(kernels, changes, optimizer, liger)
    if bf16 is not None:
        family_kernels.bf16_faster(args, kernels, changes, bf16)
    if tools.keep_attention_outputs:
        family_kernels.keep_attention_eager(args, kernels, changes)
    memory = MemoryDecision(micro, tools, sp, ratio, sentence, "per_device_train_batch_size" in args.auto_settings)
    return d.with_changes(changes, kernels=kernels, memory=memory)


def _attention_step(d: Decided) -> Decided:
    """The attention backend that honours the model (and the sequence-parallel size), and FP8's fields."""
    args, changes = d.training_args, dict(d.changes)
    attn = _attention(d.model_args.attn_implementation, args, d.model_config, d.arch, d.memory.sp, d.image_text)
    family_kernels.fp8_changes(args, d.kernels["FP8"].on, d.memory.sp, changes)
    return d.with_changes(changes, attn=attn)


def _parallel_step(d: Decided) -> Decided:
    """The parallel sizes with the plan's sequence-parallel size, checked against the model; an image+text run's
    packing."""
    args, dims, engine, sp, changes = d.training_args, d.dims, d.engine, d.memory.sp, dict(d.changes)
    if sp != dims.sp:  # `sequence_parallel_size: auto`, chosen by the plan
        changes["sequence_parallel_size"] = sp
        changes[engine.traits.config_field] = engine.unresolved(args)  # resolved again for this sp
        dims = ParallelDims.build(dims.world_size, sp, dims.gpus_per_node, dims.rank)
        seqpar.check(dims, args.run_engine, args, args.padding_free_batches)
    seqpar.check_model(d.model_config, sp, d.attn, d.arch)
    vision = _vision_changes(args, d.model_config, sp, changes) if d.image_text else None
    return d.with_changes(changes, dims=dims, vision=vision)


def _packing_check_step(d: Decided) -> Decided:
    """Whether the run checks its packed rows against their samples alone before the first step
    (`sft.run.packing_check`): asked (`packing_check: true`), or `auto` for a family outside the architecture table,
    whose packing the suite does not check."""
    args, family = d.training_args, d.arch.family
    asked = "packing_check" not in args.auto_settings
    if not args.padding_free_batches:
        check = Check(False, "no packed rows")
    elif d.vision is not None or d.memory.sp > 1 or (d.engine.traits.host_hooks and d.engine.sharding.weights):
        what = ("image+text rows" if d.vision is not None else f"sequence parallelism (size {d.memory.sp})"
                if d.memory.sp > 1 else f"{d.engine.traits.label}'s {d.engine.sharding.label}")  # fmt: skip
        if asked and args.packing_check:
            raise ConfigError(f"`packing_check: true` with {what}: the check runs on text rows on one sequence "
                              "shard, under no engine, ZeRO-1/2 or FSDP2 (forwards before the first step break "
                              "ZeRO-3's first backward). Set packing_check: auto or false.")  # fmt: skip
        check = Check(False, f"not built for {what}")
    elif asked:
        check = Check(bool(args.packing_check), f"packing_check: {str(bool(args.packing_check)).lower()}")
    elif d.arch.known:
        check = Check(False, f"{family} is checked packed by sft's suite (tests/test_architectures.py)")
    else:
        check = Check(True, f"{family} is not in sft's architecture table, whose families the suite checks packed")
    if check.on or asked:
        logger.info("Packing check: %s (%s)", "on" if check.on else "off", check.reason)
    changes = d.changes if asked else {**d.changes, "packing_check": check.on}
    return d.with_changes(changes, packing_check=check)


def _engine_config_step(d: Decided) -> Decided:
    """The engine's configuration written with the plan's offload and the gradient buckets for this model."""
    args, engine, tools, changes = d.training_args, d.engine, d.memory.tools, d.changes
    offload = (tools.offload_optimizer, tools.offload_params, d.memory.offload_ratio)
    if tools.offload_optimizer and memplan.moment_bytes_of(args.optim) < 8:
        optim = getattr(args.optim, "value", args.optim)
        logger.warning("optim %s: the optimizer is offloaded to the CPU, where DeepSpeed's CPU Adam steps it with "
                       "fp32 moments instead (the plan counts those)", optim)  # fmt: skip
    field_ = engine.traits.config_field
    config, lines = engine.written(changes.get(field_, getattr(args, field_)), offload=offload)
    for line in lines:
        logger.info("%s", line)
    params = None
    if d.dims.world_size == 1:  # one process's gradient bucket is at most the model (`sft.engines.bucket_elements`)
        params = d.shape_of().n_params
    config, buckets = engine.written(config, hidden=d.arch.hidden, processes=d.dims.world_size, params=params)
    return dataclasses.replace(d, config=config, buckets=tuple(buckets))


def _batch_step(d: Decided) -> Decided:
    """Accumulation from the global-batch target at the chosen micro batch; the levers' training arguments."""
    args, micro, changes = d.training_args, d.memory.micro_batch, dict(d.changes)
    batch = _plan_batch(args, micro, d.resume, d.dims.dp, d.retry)
    if d.retry is not None:
        logger.warning("Micro batch %d after running out of memory (sft train's retry): %s", micro, batch.describe())
    logger.info("Parallel sizes: %s", d.dims.describe())
    logger.info("Batch plan: %s", batch.describe())
    _lever_changes(args, micro, d.memory.tools, batch, changes)
    return d.with_changes(changes, batch=batch)


def _resume_step(d: Decided) -> Decided:
    """A resume on another geometry set up in the engine's configuration; that configuration among the changes."""
    args, config, changes, field_ = d.training_args, d.config, dict(d.changes), d.engine.traits.config_field
    if d.resume is not None:
        config = _plan_resume(args, d.engine, d.resume, d.dims, d.batch, d.memory.micro_batch, config)
    if config is not getattr(args, field_) and config != getattr(args, field_):
        changes[field_] = config
    return d.with_changes(changes, config=config)


# The plan's decisions in their order: each reads what the ones before it decided (`Decided`)
STEPS = (_target_step, _model_step, _engine_step, _kernels_step, _memory_step, _attention_step, _parallel_step,
         _packing_check_step, _engine_config_step, _batch_step, _resume_step)  # fmt: skip


def _emit(d: Decided) -> RunPlan:
    """The training arguments built once with every change, and the RunPlan."""
    args, changes = d.training_args, dict(d.changes)
    if args.auto_settings:
        logger.info("auto settings: %s", _auto_line(args, changes, d.engine))
    planned = args.with_values(keep_auto=False, **changes) if changes else args
    plan = RunPlan(planned, d.model_config, d.arch, d.batch, d.memory, d.attn, d.kernels, d.resume,
                   d.model_args.use_peft, d.vision, dims=planned.parallel, engine=planned.run_engine,
                   packing_check=d.packing_check)  # fmt: skip
    for key, value in (planned.resolved_ds_settings or args.resolved_ds_settings).items():
        logger.info("DeepSpeed %s: auto -> %s (%d process%s)", key, str(value).lower(), d.dims.world_size,
                    "es" * (d.dims.world_size > 1))  # fmt: skip
    for line in d.buckets:
        logger.info("%s", line)
    return plan


# `engine: auto`: FSDP2 measured against DeepSpeed's ZeRO-3 (benchmarks/results/fsdp2_h200x4, docs/engines.md)
# Image+text runs under FSDP2 train as under ZeRO-2 (the demo on the CPU, tests/multiproc/test_vision_runs.py, since
# the head's unit holds the text model's norm: `sft.engines.fsdp2.head_with_the_decoders_norm`; on 2 x H200 their loss
# curves agree within 0.7% over 10 steps) and were measured against ZeRO-3 on GPUs (benchmarks/results/vlm_engines)


def check_resume_engine(engine: str, resume: Resume | None) -> None:
    """A resume under the engine that wrote the checkpoint (`sft.engines.written_by`): one engine cannot read another's
    sharded state (DeepSpeed FSDP2's, FSDP2 DeepSpeed's: it would start, then fail deep inside a load). Refused before
    the model is built, naming both."""
    written = engines.written_by(resume.checkpoint) if resume is not None else None
    if written is None or written.name == engine:
        return
    label, ours = written.traits.label, engines.spec(engine).traits.label
    raise ConfigError(
        f"{resume.checkpoint} was written by {label} and this run's engine is {ours}, which cannot read it. Resume "
        f"with {label} ({written.traits.resume_flags}, or `engine: auto`, which follows the checkpoint), or start a "
        "new run in another --output_dir."
    )


def _shape_of(model_args, training_args, model_config, arch, remote: bool, image_text: bool):
    """The model's shape (a meta-device build) at most once, when first asked: for the memory plan and one process's
    gradient bucket; an image+text run's encoder counted frozen unless `train_vision_tower`."""
    frozen_vision = image_text and not training_args.train_vision_tower
    return functools.cache(functools.partial(shapes.load_shape, model_args.model_name_or_path, remote, model_config,
                                             arch, frozen_vision))  # fmt: skip


def _image_text(model_config, sources) -> bool:
    """Whether the run is image+text: always for a vision family; for a config that trains on text too (Gemma 3) where
    the data's records hold images (read only for such a config)."""
    if architectures.is_vision(model_config):
        return True
    multimodal = getattr(model_config, "vision_config", None) is not None  # Gemma 4, Qwen3.5: trained on text here
    if model_config.model_type not in architectures.IMAGE_DATA_FAMILIES and not multimodal:
        return False
    from sft.data import vision

    images = vision.sources_have_images(sources)
    if images and model_config.model_type not in architectures.IMAGE_DATA_FAMILIES:
        raise ConfigError(
            f"{model_config.model_type} is an image+text model, and the data's records hold images: sft trains "
            f"{model_config.model_type} on text only so far (its image rows are not packed or checked exactly by sft "
            f"yet; image+text families: {', '.join(sorted(architectures.VISION))}). Train it on text records, or use "
            "another tool for its images."
        )
    logger.info("%s: %s data, an %s run", model_config.model_type, "image+text" if images else "text-only",
                "image+text" if images else "text")  # fmt: skip
    return images


def _image_text_kernels(arch):
    """The architecture of an image+text run: Liger, FP8 and compiled layers off (each measured on text rows only;
    Liger's patches of a vision-language model, FP8's casts of its encoder's weights and compiled layers over rows
    with images are not)."""
    off = architectures.Kernel(False, "measured on text rows only, not on image+text runs")
    return dataclasses.replace(arch, kernels={**arch.kernels, **dict.fromkeys(("liger", "fp8", "compile",
                                                                              "compile_bf16"), off)})  # fmt: skip


def _attention(requested, training_args, model_config, arch, sp: int, image_text: bool) -> str | None:
    """The attention backend: an image+text run of a family packed with sft's own masks takes one that reads them
    (`sft.data.vision.mask_attention`); any other run the fastest that honours the model
    (`resolve_attn_implementation`)."""
    if image_text and architectures.VISION[model_config.model_type].packing == "masks":
        from sft.data import vision

        return vision.mask_attention(requested, model_config)
    padding_free = training_args.padding_free_batches
    attn = resolve_attn_implementation(requested, sp > 1, arch, padding_free)
    check_packing(attn, padding_free, training_args.model_init_kwargs)
    return attn


def _vision_changes(training_args, model_config, sp: int, changes: dict):
    """An image+text run (`sft.data.vision`): packed exactly or refused, its rows made and labelled by sft (TRL's
    dataset preparation, packing and assistant masks off: the rows come ready); its `vision.Plan`."""
    from sft.data import vision

    vision.check(model_config)
    if not training_args.packing or not training_args.max_length:
        raise ConfigError(
            f"`{model_config.model_type}` trains on image+text chats packed into rows (`packing: true` with a "
            "`max_length`); padded batches of images are not built by sft yet. Set `packing: true` and `max_length`."
        )
    if sp > 1:
        raise ConfigError(
            f"`sequence_parallel_size: {sp}` with the image+text model `{model_config.model_type}`: sequence "
            "parallelism is not checked for vision-language models yet. Set it to 1."
        )
    changes["dataset_kwargs"] = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    changes["remove_unused_columns"] = False
    changes["packing"] = False  # the rows come packed from sft.data.vision; TRL's trainer collates none itself
    changes["assistant_only_loss"] = False  # sft.data.vision labels the assistant's tokens (the plan keeps the choice)
    packing = vision.packing(model_config)
    how = {"masks": "sft's attention masks: each sample's tokens causally, its images both ways where the model's own "
                    "masks have them, the sliding window",
           "mrope": "per-sample M-RoPE positions, each sample's own attention",
           "positions": "positions restarting at each sample, each sample's own attention; images in tiles",
           }[packing]  # fmt: skip
    logger.info("Image+text chats of %s: packed exactly by sft.data.vision (%s)", model_config.model_type, how)
    return vision.Plan(assistant_only=bool(training_args.assistant_only_loss),
                       train_tower=bool(training_args.train_vision_tower), packing=packing)  # fmt: skip


def _auto_line(training_args, changes: dict, engine) -> str:
    """The `auto` fields as the plan set them (`engine = none` where the engine is off: DeepSpeed without a config)."""
    shown = {k: changes.get(k, getattr(training_args, k)) for k in training_args.auto_settings}
    if "engine" in shown and not engine.on:
        shown["engine"] = "none"
    return ", ".join(f"{k} = {_shown(v)}" for k, v in sorted(shown.items()))


def _shown(value):
    """A setting as a recipe writes it (an enum's value: `adamw_torch_fused`, not its name)."""
    return getattr(value, "value", value)


def check_lora_parameters(model_args, model_config, trust_remote_code: bool = False) -> None:
    """`lora_target_parameters` must each name parameters of the model, as PEFT matches them (a parameter's name, or
    its end after a dot): PEFT only warns when none matches and trains an adapter that is not what was asked for."""
    targets = list(model_args.lora_target_parameters or []) if model_args.use_peft else []
    if not targets:
        return
    names = shapes.parameter_names(model_config, trust_remote_code)
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not missing:
        return
    # the model's parameters with layer numbers taken out, as a target would name them
    kinds = sorted({re.sub(r"^.*?\.\d+\.", "", n) for n in names})
    raise ConfigError(
        f"`lora_target_parameters`: {', '.join(missing)} matches no parameter of {model_args.model_name_or_path} "
        f"({model_config.model_type}), so PEFT would train an adapter without it. Its parameters (per layer): "
        f"{', '.join(kinds)}. Name some of those, or use `lora_target_modules` for its linear layers."
    )


def _target(training_args, resume: Resume | None, retry) -> int | None:
    """The global batch to plan for: the checkpoint's on a resume, the failed run's on a retry, else the recipe's."""
    if resume is not None:
        return resume.global_batch
    if retry is not None:
        return retry.global_batch
    if training_args.tokens_per_step and training_args.max_length:
        return training_args.tokens_per_step // training_args.max_length
    return training_args.global_batch_size


def _lever_changes(training_args, micro: int, tools: memplan.Tools, batch: BatchPlan, changes: dict) -> None:
    """The micro batch, the memory levers and the accumulation as the plan set them."""
    auto = training_args.auto_settings
    if micro != training_args.per_device_train_batch_size or "per_device_train_batch_size" in auto:
        changes["per_device_train_batch_size"] = micro
    for lever in levers.run_levers():
        value = getattr(tools, lever)
        if value != getattr(training_args, lever) or lever in auto:
            changes[lever] = value
    if batch.gradient_accumulation_steps != training_args.gradient_accumulation_steps:
        changes["gradient_accumulation_steps"] = batch.gradient_accumulation_steps


def _plan_resume(training_args, engine, resume: Resume, dims, batch: BatchPlan, micro: int, config):
    """A resume's engine configuration: the experts' layout of an AutoEP checkpoint kept, a checkpoint of another
    process count (or expert split) loaded as a universal one; logged."""
    keep = resume.autoep and dims.ep == 1 and engine.experts is None
    if keep:
        config, _ = engine.written(config, keep_experts=True)
        logger.info("The checkpoint's experts are in AutoEP's layers: AutoEP stays on, every expert on each GPU")
    if (resume.world_size, resume.ep) == (dims.world_size, dims.ep):
        return config
    universal = engine.on and not engine.traits.reshards_checkpoints  # DeepSpeed's: converted, loaded as universal
    if universal:
        config, _ = engine.written(config, universal=True)
    logger.warning(
        "Resuming %s on %d processes%s (was %d%s): global batch %d = %s%s",
        resume.checkpoint,
        dims.world_size,
        f", experts split {dims.ep} ways" if dims.ep > 1 else "",
        resume.world_size,
        f", experts split {resume.ep} ways" if resume.ep > 1 else "",
        batch.global_batch_size,
        f"{dims.dp} x {micro} x {batch.gradient_accumulation_steps} accumulation",
        ", loading the ZeRO state as a universal checkpoint" if universal else "",
    )
    return config


def zero2_advice(
    shape, setting: memplan.Setting, memory: float, headroom: float, host: float | None, engine
) -> str | None:
    """For a ZeRO-3 run without offload: if ZeRO-2 fits with the same micro batch and no checkpointing, offloading or
    tiling, say so with what ZeRO-3 cost in the nearest measured setting; else None."""
    if not setting.sharding.weights or setting.offload_optimizer or setting.offload_params:
        return None
    zero2 = dataclasses.replace(setting.with_tools(memplan.Tools(False, False, False)), zero_stage=2)
    estimate = memplan.estimate(shape, zero2)
    if not estimate.fits(memory, headroom, host):
        return None
    cost = engine.sharded_cost(shape.n_params, setting.gpus)
    if cost is None:
        return None
    return (
        f"ZeRO-2 fits here: {zero2.describe()} peaks at {estimate.peak / memplan.GiB:.2f} GiB of "
        f"{memory * (1 - headroom) / memplan.GiB:.2f} GiB usable per GPU. In sft's nearest measured setting, "
        f"{cost.describe()}, ZeRO-2 was {1 / cost.ratio - 1:.0%} faster. ZeRO-3 kept as asked; for ZeRO-2: "
        "--deepspeed ds_configs/zero2.json"
    )


def _plan_batch(training_args, micro: int, resume: Resume | None, dp: int, retry=None) -> BatchPlan:
    if resume is not None:
        return keep_global_batch(resume.global_batch, dp, micro, resume.describe())
    if retry is not None:
        return keep_global_batch(retry.global_batch, dp, micro, retry.describe())
    batch = plan_batch(
        dp,
        micro,
        training_args.global_batch_size,
        training_args.tokens_per_step,
        training_args.max_length,
        training_args.gradient_accumulation_steps,
    )
    targeted = training_args.global_batch_size or training_args.tokens_per_step
    if targeted and training_args.gradient_accumulation_steps not in (1, batch.gradient_accumulation_steps):
        raise ConfigError(
            f"`gradient_accumulation_steps` {training_args.gradient_accumulation_steps} contradicts the global-batch "
            f"target, which needs {batch.gradient_accumulation_steps} here ({batch.describe()}). Remove one of them."
        )
    return batch


def _plan_memory(
    training_args,
    model_args,
    model_config,
    target: int | None,
    kernels: dict,
    micro_cap: int | None,
    shape_of,
    arch: architectures.Architecture,
    resume: Resume | None = None,
) -> tuple[int, memplan.Tools, int, str, float, bool | None, dict, bool | None]:
    """(micro batch, memory levers, sequence-parallel size, the plan's figures in a sentence, the optimizer offload
    share, whether layers compile in bf16 where the speed model turned `auto` FP8 off (else None), the optimizer fields
    `optim: auto` set (`optim`, and `optim_args` for bf16 weights without a master copy: `_precision`), Liger where
    the ranking took it the other way from the family's rule (else None)), from the model's shape (`shape_of()`,
    built on first call): the `auto` ones chosen by the memory plan and the speed model (the smallest sp first, then
    the fastest setting that fits; micro batches up to `micro_cap`, an out-of-memory retry's; `optim: auto` takes the
    checkpoint's optimizer on a `resume`); the plan logged and checked against the GPU and host."""
    auto = training_args.auto_settings
    master, optimizer = _precision(training_args, model_args, model_config)
    resumed_optim = optimizer.get("optim", resume.optim if resume is not None and "optim" in auto else None)
    unplanned = {"optim": resumed_optim, **optimizer}  # what the optimizer is where the memory plan does not run
    micro = training_args.per_device_train_batch_size
    tools = search.given_levers(training_args)
    ratio = training_args.run_engine.sharding.offload_ratio
    sp = training_args.sequence_parallel_size
    memory, headroom, host = search.memory_limits(training_args)
    if memory is None:
        if auto:
            logger.info(
                "No GPU to plan memory for (plan_gpu_memory_gib plans for one): the `auto` settings take their "
                "no-GPU values (micro batch 1, no checkpointing, offloading or tiling)"
            )
        return micro, tools, sp, "There was no GPU memory to plan for.", ratio, None, unplanned, None
    if not training_args.max_length:
        if "per_device_train_batch_size" in auto:
            raise ConfigError(
                "`per_device_train_batch_size: auto` needs `max_length` (tokens per row) to size activations. Set "
                "max_length, or give per_device_train_batch_size."
            )
        logger.warning("No max_length: the memory plan cannot size activations and is skipped.")
        return micro, tools, sp, "The memory plan was skipped (no max_length).", ratio, None, unplanned, None
    shape = shape_of()
    base = search.planned_base(training_args, model_args, kernels, master, resumed_optim, target)
    bf16, optim, liger = None, resumed_optim, None
    if auto:
        limits = (memory, headroom, host)
        chosen = search.auto_setting(training_args, shape, arch, base, target, micro_cap, limits, resumed_optim)
        micro, tools, sp, ratio = chosen.micro_batch, chosen.tools, chosen.sp, chosen.offload_ratio
        if chosen.moment_bytes != base.moment_bytes:  # `optim: auto` chose 8-bit moments
            base, optim = dataclasses.replace(base, moment_bytes=chosen.moment_bytes), memplan.EIGHT_BIT_OPTIM
        if chosen.liger != base.liger:  # `use_liger_kernel: auto`, taken the other way by the ranking
            base, liger = dataclasses.replace(base, liger=chosen.liger), chosen.liger
        if base.fp8 and not chosen.fp8 and not chosen.keep_attention_outputs:  # kept attention turns FP8 off by itself
            bf16, base = chosen.compiled, dataclasses.replace(base, fp8=False)
    setting = dataclasses.replace(base.with_tools(tools, ratio), micro_batch=micro, sp=sp)
    sentence = _check_plan(training_args, model_args, shape, setting, (memory, headroom, host))
    return micro, tools, sp, sentence, ratio, bf16, {"optim": optim, **optimizer}, liger


# bf16 weights without an engine that keeps an fp32 master copy: torchao's 8-bit AdamW with stochastic rounding
# (transformers' `optim_args`), so that an update under half a bf16 ulp still lands in expectation. CPU check of the
# mechanics: tests/test_precision.py (pure bf16 steps leave a regression's loss where it started; these reach fp32's)
STOCHASTIC_ROUNDING = "bf16_stochastic_round=True"


def _precision(training_args, model_args, model_config) -> tuple[bool, dict]:
    """Whether the trained weights have an fp32 master copy, and the optimizer changes that decides: an engine that
    shards keeps one (ZeRO, FSDP2), so do fp32 weights; bf16 weights stepped by transformers' optimizer (`deepspeed:
    none`) have none, so `optim: auto` takes torchao's 8-bit AdamW with stochastic rounding (logged) and any other
    optimizer is stepped in pure bf16, said in a warning. LoRA's adapters train in fp32 (PEFT's default)."""
    engine = training_args.run_engine
    if engine.on or model_args.use_peft:
        return True, {}
    if not search.bf16_weights(model_args, model_config):
        return True, {}
    if search.stepped_with_rounding(training_args, model_args, model_config):
        logger.info("Precision: bf16 weights without an fp32 master copy (no sharding engine): optim: auto -> %s with "
                    "%s (torchao: each update rounded up or down in proportion, so updates under half a bf16 ulp are "
                    "not lost; 6 bytes a weight with its 8-bit moments)", memplan.EIGHT_BIT_OPTIM,
                    STOCHASTIC_ROUNDING)  # fmt: skip
        return False, {"optim": memplan.EIGHT_BIT_OPTIM, "optim_args": STOCHASTIC_ROUNDING}
    if STOCHASTIC_ROUNDING.lower() not in str(training_args.optim_args or "").replace(" ", "").lower():
        logger.warning("Precision: bf16 weights stepped in place by %s (no sharding engine, no fp32 master copy): an "
                       "update under half a bf16 ulp is rounded away. Set optim: auto (8-bit AdamW with stochastic "
                       "rounding), dtype: float32, or a DeepSpeed config.", _shown(training_args.optim))  # fmt: skip
    return False, {}


def _check_plan(training_args, model_args, shape, setting: memplan.Setting, limits) -> str:
    """The plan of the chosen setting logged and checked against the GPU and the host (a ConfigError where it does
    not fit, unless `plan_check: false`); returns its figures in a sentence (for the out-of-memory message)."""
    memory, headroom, host = limits
    estimate = memplan.estimate(shape, setting)
    fits = estimate.fits(memory, headroom, host)
    usable = memory * (1 - headroom)
    logger.info(
        "Memory plan for %s: %s\n%s\n  %s: %.2f GiB of %.2f GiB usable per GPU",
        model_args.model_name_or_path,
        setting.describe(),
        estimate.table(),
        "fits" if fits else "does NOT fit",
        estimate.peak / memplan.GiB,
        usable / memplan.GiB,
    )
    if fits:
        advice = zero2_advice(shape, setting, memory, headroom, host, training_args.run_engine)
        if advice:
            logger.warning(advice)
    if not fits:
        best = fitting.suggest(shape, setting, memory, headroom, host_memory=host)
        fix = (
            f"The fastest setting that fits: {best.setting.describe()} (peak {best.peak / memplan.GiB:.2f} GiB)."
            if best
            else fitting.nothing_fits(setting, shape, memory, headroom, host)
        )
        if estimate.fits(memory, headroom):  # the GPU would hold it; the host would not
            over = (
                f"needs {estimate.host_pinned / memplan.GiB:.2f} GiB of host memory per node (offloaded states and "
                f"checkpoints), over the {host * (1 - headroom) / memplan.GiB:.2f} GiB usable"
            )
        else:
            over = (
                f"peaks at {estimate.peak / memplan.GiB:.2f} GiB per GPU, over the {usable / memplan.GiB:.2f} GiB "
                f"usable ({memory / memplan.GiB:.1f} GiB, headroom {headroom:.0%})"
            )
        message = (
            f"The memory plan does not fit: {setting.describe()} {over}. {fix} Change those settings, or set "
            "plan_check: false to start anyway (the plan is an estimate)."
        )
        if training_args.plan_check:
            raise ConfigError(message)
        logger.warning(message)
    return (
        f"The memory plan for {setting.describe()} estimated a peak of {estimate.peak / memplan.GiB:.2f} GiB of "
        f"{usable / memplan.GiB:.2f} GiB usable per GPU (the `Memory plan` lines at the start)."
    )
