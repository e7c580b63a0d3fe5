"""Before anything expensive: the global batch, the memory plan, and the `auto` values they decide.

`preflight` runs right after the configuration is parsed, before data or model are loaded. It resolves
`per_device_train_batch_size: auto` and `activation_checkpointing: auto` from `sft.plan` (the largest micro batch
that fits, checkpointing only if needed), turns `global_batch_size`/`tokens_per_step` into
`gradient_accumulation_steps` with `sft.batch`, logs the plan, and refuses a run whose planned peak does not fit
the GPU (unless `plan_check: false`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from sft import plan as memplan
from sft.batch import plan_batch
from sft.errors import ConfigError

logger = logging.getLogger(__name__)


def zero_setup(training_args) -> tuple[int | None, bool, bool]:
    """(ZeRO stage or None without DeepSpeed, optimizer offloaded, parameters offloaded) from the DeepSpeed config."""
    if not training_args.deepspeed:
        return None, False, False
    zero = training_args.hf_deepspeed_config.config.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str(zero.get(key, {}).get("device", "none")).lower() in ("cpu", "nvme")

    return int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param")


def base_setting(training_args, model_args) -> memplan.Setting:
    stage, offload_optimizer, offload_params = zero_setup(training_args)
    return memplan.Setting(
        gpus=training_args.world_size,
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", training_args.world_size)),
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        micro_batch=training_args.per_device_train_batch_size,
        seq_len=training_args.max_length or 0,
        activation_checkpointing=bool(training_args.activation_checkpointing),
        liger=bool(training_args.use_liger_kernel),
        lora_r=model_args.lora_r if model_args.use_peft else 0,
        lora_dropout=model_args.lora_dropout if model_args.use_peft else 0.0,
        qlora=bool(model_args.use_peft and model_args.load_in_4bit),
        dtype_bytes=2 if (training_args.bf16 or training_args.fp16) else 4,
    )


def preflight(training_args, model_args):
    """Resolve `auto` values, derive accumulation from a global-batch target, check the memory plan; returns the
    (possibly replaced) training arguments."""
    auto = training_args.auto_settings
    memory = (
        training_args.plan_gpu_memory_gib * memplan.GiB
        if training_args.plan_gpu_memory_gib
        else memplan.detected_gpu_memory()
    )
    micro = training_args.per_device_train_batch_size
    checkpointing = bool(training_args.activation_checkpointing)
    world = training_args.world_size
    target = training_args.global_batch_size
    if training_args.tokens_per_step and training_args.max_length:
        target = training_args.tokens_per_step // training_args.max_length
    headroom = training_args.plan_headroom
    if memory is None:
        if auto:
            logger.info(
                "No GPU to plan for: %s set to micro batch 1 / no activation checkpointing (set plan_gpu_memory_gib "
                "to plan for a GPU).",
                " and ".join(sorted(auto)),
            )
    elif not training_args.max_length:
        if "per_device_train_batch_size" in auto:
            raise ConfigError(
                "`per_device_train_batch_size: auto` needs `max_length` (tokens per row) to size activations. Set "
                "max_length, or give per_device_train_batch_size."
            )
        logger.warning("No max_length: the memory plan cannot size activations and is skipped.")
    else:
        shape = memplan.load_shape(
            model_args.model_name_or_path, bool(getattr(model_args, "trust_remote_code", False))
        )
        base = base_setting(training_args, model_args)
        if auto:
            micro_choices = (micro,)
            if "per_device_train_batch_size" in auto:
                micro_choices = tuple(m for m in memplan.MICRO_BATCHES if not target or target % (world * m) == 0)
            ckpt_choices = (False, True) if "activation_checkpointing" in auto else (checkpointing,)
            estimate = memplan.suggest(
                shape, base, memory, headroom, micro_choices or (1,), candidates=[base], checkpointing=ckpt_choices
            )
            if estimate is not None:
                micro, checkpointing = estimate.setting.micro_batch, estimate.setting.activation_checkpointing
            else:
                micro, checkpointing = min(micro_choices or (1,)), ckpt_choices != (False,)
        setting = dataclasses.replace(base, micro_batch=micro, activation_checkpointing=checkpointing)
        estimate = memplan.estimate(shape, setting)
        fits = estimate.fits(memory, headroom)
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
        if not fits:
            best = memplan.suggest(shape, setting, memory, headroom)
            fix = (
                f"The fastest setting that fits: {best.setting.describe()} (peak {best.peak / memplan.GiB:.2f} GiB)."
                if best
                else "Nothing fits on this many GPUs, even with CPU offload and micro batch 1: add GPUs or use LoRA."
            )
            message = (
                f"The memory plan does not fit: {setting.describe()} peaks at {estimate.peak / memplan.GiB:.2f} GiB "
                f"per GPU, over the {usable / memplan.GiB:.2f} GiB usable ({memory / memplan.GiB:.1f} GiB, headroom "
                f"{headroom:.0%}). {fix} Change those settings, or set plan_check: false to start anyway (the plan "
                "is an estimate)."
            )
            if training_args.plan_check:
                raise ConfigError(message)
            logger.warning(message)
    batch = plan_batch(
        world,
        micro,
        training_args.global_batch_size,
        training_args.tokens_per_step,
        training_args.max_length,
        training_args.gradient_accumulation_steps,
    )
    if (
        training_args.global_batch_size or training_args.tokens_per_step
    ) and training_args.gradient_accumulation_steps not in (
        1,
        batch.gradient_accumulation_steps,
    ):
        raise ConfigError(
            f"`gradient_accumulation_steps` {training_args.gradient_accumulation_steps} contradicts the global-batch "
            f"target, which needs {batch.gradient_accumulation_steps} here ({batch.describe()}). Remove one of them."
        )
    logger.info("Batch plan: %s", batch.describe())
    changes = {}
    if micro != training_args.per_device_train_batch_size or "per_device_train_batch_size" in auto:
        changes["per_device_train_batch_size"] = micro
    if checkpointing != training_args.activation_checkpointing or "activation_checkpointing" in auto:
        changes["activation_checkpointing"] = checkpointing
    if batch.gradient_accumulation_steps != training_args.gradient_accumulation_steps:
        changes["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
    for key, value in getattr(training_args, "resolved_ds_settings", {}).items():
        logger.info("DeepSpeed %s: auto -> %s (%d process%s)", key, str(value).lower(), world, "es" * (world > 1))
    if auto:
        logger.info(
            "auto settings: %s", ", ".join(f"{k} = {changes.get(k, getattr(training_args, k))}" for k in sorted(auto))
        )
    return dataclasses.replace(training_args, **changes) if changes else training_args
