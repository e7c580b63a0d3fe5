"""Before anything expensive: the global batch, the memory plan, the resume geometry and the `auto` values they set.

`preflight` runs right after the configuration is parsed and the resume point is known, before data or model are
loaded. It resolves `per_device_train_batch_size: auto` and the `auto` memory levers (`activation_checkpointing`,
`keep_attention_outputs`, `offload_checkpoints`, `tiled_mlp`, and ZeRO's offload where the DeepSpeed config's device
is `"auto"`) from `sft.plan.memory` (the largest micro batch that fits, each lever only if needed, in the plan's
order), turns the global-batch target into `gradient_accumulation_steps` with `sft.core.batch` (on a resume the target
is the checkpoint's global batch, kept on any number of processes), sets DeepSpeed to load a ZeRO checkpoint of another
process count as a universal checkpoint, logs the plan, and refuses a run whose planned peak does not fit the GPU
(unless `plan_check: false`). The training arguments are then rebuilt once, with every change.

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
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from sft import engines
from sft.core.batch import BatchPlan, keep_global_batch, micro_batches_for, plan_batch
from sft.core.dims import ParallelDims
from sft.core.engine import Sharding
from sft.core.retry import Retry
from sft.core.run import Check, MemoryDecision, Resume, RunPlan
from sft.errors import ConfigError
from sft.model import architectures, fp8, quantization, shapes
from sft.model.attention import check_packing, resolve_attn_implementation
from sft.parallel import sequence as seqpar
from sft.plan import kernels as family_kernels
from sft.plan import memory as memplan
from sft.plan import speed

# The training arguments of the plan's memory levers: {argument: `sft.plan.memory.Tools` field} (ZeRO's offload levers
# are the engine's, `Engine.offload_auto`)
TOOL_FIELDS = {"activation_checkpointing": "checkpointing", "offload_checkpoints": "offload", "tiled_mlp": "tiled_mlp",
               "keep_attention_outputs": "keep_attention"}  # fmt: skip

logger = logging.getLogger(__name__)


def base_setting(
    training_args, model_args, fp8_on: bool | None = None, liger_on: bool | None = None
) -> memplan.Setting:
    """The setting the training arguments ask for (`sft.plan.memory.setting_of`), with the kernels as decided where
    given; compiled layers are set by the caller."""
    fields = {k: getattr(training_args, k, getattr(model_args, k, None)) for k in memplan.SETTING_FIELDS}
    fields.update(compile_decoder_layers=False, use_liger_kernel=training_args.use_liger_kernel if liger_on is None
                  else liger_on, fp8=training_args.fp8 if fp8_on is None else fp8_on)  # fmt: skip
    engine, dims = training_args.run_engine, training_args.parallel
    return memplan.setting_of(fields, engine.sharding, engine.name, dims.world_size, dims.gpus_per_node, dims.sp,
                              dims.ep)  # fmt: skip


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
        args = _choose_engine(args, model_args, arch, d.shape_of, d.target, d.micro_cap, d.resume, d.model_config)
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
    if tools.keep_attention:
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
FSDP2_MEASURED = ("FSDP2's default measured 1.26-1.33x ZeRO-3's on Llama-3.1-8B widths, 2 and 4 x H200 "
                  "(benchmarks/results/fsdp2_h200x4), and 1.59x on the Qwen2.5-VL-7B widths' image+text benchmark, "
                  "2 x H200 planned for 80 GB (benchmarks/results/vlm_engines)")  # fmt: skip
QLORA_MEASURED = ("QLoRA on the Llama-3.1-70B widths, 2 x H200 capped at 24 GiB: FSDP2 2.47x ZeRO-3's tokens/s at 4 "
                  "layers, and 40 layers trained in 17.26 GiB where ZeRO-3 ran out of memory "
                  "(benchmarks/results/qlora_70b_fsdp2)")  # fmt: skip


def gpu_name() -> str | None:
    """This machine's GPU (the speed model's card), None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


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


def _choose_engine(training_args, model_args, arch, shape_of, target, micro_cap, resume: Resume | None,
                   model_config=None):  # fmt: skip
    """`engine: auto`: on one process, no engine where that is estimated fastest (`_without_engine`); an engine
    declared to stand in for the config's layout (`Traits.in_place_of`: FSDP2 in place of DeepSpeed's ZeRO-3) where
    the speed model estimates its fastest setting that fits faster (each with its own kernels: FP8 under FSDP2, 8-bit
    Adam under DeepSpeed where `optim: auto` takes it), else the registry's first engine (DeepSpeed); a resume keeps
    its checkpoint's engine. Only for what both engines can run and what was measured: full fine-tuning on a GPU, no
    offload, sequence or expert parallelism. The choice and its reason are logged; the training arguments are emitted
    for the chosen engine (the `auto` fields kept `auto`). QLoRA under ZeRO-3 goes to FSDP2 by its measurement
    (`QLORA_MEASURED`), not the speed model's estimate."""
    sharding, dims = training_args.run_engine.sharding, training_args.parallel
    current = engines.spec(training_args.engine)

    def keep(reason: str):
        logger.info("engine: auto -> %s (%s)", current.name, reason)
        return training_args

    if resume is None and model_config is not None:
        alone = _without_engine(training_args, model_args, model_config, arch, shape_of, target, micro_cap)
        if alone is not None:
            return alone
    if resume is not None:
        return _resumed_engine(training_args, resume, current, keep)
    rival = next((s for s in engines.SPECS.values() if s.traits.in_place_of is not None and s is not current), None)
    if rival is None:
        return keep("no other engine is registered to stand in for it")
    reason = _engine_excluded(training_args, model_args, sharding, dims, current, rival)
    if reason:
        return keep(reason)
    if model_args.use_peft and model_args.load_in_4bit:
        logger.info("engine: auto -> %s (QLoRA: PyTorch's FSDP2 in place of ZeRO-3; %s; `engine: deepspeed` keeps "
                    "DeepSpeed)", rival.name, QLORA_MEASURED)  # fmt: skip
        return training_args.with_values(**rival.selected)
    reason = next((why for cut, why in (
        (not arch.kernel("speed").on, f"the speed model does not rank {arch.family}"),
        (not training_args.max_length, "no max_length to plan for"),
    ) if cut), None)  # fmt: skip
    if reason:
        return keep(reason)
    limits, best = _memory_limits(training_args), {}
    names = {current.name: f"{current.traits.label} ZeRO-{sharding.stage}", rival.name: rival.traits.label}
    for name in names:
        bases = _engine_bases(training_args, model_args, arch, target, name)
        fits = _fits_with_optim(training_args, shape_of(), bases, target, micro_cap, limits)
        best[name] = fits[0] if fits else None
    if best[rival.name] is None or (best[current.name] and best[current.name].time.tokens_per_second
                                    >= best[rival.name].time.tokens_per_second):  # fmt: skip
        return keep(f"ZeRO-{sharding.stage}'s fastest setting that fits estimated as fast or faster: "
                    + _against(best, names))  # fmt: skip
    logger.info("engine: auto -> %s (PyTorch's FSDP2 in place of ZeRO-3: %s; %s; `engine: deepspeed` keeps "
                "DeepSpeed)", rival.name, _against(best, names, first=rival.name), FSDP2_MEASURED)  # fmt: skip
    return training_args.with_values(**rival.selected)


def _resumed_engine(training_args, resume: Resume, current, keep):
    """`engine: auto` on a resume: the engine that wrote the checkpoint (`sft.engines.written_by`); one process's
    checkpoint without an engine's state (transformers' `optimizer.pt`) resumed without one."""
    written, dims = engines.written_by(resume.checkpoint), training_args.parallel
    alone = written is None and (Path(resume.checkpoint) / "optimizer.pt").is_file()  # transformers' own save
    if alone and resume.world_size == dims.world_size == 1 and training_args.run_engine.on and current.unsharded:
        logger.info("engine: auto -> none (%s was written by one process without an engine)", resume.checkpoint)
        return training_args.with_values(**current.unsharded)
    if written is None or written is current:
        by = written.traits.label if written else "processes without a sharding engine"
        return keep(f"{resume.checkpoint} was written by {by}")
    logger.info("engine: auto -> %s (%s was written by %s)", written.name, resume.checkpoint, written.traits.label)
    return training_args.with_values(**written.selected)


def _engine_excluded(training_args, model_args, sharding, dims, current, rival) -> str | None:
    """Why `engine: auto` does not weigh `rival` against the config's engine here, else None."""
    stage = sharding.label if sharding.engine else "no ZeRO"
    label, theirs = current.traits.label, rival.traits
    excluded = (
        (sharding.stage != theirs.in_place_of,
         f"{stage}: {theirs.label} is chosen only in place of ZeRO-{theirs.in_place_of}, where the states are "
         "sharded"),
        ((sharding.offload_optimizer or sharding.offload_params) and not theirs.offload,
         f"offloading to the CPU or NVMe is {label}'s here"),
        ((dims.sp > 1 or "sequence_parallel_size" in training_args.auto_settings) and not theirs.sequence_parallel,
         f"sequence parallelism is {label}'s (Ulysses)"),
        (dims.ep > 1 and not theirs.expert_parallel, f"expert parallelism is {label}'s (AutoEP)"),
        (model_args.use_peft and not model_args.load_in_4bit, f"LoRA on 16-bit weights under {theirs.label} is not "
         "measured on GPUs"),
        (gpu_name() is None, "no GPU: the engines' speeds were measured on GPUs"),
    )  # fmt: skip
    return next((why for cut, why in excluded if cut), None)


# `engine: auto` without an engine on one process: what it was measured on (benchmarks/results/family_speed_h100)
ALONE_MEASURED = ("measured without DeepSpeed on one GPU at 43.5-59.7% MFU: Qwen3-4B widths 17,102 tokens/s on an "
                  "H100 (16,072 under ZeRO-2 on another); Qwen3-8B, Mistral-7B, Llama-3.1-8B and the Qwen2.5-VL "
                  "benchmark on an H200 planned for 80 GB, where ZeRO-2 fits none of the 7-8B ones; its loss curve "
                  "0.9% from fp32 master weights' on the 1B widths")  # fmt: skip


def _auto_line(training_args, changes: dict, engine) -> str:
    """The `auto` fields as the plan set them (`engine = none` where the engine is off: DeepSpeed without a config)."""
    shown = {k: changes.get(k, getattr(training_args, k)) for k in training_args.auto_settings}
    if "engine" in shown and not engine.on:
        shown["engine"] = "none"
    return ", ".join(f"{k} = {_shown(v)}" for k, v in sorted(shown.items()))


def _without_engine(training_args, model_args, model_config, arch, shape_of, target, micro_cap):
    """`engine: auto` on one process: the training arguments without DeepSpeed (bf16 weights stepped in place by
    torchao's 8-bit AdamW with stochastic rounding: `_precision`) where the speed model estimates that run's fastest
    setting that fits faster than the DeepSpeed config's (or nothing fits with DeepSpeed); None to keep the engine.
    Only where that path is what `_precision` takes (bf16 weights, `optim: auto`, torchao) and what was measured: full
    fine-tuning on a GPU, one process, no offload, sequence or expert parallelism."""
    sharding, dims = training_args.run_engine.sharding, training_args.parallel
    current = engines.spec(training_args.engine)
    cut = (dims.world_size > 1, not training_args.run_engine.on, current.unsharded is None,
           sharding.offload_optimizer or sharding.offload_params,
           dims.sp > 1 or "sequence_parallel_size" in training_args.auto_settings, dims.ep > 1, model_args.use_peft,
           gpu_name() is None, not arch.kernel("speed").on, not training_args.max_length,
           not _stepped_with_rounding(training_args, model_args, model_config))  # fmt: skip
    if any(cut):
        return None
    shape, limits = shape_of(), _memory_limits(training_args)
    engine_bases = _engine_bases(training_args, model_args, arch, target, current.name, sharding.stage)
    engine = _fits_with_optim(training_args, shape, engine_bases, target, micro_cap, limits)
    bases = memplan.without_engine(_engine_bases(training_args, model_args, arch, target, current.name, None))
    alone = _ranked(training_args, shape, bases, target, micro_cap, limits)[0]

    def said(fits) -> str:
        if not fits:
            return "nothing fits"
        best, levers = fits[0], fits[0].estimate.setting.levers_and_micro()
        return f"{best.time.tokens_per_second:,.0f} tokens/s/GPU estimated ({levers})"

    if not alone or (engine and engine[0].time.tokens_per_second >= alone[0].time.tokens_per_second):
        logger.info("engine: auto keeps %s on one process (ZeRO-%s: %s; without an engine: %s)",
                    current.traits.label, sharding.stage, said(engine), said(alone))  # fmt: skip
        return None
    logger.info("engine: auto -> none (one process: nothing to shard; bf16 weights stepped in place by torchao's "
                "8-bit AdamW with stochastic rounding, no fp32 master copy: %s, against DeepSpeed ZeRO-%s: %s; %s; "
                "`engine: deepspeed` keeps DeepSpeed)", said(alone), sharding.stage, said(engine),
                ALONE_MEASURED)  # fmt: skip
    return training_args.with_values(**current.unsharded)


def _fits_with_optim(training_args, shape, bases, target, micro_cap, limits) -> list:
    """The settings of `bases` that fit, fastest first, with the moments `optim: auto` would take: 8-bit where they
    win (`sft.plan.memory.eight_bit_wins`; DeepSpeed's only), else the bases' own."""
    fits = _ranked(training_args, shape, bases, target, micro_cap, limits)[0]
    if "optim" not in training_args.auto_settings or not memplan.eight_bit_candidate(bases[0]):
        return fits
    eight = _ranked(training_args, shape, memplan.with_eight_bit_moments(bases), target, micro_cap, limits)[0]
    return eight if memplan.eight_bit_wins(fits, eight) else fits


def _against(best: dict, names: dict, first: str | None = None) -> str:
    """Both engines' estimates ({name: fastest fit}), `first`'s first (else `names`' order)."""

    def said(name: str) -> str:
        fit = best[name]
        if fit is None:
            return f"{names[name]}: nothing fits"
        speed_ = f"{fit.time.tokens_per_second:,.0f}"
        return f"{names[name]} {speed_} tokens/s/GPU estimated ({fit.estimate.setting.levers_and_micro()})"

    first = first or next(iter(names))
    return ", against ".join(said(n) for n in (first, *(n for n in names if n != first)))


def _engine_bases(
    training_args, model_args, arch, target, engine: str, stage: int | None = 3
) -> list[memplan.Setting]:
    """The settings `_plan_memory` would rank for this run under the engine called `engine` (in its own layout of ZeRO
    `stage`; None: no engine): its kernels as `family_kernels.decide` decides them (without logging), bf16 beside
    FP8 where `fp8: auto` turned it on."""
    fp8_on = family_kernels.fp8_decision(training_args, model_args, arch, engine, Sharding(stage)).on
    compiled = family_kernels.compiled(training_args, arch, fp8_on)
    liger = family_kernels.liger_on(training_args, arch)
    base = dataclasses.replace(base_setting(training_args, model_args, fp8_on, liger), compiled=bool(compiled),
                               engine=engine)  # fmt: skip
    return family_kernels.run_bases(training_args, arch, _with_accumulation(training_args, base, target))


def _memory_limits(training_args) -> tuple[float | None, float, float | None]:
    """(the GPU memory planned for: `plan_gpu_memory_gib`, `max_gpu_memory_gib` or the GPU's; None without any, the
    headroom, the host's memory)."""
    planned_gib = training_args.plan_gpu_memory_gib or training_args.max_gpu_memory_gib
    memory = planned_gib * memplan.GiB if planned_gib else memplan.detected_gpu_memory()
    return memory, training_args.plan_headroom, memplan.detected_host_memory()


def _with_accumulation(training_args, base: memplan.Setting, target: int | None) -> memplan.Setting:
    """`base` with the accumulation the global-batch target gives: above 1 wherever a micro batch is below
    target / dp (the micro batch `auto`: 2, the plan then sets it per candidate)."""
    if not target:
        return base
    dp, micro = training_args.parallel.dp, training_args.per_device_train_batch_size
    fixed = "per_device_train_batch_size" not in training_args.auto_settings
    accumulation = target // (dp * micro) if fixed else (2 if target > dp else 1)
    return dataclasses.replace(base, accumulation=max(accumulation, 1))


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
    for key, lever in TOOL_FIELDS.items():
        value = getattr(tools, lever)
        if value != getattr(training_args, key) or key in auto:
            changes[key] = value
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


def _tool_levels(training_args) -> tuple[memplan.Tools, ...]:
    """The plan's memory levels with every lever that is not `auto` held at its given value (in the plan's order):
    the tools of TOOL_FIELDS, and ZeRO's offload where the DeepSpeed config's device is `"auto"`."""
    auto = training_args.auto_settings
    given = _given_levers(training_args)
    optimizer, params = training_args.run_engine.offload_auto()
    free = {lever for key, lever in TOOL_FIELDS.items() if key in auto}
    free |= {lever for lever, on in (("offload_optimizer", optimizer), ("offload_params", params)) if on}
    levels = []
    for level in memplan.levels():
        fixed = memplan.Tools(**{f: getattr(level if f in free else given, f) for f in memplan.Tools._fields})
        if fixed not in levels and fixed.valid:
            levels.append(fixed)
    return tuple(levels)


def _given_levers(training_args) -> memplan.Tools:
    """The memory levers as the recipe and DeepSpeed config give them (`auto` ones off)."""
    zero = training_args.run_engine.sharding
    fields = {lever: bool(getattr(training_args, key)) for key, lever in TOOL_FIELDS.items()}
    return memplan.Tools(**fields, offload_optimizer=zero.offload_optimizer, offload_params=zero.offload_params)


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
    tools = _given_levers(training_args)
    ratio = training_args.run_engine.sharding.offload_ratio
    sp = training_args.sequence_parallel_size
    memory, headroom, host = _memory_limits(training_args)
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
    base = _planned_base(training_args, model_args, kernels, master, resumed_optim, target)
    bf16, optim, liger = None, resumed_optim, None
    if auto:
        limits = (memory, headroom, host)
        chosen = _auto_setting(training_args, shape, arch, base, target, micro_cap, limits, resumed_optim)
        micro, tools, sp, ratio = chosen.micro_batch, chosen.tools, chosen.sp, chosen.offload_ratio
        if chosen.moment_bytes != base.moment_bytes:  # `optim: auto` chose 8-bit moments
            base, optim = dataclasses.replace(base, moment_bytes=chosen.moment_bytes), memplan.EIGHT_BIT_OPTIM
        if chosen.liger != base.liger:  # `use_liger_kernel: auto`, taken the other way by the ranking
            base, liger = dataclasses.replace(base, liger=chosen.liger), chosen.liger
        if base.fp8 and not chosen.fp8 and not chosen.keep_attention:  # kept attention turns FP8 off by itself
            bf16, base = chosen.compiled, dataclasses.replace(base, fp8=False)
    setting = dataclasses.replace(base.with_tools(tools, ratio), micro_batch=micro, sp=sp)
    sentence = _check_plan(training_args, model_args, shape, setting, (memory, headroom, host))
    return micro, tools, sp, sentence, ratio, bf16, {"optim": optim, **optimizer}, liger


def _planned_base(training_args, model_args, kernels: dict, master: bool, resumed_optim, target):
    """The setting the plan starts from: the run's fields, its kernels, the resumed optimizer's moments, bf16 weights
    stepped in place where no master copy is kept, the accumulation for the target global batch."""
    base = dataclasses.replace(base_setting(training_args, model_args, kernels["FP8"].on, kernels["Liger"].on),
                               compiled=kernels["compiled layers"].on)  # fmt: skip
    if resumed_optim:
        base = dataclasses.replace(base, moment_bytes=memplan.moment_bytes_of(resumed_optim))
    if not master:
        base = base.stepped_in_place()
    return _with_accumulation(training_args, base, target)


def _auto_setting(training_args, shape, arch, base, target, micro_cap, limits, resumed_optim):
    """The setting the `auto` fields take: the kernel bases of the family (where its speed model is on; else the
    largest micro batch with the fewest levers), with 8-bit moments as candidates where `optim: auto` may take them,
    ranked by `_choose`."""
    bases = [base]
    by_speed = arch.kernel("speed")
    if not by_speed.on:
        logger.info("Speed model: off for %s (%s): the largest micro batch with the fewest levers", arch.family,
                    by_speed.reason)  # fmt: skip
    else:
        bases = family_kernels.run_bases(training_args, arch, base)
    auto = training_args.auto_settings
    if by_speed.on and "optim" in auto and not resumed_optim and memplan.eight_bit_candidate(base):
        bases = _optimizer_states(training_args, shape, bases, target, micro_cap, limits)
    return _choose(training_args, shape, bases, target, micro_cap, limits, by_speed.on)


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
    if not _bf16_weights(model_args, model_config):
        return True, {}
    if _stepped_with_rounding(training_args, model_args, model_config):
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


def _bf16_weights(model_args, model_config) -> bool:
    """Whether the model's weights are bf16 (`dtype`, or with `auto` the checkpoint's own)."""
    weights = str(model_args.dtype or "auto")
    if weights == "auto":
        weights = str(getattr(model_config, "dtype", None) or "")
    return "bfloat16" in weights


def _stepped_with_rounding(training_args, model_args, model_config) -> bool:
    """Whether bf16 weights without an engine would be stepped by torchao's 8-bit AdamW with stochastic rounding
    (`optim: auto`, torchao installed)."""
    return (_bf16_weights(model_args, model_config) and "optim" in training_args.auto_settings
            and fp8.torchao_installed())  # fmt: skip


def _optimizer_states(training_args, shape, bases, target, micro_cap, limits) -> list[memplan.Setting]:
    """`optim: auto`: `bases` with 8-bit Adam moments where their fastest fitting setting beats fp32 moments' by
    `EIGHT_BIT_GAIN` (then `optim` is set to torchao's 8-bit AdamW, logged), else `bases` unchanged."""
    eight = memplan.with_eight_bit_moments(bases)
    fp32_fits = _ranked(training_args, shape, bases, target, micro_cap, limits)[0]
    eight_fits = _ranked(training_args, shape, eight, target, micro_cap, limits)[0]
    if not memplan.eight_bit_wins(fp32_fits, eight_fits):
        return bases
    fast = eight_fits[0].time.tokens_per_second
    slow = fp32_fits[0].time.tokens_per_second if fp32_fits else 0.0
    against = (f"{fp32_fits[0].estimate.setting.levers_and_micro()} at {slow:,.0f} tokens/s with fp32 moments"
               if fp32_fits else "nothing fitting with fp32 moments")  # fmt: skip
    logger.info("optim: auto -> %s (torchao's 8-bit AdamW): the fastest setting that fits with 8-bit Adam moments, "
                "%s, estimates %s tokens/s per GPU against %s (its loss curve measured equal to fp32 Adam's)",
                memplan.EIGHT_BIT_OPTIM, eight_fits[0].estimate.setting.levers_and_micro(), f"{fast:,.0f}",
                against)  # fmt: skip
    return eight


def _choose(training_args, shape, bases, target, micro_cap, limits, by_speed: bool = True) -> memplan.Setting:
    """The `auto` settings as the memory plan and the speed model choose them: the fastest that fits (`_ranked`), the
    ranking logged; nothing fitting, the most frugal setting (reported by `_check_plan`)."""
    fits, card, frugal = _ranked(training_args, shape, bases, target, micro_cap, limits, by_speed)
    if not fits:
        return frugal
    if by_speed:
        _log_ranking(fits, card)
    return fits[0].estimate.setting


def _ranked(
    training_args, shape, bases, target, micro_cap, limits, by_speed: bool = True
) -> tuple[list, speed.Card, memplan.Setting]:
    """(the settings that fit at the smallest sp that fits any (every step of sp costs all-to-all traffic): `bases`
    (their kernels: FP8 or bf16) with the micro batches and levers that fit, fastest first (`sft.plan.memory.ranked`),
    empty where nothing fits; the speed model's card; the most frugal setting, for when nothing fits)."""
    memory, headroom, host = limits
    auto = training_args.auto_settings
    micro, sp = training_args.per_device_train_batch_size, training_args.sequence_parallel_size
    world = training_args.parallel.world_size
    sp_choices = memplan.sp_sizes(shape, world) if "sequence_parallel_size" in auto else (sp,)
    levels = _tool_levels(training_args)
    micro_choices = (micro,)
    card = speed.card(gpu_name())
    kernels = functools.partial(family_kernels.candidate_kernels, training_args)
    fits = []
    for sp_choice in sp_choices:
        if "per_device_train_batch_size" in auto:  # one packed row per micro-batch under SP
            rows = memplan.MICRO_BATCHES if sp_choice == 1 else (1,)
            rows = [m for m in rows if not micro_cap or m <= micro_cap]
            micro_choices = micro_batches_for(target, world // sp_choice, rows) or (1,)
        fits = memplan.ranked_bases(shape, bases, memory, headroom, micro_choices, levels=levels,
                                    sp_choices=(sp_choice,), host_memory=host, target=target, card=card,
                                    kernels=kernels, by_speed=by_speed)  # fmt: skip
        if fits:
            break
    frugal = dataclasses.replace(bases[0].with_tools(levels[-1]), micro_batch=min(micro_choices), sp=max(sp_choices))
    return fits, card, frugal


def _log_ranking(fits: list, card, shown: int = 3) -> None:
    """Why the chosen setting won: its estimate beside the next ones'."""
    if len(fits) < 2:
        return
    lines = [
        f"  {'chosen' if i == 0 else 'then':<6} {r.estimate.setting.levers_and_micro()}: {r.time.describe()}, peak "
        f"{r.estimate.peak / memplan.GiB:.2f} GiB"
        for i, r in enumerate(fits[:shown])
    ]
    logger.info("Speed model (%s; %s): %d settings fit, fastest first\n%s", card.name, card.source, len(fits),
                "\n".join(lines))  # fmt: skip


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
        best = memplan.suggest(shape, setting, memory, headroom, host_memory=host)
        fix = (
            f"The fastest setting that fits: {best.setting.describe()} (peak {best.peak / memplan.GiB:.2f} GiB)."
            if best
            else memplan.nothing_fits(setting, shape, memory, headroom, host)
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
