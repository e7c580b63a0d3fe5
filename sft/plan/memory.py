"""Pre-flight memory planner: per-GPU and host memory of a setting, whether it fits, and the fastest that does.

    python -m sft.plan --model meta-llama/Llama-3.1-8B --gpus 8 --seq-len 4096 --micro-batch 2 --zero 3
    python -m sft.plan --model recipes/demo/model --gpus 2 --gpu-memory 80 --suggest

Model states (weights, gradients, optimizer) per ZeRO stage are DeepSpeed's own memory equations
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`; tests hold the planner to them).
The peak adds what those leave out, each as its own line:

- activations: what autograd keeps per token and decoder layer as the model's family builds it (`LayerKeeps`), counted
  tensor by tensor (with and without Liger's RMSNorm/SwiGLU/RoPE kernels, FlashAttention-2 varlen, bf16), plus a
  per-token allowance for the loss and backward working set; with activation checkpointing, each layer's input plus
  one layer recomputed; with the checkpoints offloaded, those inputs in pinned host memory and two layers' on the GPU;
  with the tiled MLP, no MLP intermediates but one tile's (about `hidden` tokens);
- the loss: TRL's fused LM head never builds the logits, but its backward holds the head's gradient in fp32 and bf16
  and a [4096 x 32768] tile;
- DeepSpeed's buffers: ZeRO-2's bf16 gradient partition during backward and the flattened copy at the optimizer step;
  ZeRO-3's gathered layers and LM head during forward/backward and its per-sub-group fp32 gradients at the step;
- with the checkpoints offloaded under ZeRO-3, the loss's backward and the decoder layers' are apart: the larger is
  the peak (`loss_backward_apart`, measured on H100 in that regime).

Host memory (`host_bytes`) is planned too where anything is offloaded, as DeepSpeed and torch allocate it. For long
rows the memory levers come on in `MEMORY_LEVELS` order (checkpointing that keeps attention outputs, checkpointing,
its offload, the tiled MLP, ZeRO-3's optimizer states on the CPU in whole sub-groups, its weights), and `longest`
answers the longest row a GPU trains and (`binding`) whether GPU or host memory stops a longer one.

Those extra terms were measured on H200s (benchmarks/memory_plan.py, benchmarks/results/memory_plan_calibration.md);
the per-token allowance is the one figure fitted to those measurements. ZeRO-3's CPU offload with long rows was
measured on H100 (benchmarks/results/long_context_1gpu); ZeRO-0/1, ZeRO-2's offload and LoRA use the same equations
but have not been measured on a GPU yet. `max_memory_allocated` does not count the CUDA context, NCCL's
buffers or allocator fragmentation, so a plan fits when its peak is under (1 - headroom) of the GPU's memory.

What the plan reads from a model (its `ModelShape`) is `sft.model.shapes`'s; the command line (`sft plan`) is
`sft.plan.cli`'s. What is here reads best together: the per-stage equations, the levers for long rows with the host
memory they take, and the search for what fits.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from sft import engines
from sft.errors import ConfigError
from sft.model import attention, wide_heads
from sft.model.shapes import ModelShape
from sft.plan.levers import ACTIVATION_LEVELS, MEMORY_LEVELS, Tools, levels  # noqa: F401 (the plan's names)
from sft.plan.setting import EIGHT_BIT_MOMENTS, SETTING_FIELDS, Setting, moment_bytes_of, setting_of  # noqa: F401

logger = logging.getLogger(__name__)

GiB = 2**30
# TRL's fused LM head (trl.kernels.chunked_logprob): tiles of TOKEN_CHUNK_SIZE tokens x this many vocabulary entries
TOKEN_CHUNK, VOCAB_CHUNK = 4096, 32768
# Per-token bytes beyond the decoder layers' saved tensors, in units of hidden_size: final norm, the loss's inputs and
# gradients, the backward's working set. Fitted on H200 (1B/8B shapes,
# benchmarks/results/memory_plan_calibration_measured.json).
EXTRA_PER_TOKEN = {"liger": 10, "eager": 40}
# Without a sharding engine, what the runs held beyond every line counted, not yet attributed to a tensor: one process,
# bf16 weights, 8-bit moments, Liger, the peak in the backward, 1 x H200 planned for 80 GB: Llama-3.1-8B 0.56 GiB,
# Mistral-7B 0.56, Qwen3-8B 1.01, Gemma-3-4B 1.02, Phi-3-mini 0.45, OLMo-2-7B 1.60 (benchmarks/results/
# family_speed_h100, calls 8 and 9, the layers counted per family). Counted so that the plan is not below a measured
# peak (Qwen3-4B's, call 4, is then 2.2 GiB above).
UNATTRIBUTED_WITHOUT_ENGINE = 1.7 * 2**30
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed ZeRO-3 `sub_group_size` default: the optimizer steps this many at a time
# ZeRO-1/2 with a low-bit optimizer: groups of at most this many parameters (`sft.engines.deepspeed.zero`)
STEP_GROUP_PARAMS = SUB_GROUP_SIZE
MICRO_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# With the checkpoints offloaded, this many layers' inputs are on the GPU at once (the one recomputed, the next)
OFFLOAD_STASH_LAYERS = 2


# Host memory of one training process besides what it offloads (Python, torch, the CUDA context's host side,
# DeepSpeed's pinned transfer buffers)
HOST_PER_PROCESS = 3 * GiB


@dataclass
class Estimate:
    setting: Setting
    items: dict[str, float]  # bytes per GPU at the peak, by line
    model_states: float  # DeepSpeed's estimator figure (weights + gradients + optimizer), bytes per GPU
    peak: float
    peak_phase: str  # "forward/backward", "optimizer step" or "model load"
    host: float  # bytes per node (DeepSpeed's estimate)
    at_backward: float = 0.0  # peak of forward + backward
    at_step: float = 0.0  # peak of the optimizer step
    states_own: float = 0.0  # weights + gradients + optimizer at the step by sft's equations (cf. model_states)
    host_pinned: float = 0.0  # bytes per node held on the host while training: offloaded ZeRO states, checkpoints

    def fits(self, gpu_memory: float, headroom: float, host_memory: float | None = None) -> bool:
        """The peak within (1 - headroom) of the GPU's memory and, when `host_memory` (bytes per node) is given, the
        host figure (offloaded states and checkpoints, pinned) within (1 - headroom) of it."""
        host_ok = host_memory is None or self.host_pinned <= host_memory * (1 - headroom)
        return self.peak <= gpu_memory * (1 - headroom) and host_ok

    def table(self) -> str:
        lines = [f"  {name:<44} {value / GiB:8.2f} GiB" for name, value in self.items.items()]
        lines.append(f"  {'peak per GPU (' + self.peak_phase + ')':<44} {self.peak / GiB:8.2f} GiB")
        lines.append(f"  {'model states (these equations)':<44} {self.states_own / GiB:8.2f} GiB")
        lines.append(f"  {'model states (DeepSpeed estimator)':<44} {self.model_states / GiB:8.2f} GiB")
        lines.append(f"  {'host memory per node (DeepSpeed estimator)':<44} {self.host / GiB:8.2f} GiB")
        lines.append(f"  {'host memory held while training (per node)':<44} {self.host_pinned / GiB:8.2f} GiB")
        return "\n".join(lines)


PER_LAYER_INPUT_BYTES = 8  # Gemma 4: the gate's activation in and out, the product, the model's projection and norm


def layer_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """Bytes autograd keeps per token for one decoder layer, by how its family builds it (`shape.keeps`; each term
    checked against autograd's saved-tensor hooks, tests/test_plan.py, benchmarks/results/layer_activations), but for
    its query and key norms (`qk_norm_bytes_per_token`)."""
    b, keeps = s.dtype_bytes, shape.keeps
    h, hq, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    attention = b * (2 * hq + 2 * kv) + 4 * shape.heads  # q, k, v and the output; fp32 log-sum-exp per head
    if keeps.fused_qkv:  # the fused projection's output, alive through v's view (q and k are rotated copies)
        attention += b * (hq + kv)
    if keeps.output_gate:  # the gate's sigmoid, the attention's output made contiguous, and their product (what the
        # output projection reads)
        attention += 3 * b * hq
    if keeps.kv_shared:  # layers reading an earlier layer's keys and values keep no k or v of their own (averaged)
        attention -= 2 * b * keeps.kv_shared[1] / shape.layers
    if keeps.linear:  # Gated DeltaNet layers in place of some attention layers: the average over the layers
        linear = keeps.linear[0]
        attention = ((shape.layers - linear) * attention + linear * linear_attention_bytes_per_token(shape, s)) / (
            shape.layers
        )
    # The attention's and the MLP's inputs, kept by the projections that read them (a norm's output or the residual).
    # Each RMSNorm on the residual stream: Liger's keeps its input and an fp32 rstd; transformers' an fp32 copy of its
    # input, the rstd and the normalised 16-bit input it scales, or the fp32 one where it scales in fp32 (Gemma, OLMo)
    norm = b * h + 4 if s.liger else 4 * h + 4 + (4 if keeps.fp32_scale else b) * h
    norms = 2 * b * h + keeps.norms * norm
    if keeps.residual_dropout and not s.liger:
        norms += 2 * h
    if keeps.per_layer_input:  # Gemma 4's gate reads the layer's output; its per-layer input's share (its norm
        # counted above): PER_LAYER_INPUT_BYTES x 16-bit elements per token (autograd's hooks, tests/test_plan.py)
        norms += b * h + PER_LAYER_INPUT_BYTES * b * keeps.per_layer_input
    # Tiled, the MLP keeps only its input (counted above) and recomputes the rest per tile
    mlp = 0 if s.tiled_mlp else mlp_bytes_per_token(shape, s) + routing_bytes_per_token(shape, s)
    layer = attention + norms + mlp
    if s.lora_r and s.lora_dropout > 0:  # PEFT's dropout makes a copy of each adapted layer's input
        layer += b * (5 * h + hq + i)
    return layer


def linear_attention_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """Bytes per token that a Gated DeltaNet layer's token mixer keeps (its input apart) through transformers' torch
    recurrence (chunks of 64 tokens) and convolution, bf16 weights: fitted exactly (to the byte, but for the
    convolution's padding per sample) to autograd's saved-tensor hooks over 20 widths, and checked on others in
    tests/test_plan.py. The convolution's input and pre-activation output (16-bit, key heads x key dim twice plus value
    heads x value dim); per value head, fp32: q, k, v and their products (32 B per key dim, 30 per value dim beside the
    convolution's 4), the chunks' 64 x 64 matrices and per-head scalars (1,318 B), a state per chunk (4 B x key dim x
    value dim / 64). fla's kernels keep fewer (not measured)."""
    k_heads, k_dim, v_heads, v_dim = shape.keeps.linear[1:]
    b = s.dtype_bytes
    conv = 2 * k_heads * k_dim + v_heads * v_dim
    return 2 * b * conv + v_heads * ((34 - 2 * b) * v_dim + 32 * k_dim + 1318 + 4 * k_dim * v_dim / 64)


def qk_norm_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """Bytes per token and layer that RMSNorms on the queries and keys keep (`LayerKeeps.qk_norm`). transformers': an
    fp32 copy of the input, the normalised input it scales (fp32 where it scales in fp32: Gemma 3, OLMo 2) and an fp32
    rstd per row (a head's, or the token's for a norm over the whole width). Liger's: counted as 2 x 16-bit q and k,
    from a whole run's peak on 1 x H100 (Qwen3-4B widths, micro batch 2 without checkpointing: 19.1 KB per token and
    layer over the plan without it, this 20.5 KB; benchmarks/results/family_speed_h100/call4_qwen3_4b_nods), where
    autograd's hooks see half of it (the input and a per-head rstd, benchmarks/results/layer_activations)."""
    keeps, b = shape.keeps, s.dtype_bytes
    if keeps.qk_norm is None:
        return 0.0
    # averaged over the layers: Gated DeltaNet layers (`LayerKeeps.linear`) have none
    share = 1 - (keeps.linear[0] / shape.layers if keeps.linear else 0)
    width = (shape.heads + shape.kv_heads) * shape.head_dim
    if s.liger and keeps.liger_qk_norm:
        return share * 2 * b * width
    rows = shape.heads + shape.kv_heads if keeps.qk_norm == "head" else 2
    values = 4 * (shape.kv_heads * shape.head_dim + shape.kv_heads) if keeps.v_norm else 0  # no scale: input, rstd
    per_element = 4 + (4 if keeps.fp32_scale else b)
    per_layer = per_element * width + 4 * rows + values
    if keeps.kv_shared:  # layers reusing earlier keys and values norm no keys or values (averaged over the layers)
        _, elements, kv_heads = keeps.kv_shared
        reused = per_element * elements + 4 * kv_heads
        reused += 4 * (elements + kv_heads) if keeps.v_norm else 0
        per_layer -= reused / shape.layers
    return share * per_layer


def mlp_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    if shape.mlp_kept != 4:  # a family's own gate (gpt-oss's), which Liger does not replace
        return shape.mlp_kept * s.dtype_bytes * shape.intermediate
    return (3 if s.liger else 4) * s.dtype_bytes * shape.intermediate


def routing_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """What a mixture-of-experts layer keeps per token besides its experts' intermediates (which `intermediate`, the
    active experts' width, counts like a dense MLP's), averaged over the decoder's layers. transformers' grouped
    experts keep the token's input copied once per active expert and the active experts' outputs (two [tokens x k,
    hidden] tensors), the router's fp32 probabilities over all experts, and the int64 indices of the dispatch:
    counted with autograd's saved-tensor hooks on Qwen3-MoE (tests/test_plan.py)."""
    if not shape.experts:
        return 0.0
    count, k, moe_layers = shape.experts
    per_layer = 2 * k * shape.hidden * s.dtype_bytes + 4 * count + 34 * k
    return per_layer * moe_layers / shape.layers


def activation_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """Bytes kept on the GPU per token for the whole model (the saved tensors of every layer, or with checkpointing
    the layers' inputs and one layer recomputed; offloaded, only the few layers in flight), plus the per-token
    working set."""
    layer = layer_bytes_per_token(shape, s)
    extra = EXTRA_PER_TOKEN["liger" if s.liger else "eager"] * shape.hidden
    if s.activation_checkpointing:
        kept = min(OFFLOAD_STASH_LAYERS, shape.layers) if s.offload_checkpoints else shape.layers
        attention = shape.layers * attention_kept_bytes_per_token(shape, s) if s.keep_attention_outputs else 0
        return kept * s.dtype_bytes * shape.hidden + attention + layer + extra
    # the query and key norms' saved tensors, where every layer keeps its own (within the peaks measured with
    # checkpointing, Qwen3-4B's long rows, the one recomputed layer's are not counted apart)
    return shape.layers * (layer + qk_norm_bytes_per_token(shape, s)) + extra


def attention_kept_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """What `sft.model.checkpointing` keeps per token and layer: the attention kernel's output and its fp32
    log-sum-exp."""
    return s.dtype_bytes * shape.heads * shape.head_dim + 4 * shape.heads


def fp8_bytes_in_flight(shape: ModelShape, s: Setting) -> float:
    """What float8 adds at the peak (`sft.model.fp8`): it saves the same high-precision input and weight for the
    backward as a bf16 linear, so its cost is transient, in the backward of the widest linear (down_proj): its input
    and output gradient each cast once per scaling axis (1 byte per element, two axes) and the weight cast twice (1
    byte each)."""
    widest = max(shape.intermediate, shape.heads * shape.head_dim)
    return 2 * s.tokens * (widest + shape.hidden) + 2 * shape.hidden * widest


def offloaded_bytes_per_token(shape: ModelShape, s: Setting) -> float:
    """Bytes per token that checkpoint offloading keeps in pinned CPU memory: every layer's input."""
    return shape.layers * s.dtype_bytes * shape.hidden if s.offload_checkpoints else 0.0


def pinned(nbytes: float) -> float:
    """What a pinned host allocation of `nbytes` takes: torch's caching host allocator rounds it up to a power of 2."""
    return 2.0 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0.0


def optimizer_groups(shape: ModelShape, s: Setting, ratio: float) -> tuple[list[float], list[float]]:
    """(stepped on the GPU, stepped on the CPU): the sizes of DeepSpeed ZeRO-3's optimizer sub-groups of one process's
    partition, as `_create_fp16_sub_groups` makes them (parameters in the model's order, each partitioned over the
    GPUs, a sub-group closed once it holds `sub_group_size`), split as its partial offload does (sub-group i on the
    CPU if i >= int((1 - ratio) x count)). LoRA's adapters, or a shape without parameter sizes: one sub-group."""
    sizes = [-(-n // s.gpus) for n in shape.param_sizes] if shape.param_sizes and not s.lora_r else []
    groups, held = [], 0.0
    for size in sizes:
        held += size
        if held >= SUB_GROUP_SIZE:
            groups.append(held)
            held = 0.0
    if held or not groups:
        groups.append(held or trainable(shape, s) / s.gpus)
    here = int((1 - ratio) * len(groups))
    return groups[:here], groups[here:]


def host_bytes(shape: ModelShape, s: Setting) -> float:
    """Host memory per node while training where anything is offloaded (without, host memory is not what limits a
    run): each process's own (`HOST_PER_PROCESS`), what it offloads and the 16-bit gradients DeepSpeed keeps there:
    - the optimizer (its share under ZeRO-3): fp32 master weights and Adam moments (`state_bytes` per parameter) and
      the fp32 gradients, pinned per sub-group; under ZeRO-3 a pinned 16-bit gradient of every parameter too;
    - the weights (ZeRO-3 parameter offload): a pinned 16-bit copy;
    - the checkpoints: each layer's input, pinned.
    Pinned allocations are rounded up to a power of 2 (`pinned`). (DeepSpeed's estimator, printed beside it, counts
    the whole model built in host memory and 1.5x that, which sft's `zero.Init` build does not need.)"""
    per_node = min(s.gpus_per_node or s.gpus, s.gpus)
    part = trainable(shape, s) / s.gpus
    offloaded = 0.0
    if s.offload_optimizer:
        cpu = optimizer_groups(shape, s, s.ratio)[1] if s.sharding.weights else [part]
        offloaded += s.state_bytes * sum(cpu) + sum(pinned(4 * g) for g in cpu)
        offloaded += pinned(s.dtype_bytes * part) if s.sharding.weights else 0
    if s.offload_params:  # zero.Init pins each weight's partition, then copies them into one flat pinned buffer
        offloaded += pinned(s.dtype_bytes * part) + offloaded_weight_bytes(shape, s)
    if s.offload_checkpoints:
        offloaded += shape.layers * pinned(s.tokens * s.dtype_bytes * shape.hidden)
    return per_node * (HOST_PER_PROCESS + offloaded) if offloaded else 0.0


def offloaded_weight_bytes(shape: ModelShape, s: Setting) -> float:
    """ZeRO-3 parameter offload: DeepSpeed's `zero.Init` pins each parameter's partition on the host as it builds
    the model (`partition_parameters.py`), then the optimizer copies the trainable ones into a flat pinned buffer per
    parameter group (`stage3.py`, `param_groups_fp16_flat_cpu_memory`, counted apart) and frees them; torch's caching
    host allocator keeps what was freed, so both stay. Each partition is rounded up to a power of 2 (`pinned`).
    Measured on 1 x H100: Llama-3.2-3B and Qwen3-4B shapes held 9.5 and 12.3 GiB more than a plan without this term,
    which counts 8.4 and 10.6 GiB for it (benchmarks/results/long_context_1gpu, calls 6 and 8)."""
    if not shape.param_sizes:  # a shape without sizes: the weights once, unpinned
        return s.dtype_bytes * shape.n_params / s.gpus
    return sum(pinned(s.dtype_bytes * -(-n // s.gpus)) for n in shape.param_sizes)


def model_states(shape: ModelShape, s: Setting) -> tuple[float, float]:
    """(GPU bytes per GPU, host bytes per node) for weights, gradients and optimizer: DeepSpeed's equations, plus
    QLoRA's quantization constants, whole on every GPU at any stage."""
    gpu, cpu = _partitioned_states(shape, s)
    return gpu + quant_constant_bytes(shape, s), cpu


def _partitioned_states(shape: ModelShape, s: Setting) -> tuple[float, float]:
    """(GPU bytes per GPU, host bytes per node) of weights, gradients and optimizer states. Under expert parallelism
    (AutoEP, ZeRO-0/1/2) the routed experts are apart: each GPU holds 1/ep of them, with their 16-bit weights and
    gradients whole and their fp32 master weights and Adam moments partitioned (ZeRO-1/2) over the gpus/ep ranks that
    hold the same experts, as DeepSpeed's expert-data-parallel groups do."""
    split = shape.expert_params if s.ep > 1 and not s.lora_r else 0
    gpu, cpu = _zero_states(shape, s, trainable(shape, s) - split)
    if split:
        local, group = split / s.ep, max(s.gpus // s.ep, 1)
        sharding = s.sharding  # ZeRO-1/2: the experts' states (and ZeRO-2's fp32 gradients) over the group
        states = (s.state_bytes + 4 * sharding.gradients) / group if sharding.optimizer else s.state_bytes
        gpu += 4 * local + (s.state_bytes if sharding.weights else states) * local
        cpu += 4 * local * (s.gpus_per_node or s.gpus) * 1.5  # the weights loaded on the host, as for the others
    return gpu, cpu


def _zero_states(shape: ModelShape, s: Setting, p: float) -> tuple[float, float]:
    """The engine's equations for `p` trainable parameters (DeepSpeed's for ZeRO-2/3, `sft.engines.model_states`),
    plus LoRA's frozen base."""
    per_node = s.gpus_per_node or s.gpus
    nodes = max(s.gpus // per_node, 1)
    frozen = frozen_weight_bytes(shape, s)
    states = engines.model_states(
        p, shape.largest_module_params, per_node, nodes, s.zero_stage, s.offload_optimizer, s.offload_params
    )
    if s.sharding.weights:
        gpu, cpu = states
        return gpu + (0 if s.offload_params else frozen / s.gpus), cpu
    if s.sharding.gradients:
        gpu, cpu = states
        return gpu + frozen, cpu
    if s.sharding.optimizer:  # ZeRO paper: 16-bit weights and gradients whole, optimizer states partitioned
        return 4 * p + s.state_bytes * p / s.gpus + frozen, 4 * p * per_node * 1.5
    # stage 0 / no DeepSpeed: 16-bit weights and gradients, fp32 master weights and Adam moments
    return (4 + s.state_bytes) * p + frozen, 4 * p * per_node * 1.5


def trainable(shape: ModelShape, s: Setting) -> int:
    return shape.trainable(s.lora_r)


def frozen_weight_bytes(shape: ModelShape, s: Setting) -> float:
    """LoRA: the frozen base weights (16-bit, or QLoRA's linears in 4-bit NF4; their constants are apart); full
    fine-tuning: the weights that stay frozen (a vision encoder), 16-bit, with no gradient or optimizer state."""
    if not s.lora_r:
        return shape.frozen_params * s.dtype_bytes
    if s.qlora:
        return shape.linear_params * 0.5 + (shape.n_params - shape.linear_params) * 2
    return shape.n_params * s.dtype_bytes


def load_bytes(shape: ModelShape, s: Setting) -> float:
    """QLoRA under ZeRO-3, while the model loads: the weights load into host memory, each quantized on the GPU on its
    way (`sft.model.quantization.loading`), so the GPU holds one linear at a time, in 16 bits and packed in 4. (Before,
    transformers' loader put the whole 4-bit model on each GPU: 20.78 GiB at 40 layers of 70B width;
    benchmarks/results/qlora_70b.)"""
    if not (s.qlora and s.sharding.weights):
        return 0.0
    largest = shape.hidden * max(shape.intermediate, shape.heads * shape.head_dim)
    return largest * (s.dtype_bytes + 0.5)


def quant_constant_bytes(shape: ModelShape, s: Setting) -> float:
    """QLoRA's quantization constants: an fp32 absmax per block of 64 weights, or (`use_bnb_nested_quant`) an 8-bit
    one plus an fp32 per 256 blocks. bitsandbytes keeps them beside the parameter, so ZeRO-3 never partitions them."""
    if not s.qlora:
        return 0.0
    return shape.linear_params * ((1 / 64 + 4 / (64 * 256)) if s.qlora_nested else 4 / 64)


def gathered_layer_bytes(shape: ModelShape, s: Setting) -> float:
    """One decoder layer as ZeRO-3 gathers it: 16-bit, or (QLoRA) its linears still packed in 4 bits."""
    if not s.qlora:
        return s.dtype_bytes * shape.decoder_layer_params
    linear = shape.linear_params / shape.layers
    return linear * 0.5 + (shape.decoder_layer_params - linear) * s.dtype_bytes


def estimate(shape: ModelShape, s: Setting) -> Estimate:
    _check_setting(s)
    b, n = s.dtype_bytes, s.gpus
    p = trainable(shape, s)
    # Expert parallelism (ZeRO-0/1/2): a GPU holds 1/ep of the routed experts, whose optimizer states and gradient
    # partition are split over the n/ep GPUs holding the same experts; the other parameters as without it
    e = shape.expert_params if s.ep > 1 and not s.lora_r else 0
    held = p - e + e / s.ep  # parameters a GPU holds whole in 16 bits
    part = (p - e) / n + e / s.ep / max(n // s.ep, 1)  # its partition of the optimizer states and gradients
    states_gpu, host = model_states(shape, s)
    items, step, states_own = _resident(shape, s, p, held, part)
    static = sum(items.values())
    backward, loss_phase = _backward(shape, s, held, part)
    host_pinned = host_bytes(shape, s)
    if s.qlora:
        largest_linear = max(shape.hidden * shape.intermediate, shape.hidden * shape.heads * shape.head_dim)
        backward["QLoRA dequantised weight (largest linear)"] = 2 * b * largest_linear
    if s.fp8:
        backward["FP8 casts in flight (largest linear)"] = fp8_bytes_in_flight(shape, s)
    at_backward = static + max(sum(backward.values()), loss_phase)
    if loss_phase:  # shown beside the layers' lines, not added to them
        backward["(the loss's backward, before the layers': stash, LM head, its gradients, tile)"] = loss_phase
    at_step = static + sum(step.values())
    at_load = load_bytes(shape, s)
    if at_backward >= at_step:
        items.update(backward)
        phase, peak = "forward/backward", at_backward
    else:
        items.update(step)
        phase, peak = "optimizer step", at_step
    if at_load:  # before training, alone on the GPU: not added to the lines above
        items["(model load: one linear quantized at a time)"] = at_load
    if at_load > peak:
        phase, peak = "model load", at_load
    return Estimate(s, items, states_gpu, peak, phase, host, at_backward, at_step, states_own, host_pinned)


def _check_setting(s: Setting) -> None:
    """Settings the plan cannot estimate because the engine cannot run them."""
    sharding = s.sharding  # a stage ZeRO does not have is refused here
    if (s.offload_optimizer or s.offload_params) and not sharding.gradients:
        raise ConfigError("CPU offload needs ZeRO-2 (optimizer) or ZeRO-3 (optimizer and/or parameters).")
    if s.offload_params and not sharding.weights:
        raise ConfigError("Parameter offload needs ZeRO-3.")
    if s.qlora and not s.lora_r:
        raise ConfigError("QLoRA needs a LoRA rank (--lora-r).")
    if s.offload_checkpoints and not s.activation_checkpointing:
        raise ConfigError("Offloading checkpoints needs activation checkpointing (--activation-checkpointing).")
    if s.keep_attention_outputs and not (s.activation_checkpointing and not s.offload_checkpoints):
        raise ConfigError("Keeping attention outputs needs activation checkpointing, without offloaded checkpoints.")


# ... and what its step holds besides, per element of the tensor it steps: both moments dequantised to fp32 (measured:
# 8.031 bytes per element of a flat tensor of 1e9 and 4e9 elements, none for fused fp32 AdamW; benchmarks/results/
# optimizer_step_memory). ZeRO-1/2 hand it the whole partition as one tensor, ZeRO-3 one sub-group at a time.
EIGHT_BIT_STEP_BYTES = 8 + 8 / 256
# ... except where sft's fused step runs it (`sft.run.optimizer`, one Triton kernel per tensor that reads and writes
# the codes, nothing dequantized beside them): without an engine on a GPU, each tensor under this many elements
FUSED_STEP_MAX_ELEMENTS = 2**31


def fused_step_off() -> str | None:
    """Why sft's fused 8-bit step is off by the user's choice (`SFT_FUSED_ADAMW=0`: torchao's own step, the benchmarks'
    baseline), or None: the plan counts the fused step for every GPU, whose torch ships Triton
    (`sft.run.optimizer.cannot_fuse` adds what only the run's machine can tell)."""
    return "SFT_FUSED_ADAMW=0" if os.environ.get("SFT_FUSED_ADAMW") == "0" else None


EIGHT_BIT_STEP_LINE = "8-bit Adam moments as fp32 (step)"
# `optim: auto` (`sft train` and `sft plan`): torchao's 8-bit AdamW where the fastest setting that fits with its
# moments is this much faster than with fp32 moments. Its 300-step loss curve equals fp32 Adam's (1B widths on
# 1 x H100, last-50-step mean -0.001%, benchmarks/results/fp8/call5_accuracy_adam8); 8B on 2 GPUs planned for 80 GB
# under ZeRO-3 trained at 9,186 tokens/s with it against 6,053 with fp32 moments (benchmarks/results/
# speed_sweep_h200x4/call5_8b_adam8); on 3B on 1 x H100 it gained 1-2% (call6_adam8): not worth another optimizer.
EIGHT_BIT_GAIN = 1.1
EIGHT_BIT_OPTIM = "adamw_torch_8bit"


def _optimizer_line(s: Setting) -> str:
    if not s.master_weights:
        return "optimizer: Adam moments" + (" (8-bit)" if s.eight_bit_moments else " (16-bit)") + ", no fp32 master"
    return "optimizer: fp32 master + Adam moments" + (" (8-bit)" if s.eight_bit_moments else "")


def _sharded_weights(shape: ModelShape, s: Setting, p: float, frozen: float, items: dict, step: dict) -> float:
    """ZeRO-3's resident lines (into `items`) and the step's (into `step`); returns the model states alone."""
    b, n = s.dtype_bytes, s.gpus
    items["weights (16-bit, partitioned)"] = 0 if s.offload_params else b * p / n + frozen / n
    if s.offload_optimizer:  # DeepSpeed keeps every 16-bit gradient on the host then (`host_bytes`)
        stepped_here = sum(optimizer_groups(shape, s, s.ratio)[0])
        items["optimizer's GPU share: fp32 master, Adam, fp32 gradients"] = (s.state_bytes + 4) * stepped_here
        sub_group = 0
    else:
        items["gradient partition (16-bit)"] = b * p / n
        items[_optimizer_line(s)] = s.state_bytes * p / n
        sub_group = min(p / n, SUB_GROUP_SIZE)
    step["fp32 gradients of one sub-group (step)"] = 4 * sub_group
    step["16-bit gradient copy of one sub-group (step)"] = 2 * sub_group
    if s.eight_bit_moments:
        step[EIGHT_BIT_STEP_LINE] = EIGHT_BIT_STEP_BYTES * sub_group
    # DeepSpeed's "largest layer" term: one module's 16-bit weight and gradient, gathered
    return sum(items.values()) + 4 * sub_group + 4 * shape.largest_module_params


def _sharded_gradients(s: Setting, part: float, items: dict, step: dict) -> float:
    """ZeRO-2's optimizer line (into `items`, beside the weights) and the step's (into `step`); returns the model
    states alone."""
    b, n = s.dtype_bytes, s.gpus
    items[_optimizer_line(s)] = 0 if s.offload_optimizer else s.state_bytes * part
    on_gpu = 0 if s.offload_optimizer else part
    step["gradient partition (16-bit)"] = b * on_gpu
    # with 8-bit moments the flattened copy is gone by the optimizer's step (3B on 1 x H100 and 8B on 2 x H200,
    # benchmarks/results/speed_sweep_*: planned 66.0 and 90.0 GiB this way, measured 66.1 and 90.1), and the step
    # goes one group of at most STEP_GROUP_PARAMS at a time (`sft.engines.deepspeed.zero.split_optimizer_groups`)
    if s.eight_bit_moments:
        group = min(on_gpu, STEP_GROUP_PARAMS / n)
        step["fp32 gradients of one group (step)"] = 4 * group
        step[EIGHT_BIT_STEP_LINE] = EIGHT_BIT_STEP_BYTES * group
    else:
        step["fp32 gradient partition (step)"] = 4 * on_gpu
        step["flattened gradient copy (step)"] = b * on_gpu
    return sum(items.values()) + (b + 4) * on_gpu


def _resident(shape: ModelShape, s: Setting, p: float, held: float, part: float) -> tuple[dict, dict, float]:
    """What stays allocated between steps, by stage (measured: ZeRO-2 2P + 12P/N, ZeRO-3 16P/N for full fine-tuning),
    what the optimizer step adds, and the model states alone; `p` trainable parameters, `held` whole on a GPU, `part`
    its partition."""
    b, n = s.dtype_bytes, s.gpus
    frozen = frozen_weight_bytes(shape, s)
    items: dict[str, float] = {}
    step: dict[str, float] = {}
    if s.qlora:
        items["QLoRA quantization constants (whole on every GPU)"] = quant_constant_bytes(shape, s)
    if s.sharding.weights:
        states_own = _sharded_weights(shape, s, p, frozen, items, step)
    elif s.sharding.gradients:
        items["weights (16-bit)"] = b * held + frozen
        states_own = _sharded_gradients(s, part, items, step)
    elif s.sharding.optimizer:
        items["weights (16-bit)"] = b * held + frozen
        items[_optimizer_line(s)] = s.state_bytes * part
        if s.eight_bit_moments:  # one group of at most STEP_GROUP_PARAMS at a time (as ZeRO-2)
            group = min(part, STEP_GROUP_PARAMS / n)
            step["gradients 16-bit + fp32 of one group (step)"] = b * held + 4 * group
            step[EIGHT_BIT_STEP_LINE] = EIGHT_BIT_STEP_BYTES * group
        else:
            step["gradients 16-bit + fp32 partition (step)"] = b * held + 4 * part
        states_own = sum(items.values()) + sum(step.values())
    else:
        items["weights (16-bit)"] = b * held + frozen
        items[_optimizer_line(s)] = s.state_bytes * held
        if s.master_weights:
            step["gradients 16-bit + fp32 (step)"] = b * held + 4 * held
        else:  # bf16 weights stepped in place: their bf16 gradients, no fp32 copy
            step["gradients (16-bit, step)"] = b * held
        # without ZeRO the optimizer steps each parameter apart, the fused step without a fp32 copy of its moments
        largest = shape.largest_module_params
        if s.eight_bit_moments and (fused_step_off() or largest >= FUSED_STEP_MAX_ELEMENTS):
            step[EIGHT_BIT_STEP_LINE] = EIGHT_BIT_STEP_BYTES * largest
        states_own = sum(items.values()) + sum(step.values())
    return items, step, states_own


def _backward(shape: ModelShape, s: Setting, held: float, part: float) -> tuple[dict, float]:
    """Forward/backward: activations plus the largest of the buffers that live at the start of backward; returns
    (those terms, the loss's backward where it runs apart from the layers' (0 otherwise))."""
    b, n, v_h, full = s.dtype_bytes, s.gpus, shape.vocab * shape.hidden, not s.lora_r
    backward: dict[str, float] = {"activations": s.tokens * activation_bytes_per_token(shape, s)}
    if s.tiled_mlp:  # one tile of about `hidden` tokens: its intermediates and their gradients
        backward["tiled MLP: one tile in flight"] = 2 * min(s.tokens, shape.hidden) * mlp_bytes_per_token(shape, s)
    elif shape.experts:  # the backward of one MoE layer: the gradient of its [tokens x k, hidden] input copy
        backward["experts: one layer's dispatch gradient"] = s.tokens * 2 * shape.experts[1] * shape.hidden * b
    if shape.wide_layers and attention.wide_kernel_name() == "matmul":  # `sft.model.wide_heads`: one batch at a time
        backward["wide heads' attention: one batch in flight"] = wide_heads.in_flight_bytes(
            shape.heads, shape.wide_head_dim, s.tokens, -(-s.seq_len // s.sp)
        )
    loss_phase = 0.0
    tile = b * min(s.tokens, TOKEN_CHUNK) * min(shape.vocab, VOCAB_CHUNK)
    head_grad = 6 * v_h if full else 0  # fused LM head backward: its weight gradient in fp32, then in 16-bit
    if s.sharding.weights:
        # One process holds every parameter whole in its partition: DeepSpeed skips the gather (no buffers;
        # measured: QLoRA 70B widths on 1 GPU, benchmarks/results/qlora_70b), unless the partition is on the CPU
        gathers = n > 1 or s.offload_params
        if s.offload_checkpoints:  # the loss's backward and the layers' are apart (`loss_backward_apart`)
            held, loss_phase = loss_backward_apart(shape, s, gathers, head_grad, tile)
            backward.update(held)
        else:
            backward["LM head gathered + its gradient + loss tile"] = b * v_h * gathers + head_grad + tile
            if shape.tied:  # the shared embedding is gathered again for the input and (full FT) its gradient kept
                backward["tied embedding: second copy + gradient"] = b * v_h * (gathers + full)
        backward["decoder layers gathered (current + prefetch)"] = 2 * gathered_layer_bytes(shape, s) * gathers
    elif s.sharding.gradients:
        from sft.engines import bucket_elements

        partition = 0 if s.offload_optimizer else b * part
        # reduce_bucket_size "auto": double-buffered where overlap_comm is on (several processes), one on one process
        buckets = (2 if s.gpus > 1 else 1) * b * bucket_elements(shape.hidden, s.gpus, trainable(shape, s))
        during = max(partition + (b * v_h if full else 0), head_grad + tile)
        backward["gradient partition / LM head gradient"] = during + buckets
        if s.accumulation > 1 and partition:
            # held from the first optimizer step on when micro-batches accumulate (measured on 1 x H100, Llama-3.2-3B
            # widths: every step after the first peaks 2P bytes higher, FP8 on or off; benchmarks/results/
            # plan_defaults; the calibration and validation runs had no accumulation)
            backward["16-bit gradients accumulated across micro-batches"] = partition
    else:  # the LM head's gradient from the fused loss is in flight beside the 16-bit ones held: Liger's in 16 bits,
        # TRL's fused head's in fp32 and then 16 bits (measured: Qwen2.5-VL-7B widths at 12 layers without an engine,
        # 1 x H200 capped at 79.18 GiB, micro batch 1 and 2: 48.23 and 69.26 GiB, planned 45.24 and 66.97 without it;
        # benchmarks/results/family_speed_h100/call6_vlm_h200)
        in_flight = (b * v_h if s.liger else head_grad) if full else 0
        backward["gradients (16-bit) + LM head's in flight + loss tile"] = b * held + in_flight + tile
        if s.liger and not s.lora_r:  # measured with Liger (without it, Qwen2.5-7B's peak was 0.2% under the lines)
            backward["measured beyond these lines, not yet attributed"] = UNATTRIBUTED_WITHOUT_ENGINE
    return backward, loss_phase


def loss_backward_apart(
    shape: ModelShape, s: Setting, gathers: bool, head_grad: float, tile: float
) -> tuple[dict[str, float], float]:
    """ZeRO-3 with the checkpoints offloaded: (what the loss leaves on the GPU through the decoder layers' backward,
    the loss's own backward). With every layer's input on the host, the LM head's backward (its weight's gradient in
    fp32 and 16 bits, the loss tile, the hidden states' gradient) runs before the layers' and is gone by their peak:
    the larger of the two is the peak, not their sum. Through the layers' backward stay the head's gathered weight
    and, where the embedding is tied to it, the head's gradient, which autograd holds until the embedding's is added
    to it. Liger's fused linear cross-entropy computes the head's gradient in 16 bits in the forward.
    Measured on 1 x H100 (benchmarks/results/long_context_1gpu, calls 8, 9, 11): Llama-3.2-3B with Liger at 69,632 /
    97,280 / 110,592 / 120,832 tokens peaked at 7.66 / 9.63 / 10.58 / 11.31 GiB, planned 7.58 / 9.74 / 10.78 / 11.58;
    Qwen3-4B without Liger at 32,768 / 52,224 / 57,344 at 6.95 / 9.47 / 10.13, planned 7.51 / 10.67 / 11.50. The sum
    the other regimes add was 35-53% over there (call 6)."""
    b, v_h, h = s.dtype_bytes, shape.vocab * shape.hidden, shape.hidden
    full = not s.lora_r
    held = {"LM head weight gathered (held through the backward)": b * v_h * gathers}
    if shape.tied and full:
        held["tied LM head's gradient (held until the embedding's)"] = b * v_h
    stash = min(OFFLOAD_STASH_LAYERS, shape.layers) * b * h * s.tokens
    # Liger: its 16-bit weight gradient and the input's gradient, from the forward; TRL's fused LM head: the head's
    # and the hidden states' gradients in fp32, then cast
    loss = b * v_h * full + b * h * s.tokens if s.liger else head_grad + tile + 6 * h * s.tokens
    return held, b * v_h * gathers + 2 * b * h * s.tokens + stash + loss
