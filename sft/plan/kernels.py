"""The kernels a run trains with, decided per family: Liger, FP8, compiled decoder layers and (for a mixture of
experts) sft's experts implementation, each with the reason the log gives, and the kernel settings the plan's ranking
weighs (`kernel_bases`: FP8 and Liger as candidates where `auto`).

What was measured per family lives in `sft.model.architectures.KERNELS` (`Architecture.liger_on`, `.compiled_on`,
`.compiled_bf16`); this module turns a run's `auto` fields and this machine (its GPU, torchao) into on or off.
`sft train`'s plan (`sft.plan.preflight`, its kernels and memory steps) and `sft plan` (`sft.plan.cli`, for the card it
plans for) both decide here.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from sft import engines
from sft.core.engine import Sharding
from sft.model import architectures, experts, fp8
from sft.plan import fits as fitting
from sft.plan import memory as memplan

logger = logging.getLogger(__name__)


def run_bases(training_args, arch, base: memplan.Setting) -> list[memplan.Setting]:
    """`kernel_bases` for this run's `auto` fields on this machine."""
    auto = training_args.auto_settings
    liger_auto = "use_liger_kernel" in auto and bool(training_args.use_liger_kernel)  # auto, and Liger can run here
    return kernel_bases(arch, base, "fp8" in auto, "compile_decoder_layers" in auto, liger_auto, on_gpu())


def kernel_bases(arch, base: memplan.Setting, fp8_auto: bool, compile_auto: bool, liger_auto: bool, on_gpu: bool):
    """The kernel settings to rank: `base`, and where `fp8: auto` turned FP8 on, bf16 beside it (compiled where the
    family's compiled bf16 is good on a GPU); where `use_liger_kernel: auto` and Liger was measured exact on the
    family, each with Liger the other way: FP8 and Liger are candidates, not givens (Liger's fused loss frees the
    logits, which may fit a faster setting where it is no faster at one micro batch). `sft train`'s plan and `sft
    plan --suggest` both rank these."""
    bases = [base]
    if fp8_auto and base.fp8:
        compile_bf16 = arch.compiled_bf16(on_gpu) if compile_auto else base.compiled
        bases.append(dataclasses.replace(base, fp8=False, compiled=compile_bf16))
    # Liger beside these layers (never a compiled one where the pair was measured wrong)
    beside = not (any(b.compiled for b in bases) and arch.liger_breaks_compile())
    if liger_auto and arch.liger_exact and beside:
        return fitting.with_liger_candidates(bases)
    return bases


def decide(training_args, model_args, arch, engine) -> tuple[dict, dict]:
    """Liger, FP8, compiled layers (and sft's experts for a MoE) decided for the family, each with its reason,
    logged in one line; returns (kernels, changes to the training arguments). Decided here, applied in the one
    rebuild at the end (a rebuild would turn every `auto` into its placeholder)."""
    liger_on = family_liger(training_args, arch)
    changes = {"use_liger_kernel": liger_on} if liger_on != training_args.use_liger_kernel else {}
    fp8_decision = resolve_fp8(training_args, model_args, engine, arch)
    compile_on = compiled(training_args, arch, fp8_decision.on)
    if "compile_decoder_layers" in training_args.auto_settings:
        changes["compile_decoder_layers"] = compile_on
    kernels = {
        "Liger": architectures.Kernel(liger_on, liger_reason(training_args, arch)),
        "FP8": architectures.Kernel(fp8_decision.on, fp8_decision.reason),
        "compiled layers": architectures.Kernel(
            bool(compile_on), compile_reason(training_args, arch, fp8_decision.on)
        ),
    }
    if arch.is_moe:
        name, reason = experts.decide(arch, training_args.model_init_kwargs)
        kernels["sft experts"] = architectures.Kernel(name == experts.NAME, reason)
    architectures.log_kernels(arch, kernels, training_args.router_aux_loss_coef)
    return kernels, changes


def ranked_changes(kernels: dict, changes: dict, optimizer: dict, liger: bool | None) -> None:
    """What the plan set: the optimizer (and its arguments) where `optim: auto` chose it, Liger the other way from the
    family's rule where the fastest setting that fits has it so (logged)."""
    changes.update({key: value for key, value in optimizer.items() if value is not None})
    if liger is None:
        return
    why = ("its fused loss frees the logits for a faster setting than any that fits without it" if liger
           else "the fastest setting that fits does as well without it, and plain bf16 measured faster")  # fmt: skip
    kernels["Liger"] = architectures.Kernel(liger, f"the speed model's ranking above: {why}")
    changes["use_liger_kernel"] = liger
    logger.info("Liger: %s after all (%s)", "on" if liger else "off", kernels["Liger"].reason)


def bf16_faster(training_args, kernels: dict, changes: dict, compiled: bool) -> None:
    """FP8 off where `auto` turned it on and the speed model found the fastest setting that fits in bf16 (`compiled`:
    its layers compiled or not); logged."""
    kernels["FP8"] = architectures.Kernel(False, "the speed model estimates bf16 faster for what fits (the ranking "
                                                 "above; FP8 measured slower where memory binds)")  # fmt: skip
    changes["fp8"] = False
    if "compile_decoder_layers" in training_args.auto_settings:
        kernels["compiled layers"] = architectures.Kernel(compiled, "as the speed model's fastest setting")
        changes["compile_decoder_layers"] = compiled
    logger.info("FP8: off after all: %s", kernels["FP8"].reason)


def keep_attention_eager(training_args, kernels: dict, changes: dict) -> None:
    """With attention outputs kept, compiled layers (and FP8 with them, where `auto`) off where `auto` turned them on:
    a compiled layer runs inside the checkpoint as one piece, where the selection of what to keep does not reach
    (measured on 1 x H100, 1B shape, 131,072 tokens, 11,458 tokens/s with attention kept and layers eager in bf16,
    9,490 compiled with FP8: benchmarks/results/long_context_1gpu)."""
    auto = training_args.auto_settings
    if not (kernels["compiled layers"].on and "compile_decoder_layers" in auto):
        return
    changes["compile_decoder_layers"] = False
    kernels["compiled layers"] = architectures.Kernel(False, "attention outputs kept")
    fp8_was = kernels["FP8"].on
    if fp8_was and "fp8" in auto:  # float8 is fast only compiled (`sft.model.fp8`)
        kernels["FP8"] = architectures.Kernel(False, "attention outputs kept: layers not compiled")
    with_fp8 = ", and FP8 with them" if fp8_was and not kernels["FP8"].on else ""
    logger.info("Activation checkpointing keeps attention outputs: compiled layers off%s (the selection does not "
                "reach inside a compiled layer)", with_fp8)  # fmt: skip


def fp8_changes(training_args, fp8_on: bool, sp: int, changes: dict) -> None:
    if fp8_on != training_args.fp8 or "fp8" in training_args.auto_settings:
        changes["fp8"] = fp8_on
    if fp8_on and sp == 1:  # float8 matmuls need the tokens of a micro-batch in multiples of 16
        multiple = math.lcm(training_args.pad_to_multiple_of or 1, fp8.token_multiple(fp8_on))
        if multiple != training_args.pad_to_multiple_of:
            changes["pad_to_multiple_of"] = multiple


def liger_on(training_args, arch: architectures.Architecture) -> bool:
    """Liger as asked, except `auto` on a family where it was not measured good (`Architecture.liger_on`)."""
    return arch.liger_on(bool(training_args.use_liger_kernel), "use_liger_kernel" in training_args.auto_settings)


def compiled(training_args, arch: architectures.Architecture, fp8_on: bool) -> bool:
    """Compiled decoder layers as asked or `auto` (`Architecture.compiled_on`), on this machine's GPU or not."""
    auto = "compile_decoder_layers" in training_args.auto_settings
    return arch.compiled_on(bool(training_args.compile_decoder_layers), auto, liger_on(training_args, arch), fp8_on,
                            on_gpu())  # fmt: skip


def family_liger(training_args, arch: architectures.Architecture) -> bool:
    """Whether Liger is on: left unset, off for a family where it was not measured good
    (`sft.model.architectures.KERNELS`). A fast path asked for by name on such a family is kept, with a warning."""
    liger = arch.kernel("liger")
    on = liger_on(training_args, arch)
    if training_args.use_liger_kernel and not liger.on and "use_liger_kernel" not in training_args.auto_settings:
        logger.warning("use_liger_kernel: true on %s, kept as asked, though %s", arch.family, liger.reason)
    # compiled layers: the family's bf16 measurement where there is one (on: nothing to warn of), else the FP8 one
    compiled = arch.kernels.get("compile_bf16") or arch.kernel("compile")
    for key, kernel in (("fp8", arch.kernel("fp8")), ("compile_decoder_layers", compiled)):
        if getattr(training_args, key) and key not in training_args.auto_settings and not kernel.on:
            logger.warning("%s: true on %s, kept as asked, though %s", key, arch.family, kernel.reason)
    return on


def liger_reason(training_args, arch: architectures.Architecture) -> str:
    if "use_liger_kernel" not in training_args.auto_settings:
        return f"use_liger_kernel: {str(bool(training_args.use_liger_kernel)).lower()}"
    kernel = arch.kernel("liger")
    return kernel.reason if training_args.use_liger_kernel or not kernel.on else "no CUDA GPU or liger-kernel"


def on_gpu() -> bool:
    """Whether this run has a GPU: the measurements of compiled bf16 layers hold there (on the CPU Inductor's compile
    costs more than a test-sized run)."""
    return torch.cuda.is_available()


def compile_reason(training_args, arch: architectures.Architecture, fp8_on: bool) -> str:
    if "compile_decoder_layers" not in training_args.auto_settings:
        return f"compile_decoder_layers: {str(bool(training_args.compile_decoder_layers)).lower()}"
    if liger_on(training_args, arch) and (wrong := arch.liger_breaks_compile()):
        return f"off beside Liger: {wrong}"
    if arch.compiled_bf16(on_gpu()) and not (fp8_on and arch.kernel("compile").on):
        return arch.kernel("compile_bf16").reason
    if not fp8_on:
        measured = arch.kernels.get("compile_bf16")  # measured for this family: that says why
        if measured is None:
            return "compile_decoder_layers: auto compiles only with FP8"
        return f"on a GPU only ({measured.reason})" if measured.on else measured.reason
    return arch.kernel("compile").reason


def fp8_decision(training_args, model_args, arch, engine: str, sharding: Sharding) -> fp8.Decision:
    """`fp8` resolved by `sft.model.fp8` for this engine and its layout (`true` refused where it cannot run); `auto`
    by `fp8_auto` on this machine."""
    traits = engines.spec(engine).traits
    under_zero3, use_peft = sharding.weights and traits.host_hooks, bool(model_args.use_peft)
    if "fp8" not in training_args.auto_settings:
        return fp8.resolve(bool(training_args.fp8), False, arch.hidden, use_peft, under_zero3, traits.layer_units)
    return fp8_auto(arch, fp8.fp8_gpu(), fp8.torchao_installed(), arch.hidden, use_peft, under_zero3,
                    traits.layer_units)  # fmt: skip


def fp8_auto(arch, gpu: str | None, has_torchao: bool, hidden: int, use_peft: bool, under_zero3: bool,
             fsdp2: bool = False) -> fp8.Decision:  # fmt: skip
    """`fp8: auto` for a run on `gpu` (`sft.model.fp8.decide_auto`), and only where the family was measured good.
    `sft train`'s plan (this machine) and `sft plan` (the card it plans for) both decide it here."""
    decision = fp8.decide_auto(gpu, has_torchao, hidden, use_peft, under_zero3, fsdp2)
    if decision.on and not arch.kernel("fp8").on:
        return fp8.Decision(False, arch.kernel("fp8").reason)
    return decision


def resolve_fp8(training_args, model_args, engine, arch: architectures.Architecture) -> fp8.Decision:
    """`fp8` resolved by `sft.model.fp8` (`true` refused where it cannot run; `auto` also needs the family measured
    good), the choice and its reason logged."""
    decision = fp8_decision(training_args, model_args, arch, engine.name, engine.sharding)
    if decision.on:
        recipe = training_args.fp8_recipe
        logger.info("FP8: on, %s scaling (%s); MFU stays against the dense bf16 peak", recipe, decision.reason)
        if engine.sharding.weights and engine.traits.host_hooks:
            logger.warning(fp8.ZERO3_SLOWER)
    else:
        logger.info("FP8: off (%s)", decision.reason)
    return decision


def kept_eager(setting: memplan.Setting, compile_auto: bool, fp8_auto: bool) -> memplan.Setting:
    """A candidate's FP8 and compile flags as a run sets them: with attention outputs kept, compiled layers (and FP8
    with them where `fp8_auto`) off where compiled layers are `auto` (`keep_attention_eager`)."""
    return setting.attention_kept_eager(fp8_auto=fp8_auto) if compile_auto else setting


def for_card(arch, liger: str, fp8_asked: str, under_zero3: bool, gpu: str | None, hidden: int, use_peft: bool):
    """(Liger, FP8, compiled layers) for `sft plan`'s flags (`on`, `off`, `auto`) on the card it plans for (`gpu`;
    torchao taken as installed there): `auto` as `sft train` decides it on that GPU."""
    liger_on = arch.liger_on(liger != "off", liger == "auto")
    if fp8_asked == "auto":
        fp8_on = fp8_auto(arch, gpu or "the planned GPU", True, hidden, use_peft, under_zero3).on
    else:
        fp8_on = fp8_asked == "on"
    return liger_on, fp8_on, arch.compiled_on(False, True, liger_on, fp8_on, on_gpu=True)
