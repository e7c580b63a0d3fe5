"""The plan's search: the candidate settings of a run (micro batches x memory levers x kernels x optimizer states x
engines, each at the sequence-parallel sizes the run allows) built from its training arguments and ranked once by the
memory plan (`sft.plan.memory`: what fits) and the speed model (`sft.plan.speed`: the fastest of those), with the
lines the log gives for each choice: `choose_engine` (`engine: auto`: the configured engine against its rival, and
one process without an engine), `auto_setting` (`per_device_train_batch_size`, the memory levers and `optim` where
`auto`). `sft.plan.preflight` calls it in its engine and memory steps; the kernels a candidate carries are
`sft.plan.kernels`'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sft import engines
from sft.core.batch import micro_batches_for
from sft.core.engine import Sharding
from sft.core.run import Resume
from sft.model import fp8
from sft.plan import fits as fitting
from sft.plan import kernels as family_kernels
from sft.plan import levers, speed
from sft.plan import memory as memplan

logger = logging.getLogger(__name__)

FSDP2_MEASURED = ("FSDP2's default measured 1.26-1.33x ZeRO-3's on Llama-3.1-8B widths, 2 and 4 x H200 "
                  "(benchmarks/results/fsdp2_h200x4), and 1.59x on the Qwen2.5-VL-7B widths' image+text benchmark, "
                  "2 x H200 planned for 80 GB (benchmarks/results/vlm_engines)")  # fmt: skip
QLORA_MEASURED = ("QLoRA on the Llama-3.1-70B widths, 2 x H200 capped at 24 GiB: FSDP2 2.47x ZeRO-3's tokens/s at 4 "
                  "layers, and 40 layers trained in 17.26 GiB where ZeRO-3 ran out of memory "
                  "(benchmarks/results/qlora_70b_fsdp2)")  # fmt: skip


def base_setting(
    training_args, model_args, fp8_on: bool | None = None, liger_on: bool | None = None
) -> memplan.Setting:
    """The setting the training arguments ask for (`sft.plan.setting.setting_of`), with the kernels as decided where
    given; compiled layers are set by the caller."""
    fields = {k: getattr(training_args, k, getattr(model_args, k, None)) for k in memplan.SETTING_FIELDS}
    fields.update(compile_decoder_layers=False, use_liger_kernel=training_args.use_liger_kernel if liger_on is None
                  else liger_on, fp8=training_args.fp8 if fp8_on is None else fp8_on)  # fmt: skip
    engine, dims = training_args.run_engine, training_args.parallel
    return memplan.setting_of(fields, engine.sharding, engine.name, dims.world_size, dims.gpus_per_node, dims.sp,
                              dims.ep)  # fmt: skip


def gpu_name() -> str | None:
    """This machine's GPU (the speed model's card), None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def choose_engine(training_args, model_args, arch, shape_of, target, micro_cap, resume: Resume | None,
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
    found, best = Search.of_run(training_args, shape_of(), target, micro_cap, memory_limits(training_args)), {}
    names = {current.name: f"{current.traits.label} ZeRO-{sharding.stage}", rival.name: rival.traits.label}
    for name in names:
        fits = _fits_with_optim(training_args, found, _engine_bases(training_args, model_args, arch, target, name))
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


def _without_engine(training_args, model_args, model_config, arch, shape_of, target, micro_cap):
    """`engine: auto` on one process: the training arguments without DeepSpeed (bf16 weights stepped in place by
    torchao's 8-bit AdamW with stochastic rounding: `sft.plan.preflight._precision`) where the speed model estimates
    that run's fastest setting that fits faster than the DeepSpeed config's (or nothing fits with DeepSpeed); None to
    keep the engine. Only where that path is what `_precision` takes (bf16 weights, `optim: auto`, torchao) and what
    was measured: full fine-tuning on a GPU, one process, no offload, sequence or expert parallelism."""
    sharding, dims = training_args.run_engine.sharding, training_args.parallel
    current = engines.spec(training_args.engine)
    sp_many = dims.sp > 1 or "sequence_parallel_size" in training_args.auto_settings
    offload = sharding.offload_optimizer or sharding.offload_params
    if (
        gpu_name() is None
        or not training_args.max_length
        or alone_excluded(
            dims.world_size,
            training_args.run_engine.on,
            current.unsharded,
            offload,
            sp_many,
            dims.ep,
            model_args.use_peft,
            arch.kernel("speed").on,
            stepped_with_rounding(training_args, model_args, model_config),
        )
    ):
        return None
    found = Search.of_run(training_args, shape_of(), target, micro_cap, memory_limits(training_args))
    engine_bases = _engine_bases(training_args, model_args, arch, target, current.name, sharding.stage)
    engine = _fits_with_optim(training_args, found, engine_bases)
    alone = found.alone(_engine_bases(training_args, model_args, arch, target, current.name, None))

    def said(fits) -> str:
        if not fits:
            return "nothing fits"
        best, levers = fits[0], fits[0].estimate.setting.levers_and_micro()
        return f"{best.time.tokens_per_second:,.0f} tokens/s/GPU estimated ({levers})"

    if not alone_wins(engine, alone):
        logger.info("engine: auto keeps %s on one process (ZeRO-%s: %s; without an engine: %s)",
                    current.traits.label, sharding.stage, said(engine), said(alone))  # fmt: skip
        return None
    logger.info("engine: auto -> none (one process: nothing to shard; bf16 weights stepped in place by torchao's "
                "8-bit AdamW with stochastic rounding, no fp32 master copy: %s, against DeepSpeed ZeRO-%s: %s; %s; "
                "`engine: deepspeed` keeps DeepSpeed)", said(alone), sharding.stage, said(engine),
                ALONE_MEASURED)  # fmt: skip
    return training_args.with_values(**current.unsharded)


def _fits_with_optim(training_args, found: Search, bases) -> list:
    """The settings of `bases` that fit, fastest first, with the moments `optim: auto` would take: 8-bit where they
    win (`Search.optimizer_states`; DeepSpeed's only), else the bases' own."""
    fits = found.rank(bases)
    if "optim" not in training_args.auto_settings or not fitting.eight_bit_candidate(bases[0]):
        return fits
    _, eight, taken = found.optimizer_states(bases, fits)
    return eight if taken else fits


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
    """The settings `sft.plan.preflight._plan_memory` would rank for this run under the engine called `engine` (in
    its own layout of ZeRO `stage`; None: no engine): its kernels as `sft.plan.kernels.decide` decides them (without
    logging), bf16 beside FP8 where `fp8: auto` turned it on."""
    fp8_on = family_kernels.fp8_decision(training_args, model_args, arch, engine, Sharding(stage)).on
    compiled = family_kernels.compiled(training_args, arch, fp8_on)
    liger = family_kernels.liger_on(training_args, arch)
    base = dataclasses.replace(base_setting(training_args, model_args, fp8_on, liger), compiled=bool(compiled),
                               engine=engine)  # fmt: skip
    return family_kernels.run_bases(training_args, arch, _with_accumulation(training_args, base, target))


def memory_limits(training_args) -> tuple[float | None, float, float | None]:
    """(the GPU memory planned for: `plan_gpu_memory_gib`, `max_gpu_memory_gib` or the GPU's; None without any, the
    headroom, the host's memory)."""
    planned_gib = training_args.plan_gpu_memory_gib or training_args.max_gpu_memory_gib
    memory = planned_gib * memplan.GiB if planned_gib else fitting.detected_gpu_memory()
    return memory, training_args.plan_headroom, fitting.detected_host_memory()


def _with_accumulation(training_args, base: memplan.Setting, target: int | None) -> memplan.Setting:
    """`base` with the accumulation the global-batch target gives: above 1 wherever a micro batch is below
    target / dp (the micro batch `auto`: 2, the plan then sets it per candidate)."""
    if not target:
        return base
    dp, micro = training_args.parallel.dp, training_args.per_device_train_batch_size
    fixed = "per_device_train_batch_size" not in training_args.auto_settings
    accumulation = target // (dp * micro) if fixed else (2 if target > dp else 1)
    return dataclasses.replace(base, accumulation=max(accumulation, 1))


def _tool_levels(training_args) -> tuple[memplan.Tools, ...]:
    """The plan's memory levels with every lever that is not `auto` held at its given value (in the plan's order):
    the training arguments' levers (`sft.plan.levers.run_levers`), and ZeRO's offload where the DeepSpeed config's
    device is `"auto"`."""
    auto = training_args.auto_settings
    given = given_levers(training_args)
    optimizer, params = training_args.run_engine.offload_auto()
    free = {lever for lever in levers.run_levers() if lever in auto}
    free |= {lever for lever, on in (("offload_optimizer", optimizer), ("offload_params", params)) if on}
    levels = []
    for level in memplan.levels():
        fixed = memplan.Tools(**{f: getattr(level if f in free else given, f) for f in memplan.Tools._fields})
        if fixed not in levels and fixed.valid:
            levels.append(fixed)
    return tuple(levels)


def given_levers(training_args) -> memplan.Tools:
    """The memory levers as the recipe and DeepSpeed config give them (`auto` ones off)."""
    zero = training_args.run_engine.sharding
    fields = {lever: bool(getattr(training_args, lever)) for lever in levers.run_levers()}
    return memplan.Tools(**fields, offload_optimizer=zero.offload_optimizer, offload_params=zero.offload_params)


def planned_base(training_args, model_args, kernels: dict, master: bool, resumed_optim, target):
    """The setting the plan starts from: the run's fields, its kernels, the resumed optimizer's moments, bf16 weights
    stepped in place where no master copy is kept, the accumulation for the target global batch."""
    base = dataclasses.replace(base_setting(training_args, model_args, kernels["FP8"].on, kernels["Liger"].on),
                               compiled=kernels["compiled layers"].on)  # fmt: skip
    if resumed_optim:
        base = dataclasses.replace(base, moment_bytes=memplan.moment_bytes_of(resumed_optim))
    if not master:
        base = base.stepped_in_place()
    return _with_accumulation(training_args, base, target)


def auto_setting(training_args, shape, arch, base, target, micro_cap, limits, resumed_optim):
    """The setting the `auto` fields take: the kernel bases of the family (where its speed model is on; else the
    largest micro batch with the fewest levers), with 8-bit moments as candidates where `optim: auto` may take them,
    ranked by `_choose`."""
    bases = [base]
    by_speed = arch.kernel("speed")
    found = Search.of_run(training_args, shape, target, micro_cap, limits, by_speed.on)
    if not by_speed.on:
        logger.info("Speed model: off for %s (%s): the largest micro batch with the fewest levers", arch.family,
                    by_speed.reason)  # fmt: skip
    else:
        bases = family_kernels.run_bases(training_args, arch, base)
    auto = training_args.auto_settings
    if by_speed.on and "optim" in auto and not resumed_optim and fitting.eight_bit_candidate(base):
        bases = _optimizer_states(found, bases)
    return _choose(found, bases)


def card_bases(arch, setting: memplan.Setting, fp8_auto: bool, liger_auto: bool, by_speed: bool):
    """`sft plan --suggest`'s kernel settings to rank (`sft.plan.kernels.kernel_bases` on the GPU planned for, where
    `auto` Liger can run), as `sft train` ranks them there; the setting alone where the speed model does not rank."""
    if not by_speed:
        return [setting]
    return family_kernels.kernel_bases(arch, setting, fp8_auto, True, liger_auto, on_gpu=True)


def without_master(setting: memplan.Setting, optim: str) -> memplan.Setting:
    """bf16 weights without an engine (no fp32 master copy), as `sft.plan.preflight._precision` steps them: in place,
    with 8-bit moments and stochastic rounding under `optim: auto`, else the optimizer's own moments."""
    moments = memplan.moment_bytes_of(memplan.EIGHT_BIT_OPTIM if optim == "auto" else optim)
    return dataclasses.replace(setting, moment_bytes=moments).stepped_in_place()


def bf16_weights(model_args, model_config) -> bool:
    """Whether the model's weights are bf16 (`dtype`, or with `auto` the checkpoint's own)."""
    weights = str(model_args.dtype or "auto")
    if weights == "auto":
        weights = str(getattr(model_config, "dtype", None) or "")
    return "bfloat16" in weights


def stepped_with_rounding(training_args, model_args, model_config) -> bool:
    """Whether bf16 weights without an engine would be stepped by torchao's 8-bit AdamW with stochastic rounding
    (`optim: auto`, torchao installed)."""
    return (bf16_weights(model_args, model_config) and "optim" in training_args.auto_settings
            and fp8.torchao_installed())  # fmt: skip


def _optimizer_states(found: Search, bases) -> list[memplan.Setting]:
    """`optim: auto`: `bases` with 8-bit Adam moments where `Search.optimizer_states` takes them (then `optim` is set
    to torchao's 8-bit AdamW, logged), else `bases` unchanged."""
    fp32_fits = found.rank(bases)
    chosen, eight_fits, taken = found.optimizer_states(bases, fp32_fits)
    if not taken:
        return bases
    fast = eight_fits[0].time.tokens_per_second
    slow = fp32_fits[0].time.tokens_per_second if fp32_fits else 0.0
    against = (f"{fp32_fits[0].estimate.setting.levers_and_micro()} at {slow:,.0f} tokens/s with fp32 moments"
               if fp32_fits else "nothing fitting with fp32 moments")  # fmt: skip
    logger.info("optim: auto -> %s (torchao's 8-bit AdamW): the fastest setting that fits with 8-bit Adam moments, "
                "%s, estimates %s tokens/s per GPU against %s (its loss curve measured equal to fp32 Adam's)",
                memplan.EIGHT_BIT_OPTIM, eight_fits[0].estimate.setting.levers_and_micro(), f"{fast:,.0f}",
                against)  # fmt: skip
    return chosen


def _choose(found: Search, bases) -> memplan.Setting:
    """The `auto` settings as the memory plan and the speed model choose them: the fastest that fits
    (`Search.rank`), the ranking logged; nothing fitting, the most frugal setting (reported by
    `sft.plan.preflight._check_plan`)."""
    fits = found.rank(bases)
    if not fits:
        return found.frugal(bases)
    if found.by_speed:
        _log_ranking(fits, found.card)
    return fits[0].estimate.setting


@dataclass(frozen=True)
class Search:
    """One search's inputs, the same for `sft train`'s `auto` fields (`of_run`) and `sft plan --suggest` (its flags):
    the model's shape, (GPU memory planned for, headroom, host memory), the process count and the global-batch target
    (rows per optimizer step), the card whose speed constants rank, the memory levels to try, the sequence-parallel
    sizes (smallest first: every step of sp costs all-to-all traffic), the micro batch (None: `auto`, the ones that
    make the target, one packed row per micro batch under sp, up to `micro_cap`), the kernels' `auto` fields, whether
    the speed model ranks, and whether each base keeps its ZeRO stage."""

    shape: Any
    limits: tuple
    world: int
    target: int | None
    card: speed.Card
    levels: tuple
    sp_choices: tuple[int, ...]
    micro: int | None = None
    micro_cap: int | None = None
    compile_auto: bool = True
    fp8_auto: bool = True
    by_speed: bool = True
    same_stage: bool = True

    @classmethod
    def of_run(cls, training_args, shape, target, micro_cap, limits, by_speed: bool = True) -> Search:
        """The search of a run's `auto` fields: every lever that is not `auto` held at its value (`_tool_levels`)."""
        auto, world = training_args.auto_settings, training_args.parallel.world_size
        sp_choices = (fitting.sp_sizes(shape, world) if "sequence_parallel_size" in auto
                      else (training_args.sequence_parallel_size,))  # fmt: skip
        micro = None if "per_device_train_batch_size" in auto else training_args.per_device_train_batch_size
        return cls(shape, limits, world, target, speed.card(gpu_name()), _tool_levels(training_args), sp_choices,
                   micro, micro_cap, "compile_decoder_layers" in auto, "fp8" in auto, by_speed)  # fmt: skip

    def micro_batches(self, sp: int) -> tuple[int, ...]:
        """The micro batches tried at sequence-parallel size `sp`."""
        if self.micro is not None:
            return (self.micro,)
        rows = memplan.MICRO_BATCHES if sp == 1 else (1,)  # one packed row per micro-batch under SP
        rows = [m for m in rows if not self.micro_cap or m <= self.micro_cap]
        return micro_batches_for(self.target, self.world // sp, rows) or (1,)

    def rank(self, bases: list[memplan.Setting]) -> list:
        """The settings of `bases` (their kernels: FP8 or bf16) with the micro batches and levers that fit, fastest
        first (`sft.plan.fits.ranked_bases`), at the smallest sp where any fits; empty where nothing fits."""
        memory, headroom, host = self.limits
        # a candidate's FP8 and compile flags as the run sets them
        kernels = functools.partial(family_kernels.kept_eager, compile_auto=self.compile_auto,
                                    fp8_auto=self.fp8_auto)  # fmt: skip
        for sp in self.sp_choices:
            fits = fitting.ranked_bases(self.shape, bases, memory, headroom, self.micro_batches(sp),
                                        same_stage=self.same_stage, levels=self.levels, sp_choices=(sp,),
                                        host_memory=host, target=self.target, card=self.card, kernels=kernels,
                                        by_speed=self.by_speed)  # fmt: skip
            if fits:
                return fits
        return []

    def frugal(self, bases: list[memplan.Setting]) -> memplan.Setting:
        """The most frugal setting, for when nothing fits: the last level, the smallest micro batch, the largest sp."""
        sp = max(self.sp_choices)
        return dataclasses.replace(bases[0].with_tools(self.levels[-1]), micro_batch=min(self.micro_batches(sp)),
                                   sp=sp)  # fmt: skip

    def alone(self, bases: list[memplan.Setting]) -> list:
        """`rank` of `bases` on one process without an engine (bf16 weights stepped in place: `without_engine`)."""
        return self.rank(fitting.without_engine(bases))

    def optimizer_states(self, bases: list[memplan.Setting], fits: list) -> tuple[list, list, bool]:
        """`optim: auto`: `bases` with 8-bit Adam moments, their fits, and whether they are taken: their fastest
        fitting setting beats `fits`' (`bases`' own moments) by `EIGHT_BIT_GAIN` (`sft.plan.fits.eight_bit_wins`)."""
        eight_bases = fitting.with_eight_bit_moments(bases)
        eight = self.rank(eight_bases)
        return eight_bases, eight, bool(eight) and fitting.eight_bit_wins(fits, eight)


def alone_wins(fits: list, alone: list) -> bool:
    """Whether one process without an engine (`alone`: its fits, bf16 weights stepped in place) is taken over an
    engine (`fits`: ranked with its optimizer states): its fastest estimated faster, or nothing else fits. Decided only
    where `alone_excluded` gives no reason."""
    return bool(alone) and not (fits and fits[0].time.tokens_per_second >= alone[0].time.tokens_per_second)


def alone_excluded(processes: int, engine_on: bool, unsharded, offload: bool, sp_many: bool, ep: int, peft: bool,
                   by_speed: bool, rounding: bool) -> bool:  # fmt: skip
    """Whether one process without an engine is not weighed against the engine: only what was measured (full
    fine-tuning on a GPU, one process, an engine that has an unsharded form, no offload, sequence or expert
    parallelism, a family the speed model ranks) where that path is what `sft.plan.preflight._precision` takes (bf16
    weights stepped with stochastic rounding: `rounding`)."""
    return any((processes > 1, not engine_on, unsharded is None, offload, sp_many, ep > 1, peft, not by_speed,
                not rounding))  # fmt: skip


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
