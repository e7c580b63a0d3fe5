"""The plan's speed model: the time of an optimizer step of a setting, so that `auto` takes the fastest that fits.

    python -m sft.plan --model meta-llama/Llama-3.2-3B --gpus 1 --seq-len 4096 --gpu-memory 80 --suggest

A step of `accumulation` micro-batches of `micro_batch` rows is

    accumulation x (compute + per-micro-step work + exposed communication) + optimizer step

- compute: the micro-batch's training FLOPs (`sft.model.flops`' count: linear layers at 6 FLOPs per weight and token,
  4 for a frozen one; causal attention over rows of `seq_len`) plus what the memory levers run again (activation
  checkpointing: the forward once more, but for the attention kernel where its outputs are kept; the tiled MLP: the
  MLP's forward), over the card's dense bf16 peak times the efficiency measured for the linear layers' kernel setting
  (bf16 eager, bf16 compiled, FP8 compiled) and bf16's for attention, which rises with the tokens of a micro-batch as
  `tokens / (tokens + half_tokens)`; FP8 adds its casts to float8, memory-bound work per token and layer that weighs
  more on a narrow model (Llama 1B: no faster than bf16; 8B: 1.17x);
- per-micro-step work: the host's, of which only what the GPU's compute does not cover shows (the host runs ahead
  while the GPU is busy): per decoder layer by kernel setting (FP8's compiled layers cost the host more than bf16's;
  kept attention outputs add the selective checkpoint's dispatch of every op; ZeRO-3 adds its hooks per layer and
  pass: at micro batch 1 an 8B step waits for them) and one reduction call per gradient bucket; plus ZeRO's handling
  of the gradients at each backward (ZeRO-1/2 copy them into their buckets, ZeRO-3 into its partition), per parameter
  held: serial on one process, overlapped with the backward on several (`overlap_comm`), each with its own constant;
- communication (more than one process): ZeRO-3 gathers the 16-bit weights in the forward, the backward and a
  recomputation, and reduce-scatters the gradients; ZeRO-1/2 reduce the gradients at every backward; sequence
  parallelism's all-to-all per layer. The share the engine overlaps with compute is hidden;
- the optimizer step: the fused Adam over this GPU's fp32 partition (without ZeRO, torchao's 8-bit AdamW stepping
  each bf16 weight tensor apart, its own constant); the share of the states offloaded to the CPU
  stepped by DeepSpeed's CPU Adam, their gradients copied out and the weights back.

The constants of each card (`speed_constants.json` beside this module) come from a committed sweep
(`benchmarks/speed_sweep.py`: the candidates that fit, each the real `sft train`, fitted by least squares with
`--fit`); the file names the result each constant was fitted from. A card not in the file is planned with the
reference card's constants (H100 80 GB) scaled by its peak, and the log says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

from sft.model.shapes import ModelShape

logger = logging.getLogger(__name__)

CONSTANTS = Path(__file__).with_name("speed_constants.json")
REFERENCE_CARD = "H100 80GB"
# the efficiency rows of a card: FP8 (compiled) with activation checkpointing apart, measured much slower than either
KERNELS = ("bf16", "bf16_compiled", "fp8_compiled", "fp8_compiled_checkpointed")
KEPT_ATTENTION = "kept_attention"  # the host cost of checkpointing that keeps attention outputs (`host_s_per_layer`)


@dataclasses.dataclass(frozen=True)
class Card:
    """A GPU kind's speed constants (one entry of `speed_constants.json`)."""

    name: str
    peak_tflops: float  # dense bf16 peak (`sft.model.flops.PEAK_TFLOPS`)
    efficiency: dict  # kernel setting (KERNELS) -> share of the bf16 peak its linear layers reach, saturated (FP8's
    # can pass 1: its tensor cores have twice the peak); attention runs at bf16's (FlashAttention in every setting)
    half_tokens: float  # tokens per micro-batch at which the efficiency is half its saturated value
    host_s_per_layer: dict  # kernel setting (KERNELS) -> the host's seconds per decoder layer and micro step; with
    # KEPT_ATTENTION: what attention outputs kept add (the selective checkpoint dispatches every op through Python)
    # ZeRO stage -> seconds per micro step per 1e9 parameters: "2", "3" on one process (no overlap), "2+", "3+" on
    # several (`overlap_comm` on); a key not measured takes "2+" (several processes), else "2"
    gradient_s_per_gparam: dict
    fp8_cast_s_per_gelement: float  # FP8: seconds per 1e9 elements cast to float8 (`_fp8_casts`)
    zero3_host_s_per_layer_pass: float  # ZeRO-3: the host's seconds per layer and pass (its fetch/release hooks)
    bucket_s: float  # seconds per gradient-reduction bucket (ZeRO's `reduce_bucket_size`) per micro step
    optimizer_s_per_gparam: float  # fused Adam on the GPU, per 1e9 parameters of this GPU's partition
    # torchao's 8-bit AdamW without ZeRO (bf16 weights stepped in place with stochastic rounding), per 1e9 parameters:
    # it steps each weight tensor apart (ZeRO-1/2 hand it flat groups instead, timed as fused Adam). One value for
    # both cards, fitted by least squares on the defaults without DeepSpeed (`benchmarks/results/family_speed_h100`:
    # Qwen3-4B on 1 x H100, call 4; Qwen3-8B, Mistral-7B and Llama-3.1-8B widths on 1 x H200, call 7): their
    # estimates were 1.13-1.29x the measurements without it, 0.94-1.12x with it. Fitted on whole steps, so it holds
    # more than the step (torchao's alone measured 0.05 s per 1e9 at 4B, sft's fused one 0.011-0.014:
    # benchmarks/results/optimizer_step)
    eight_bit_step_s_per_gparam: float
    cpu_adam_s_per_gparam: float  # DeepSpeed's CPU Adam plus the copies, per 1e9 offloaded parameters
    link_gbps: float  # GB/s between a node's GPUs (NVLink) as collectives see it: fitted together with `overlap`
    pcie_gbps: float  # GB/s between host and GPU (offloaded weights and checkpoints)
    overlap: float  # the share of ZeRO's communication hidden behind compute
    source: str  # what these figures were fitted from


def kernel_name(fp8: bool, compiled: bool, checkpointing: bool = False) -> str:
    """The efficiency row of a setting's kernels (KERNELS)."""
    if fp8:
        return "fp8_compiled_checkpointed" if checkpointing else "fp8_compiled"
    return "bf16_compiled" if compiled else "bf16"


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step of a setting, by part."""

    compute: float  # the FLOPs a step counts for MFU
    recompute: float  # what checkpointing and the tiled MLP run again
    per_micro: float  # fixed costs and ZeRO's gradient handling, all micro steps
    communication: float  # exposed (not overlapped) collectives
    optimizer: float  # the optimizer step (GPU and CPU parts)
    tokens: int  # tokens per GPU per step
    flops: float  # training FLOPs per GPU per step (what MFU counts)
    peak_tflops: float

    @property
    def seconds(self) -> float:
        return self.compute + self.recompute + self.per_micro + self.communication + self.optimizer

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def mfu(self) -> float:
        return self.flops / self.seconds / (self.peak_tflops * 1e12)

    def describe(self) -> str:
        parts = ", ".join(
            f"{name} {value:.2f} s"
            for name, value in (
                ("compute", self.compute),
                ("recompute", self.recompute),
                ("per micro step", self.per_micro),
                ("communication", self.communication),
                ("optimizer", self.optimizer),
            )  # fmt: skip
            if value >= 0.005
        )
        return f"{self.tokens_per_second:,.0f} tokens/s/GPU, MFU {self.mfu:.1%} ({self.seconds:.2f} s a step: {parts})"


@functools.cache
def _table() -> dict:
    return json.loads(CONSTANTS.read_text())


def card(device_name: str | None = None) -> Card:
    """The constants of the card named `device_name` (a `torch.cuda.get_device_name()` or a key of the file: the
    first key whose words are all in the name), else the reference card's scaled by its peak."""
    table = _table()["cards"]
    name = device_name or REFERENCE_CARD
    for key, values in table.items():
        if all(word.lower() in name.lower() for word in key.split()):
            return Card(key, **values)
    from sft.model.flops import detect_peak_tflops

    reference = Card(REFERENCE_CARD, **table[REFERENCE_CARD])
    peak = detect_peak_tflops(name) or reference.peak_tflops
    logger.info("Speed model: no measured constants for %s; the %s's, scaled to its %.0f TFLOP/s peak", name,
                REFERENCE_CARD, peak)  # fmt: skip
    return dataclasses.replace(reference, name=f"{name} (as {REFERENCE_CARD})", peak_tflops=peak)


def linear_flops_per_token(shape: ModelShape, lora_r: int = 0) -> float:
    """Training FLOPs per token of the linear layers (the output head included): 6 per weight, 4 for a frozen one
    (LoRA's base, which needs no weight gradient) plus the adapters' 6 per weight."""
    h, hq, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    per_layer = h * hq + 2 * h * kv + hq * h + 3 * h * i
    weights = shape.layers * per_layer + shape.vocab * h
    if not lora_r:
        return 6.0 * weights
    return 4.0 * weights + 6.0 * shape.lora_params(lora_r)


def attention_flops_per_token(shape: ModelShape, sample_tokens: float) -> float:
    """Causal attention per token where samples are `sample_tokens` long (length-weighted: sum(len^2) / sum(len)):
    12 x width x sample_tokens / 2 pairs per token and layer (`sft.model.flops`)."""
    return 12.0 * shape.heads * shape.head_dim * shape.layers * sample_tokens / 2


def mlp_share(shape: ModelShape) -> float:
    """The MLP's share of a decoder layer's linear FLOPs (what the tiled MLP runs again)."""
    h, hq, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return 3 * h * i / (h * hq + 2 * h * kv + hq * h + 3 * h * i)


def step_time(
    shape: ModelShape, s, constants: Card | None = None, sample_tokens: float | None = None, bucket: int | None = None
) -> StepTime:
    """The step time of `s` (a `sft.plan.setting.Setting`) on `constants`' card, for samples `sample_tokens` long
    (length-weighted; default: each row one sample, the most attention a row can cost) and ZeRO's gradient buckets of
    `bucket` elements (default: as sft sets `"auto"`)."""
    c = constants or card()
    compiled = s.compiled or s.fp8  # float8 runs compiled
    kernel = kernel_name(s.fp8, compiled, s.activation_checkpointing)
    tokens = s.tokens  # per GPU per micro step
    saturation = tokens / (tokens + c.half_tokens)
    # the linear layers at the kernel setting's efficiency; attention's kernel is bf16 FlashAttention in every one
    linear_rate = c.peak_tflops * 1e12 * c.efficiency[kernel] * saturation
    bf16 = "bf16_compiled" if compiled and not s.fp8 else "bf16"
    attention_rate = c.peak_tflops * 1e12 * c.efficiency[bf16] * saturation
    linear = linear_flops_per_token(shape, s.lora_r)
    decoder = linear - (6.0 if not s.lora_r else 4.0) * shape.vocab * shape.hidden  # the head is never recomputed
    attention = attention_flops_per_token(shape, min(sample_tokens or s.seq_len, s.seq_len))
    flops = tokens * (linear + attention)
    again_linear = again_attention = 0.0
    if s.activation_checkpointing:  # the forward is a third of a layer's training FLOPs
        again_linear, again_attention = decoder / 3, (0 if s.keep_attention_outputs else attention / 3)
    if s.tiled_mlp:
        again_linear += decoder * mlp_share(shape) / 3
    compute = tokens * (linear / linear_rate + attention / attention_rate) + _fp8_casts(shape, s, c)
    recompute = tokens * (again_linear / linear_rate + again_attention / attention_rate)
    if not s.liger:  # the constants were fitted with Liger on; the family's measured Liger speed says what off costs
        compute, recompute = compute * liger_factor(shape), recompute * liger_factor(shape)
    # the host's work per micro step (launches, one reduction call per bucket) runs ahead of a busy GPU: only what the
    # GPU's work does not cover shows
    per_layer = c.host_s_per_layer.get(kernel, 0.0) + (
        c.host_s_per_layer.get(KEPT_ATTENTION, 0.0) if s.keep_attention_outputs else 0
    )
    host = shape.layers * per_layer + c.bucket_s * _buckets(shape, s, bucket)
    if s.sharding.weights and s.traits.host_hooks:  # ZeRO-3's hooks fetch and release each layer's weights each pass
        host += shape.layers * _passes(s) * c.zero3_host_s_per_layer_pass
    host = max(host - compute - recompute, 0.0)
    per_micro = host + _gradient_work(shape, s, c)
    communication = _communication(shape, s, c, compute + recompute)
    return StepTime(
        compute=s.accumulation * compute,
        recompute=s.accumulation * recompute,
        per_micro=s.accumulation * per_micro,
        communication=s.accumulation * communication,
        optimizer=_optimizer(shape, s, c),
        tokens=s.accumulation * tokens,
        flops=s.accumulation * flops,
        peak_tflops=c.peak_tflops,
    )


# Liger's speed against plain bf16 was measured at 2 layers, one run each (`sft.model.architectures`): a difference
# under this share is not told apart from the runs' noise, and Liger off then costs what Liger on does
LIGER_NOISE = 0.05


def liger_factor(shape: ModelShape) -> float:
    """The compute time of Liger off over Liger on for this family: its measured Liger speed where the measurement
    tells them apart (`LIGER_NOISE`), else 1. At equal speed Liger's candidate ranks first (it frees memory)."""
    return shape.liger_speedup if abs(shape.liger_speedup - 1) >= LIGER_NOISE else 1.0


def _fp8_casts(shape: ModelShape, s, c: Card) -> float:
    """Seconds of a micro step's float8 casts (memory-bound, so their share shrinks with the width): per token and
    layer about 8 x hidden + 3 x intermediate elements (the inputs of the forward's linears and the output gradients
    of the backward's)."""
    if not s.fp8:
        return 0.0
    elements = s.tokens * shape.layers * (8 * shape.hidden + 3 * shape.intermediate)
    return c.fp8_cast_s_per_gelement * elements / 1e9


def _trainable(shape: ModelShape, s) -> float:
    return float(shape.trainable(s.lora_r))


def gradient_key(s) -> str:
    """The `gradient_s_per_gparam` key of a setting: its ZeRO stage, with `+` on several processes (`overlap_comm`)."""
    return f"{s.sharding.stage}+" if s.gpus > 1 else str(s.sharding.stage)


def _gradient_work(shape: ModelShape, s, c: Card) -> float:
    """ZeRO's gradient handling at each backward, per parameter this GPU's engine touches (ZeRO-1/2 copy every
    gradient into their buckets; ZeRO-3 its partition of each); on several processes what the overlap leaves."""
    if not s.sharding.engine or s.traits.layer_units:  # FSDP2 reduce-scatters each layer's gradients in the backward
        return 0.0  # (measured: its micro-batch-2 x 8 steps are compute + communication within 3%, fsdp2_h200x4)
    rates = c.gradient_s_per_gparam
    rate = rates.get(gradient_key(s), rates.get("2+", rates["2"]) if s.gpus > 1 else rates["2"])
    return rate * _trainable(shape, s) / (s.gpus if s.sharding.weights else 1) / 1e9


def _buckets(shape: ModelShape, s, bucket: int | None = None) -> int:
    """Gradient reductions per micro step: one per bucket of `bucket` elements (default: what sft sets
    `reduce_bucket_size: "auto"` to, `sft.engines.bucket_elements`)."""
    if not s.sharding.engine:
        return 0
    if bucket is None:
        from sft.engines import bucket_elements

        bucket = bucket_elements(shape.hidden, s.gpus, int(_trainable(shape, s)))
    return -(-int(_trainable(shape, s)) // bucket)


def _communication(shape: ModelShape, s, c: Card, busy: float) -> float:
    """Exposed seconds of one micro step's collectives: what the engine moves over the link, less the share it
    overlaps with `busy` (the micro step's compute)."""
    world = s.gpus
    if world <= 1:
        seconds = _host_traffic(shape, s, c)
        return max(seconds - c.overlap * min(seconds, busy), 0.0)
    link = c.link_gbps * 1e9
    share = (world - 1) / world
    # FSDP2 all-gathers FP8's linear weights in float8 (`sft.model.fp8`, tensorwise scaling, the default recipe): a
    # byte a weight (the embeddings count so too)
    weights = (1 if s.fp8 and s.traits.float8_all_gather else s.dtype_bytes) * shape.n_params
    grads = s.dtype_bytes * _trainable(shape, s)
    moved = 0.0
    if s.sharding.weights and not s.lora_r:
        moved = share * (_passes(s) * weights + grads)
    elif s.sharding.engine:  # ZeRO-0/1/2: every backward reduces the gradients (all-reduce or scatter)
        moved = share * grads if s.sharding.gradients else 2 * share * grads
    if s.sp > 1:  # Ulysses: four all-to-alls of a layer's q, k, v and output per layer, forward and backward
        hq, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        moved += 2 * shape.layers * s.tokens * s.dtype_bytes * (2 * hq + 2 * kv) * share
    seconds = moved / link + _host_traffic(shape, s, c)
    return max(seconds - c.overlap * min(seconds, busy), 0.0)


def _passes(s) -> int:
    """Passes over the layers in a micro step that gather ZeRO-3's weights: forward, backward, the recomputation."""
    return 2 + (1 if s.activation_checkpointing else 0)


def _host_traffic(shape: ModelShape, s, c: Card) -> float:
    """Seconds of one micro step's copies between host and GPU: ZeRO-3's offloaded weights gathered from the host
    in each pass, offloaded checkpoints out and back."""
    moved = 0.0
    if s.offload_params:
        moved += (2 + (1 if s.activation_checkpointing else 0)) * s.dtype_bytes * shape.n_params / s.gpus
    if s.offload_checkpoints:
        moved += 2 * shape.layers * s.dtype_bytes * shape.hidden * s.tokens
    return moved / (c.pcie_gbps * 1e9)


def _optimizer(shape: ModelShape, s, c: Card) -> float:
    partition = _trainable(shape, s) / (s.gpus if s.sharding.optimizer else 1)
    if not s.sharding.engine and s.eight_bit_moments:  # torchao's 8-bit step, one weight tensor at a time
        return c.eight_bit_step_s_per_gparam * partition / 1e9
    on_cpu = partition * s.ratio if s.offload_optimizer else 0.0
    return (c.optimizer_s_per_gparam * (partition - on_cpu) + c.cpu_adam_s_per_gparam * on_cpu) / 1e9
