"""`sft plan` (and `python -m sft.plan`): the memory plan of a setting from the command line, whether it fits, the
fastest setting that does (`--suggest`), the longest row (`--longest`); without a GPU, a table over common GPU sizes.
The equations and the search are `sft.plan.memory`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from sft import engines
from sft.core import flags, logs
from sft.core.engine import Sharding
from sft.errors import ConfigError
from sft.model import architectures
from sft.model.shapes import ModelShape, load_config, load_shape, shipped_note
from sft.plan import fits as fitting
from sft.plan import kernels as family_kernels
from sft.plan import memory as plan
from sft.plan import search, speed
from sft.plan.fits import (
    binding,
    detected_gpu_memory,
    detected_host_memory,
    lever_report,
    longest,
    nothing_fits,
    sp_sizes,
    suggest,
)
from sft.plan.memory import Estimate, GiB, estimate
from sft.plan.setting import Setting

logger = logging.getLogger(__name__)


# GPU sizes `--suggest` answers for when there is no GPU here and no --gpu-memory: 24 GB cards, A100 40/80 GB,
# H100 80 GB, H200 141 GB
COMMON_GPU_GIB = (24, 40, 80, 141)


def gpu_size_table(shape: ModelShape, setting: Setting, result: Estimate, args, host: float) -> str:
    """Whether the setting fits, and the fastest that does, on each of the common GPU sizes (one table)."""
    sp_choices = (setting.sp,) if args.sp else sp_sizes(shape, args.gpus)
    lines = [
        f"No GPU here and no --gpu-memory: the common GPU sizes (headroom {args.headroom:.0%}).",
        "| GPU GiB | as given | fastest setting that fits | its peak GiB |",
        "| --- | --- | --- | --- |",
    ]
    if args.longest:
        lines = [
            f"No GPU here and no --gpu-memory: the longest row on the common GPU sizes (headroom {args.headroom:.0%}, "
            f"host {host / GiB:.0f} GiB per node).",
            "| GPU GiB | longest row (tokens) | setting | peak GiB | host GiB | binding |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for gib in COMMON_GPU_GIB:
            top = longest(shape, setting, gib * GiB, args.headroom, sp_choices, host_memory=host)
            if top is None:
                lines.append(f"| {gib} | none | - | - | - | - |")
                continue
            binds = binding(shape, top, gib * GiB, args.headroom, host)
            lines.append(f"| {gib} | {top.setting.seq_len:,} | {top.setting.describe()} | {top.peak / GiB:.2f} | "
                         f"{top.host_pinned / GiB:.2f} | {binds} |")  # fmt: skip
        return "\n".join(lines)
    for gib in COMMON_GPU_GIB:
        fits = "fits" if result.fits(gib * GiB, args.headroom, host) else "does NOT fit"
        best = suggest(shape, setting, gib * GiB, args.headroom, sp_choices=sp_choices, host_memory=host)
        if best is None:
            lines.append(f"| {gib} | {fits} | nothing fits | - |")
        else:
            lines.append(f"| {gib} | {fits} | {best.setting.describe()} | {best.peak / GiB:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    logs.quiet_accelerator_detection()
    try:
        model_config = load_config(args.model, False)
        frozen_vision = architectures.is_vision(model_config) and not args.train_vision_tower
        shape = load_shape(args.model, False, model_config, frozen_vision=frozen_vision)
        setting = _setting(args, _kernels(args, model_config, shape))
        args.arch = architectures.of(model_config)
        args.by_speed = args.arch.kernel("speed").on
        if args.gpus % setting.sp:
            raise ConfigError(f"--sp {setting.sp} must divide --gpus {args.gpus}.")
        result = estimate(shape, setting)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    memory = args.gpu_memory * GiB if args.gpu_memory else detected_gpu_memory()
    host = args.host_memory * GiB if args.host_memory else detected_host_memory()
    print(
        f"{args.model}: {shape.model_type}, {shape.n_params / 1e9:.3f}B parameters"
        + (f" ({shape.frozen_params / 1e9:.3f}B in the frozen vision encoder)" if shape.frozen_params else "")
    )
    note = None if Path(args.model).exists() else shipped_note(args.model)
    if note:
        print(f"Planned as a text model: {note} (give the checkpoint's config.json or folder to plan it whole).")
    print(setting.describe())
    print(result.table())
    if memory is None and (args.suggest or args.longest):
        print(gpu_size_table(shape, setting, result, args, host))
    elif memory is None:
        print("No GPU here and no --gpu-memory: say the GPU's GiB (--gpu-memory 80), or add --suggest for a table of "
              f"{', '.join(f'{g:g}' for g in COMMON_GPU_GIB)} GiB GPUs.")  # fmt: skip
    else:
        return _fit_report(args, shape, setting, result, memory, host)
    return 0


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = flags.Parser(prog=prog or "python -m sft.plan", description=plan.__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="config.json, a model directory or a hub id")
    parser.add_argument("--gpus", type=flags.whole(1), default=1, help="GPUs in all (nodes x GPUs per node)")
    parser.add_argument("--gpus-per-node", type=flags.whole(1), help="Defaults to --gpus (one node)")
    parser.add_argument("--zero", default="2", choices=["none", "0", "1", "2", "3"], help="DeepSpeed ZeRO stage")
    parser.add_argument("--engine", default=engines.NAMES[0], choices=engines.NAMES,
                        help="fsdp2: PyTorch's FSDP2 in ZeRO-3's layout (--zero 3; its memory planned as ZeRO-3's, "
                             "its speed without ZeRO-3's per-layer hooks)")  # fmt: skip
    parser.add_argument("--offload", default="none", choices=["none", "optimizer", "optimizer+params"])
    parser.add_argument(
        "--sp", type=flags.whole(1), help="Sequence-parallel size (default 1; --suggest tries the smallest fit)"
    )
    parser.add_argument("--micro-batch", type=flags.whole(1), default=1, help="Rows per GPU per forward pass")
    parser.add_argument("--seq-len", type=flags.whole(1), default=2048, help="Tokens per row (max_length)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--offload-checkpoints", action="store_true", help="Checkpointed layer inputs in CPU memory")
    parser.add_argument("--tiled-mlp", action="store_true", help="MLP in tiles along the row (DeepSpeed's TiledMLP)")
    parser.add_argument("--keep-attention", action="store_true", help="Checkpointing keeps attention outputs")
    parser.add_argument("--liger", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                        help="Liger kernels (RMSNorm, SwiGLU, RoPE, the fused loss); auto: as `sft train` decides "
                             "for the family on a GPU")  # fmt: skip
    parser.add_argument(
        "--lora-r", type=flags.whole(0), default=0, help="LoRA rank on all linear layers (0: full fine-tuning)"
    )
    parser.add_argument("--lora-dropout", type=flags.positive(below=1, zero=True), default=0.0)
    parser.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (with --lora-r)")
    parser.add_argument("--train-vision-tower", action="store_true",
                        help="A vision-language model's encoder trains too (as `train_vision_tower: true`); by "
                        "default it is frozen, as in a run")  # fmt: skip
    parser.add_argument("--qlora-nested", action="store_true", help="QLoRA constants quantised too (nested quant)")
    _add_kernel_and_search_flags(parser)
    return parser


def _add_kernel_and_search_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `_parser` for FP8, the optimizer, the card and its memory, and what the search reports."""
    parser.add_argument("--fp8", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                        help="Decoder linears in torchao float8 (sft.model.fp8), compiled; auto: as `sft train` "
                             "decides for the family on an H100/H200")  # fmt: skip
    parser.add_argument("--optim", default="auto",
                        help="The training argument `optim`: adamw_torch_8bit (torchao's AdamW8bit) keeps Adam's "
                             "moments in 8-bit blocks; auto: --suggest takes them as `sft train` does, where the "
                             "fastest setting that fits with them is 1.1x as fast")  # fmt: skip
    parser.add_argument(
        "--global-batch", type=flags.whole(1), help="Rows per optimizer step: the speed model's accumulation"
    )
    parser.add_argument("--gpu-name", help="The card whose speed constants rank the settings (default: this "
                                           f"machine's GPU, else {speed.REFERENCE_CARD}; sft.plan.speed)")  # fmt: skip
    parser.add_argument("--top", type=flags.whole(1), default=5, help="Settings --suggest lists, fastest first")
    parser.add_argument("--same-stage", action="store_true",
                        help="--suggest within --zero's stage and offload, as `sft train` does with its DeepSpeed "
                             "config (default: the lowest stage that fits)")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--gpu-memory",
        "--gpu-memory-gib",
        type=flags.positive(),
        help="GiB per GPU, e.g. 24 (default: this machine's GPU)",
    )
    parser.add_argument(
        "--host-memory", type=flags.positive(), help="GiB of host memory per node (default: this machine's)"
    )
    parser.add_argument(
        "--headroom", type=flags.positive(below=1, zero=True), default=0.1, help="Fraction of GPU memory left free"
    )
    parser.add_argument("--suggest", action="store_true", help="Also search for the fastest setting that fits")
    parser.add_argument(
        "--longest", action="store_true", help="Also the longest row that fits (this ZeRO stage, any sp and levers)"
    )


def _kernels(args, model_config, shape: ModelShape) -> tuple[bool, bool, bool]:
    """(Liger, FP8, compiled layers) as the flags give them, `auto` as `sft train` decides them for the family on the
    card planned for (`sft.plan.kernels.for_card`)."""
    hooks = args.zero == "3" and engines.spec(args.engine).traits.host_hooks
    arch = architectures.of(model_config)
    return family_kernels.for_card(arch, args.liger, args.fp8, hooks, args.gpu_name, shape.hidden, bool(args.lora_r))


def _ranking_table(fits: list, card: speed.Card, by_speed: bool = True) -> str:
    """The settings that fit, fastest first (or, for a family the speed model was not fitted on, in the plan's rule's
    order), with the speed model's estimate and the memory plan's peak."""
    order = (
        "fastest first"
        if by_speed
        else "in the plan's order (the speed model is not fitted on this family: no estimate)"
    )
    lines = [
        f"speed model: {card.name} ({card.source}); {order}",
        "| # | setting | est. tokens/s/GPU | est. MFU | step s | peak GiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(fits, 1):
        s = r.estimate.setting
        zero = s.sharding.label
        zero = f"{s.traits.label} ({zero}'s layout)" if s.traits.shards_weights_always else zero
        sp = f", sp {s.sp}" if s.sp > 1 else ""
        speed_cells = (f"{r.time.tokens_per_second:,.0f} | {r.time.mfu:.1%} | {r.time.seconds:.2f}" if by_speed
                       else "- | - | -")  # no estimate where the constants were not fitted  # fmt: skip
        lines.append(f"| {i} | {zero}{sp}, {s.levers_and_micro()} | {speed_cells} | {r.estimate.peak / GiB:.2f} |")
    return "\n".join(lines)


def _setting(args, kernels: tuple[bool, ...] = (False, False, False)) -> Setting:
    """The setting the command line describes (with the kernel flags of `_kernels`)."""
    liger, fp8_on, compiled = kernels[:3]
    fields = {
        "per_device_train_batch_size": args.micro_batch,
        "max_length": args.seq_len,
        "activation_checkpointing": args.activation_checkpointing,
        "offload_checkpoints": args.offload_checkpoints,
        "tiled_mlp": args.tiled_mlp,
        "keep_attention_outputs": args.keep_attention,
        "use_liger_kernel": liger,
        "use_peft": bool(args.lora_r or args.qlora),
        "lora_r": args.lora_r,
        "lora_dropout": args.lora_dropout,
        "load_in_4bit": args.qlora,
        "use_bnb_nested_quant": args.qlora_nested,
        "bf16": args.dtype != "float32",
        "fp8": fp8_on,
        "compile_decoder_layers": compiled,
        "optim": args.optim,
    }
    layout = Sharding(None if args.zero == "none" else int(args.zero), args.offload != "none",
                      args.offload == "optimizer+params")  # fmt: skip
    setting = plan.setting_of(fields, layout, args.engine, args.gpus, args.gpus_per_node, args.sp or 1)
    if args.zero == "none" and args.dtype == "bfloat16" and not args.lora_r:
        setting = search.without_master(setting, args.optim)
    if not args.global_batch:
        return setting
    return dataclasses.replace(setting, accumulation=fitting.accumulation_for(setting, args.global_batch))


def _suggest(args, shape, setting: Setting, memory: float, host: float) -> None:
    """`--suggest`: the fastest settings that fit, ranked by the plan's search (`sft.plan.search.Search`) as `sft
    train` ranks its `auto` fields (micro batch, levers, sp, `optim`, `engine: auto`'s run without an engine); the
    flags as given are the fields that are not `auto`."""
    card = speed.card(args.gpu_name or search.gpu_name())
    sp_choices = (setting.sp,) if args.sp else sp_sizes(shape, args.gpus)
    found = search.Search(shape, (memory, args.headroom, host), args.gpus, args.global_batch, card,
                          plan.ACTIVATION_LEVELS, sp_choices, fp8_auto=args.fp8 == "auto", by_speed=args.by_speed,
                          same_stage=args.same_stage)  # fmt: skip
    bases = search.card_bases(args.arch, setting, args.fp8 == "auto", args.liger == "auto", args.by_speed)
    fits = found.rank(bases)
    if args.optim == "auto" and args.by_speed and fitting.eight_bit_candidate(setting):
        _, eight, taken = found.optimizer_states(bases, fits)
        if eight:
            fp32_speed = f"{fits[0].time.tokens_per_second:,.0f}" if fits else "nothing fits"
            print(f"optim auto -> {plan.EIGHT_BIT_OPTIM if taken else 'fp32 AdamW'}: with 8-bit Adam moments "
                  f"the fastest estimates {eight[0].time.tokens_per_second:,.0f} tokens/s/GPU, with fp32 moments "
                  f"{fp32_speed} (8-bit taken at {plan.EIGHT_BIT_GAIN}x or more)")  # fmt: skip
        fits = eight if taken else fits
    rounding = args.dtype == "bfloat16" and args.optim == "auto"
    if not search.alone_excluded(args.gpus, setting.sharding.engine, engines.spec(args.engine).unsharded,
                                 args.offload != "none", setting.sp > 1, 1, bool(args.lora_r), args.by_speed,
                                 rounding):  # fmt: skip
        alone = found.alone(bases)
        if search.alone_wins(fits, alone):
            against = f"{fits[0].time.tokens_per_second:,.0f}" if fits else "nothing fitting"
            print(f"engine auto -> none (one GPU, as `sft train`'s `engine: auto` takes it): bf16 weights with 8-bit "
                  f"AdamW and stochastic rounding estimate {alone[0].time.tokens_per_second:,.0f} tokens/s/GPU, with "
                  f"DeepSpeed {against}")  # fmt: skip
            fits = alone
    if not fits:
        print(nothing_fits(setting, shape, memory, args.headroom, host))
        return
    best = fits[0].estimate
    print(f"fastest setting that fits: {best.setting.describe()} (peak {best.peak / GiB:.2f} GiB)")
    print(_ranking_table(fits[: args.top], card, args.by_speed))


def _fit_report(args, shape, setting: Setting, result, memory: float, host: float) -> int:
    """Whether the setting fits this GPU and host; with --suggest (or when it does not fit) the fastest setting that
    does, with --longest the longest row. Returns the exit code: 0 fits, 1 does not."""
    usable = memory * (1 - args.headroom)
    fits = result.fits(memory, args.headroom, host)
    rc = 0 if fits else 1
    print(
        f"{'fits' if fits else 'does NOT fit'}: {result.peak / GiB:.2f} GiB of {usable / GiB:.2f} GiB usable "
        f"({memory / GiB:.1f} GiB GPU, headroom {args.headroom:.0%}); host {result.host_pinned / GiB:.2f} GiB of "
        f"{host * (1 - args.headroom) / GiB:.2f} GiB usable per node"
    )
    if args.suggest or not fits:
        _suggest(args, shape, setting, memory, host)
    if args.longest:
        sp_choices = (setting.sp,) if args.sp else sp_sizes(shape, args.gpus)
        top = longest(shape, setting, memory, args.headroom, sp_choices, host_memory=host)
        if top is None:
            print("longest row that fits: none (not even 1,024 tokens)")
        else:
            print(f"longest row that fits: {top.setting.seq_len:,} tokens with {top.setting.describe()} "
                  f"(peak {top.peak / GiB:.2f} GiB)")  # fmt: skip
            binds = binding(shape, top, memory, args.headroom, host)
            print(lever_report(top, setting, memory, args.headroom, host, binds))
    return rc
