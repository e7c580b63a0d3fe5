"""`sft plan` (and `python -m sft.plan`): the memory plan of a setting from the command line, whether it fits, the
fastest setting that does (`--suggest`), the longest row (`--longest`); without a GPU, a table over common GPU sizes.
The equations and the search are `sft.plan.memory`'s.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sft.errors import ConfigError
from sft.model.shapes import ModelShape, load_shape
from sft.plan import memory as plan
from sft.plan.memory import (
    Estimate,
    GiB,
    Setting,
    binding,
    detected_gpu_memory,
    detected_host_memory,
    estimate,
    lever_report,
    longest,
    nothing_fits,
    sp_sizes,
    suggest,
)
from sft.run import logs

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
    args = _parser(prog).parse_args(argv)
    logs.quiet_accelerator_detection()
    try:
        shape = load_shape(args.model)
        setting = _setting(args)
        if args.gpus % setting.sp:
            raise ConfigError(f"--sp {setting.sp} must divide --gpus {args.gpus}.")
        result = estimate(shape, setting)
    except ConfigError as e:
        print(f"sft.plan: {e}", file=sys.stderr)
        return 2
    memory = args.gpu_memory * GiB if args.gpu_memory else detected_gpu_memory()
    host = args.host_memory * GiB if args.host_memory else detected_host_memory()
    print(f"{args.model}: {shape.model_type}, {shape.n_params / 1e9:.3f}B parameters")
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
    parser = argparse.ArgumentParser(prog=prog or "python -m sft.plan", description=plan.__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="config.json, a model directory or a hub id")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs in all (nodes x GPUs per node)")
    parser.add_argument("--gpus-per-node", type=int, help="Defaults to --gpus (one node)")
    parser.add_argument("--zero", default="2", choices=["none", "0", "1", "2", "3"], help="DeepSpeed ZeRO stage")
    parser.add_argument("--offload", default="none", choices=["none", "optimizer", "optimizer+params"])
    parser.add_argument("--sp", type=int, help="Sequence-parallel size (default 1; --suggest tries the smallest fit)")
    parser.add_argument("--micro-batch", type=int, default=1, help="Rows per GPU per forward pass")
    parser.add_argument("--seq-len", type=int, default=2048, help="Tokens per row (max_length)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--offload-checkpoints", action="store_true", help="Checkpointed layer inputs in CPU memory")
    parser.add_argument("--tiled-mlp", action="store_true", help="MLP in tiles along the row (DeepSpeed's TiledMLP)")
    parser.add_argument("--keep-attention", action="store_true", help="Checkpointing keeps attention outputs")
    parser.add_argument("--liger", action="store_true", help="Liger kernels (RMSNorm, SwiGLU, RoPE)")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (with --lora-r)")
    parser.add_argument("--qlora-nested", action="store_true", help="QLoRA constants quantised too (nested quant)")
    parser.add_argument("--fp8", action="store_true", help="Decoder linears in torchao float8 (sft.model.fp8)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--gpu-memory", "--gpu-memory-gib", type=float, help="GiB per GPU, e.g. 24 (default: this machine's GPU)"
    )
    parser.add_argument("--host-memory", type=float, help="GiB of host memory per node (default: this machine's)")
    parser.add_argument("--headroom", type=float, default=0.1, help="Fraction of GPU memory left free")
    parser.add_argument("--suggest", action="store_true", help="Also search for the fastest setting that fits")
    parser.add_argument(
        "--longest", action="store_true", help="Also the longest row that fits (this ZeRO stage, any sp and levers)"
    )
    return parser


def _setting(args) -> Setting:
    """The setting the command line describes."""
    return Setting(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        zero_stage=None if args.zero == "none" else int(args.zero),
        offload_optimizer=args.offload != "none",
        offload_params=args.offload == "optimizer+params",
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
        offload_checkpoints=args.offload_checkpoints,
        tiled_mlp=args.tiled_mlp,
        keep_attention=args.keep_attention,
        liger=args.liger,
        lora_r=args.lora_r,
        lora_dropout=args.lora_dropout,
        qlora=args.qlora,
        qlora_nested=args.qlora_nested,
        dtype_bytes=4 if args.dtype == "float32" else 2,
        sp=args.sp or 1,
        fp8=args.fp8,
    )


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
        sp_choices = (setting.sp,) if args.sp else sp_sizes(shape, args.gpus)
        best = suggest(shape, setting, memory, args.headroom, sp_choices=sp_choices, host_memory=host)
        if best is None:
            print(nothing_fits(setting, shape))
        else:
            print(f"fastest setting that fits: {best.setting.describe()} (peak {best.peak / GiB:.2f} GiB)")
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
