"""What fits: the memory of the GPU and host there is (`detected_gpu_memory`, `detected_host_memory`, a run's cap
`cap_gpu_memory`), the candidates a base setting gives (other ZeRO stages `ladder`, Liger and the optimizer's states
either way, the run without an engine), the search over the memory levers, micro batches and sequence-parallel sizes
for those that fit, fastest first by the speed model (`ranked`, `ranked_bases`; `suggest` the first), the longest row
that fits (`longest`, with what `binding` stops a longer one), and what to say when nothing fits (`nothing_fits`).
Each candidate is sized by `sft.plan.memory.estimate`; a run's search over its `auto` fields is `sft.plan.search`'s.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from sft.errors import ConfigError
from sft.model import fp8
from sft.model.shapes import ModelShape
from sft.plan import speed
from sft.plan.levers import ACTIVATION_LEVELS, Tools, levels
from sft.plan.memory import EIGHT_BIT_GAIN, EIGHT_BIT_OPTIM, MICRO_BATCHES, Estimate, GiB, estimate, optimizer_groups
from sft.plan.setting import Setting, moment_bytes_of
from sft.plan.speed import StepTime


def eight_bit_candidate(s: Setting) -> bool:
    """Whether `optim: auto` may give `s` 8-bit Adam moments: full fine-tuning (LoRA's states are small) under
    DeepSpeed's ZeRO with the optimizer on the GPU (DeepSpeed's CPU Adam keeps fp32 moments), torchao installed. Not
    under FSDP2: it steps each parameter apart, and its memory with 8-bit Adam was not measured."""
    return (not s.lora_r and s.sharding.optimizer and not s.offload_optimizer and s.traits.eight_bit_moments
            and fp8.torchao_installed())  # fmt: skip


def with_liger_candidates(bases: list[Setting]) -> list[Setting]:
    """`bases` and each with Liger the other way (`use_liger_kernel: auto` on a family where Liger was measured exact:
    what its fused loss frees may buy a faster setting), Liger's first: ahead where equally fast (it frees memory)."""
    flipped = [dataclasses.replace(b, liger=not b.liger) for b in bases]
    return flipped + bases if flipped[0].liger else bases + flipped


def without_engine(bases: list[Setting]) -> list[Setting]:
    """`bases` as one process runs them without DeepSpeed under `optim: auto` (`engine: auto`'s other candidate): bf16
    weights stepped in place by torchao's 8-bit AdamW with stochastic rounding, no fp32 master copy."""
    moments = moment_bytes_of(EIGHT_BIT_OPTIM)
    return [dataclasses.replace(b, zero_stage=None, moment_bytes=moments).stepped_in_place() for b in bases]


def with_eight_bit_moments(bases: list[Setting]) -> list[Setting]:
    """`bases` with torchao's 8-bit Adam moments (`optim: auto`'s other candidates)."""
    return [dataclasses.replace(b, moment_bytes=moment_bytes_of(EIGHT_BIT_OPTIM)) for b in bases]


def eight_bit_wins(fp32: list[Ranked], eight: list[Ranked]) -> bool:
    """`optim: auto`'s rule, given the settings that fit with fp32 and with 8-bit moments, each fastest first: 8-bit
    where its fastest keeps the optimizer on the GPU and is `EIGHT_BIT_GAIN` x as fast as fp32's (or only it fits)."""
    if not eight or eight[0].estimate.setting.offload_optimizer:
        return False
    return not fp32 or eight[0].time.tokens_per_second >= EIGHT_BIT_GAIN * fp32[0].time.tokens_per_second


def ladder(base: Setting) -> list[Setting]:
    """Settings from fastest to most memory-frugal: a base without DeepSpeed as it is (bf16 weights stepped in place
    hold the fewest bytes a weight), ZeRO-0..3, then CPU offload of the optimizer, then parameters. DeepSpeed keeps an
    fp32 master copy and fp32 moments where the base stepped bf16 weights in place with torch's."""
    own = [base] if not base.sharding.engine else []
    base = base.with_master_copy()
    plain = [dataclasses.replace(base, zero_stage=z, offload_optimizer=False, offload_params=False) for z in range(4)]
    offloaded = [
        dataclasses.replace(base, zero_stage=2, offload_optimizer=True, offload_params=False),
        dataclasses.replace(base, zero_stage=3, offload_optimizer=True, offload_params=False),
        dataclasses.replace(base, zero_stage=3, offload_optimizer=True, offload_params=True),
    ]
    return own + plain + offloaded


def suggest(
    shape: ModelShape,
    base: Setting,
    gpu_memory: float,
    headroom: float = 0.1,
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    candidates: list[Setting] | None = None,
    levels: tuple[Tools, ...] = ACTIVATION_LEVELS,
    sp_choices: tuple[int, ...] | None = None,
    host_memory: float | None = None,
    **ranking,
) -> Estimate | None:
    """The fastest setting that fits (`ranked`'s first, with its `ranking` arguments), None if nothing fits."""
    fits = ranked(shape, base, gpu_memory, headroom, micro_batches, candidates, levels, sp_choices, host_memory,
                  **ranking)  # fmt: skip
    return fits[0].estimate if fits else None


class Ranked(NamedTuple):
    estimate: Estimate
    time: StepTime


def ranked(
    shape: ModelShape,
    base: Setting,
    gpu_memory: float,
    headroom: float = 0.1,
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    candidates: list[Setting] | None = None,
    levels: tuple[Tools, ...] = ACTIVATION_LEVELS,
    sp_choices: tuple[int, ...] | None = None,
    host_memory: float | None = None,
    target: int | None = None,
    card: speed.Card | None = None,
    kernels=None,
    by_speed: bool = True,
) -> list[Ranked]:
    """The settings that fit, fastest first by the speed model (`sft.plan.speed`).

    The search goes as far as something fits: the smallest sequence-parallel size of `sp_choices` (default: the
    base's), the first of `candidates` (default: `ladder(base)`: ZeRO-0..3, then offload; sft's measurements put a
    lower stage ahead wherever it fits, and the sweep has not calibrated the collectives of a higher one), then the
    levers. Levers that the sweep measured (none, checkpointing, checkpointing that keeps attention outputs:
    `Tools.ranked`) are ranked by the speed model with every micro batch of `micro_batches`; only where none fits
    do the others (offloaded checkpoints, the tiled MLP, ZeRO's offload) come on, in `levels`' order, each with the
    largest micro batch that fits. With `target` (rows per optimizer step) a candidate accumulates `target /
    (data-parallel size x micro batch)` micro-batches; `kernels(setting)` gives a candidate's FP8 and compile flags
    where its levers change them (attention outputs kept run eager)."""
    card = card or speed.card()
    fast = [t for t in levels if t.ranked]
    rest = [t for t in levels if not t.ranked]

    def fitting(candidate: Setting, sp: int, tools: Tools, ratio: float):
        levered = lever_setting(candidate, tools, ratio)
        for micro in sorted(micro_batches, reverse=True) if levered is not None else ():
            setting = dataclasses.replace(levered, micro_batch=micro, sp=sp)
            if target:
                setting = dataclasses.replace(setting, accumulation=accumulation_for(setting, target))
            setting = kernels(setting) if kernels else setting
            e = estimate(shape, setting)
            if e.fits(gpu_memory, headroom, host_memory):
                yield Ranked(e, speed.step_time(shape, setting, card))

    for sp in sorted(sp_choices or (base.sp,)):
        for candidate in ladder(base) if candidates is None else candidates:
            fits = [r for tools in fast for ratio in offload_ratios(shape, candidate, tools)
                    for r in fitting(candidate, sp, tools, ratio)]  # fmt: skip
            if fits:  # fastest first; among equals the earlier (fewer levers, larger micro batch) stays ahead
                return sorted(fits, key=lambda r: -r.time.tokens_per_second) if by_speed else fits
            for tools in rest:
                for ratio in offload_ratios(shape, candidate, tools):
                    first = next(fitting(candidate, sp, tools, ratio), None)
                    if first is not None:
                        return [first]
    return []


def ranked_bases(
    shape: ModelShape,
    bases: list[Setting],
    gpu_memory: float,
    headroom: float = 0.1,
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    same_stage: bool = True,
    **kwargs,
) -> list[Ranked]:
    """`ranked` over several bases that differ in their kernels (FP8 and bf16 where FP8 is `auto`: a candidate, not a
    given), each within its own ZeRO stage (`same_stage`) or its ladder; one list, fastest first, a setting reached
    from two bases once (attention outputs kept run in bf16 from either). `sft train`'s `auto` and `sft plan
    --suggest` both rank through here."""
    fits = [r for base in bases
            for r in ranked(shape, base, gpu_memory, headroom, micro_batches, [base] if same_stage else None,
                            **kwargs)]  # fmt: skip
    if not kwargs.get("by_speed", True):
        return fits
    unique: dict = {}
    for r in fits:
        unique.setdefault(r.estimate.setting, r)
    # fastest first; among equals the earlier (fewer levers, larger micro batch) stays ahead
    return sorted(unique.values(), key=lambda r: -r.time.tokens_per_second)


def first_fit(shape: ModelShape, base: Setting, gpu_memory: float, headroom: float, levels: tuple[Tools, ...],
              sp_choices: tuple[int, ...], host_memory: float | None = None) -> Estimate | None:  # fmt: skip
    """The first setting in `levels`' order that fits, one row per micro-batch (what the search for the longest row
    asks: whether anything fits, fast)."""
    for sp in sorted(sp_choices):
        for tools in levels:
            for ratio in offload_ratios(shape, base, tools):
                levered = lever_setting(base, tools, ratio)
                if levered is None:
                    continue
                e = estimate(shape, dataclasses.replace(levered, micro_batch=1, sp=sp))
                if e.fits(gpu_memory, headroom, host_memory):
                    return e
    return None


def accumulation_for(s: Setting, target: int) -> int:
    """Micro-batches per optimizer step for `target` rows: over the data-parallel size x micro batch, rounded up."""
    return max(1, -(-target // (s.gpus // s.sp * s.micro_batch)))


def lever_setting(candidate: Setting, tools: Tools, ratio: float = 1.0) -> Setting | None:
    """`candidate` with the levers of `tools` on (ZeRO's offload kept where the candidate has it); None where its
    ZeRO stage cannot offload what `tools` asks (the optimizer needs ZeRO-2/3, the weights ZeRO-3)."""
    if (tools.offload_optimizer and not candidate.sharding.gradients) or (
        tools.offload_params and not candidate.sharding.weights
    ):
        return None
    optimizer, params = candidate.offload_optimizer, candidate.offload_params
    tools = tools._replace(offload_optimizer=tools.offload_optimizer or optimizer,
                           offload_params=tools.offload_params or params)  # fmt: skip
    return candidate.with_tools(tools, ratio if not optimizer else candidate.offload_ratio)


def offload_ratios(shape: ModelShape, candidate: Setting, tools: Tools) -> list[float]:
    """The optimizer offload shares to try, smallest first: under ZeRO-3 (optimizer offload turned on by `tools`, the
    weights not offloaded) each whole number of DeepSpeed's optimizer sub-groups (`sub_group_size` parameters) that
    this GPU's partition splits into; else all of it."""
    if not (tools.offload_optimizer and not tools.offload_params and candidate.sharding.weights):
        return [1.0]
    if candidate.offload_optimizer:
        return [candidate.offload_ratio]
    groups = len(optimizer_groups(shape, candidate, 1.0)[1])
    return [k / groups for k in range(1, groups + 1)]


def longest(
    shape: ModelShape,
    base: Setting,
    gpu_memory: float,
    headroom: float = 0.1,
    sp_choices: tuple[int, ...] = (1,),
    step: int = 1024,
    host_memory: float | None = None,
) -> Estimate | None:
    """The longest row (a multiple of `step` tokens, one row per micro-batch) that fits with `base`'s ZeRO stage, any
    memory levers (`MEMORY_LEVELS`: the activation tools, then ZeRO's offload) and one of `sp_choices`; its cheapest
    setting. None if not even `step` tokens fit."""

    def fitting(tokens: int) -> Estimate | None:
        setting = dataclasses.replace(base, seq_len=tokens, micro_batch=1)
        return first_fit(shape, setting, gpu_memory, headroom, levels(), sp_choices, host_memory)

    if fitting(step) is None:
        return None
    low, high = 1, 2
    while fitting(high * step) is not None:  # activations grow linearly: a fit is found in a few doublings
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fitting(middle * step) is not None else (low, middle)
    setting = dataclasses.replace(base, seq_len=low * step, micro_batch=1)
    return suggest(shape, setting, gpu_memory, headroom, (1,), [setting], levels(), sp_choices=sp_choices,
                   host_memory=host_memory)  # fmt: skip


def binding(shape: ModelShape, e: Estimate, gpu_memory: float, headroom: float, host_memory: float,
            step: int = 1024) -> str:  # fmt: skip
    """What stops a row `step` tokens longer than `e`'s (the longest that fits): `host` if some setting would fit
    with the GPU's memory alone (unlimited host memory), `GPU` if some would with the host's alone, else `both`."""
    longer = dataclasses.replace(e.setting, seq_len=e.setting.seq_len + step)
    sp = (e.setting.sp,)
    if first_fit(shape, longer, gpu_memory, headroom, levels(), sp) is not None:
        return "host"
    if first_fit(shape, longer, float("inf"), headroom, levels(), sp, host_memory) is not None:
        return "GPU"
    return "both"


def lever_report(e: Estimate, base: Setting, gpu_memory: float, headroom: float, host_memory: float,
                 binds: str = "") -> str:  # fmt: skip
    """Which levers a setting turned on beyond `base`'s (the last is the one that made it fit), the memory that
    `binds` (`binding`), and both memories' use."""
    added = [lever for lever in e.setting.tools.on() if lever not in base.tools.on()]
    share = f" ({e.setting.ratio:.0%} of its states)" if e.setting.offload_optimizer and e.setting.ratio < 1 else ""
    added = [lever.label + (share if lever.name == "offload_optimizer" else "") for lever in added]
    gpu_use, host_use = gpu_memory * (1 - headroom), host_memory * (1 - headroom)
    gpu_left, host_left = (gpu_use - e.peak) / GiB, (host_use - e.host_pinned) / GiB
    use = (
        f"GPU {e.peak / GiB:.2f} of {gpu_use / GiB:.2f} GiB usable ({gpu_left:.2f} left), host "
        f"{e.host_pinned / GiB:.2f} of {host_use / GiB:.2f} GiB usable per node ({host_left:.2f} left)"
    )
    what = {"host": "host memory binds (a longer row would fit the GPU, not the host)",
            "GPU": "GPU memory binds (a longer row would fit the host, not the GPU)",
            "both": "both bind (a longer row fits neither)", "": ""}[binds]  # fmt: skip
    levers = f"levers turned on: {', '.join(added)} (the last made it fit)" if added else "no lever needed"
    return "; ".join(part for part in (levers, what, use) if part)


def sp_sizes(shape: ModelShape, gpus: int) -> tuple[int, ...]:
    """Sequence-parallel sizes a run of `gpus` processes can use with this model (they divide the GPUs and split the
    attention heads as Ulysses needs)."""
    from sft.parallel.sequence import splits_heads

    return tuple(d for d in range(1, gpus + 1) if gpus % d == 0 and splits_heads(shape.heads, shape.kv_heads, d))


def detected_host_memory() -> float:
    import psutil

    return float(psutil.virtual_memory().total)


def detected_gpu_memory() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def nothing_fits(
    s: Setting,
    shape: ModelShape | None = None,
    gpu_memory: float | None = None,
    headroom: float = 0.1,
    host_memory: float | None = None,
) -> str:
    """What to say when no setting fits: the lever that would make one fit, tried on the plan's equations in the
    order a user would reach for them: Liger (its fused loss never builds the logits), sequence parallelism over the
    GPUs there are, LoRA (the model states), QLoRA, QLoRA's nested constants; else shorter rows or more GPUs. Without
    a shape or GPU memory to try them on: LoRA, QLoRA, nested quantization, more GPUs, in that order."""
    head = "Nothing fits on this many GPUs, even with CPU offload and micro batch 1"
    if shape is None or gpu_memory is None:
        lever = "use LoRA (use_peft)" if not s.lora_r else "use QLoRA (load_in_4bit)" if not s.qlora else "add GPUs"
        if s.qlora and not s.qlora_nested:
            lever = "set use_bnb_nested_quant: true (QLoRA's constants in 8 bits), or add GPUs"
        return f"{head}: {lever}."

    def fits(setting: Setting, sp_choices: tuple[int, ...] | None = None) -> bool:
        levels_ = levels()
        return any(first_fit(shape, setting, gpu_memory, headroom, levels_, (sp,), host_memory) is not None
                   for sp in sp_choices or (setting.sp,))  # fmt: skip

    sp_all = sp_sizes(shape, s.gpus)
    tries = [
        ("turn Liger on (use_liger_kernel: its fused loss never builds the logits)",
         dataclasses.replace(s, liger=True), sp_all),
        (f"split each row over GPUs with sequence parallelism (sequence_parallel_size: one of {sp_all[1:]})",
         s, sp_all),
        ("use LoRA (use_peft): the model states are what does not fit", dataclasses.replace(s, lora_r=16), sp_all),
        ("use QLoRA (load_in_4bit)", dataclasses.replace(s, lora_r=s.lora_r or 16, qlora=True), sp_all),
        ("set use_bnb_nested_quant: true (QLoRA's constants in 8 bits)",
         dataclasses.replace(s, lora_r=s.lora_r or 16, qlora=True, qlora_nested=True), sp_all),
    ]  # fmt: skip
    for lever, setting, sp_choices in tries:
        if (setting != s or len(sp_choices) > 1) and fits(setting, sp_choices):
            return f"{head}: {lever}."
    top = longest(shape, dataclasses.replace(s, micro_batch=1), gpu_memory, headroom, tuple(sp_all),
                  host_memory=host_memory)  # fmt: skip
    if top is not None:
        return (f"{head}: rows of at most {top.setting.seq_len:,} tokens fit here ({top.setting.describe()}); "
                "longer rows need more GPUs (sequence parallelism) or more GPU memory.")  # fmt: skip
    return f"{head}: add GPUs."


# A cap this close above a card's memory is the whole card: `max_gpu_memory_gib` is written to two decimals, and an
# H100 80GB's 79.18 GiB (what the brief caps every 80 GB claim at) rounds above its 79.179 GiB
WHOLE_CARD_GIB = 0.01


def memory_fraction(gib: float, total: float) -> float:
    """The share of a GPU of `total` bytes that a cap of `gib` GiB (`max_gpu_memory_gib`) leaves a process: 1 for a cap
    within `WHOLE_CARD_GIB` above the card's memory; a ConfigError for one further above."""
    if gib * GiB > total + WHOLE_CARD_GIB * GiB:
        raise ConfigError(
            f"`max_gpu_memory_gib: {gib}` is more than this GPU has ({total / GiB:.3f} GiB). Lower it or remove it."
        )
    return min(gib * GiB / total, 1.0)


def cap_gpu_memory(gib: float | None) -> float | None:
    """Cap this process's allocations on its GPU at `gib` GiB (`max_gpu_memory_gib`); returns the fraction set, or
    None without a cap or a GPU. A cap above the GPU's memory is an error (`memory_fraction`)."""
    import torch

    if gib is None or not torch.cuda.is_available():
        return None
    fraction = memory_fraction(gib, detected_gpu_memory())
    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
    return fraction
