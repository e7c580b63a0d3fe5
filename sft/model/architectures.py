"""What sft knows about a model architecture, in one place: every other module asks here.

`of(config)` reads a transformers config (no weights) and returns an `Architecture`:

- **attention features per decoder layer** (`Attention`): the sliding window of each layer (Mistral, Phi-3 and Qwen2
  with `use_sliding_window` on every layer; Gemma 2/3 and gpt-oss on the layers `layer_types` names), logit
  soft-capping (Gemma 2), attention sinks (gpt-oss), and layers that are not softmax attention at all (Qwen3-Next's
  linear attention). These are exactly the arguments transformers hands the attention function
  (`tests/test_architectures.py` checks the two against each other for every family), so a backend can be checked
  against them before the model is built (`sft.model.attention.check_backend`);
- **the mixture-of-experts layout** (`Experts`): experts, active experts per token, expert width, shared experts, how
  many layers are dense;
- **the kernels known good for the family** (`KERNELS`): Liger, FP8 and compiled decoder layers are on by default only
  for a family where a GPU run measured them finite, matching the plain run and faster
  (`benchmarks/architectures.py`, `benchmarks/results/architectures/`); elsewhere off, with the reason logged;
- **FLOPs per token** on the parameters a token actually multiplies (the active experts of a MoE layer, not all of
  them), and the attention FLOPs of each layer with its window;
- **the module structure**: which modules are the decoder layers (`decoder_layers`), which linears are inside them.

A family not in the table (`known` false) trains on the generic path: what `AutoModelForCausalLM` loads, with the
attention features read from the config the same way, every fast path off, and one log line saying so.
"""

from __future__ import annotations

import collections
import logging
import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sft.errors import ConfigError

logger = logging.getLogger(__name__)

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


class Kernel(NamedTuple):
    on: bool
    reason: str
    # its tokens/s against plain bf16's at the same micro batch, where measured (Liger: `benchmarks/architectures.py`);
    # the speed model weighs it against what the kernel frees (`sft.plan.speed`: a kernel's worth is the fastest
    # setting it makes possible, not its speed at a fixed micro batch)
    speedup: float | None = None


@dataclass(frozen=True)
class Attention:
    """What the attention of every decoder layer asks of a backend, beyond plain causal softmax attention."""

    windows: tuple[int | None, ...]  # per layer: transformers' `sliding_window` (a token sees the last `w`), or None
    softcap: float | None = None  # tanh soft-capping of the attention logits (Gemma 2)
    sinks: bool = False  # a learned per-head sink logit in the softmax (gpt-oss)
    other_layers: tuple[str, ...] = ()  # layer types that are not softmax attention (linear attention, mamba, ...)
    # layer types that are not softmax attention and that sft runs one sample at a time over a packed row (Gated
    # DeltaNet's linear attention: `sft.model.linear_attention`); packing keeps their samples apart
    per_sample: tuple[str, ...] = ()
    head_dims: tuple[int, ...] = ()  # per layer (Gemma 4: 512 on its full-attention layers, 256 on the sliding ones)
    softmax: tuple[bool, ...] = ()  # per layer: softmax attention (not a `per_sample` layer); empty: every layer

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def wide_heads(self) -> int:
        """Layers whose head dim is over what FlashAttention's kernels take (`FLASH_HEAD_DIM`)."""
        return sum(d > FLASH_HEAD_DIM for d in self.head_dims)

    def needs(self) -> list[str]:
        """The features a backend must honour, in words."""
        wants = []
        if self.sliding:
            sizes = sorted({w for w in self.windows if w is not None})
            layers = sum(w is not None for w in self.windows)
            wants.append(f"a sliding window of {', '.join(map(str, sizes))} tokens on {layers} of {len(self.windows)} "
                         "layers")  # fmt: skip
        if self.softcap is not None:
            wants.append(f"attention logit soft-capping at {self.softcap:g}")
        if self.sinks:
            wants.append("attention sinks")
        if self.wide_heads:
            wants.append(f"a head dim of {max(self.head_dims)} on {self.wide_heads} of {len(self.head_dims)} layers "
                         f"(FlashAttention's kernels take at most {FLASH_HEAD_DIM})")  # fmt: skip
        return wants


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layout: `moe_layers` of the decoder's layers route each token to `active` of `count`
    experts of width `width` (plus `shared` always-on experts of width `shared_width`); the others are dense."""

    count: int
    active: int
    width: int
    moe_layers: int
    shared: int = 0
    shared_width: int = 0
    router_aux: float = 0.0  # the config's `router_aux_loss_coef` (0: none)
    routes: bool = False  # the model can return its router logits (`output_router_logits`): TRL's load-balancing loss


@dataclass(frozen=True)
class Architecture:
    family: str  # transformers' model_type of the text model
    known: bool  # a row of KERNELS: its features and kernels were checked for this family
    layers: int
    hidden: int
    heads: int
    kv_heads: int  # a per-layer config's: the layers' mean (`_layer_widths`), what the plan's equations read
    head_dim: int  # the same
    intermediate: int  # the same: Gemma 4's layers that reuse another's keys and values have an MLP twice as wide
    vocab: int
    attention: Attention
    experts: Experts | None = None
    kernels: dict[str, Kernel] = field(default_factory=dict)
    kv_head_counts: tuple[int, ...] = ()  # per layer: the key-value heads (Ulysses splits each layer's)

    @property
    def packed_mask(self) -> bool:
        """Whether transformers' model code builds its attention mask from the position ids, so that mask-based
        backends (sdpa, eager, flex_attention) keep packed samples apart (tests/test_architectures.py checks both
        ways)."""
        return self.family not in MASK_WITHOUT_POSITIONS

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def liger_exact(self) -> bool:
        """Whether Liger's patches were measured exact on this family (on by themselves, or a candidate the plan's
        ranking may take for what they free)."""
        liger = self.kernel("liger")
        return liger.on or liger.speedup is not None

    def identity(self) -> dict:
        """What makes weights and optimizer states belong to this model (the checkpoint fingerprint's `architecture`):
        the family and every width and count that shapes a tensor."""
        e = self.experts
        return {
            "family": self.family, "layers": self.layers, "hidden": self.hidden, "heads": self.heads,
            "kv_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate": self.intermediate,
            "vocab": self.vocab,
            "experts": None if e is None else {"count": e.count, "active": e.active, "width": e.width,
                                               "moe_layers": e.moe_layers, "shared": e.shared},
        }  # fmt: skip

    def kernel(self, name: str) -> Kernel:
        """Whether fast path `name` (`liger`, `fp8`, `compile` (with FP8), `compile_bf16` (compiled layers without
        FP8), `experts` (`sft.model.experts`), `speed` (the plan's speed model)) is known good for this family, and
        why (not)."""
        if name in self.kernels:
            return self.kernels[name]
        unknown = f"{self.family} is not in sft's architecture table: {GENERIC}"
        return Kernel(False, UNMEASURED if self.known else unknown)

    def liger_on(self, asked: bool, auto: bool) -> bool:
        """Liger as asked (`use_liger_kernel`), except `auto` on a family where it was not measured good. `sft
        train`'s plan and `sft plan` both decide it here."""
        return asked and (self.kernel("liger").on or not auto)

    def liger_breaks_compile(self) -> str | None:
        """Why Liger's patch and compiled decoder layers must not run together on this family (measured), or None."""
        kernel = self.kernels.get("liger_compiled")
        return None if kernel is None or kernel.on else kernel.reason

    def compiled_bf16(self, on_gpu: bool) -> bool:
        """Compiled layers without FP8 where measured faster for the family, on a GPU (the measurement's; on the CPU
        Inductor's compile costs more than a test-sized run)."""
        return self.kernel("compile_bf16").on and on_gpu

    def compiled_on(self, asked: bool, auto: bool, liger_on: bool, fp8_on: bool, on_gpu: bool) -> bool:
        """Compiled decoder layers as asked (`compile_decoder_layers`), or `auto`: with FP8 (float8's casts and
        scales are fast only compiled), or where the family's compiled bf16 measured faster (`compiled_bf16`); off
        beside Liger where the pair was measured wrong (asked for both by name: refused). `sft train`'s plan and `sft
        plan` both decide it here."""
        wrong = self.liger_breaks_compile() if liger_on else None
        if not auto:
            if wrong and asked:
                raise ConfigError(
                    f"use_liger_kernel: true with compile_decoder_layers: true on {self.family}: {wrong}. Set "
                    "compile_decoder_layers: false to train with Liger, or use_liger_kernel: false for compiled "
                    "layers."
                )
            return asked
        return not wrong and ((fp8_on and self.kernel("compile").on) or self.compiled_bf16(on_gpu))

    def attention_pairs(self, lengths: torch.Tensor) -> torch.Tensor:
        """Query-key pairs causal attention computes for samples of these lengths, summed over the layers, each with
        its window: len^2 / 2 per sample for a full layer (the diagonal not counted apart); under a window w, w^2 / 2
        for the first w tokens and w for each one after. Each layer weighed by its head dim over the mean one (the
        FLOPs multiply the pairs by the mean width: Gemma 4's full layers are twice as wide); a linear-attention layer
        has none (its recurrence, linear in the length, is not counted)."""
        lengths = lengths.double()
        total = torch.zeros((), dtype=torch.float64, device=lengths.device)
        layers = len(self.attention.windows)
        dims = self.attention.head_dims or (self.head_dim,) * layers
        softmax = self.attention.softmax or (True,) * layers
        kinds = collections.Counter((w, d) for w, d, s in zip(self.attention.windows, dims, softmax, strict=True) if s)
        for (window, dim), count in kinds.items():
            inside = lengths if window is None else lengths.clamp(max=window)
            pairs = (inside * inside / 2 + (lengths - inside) * (window or 0)).sum()
            total = total + count * dim / self.head_dim * pairs
        return total

    @property
    def attention_width(self) -> int:
        """Attention heads x head dim: the inner width of QK^T and AV."""
        return self.heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """Intermediate activations one token makes in an average decoder layer's MLP (the active experts' for MoE)."""
        if self.experts is None:
            return self.intermediate
        e = self.experts
        moe = e.active * e.width + e.shared * e.shared_width
        return round((moe * e.moe_layers + self.intermediate * (self.layers - e.moe_layers)) / self.layers)

    @property
    def mlp_kept(self) -> int:
        """[tokens, intermediate] 16-bit tensors transformers' MLP (each active expert's) keeps for the backward: 4 for
        SwiGLU (SiLU's input and output, up's output, down's input); gpt-oss's clamped GLU keeps 7 (counted with
        autograd's saved-tensor hooks, tests/test_plan.py)."""
        return MLP_KEPT.get(self.family, 4)

    def describe(self, router_aux_loss_coef: float | None = None) -> str:
        """The family and what it needs; `router_aux_loss_coef` is TRL's training argument (None: the config's)."""
        parts = [self.family if self.known else f"{self.family} (generic path)"]
        parts += self.attention.needs() or ["plain causal attention"]
        if self.attention.other_layers:
            parts.append(f"{', '.join(self.attention.other_layers)} layers")
        if self.attention.per_sample:
            # which kernel (fla's varlen or the torch path one sample at a time): sft.model.converters' line
            parts.append(f"{', '.join(self.attention.per_sample)} layers (each packed sample from its own zero state)")
        if self.experts:
            e = self.experts
            parts.append(f"{e.count} experts, {e.active} active, width {e.width} on {e.moe_layers} of {self.layers} "
                         f"layers" + (f", {e.shared} shared" if e.shared else ""))  # fmt: skip
            coef = e.router_aux if router_aux_loss_coef is None else router_aux_loss_coef
            if coef and e.routes:  # TRL's SFTTrainer adds coef x the model's aux_loss and logs it
                parts.append(f"router load-balancing loss x{coef:g} trained (aux_loss in the logs)")
            else:
                parts.append("no router load-balancing loss (router_aux_loss_coef 0)")
        return "; ".join(parts)


GENERIC = "never measured on a GPU: every fast path off"
RESULTS = "benchmarks/results/architectures, 1 x H100, 2 layers at the family's widths"
# Liger's patches exist per model type (liger_kernel.transformers.monkey_patch). `benchmarks/architectures.py` measured
# each family against its plain bf16 run: every Liger run finite and within 0.06% of plain's loss per step; on where
# it was also faster. FP8 measured slower than bf16 at 2 layers for every family, Llama's too (0.49x eager, 0.63x
# compiled), where its full-depth runs gain 1.04-1.16x (benchmarks/results/fp8): so FP8 stays on only for Llama,
# measured at full depth, until another family is. Compiled layers follow FP8 (`compile_decoder_layers: auto`), or
# are on alone where `compile_bf16` was measured faster (a MoE's elementwise work between its grouped GEMMs).
LLAMA_MEASURED = Kernel(True, "measured exact and faster at full depth on the Llama shapes (benchmarks/results/fp8, "
                        "throughput)")  # fmt: skip
FP8_UNMEASURED = Kernel(False, f"slower than bf16 at 2 layers ({RESULTS}; so was Llama's, which gains only at full "
                        "depth); not yet measured at full depth")  # fmt: skip
COMPILE_WITH_FP8 = Kernel(False, "on only with FP8")


# sft's experts implementation (`sft.model.experts`) against transformers' grouped_mm, sft's defaults otherwise (1 x
# H100, benchmarks/results/moe_h100): one layer forward + backward 1.11x (Qwen3-30B-A3B widths) and 1.04x
# (gpt-oss-20b); the whole eager model 1.03x (Qwen3-MoE) and 1.02x (gpt-oss); under compiled layers 0.996x (Inductor
# fuses transformers' elementwise work)
MOE_RESULTS = "benchmarks/results/moe_h100"
EXPERTS_GPT_OSS = Kernel(True, f"sft_grouped: equal to the per-expert loop, 1.04x transformers' grouped_mm per layer, "
                         f"1.02x the whole model ({MOE_RESULTS})")  # fmt: skip
EXPERTS_UNDER_COMPILE = Kernel(False, f"equal to transformers' grouped_mm under compiled layers (0.996x its tokens/s, "
                               f"{MOE_RESULTS})")  # fmt: skip


def _liger(speed: float) -> Kernel:
    """Liger measured exact on the family at `speed` x plain bf16's tokens/s (2 layers, the same micro batch): on by
    itself where not slower; elsewhere a candidate the plan's ranking takes where what it frees (the logits, the
    norms' and SwiGLU's activations) buys a faster setting (`sft.plan.preflight`)."""
    if speed >= 1.0:
        return Kernel(True, f"finite, loss within 0.06% of plain bf16, {speed:.2f}x its tokens/s ({RESULTS})", speed)
    why = f"finite and exact but {speed:.2f}x plain bf16's tokens/s at the same micro batch ({RESULTS})"
    return Kernel(False, why, speed)


UNMEASURED = "not yet measured for this family on a GPU"
RESULTS_2026 = "benchmarks/results/families_2026"
# a family's mixture-of-experts configs where they differ from its dense row (what was measured on the dense one only)
# Gemma 4's MoE with compiled layers: equal to eager in fp32 on the CPU (tests/test_flops.py), but its first step's
# gradient norm was NaN in bf16 at 8 layers of its widths (1 x H200, compiled_failures_calls12_15.txt), so they stay
# off there; asked for by name they are kept, with this reason in the log, and sft's non-finite check stops the run.
KERNELS_MOE: dict[str, dict[str, Kernel]] = {
    "gemma4_text": {"compile_bf16": Kernel(False, "compiled layers trained a NaN gradient norm at the first step of "
                                                  f"Gemma 4's MoE (bf16, 8 layers, 1 x H200, {RESULTS_2026}); equal "
                                                  "to eager in fp32 on the CPU")},
}  # fmt: skip
# `speed`: the plan ranks what fits by its speed model (`sft.plan.speed`) for every family sft knows and every
# vision-language family: the terms (matmul and attention FLOPs, recomputation, per-layer host work, ZeRO's gradient
# work, collectives, the optimizer step) come from the model's shapes, the card's constants are shared across families
# (fitted on Llama widths; a family gets its own only where a measurement shows it differs). Only the generic path
# (a family sft has not checked) keeps the plan's rule: the largest micro batch with the fewest levers.
SPEED_MEASURED = Kernel(True, "the speed model's constants were fitted on Llama widths (1B, 3B; "
                        "benchmarks/results/speed_sweep_h100)")  # fmt: skip
SPEED_FROM_SHAPES = Kernel(True, "the speed model's terms from this model's shapes, the card's constants shared with "
                           "Llama's (benchmarks/results/speed_sweep_h100)")  # fmt: skip
KERNELS: dict[str, dict[str, Kernel]] = {
    "llama": {"liger": LLAMA_MEASURED, "fp8": LLAMA_MEASURED, "compile": LLAMA_MEASURED, "speed": SPEED_MEASURED},
    "qwen2": {"liger": _liger(0.86), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},  # windowed: 0.93
    "qwen3": {"liger": _liger(0.996), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "mistral": {"liger": _liger(1.16), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "gemma2": {"liger": _liger(1.32), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "gemma3_text": {"liger": _liger(1.47), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "phi3": {"liger": _liger(1.17), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "olmo2": {"liger": _liger(1.09), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
    "gpt_oss": {
        "liger": _liger(1.12),
        "fp8": FP8_UNMEASURED,
        "compile": Kernel(
            False,
            "compiled layers fail in the first backward (Inductor's assert_size_stride: wrong "
            f"number of dimensions; torch 2.11, {MOE_RESULTS}; again on 1 x H200, {RESULTS_2026})",
        ),  # fmt: skip
        "experts": EXPERTS_GPT_OSS,
    },
    # mixture of experts: FP8 converts only the attention projections (the experts are 3-D weights, not nn.Linear;
    # their float8 grouped GEMMs, `sft.model.experts.NAME_FP8`, measured 0.75x bf16 per layer:
    # benchmarks/results/moe_h100)
    "qwen3_moe": {
        "fp8": Kernel(False, f"converts only the attention projections; 0.86x bf16 ({RESULTS})"),
        "experts": EXPERTS_UNDER_COMPILE,
        "compile_bf16": Kernel(
            True, f"1.39x the eager layers' tokens/s at Qwen3-30B-A3B's widths, loss within 1e-5 ({MOE_RESULTS})"
        ),  # fmt: skip
    },
    "mixtral": {},
    # packed exactly (tests/test_architectures.py); no kernel measured on a GPU yet
    "olmo3": {},
    "smollm3": {},
    # packed exactly, dense and MoE, its per-layer head dims and shared keys and values (tests/test_architectures.py)
    "gemma4_text": {
        # Liger 0.8.5's patch: exact eager (losses within 4.1e-4 of plain bf16 over 6 steps) and 1.08x plain's
        # tokens/s at 2 layers, but a wrong loss under compiled layers (16.7 -> 25.9 after one step, the same in a
        # model built after Liger patched the classes), which are on for Gemma 4 and faster (1 x H200, RESULTS_2026:
        # architectures_call9_liger.json, compile_rows_call10_gemma4.json: compiled layers without Liger equal eager)
        "liger": Kernel(
            False,
            "exact but 1.08x plain bf16 eager where compiled layers, which it breaks, give 1.40x "
            f"(1 x H200, {RESULTS_2026})",
        ),
        "liger_compiled": Kernel(
            False,
            "Liger's Gemma 4 patch under compiled decoder layers trained a wrong loss "
            f"(25.9 against eager's 16.7 after one step, 1 x H200, {RESULTS_2026})",
        ),
        # its seven RMSNorms per layer in fp32, GELU gate and per-layer inputs fused: 1.40x the eager layers' tokens/s
        # at 8 layers of its widths (58,703 against 42,033, ZeRO-2, one call; 0.40 s of elementwise kernels per 1.48 s
        # step down to 0.03), loss within 7e-4 of eager per step in bf16, equal in fp32 (tests/test_flops.py)
        "compile_bf16": Kernel(
            True,
            "1.40x the eager layers' tokens/s at 8 layers of Gemma 4's widths, 1 x H200; "
            f"equal to eager in fp32 ({RESULTS_2026})",
        ),
    },
    # its compiled layers at 8 layers of its widths, sft's one-GPU plan, one call: 63,680 tokens/s against eager's
    # 50,748 (1.25x; MFU 0.342, 0.79 of Llama's), losses within 5.2e-5 of eager's per step (bf16, the same start);
    # equal in fp32 on the CPU (tests/test_flops.py)
    "glm4_moe": {
        "liger": Kernel(False, "Liger has no patches for glm4_moe"),
        "compile_bf16": Kernel(
            True,
            "1.25x the eager layers' tokens/s at 8 layers of GLM-4-MoE's widths, losses within 5.2e-5 of eager's, "
            f"1 x H200; equal to eager in fp32 ({RESULTS_2026})",
        ),
    },
    # Gated DeltaNet on three of four layers: packed rows equal their samples alone, values and gradients, dense and
    # MoE (tests/test_linear_attention.py); fla's varlen kernels where they train (`sft.model.linear_attention`)
    # compiled layers (the Gated DeltaNet token mixer outside their graph, `sft.model.linear_attention`) without Liger:
    # 37,380 tokens/s a step once compiled (MFU 0.42) at 8 layers of its widths under sft's one-GPU plan, against
    # 28,934 eager with Liger (1.29x), losses alike; with FP8 and Liger under compiled layers 21,800 (1 x H100, Triton
    # 3.6, fla with sft's piece; RESULTS_2026, item 24)
    "qwen3_5_text": {
        # no `speedup`: not a candidate of the plan's ranking either (its 1.07x was measured eager; beside compiled
        # layers it was measured only with FP8)
        "liger": Kernel(
            False,
            "exact (losses within 4e-5 of plain bf16, 1.07x its tokens/s eager), but compiled layers without it "
            f"train at 1.29x the eager Liger run's tokens/s (1 x H100, {RESULTS_2026})",
        ),
        "compile_bf16": Kernel(
            True,
            "1.29x the eager layers' (with Liger) tokens/s a step at 8 layers of Qwen3.5's widths, 1 x H100; equal to "
            f"eager in fp32 on the CPU ({RESULTS_2026})",
        ),
    },
    "qwen3_5_moe_text": {
        "compile_bf16": Kernel(
            False,
            "compiled layers beside fla's kernels had not finished one step after 130 s at 8 layers of its widths "
            f"(1 x H200, {RESULTS_2026})",
        )
    },
    "deepseek_v3": {},
}


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _windows(text) -> tuple[int | None, ...]:
    layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    types = getattr(text, "layer_types", None)
    if window is None:
        return (None,) * layers
    if types is None:  # Mistral, Phi-3, Mixtral: the window on every layer
        return (window,) * layers
    return tuple(window if t == SLIDING else None for t in types)


def _experts(text) -> Experts | None:
    count = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                  if getattr(text, n, None)), None)  # fmt: skip
    if not count or getattr(text, "enable_moe_block", True) is False:
        return None
    active = next(getattr(text, n) for n in ("num_experts_per_tok", "top_k_experts") if getattr(text, n, None))
    layers = text.num_hidden_layers
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", 1) or 1
    first_dense = getattr(text, "first_k_dense_replace", 0) or 0
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)
    shared = getattr(text, "n_shared_experts", 0) or 0
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared_width = getattr(text, "shared_expert_intermediate_size", None) or (width if shared else 0)
    if getattr(text, "shared_expert_intermediate_size", None):
        shared = max(shared, 1)
    if getattr(text, "enable_moe_block", False):  # Gemma 4: each layer's dense MLP runs beside its experts
        shared, shared_width = 1, _intermediate(text)
    router_aux = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    routes = hasattr(text, "output_router_logits")
    return Experts(count, active, width, moe_layers, shared, shared_width, router_aux, routes)


def _intermediate(text) -> int:
    """The MLP's width, over the layers: Gemma 4's layers that reuse another layer's keys and values
    (`num_kv_shared_layers`) have one twice as wide with `use_double_wide_mlp`. None (0) where every layer's MLP is
    experts and the config names no dense width (Qwen3.5-MoE)."""
    width, layers = getattr(text, "intermediate_size", None), text.num_hidden_layers
    if width is None:
        experts = _experts(text)
        if experts is None or experts.moe_layers < layers:
            raise ConfigError(
                f"{text.model_type}: its config has no `intermediate_size` (the MLP's width) and not every layer is a "
                "mixture of experts: set `intermediate_size` in its config.json"
            )
        return 0
    if getattr(text, "use_double_wide_mlp", False):
        return round(width * (layers + (getattr(text, "num_kv_shared_layers", 0) or 0)) / layers)
    return width


def _layer_widths(text) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head dim, key-value heads): a per-layer config's overrides (`PER_LAYER_WIDTHS`), else the
    model's; any other attribute that varies by layer is refused, naming it."""
    varying = set(getattr(text, "per_layer_attributes", None) or ())
    if varying - PER_LAYER_WIDTHS:
        raise ConfigError(
            f"{text.model_type}: its layers differ in {', '.join(sorted(varying - PER_LAYER_WIDTHS))} (a per-layer "
            "config), and sft's plan reads one value per model of everything but "
            f"{', '.join(sorted(PER_LAYER_WIDTHS))} (its memory, FLOPs and kernels): not supported yet. Train it with "
            "another tool, or a model whose layers share their widths."
        )
    layers = [text.per_layer_config[i] for i in range(text.num_hidden_layers)] if varying else [text]
    heads = text.num_attention_heads
    dims = tuple(getattr(layer, "head_dim", None) or text.hidden_size // heads for layer in layers)
    kv = tuple(getattr(layer, "num_key_value_heads", None) or heads for layer in layers)
    return dims * (text.num_hidden_layers // len(dims)), kv * (text.num_hidden_layers // len(kv))


def of(config) -> Architecture:
    """The architecture of a transformers config (the text model's, for a multimodal one)."""
    text = text_config(config)
    family = text.model_type
    heads = getattr(text, "num_attention_heads", None)
    if not heads or not getattr(text, "num_hidden_layers", None):
        raise ConfigError(
            f"{family}: its config names no attention heads or decoder layers (num_attention_heads, "
            "num_hidden_layers): sft plans, packs and shards decoder models with attention layers, and a model "
            "without them (a pure state-space or recurrent model) is not supported. Train it with another tool."
        )
    head_dims, kv_counts = _layer_widths(text)
    types = getattr(text, "layer_types", None) or ()
    per_sample = {LINEAR} & set(types) if family in GATED_DELTANET_FAMILIES else set()
    attention = Attention(
        windows=_windows(text),
        softcap=getattr(text, "attn_logit_softcapping", None) if family in SOFTCAP_FAMILIES else None,
        sinks=family in SINK_FAMILIES,
        other_layers=tuple(sorted(set(types) - {SLIDING, FULL, "chunked_attention"} - per_sample)),
        per_sample=tuple(sorted(per_sample)),
        head_dims=head_dims,
        softmax=tuple(t not in per_sample for t in types) if per_sample else (),
    )
    experts = _experts(text)
    kernels = KERNELS.get(family, {})
    if experts is not None:
        kernels = {**kernels, **KERNELS_MOE.get(family, {})}
    if family in KERNELS or is_vision(config):  # a vision family's text model (qwen2_5_vl_text) has no row
        kernels = {"speed": SPEED_FROM_SHAPES, **kernels}
    return Architecture(
        family=family,
        known=family in KERNELS,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        heads=heads,
        # the plan's equations are sums over layers of terms linear in each layer's widths: the means keep them
        kv_heads=round(sum(k * d for k, d in zip(kv_counts, head_dims, strict=True)) / sum(head_dims)),
        head_dim=round(sum(head_dims) / len(head_dims)),
        intermediate=_intermediate(text),
        vocab=text.vocab_size,
        attention=attention,
        experts=experts,
        kernels=kernels,
        kv_head_counts=kv_counts,
    )


# Families whose attention passes `softcap` / `s_aux` to the attention function (checked against transformers' calls
# in tests/test_architectures.py). An unknown family that passes either is caught by the backend at its first call.
SOFTCAP_FAMILIES = {"gemma2"}
# What a layer of transformers' per-layer configs may override and sft still plan (Gemma 4's full-attention layers:
# head dim 512, fewer key-value heads); the largest head dim FlashAttention's kernels take
PER_LAYER_WIDTHS = {"head_dim", "num_key_value_heads"}
FLASH_HEAD_DIM = 256
# Families whose linear-attention layers are transformers' Gated DeltaNet, which sft runs one sample at a time over a
# packed row (`sft.model.linear_attention`; tests/test_linear_attention.py)
GATED_DELTANET_FAMILIES = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
# Families whose attention gives a padded row's real tokens other keys than the same tokens alone: GLM-5's indexer
# (`glm_moe_dsa`, transformers 5.24) takes its top-k keys before the padding mask, so padding positions take places
# the real keys would have (tests/test_sparse_attention.py): trained one unpadded row per micro batch
PADDING_CHANGES_ATTENTION = {"glm_moe_dsa"}
# transformers 5.x's gpt-oss calls create_causal_mask without position_ids: its sdpa/eager/flex masks are not packed
MASK_WITHOUT_POSITIONS = {"gpt_oss"}
SINK_FAMILIES = {"gpt_oss"}
# gpt-oss's gate: the [gate, up] pairs kept by both clamps, the clamped gate, its sigmoid, up + 1, the GLU and down's
# input
MLP_KEPT = {"gpt_oss": 7}


class LayerKeeps(NamedTuple):
    """What a decoder layer keeps for the backward besides its attention's and its MLP's tensors, by how the family
    builds the layer; the memory plan counts it (`sft.plan.memory.layer_bytes_per_token`), checked against autograd's
    saved-tensor hooks for every family (tests/test_plan.py on the CPU; with Liger on a GPU,
    benchmarks/results/layer_activations)."""

    norms: int = 2  # RMSNorms on the residual stream per layer (Gemma 2/3: 4, before and after each sublayer)
    fp32_scale: bool = False  # the norm scales in fp32 (Gemma, OLMo 2): its fp32 input and fp32 result are kept
    qk_norm: str | None = None  # "head": an RMSNorm per head on q and k (Qwen3, Gemma 3); "width": over the whole
    # projection (OLMo 2); None: none
    fused_qkv: bool = False  # one qkv projection (Phi-3): its output stays alive through the values' view of it
    residual_dropout: bool = False  # nn.Dropout on each sublayer's output (Phi-3): a 1-byte mask per element, even at
    # p = 0 (not kept under Liger's patches: measured, benchmarks/results/layer_activations)
    liger_qk_norm: bool = True  # Liger's patches of a model instance replace the q and k norms (OLMo 2's do not:
    # liger-kernel 0.8.5's `apply_liger_kernel_to_olmo2` patches only the post-norms; transformers' stay)
    v_norm: bool = False  # an RMSNorm without scale per head on the values too (Gemma 4)
    per_layer_input: int = 0  # the width of Gemma 4's per-layer input embeddings (PLE) that each layer gates in
    output_gate: bool = False  # the attention's output times a sigmoid gate from the query projection (Qwen3.5,
    # Qwen3-Next): the gate and the gated output kept besides the attention's output
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): (such layers, key heads, key head dim, value heads, value head dim);
    # () where none
    linear: tuple[int, ...] = ()
    # layers that reuse an earlier layer's keys and values (Gemma 4's `num_kv_shared_layers`, the last ones): (such
    # layers, their key-value heads x head dim summed, their key-value heads summed); () where none. They keep no key
    # or value of their own, nor their norms' (tests/test_plan.py)
    kv_shared: tuple[int, ...] = ()


LAYER_KEEPS = {
    "qwen3": LayerKeeps(qk_norm="head"),
    "qwen3_moe": LayerKeeps(qk_norm="head"),
    "gemma2": LayerKeeps(norms=4, fp32_scale=True),
    "gemma3_text": LayerKeeps(norms=4, fp32_scale=True, qk_norm="head"),
    "gemma4_text": LayerKeeps(norms=4, fp32_scale=True, qk_norm="head"),  # its norms counted by `layer_keeps`
    "olmo2": LayerKeeps(fp32_scale=True, qk_norm="width", liger_qk_norm=False),
    "olmo3": LayerKeeps(fp32_scale=True, qk_norm="width", liger_qk_norm=False),  # OLMo 2's layer, windowed
    "phi3": LayerKeeps(fused_qkv=True, residual_dropout=True),
    # Gemma's norm (1 + weight, in fp32) on the residual stream and per head; the gated attention output; their linear
    # layers read from the config (`layer_keeps`)
    "qwen3_5_text": LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True),
    "qwen3_5_moe_text": LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True),
    "qwen3_next": LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True),
}


NORMS_FROM_MODULES = {"gemma4_text"}


def layer_keeps(family: str, module_names: list[str], text=None) -> LayerKeeps:
    """The family's row of `LAYER_KEEPS`; a family without one: Llama's layer, with a per-head query and key norm where
    its layers have a `q_norm` (`module_names`: a decoder layer's modules). Gemma 4's layer is read from its modules
    and `text` config: the norms on the residual stream outside the attention (4, one more with per-layer inputs, four
    more with its experts), the values' norm, the per-layer input's width, the layers that reuse earlier layers' keys
    and values; Gated DeltaNet layers' count and widths from the config's `layer_types`."""
    has_qk_norm = any(n.split(".")[-1] == "q_norm" for n in module_names)
    row = LAYER_KEEPS.get(family) or LayerKeeps(qk_norm="head" if has_qk_norm else None)
    if family in NORMS_FROM_MODULES:
        norms = sum(
            1 for n in module_names if "self_attn" not in n and re.search(r"(layernorm|_norm|\.norm)(_\d)?$", n)
        )
        row = row._replace(norms=norms, v_norm="self_attn.v_norm" in module_names,
                           per_layer_input=getattr(text, "hidden_size_per_layer_input", 0) or 0)  # fmt: skip
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared:
        dims, kv = (widths[-shared:] for widths in _layer_widths(text))
        row = row._replace(kv_shared=(shared, sum(k * d for k, d in zip(kv, dims, strict=True)), sum(kv)))
    linear = sum(1 for t in getattr(text, "layer_types", None) or () if t == LINEAR)
    if linear:
        row = row._replace(linear=(linear, text.linear_num_key_heads, text.linear_key_head_dim,
                                   text.linear_num_value_heads, text.linear_value_head_dim))  # fmt: skip
    return row


def log_kernels(arch: Architecture, decisions: dict[str, Kernel], router_aux_loss_coef: float | None = None) -> None:
    """One line: the family, what its attention needs (and a MoE's router loss), and each fast path with the reason
    it is on or off."""
    kernels = "; ".join(f"{name} {'on' if k.on else 'off'} ({k.reason})" for name, k in decisions.items())
    logger.info("Model: %s. %s", arch.describe(router_aux_loss_coef), kernels)


# --- the module structure of a built model ---


@dataclass(frozen=True)
class Vision:
    """An image+text family as sft trains it (`VISION`, its one table): how its packed rows keep samples apart
    (`sft.data.vision`'s packer of that name) and how its images become tokens."""

    # "mrope": per-sample M-RoPE rows and a boundary row (Qwen-VL); "positions": 1-D positions restarting at each
    # sample; "masks": sft's own attention masks, each sample causal and its images both ways (Gemma 3)
    packing: str
    # every run image+text (built with transformers' image-text-to-text class); else a multimodal config fine-tuned on
    # text alone as often: image+text where the data has images (`images` in its records), a text run otherwise
    always: bool
    tiles: bool = False  # images cut into tiles, each image's prompt from its rows and columns (SmolVLM, Idefics3)
    text_expansion: bool = False  # its image tokens written into the rendered text (begin/end of image: Gemma 3)
    # "masks" only: the layer types in which an image's tokens attend to each other both ways (Gemma 3: every layer;
    # Gemma 4: the sliding ones), only where the text config's (field, value) of `both_ways_if` holds (Gemma 4's
    # `use_bidirectional_attention: vision`), and the batch key of the token types the model takes (1 on image tokens)
    both_ways: tuple[str, ...] = ("full_attention", "sliding_attention")
    both_ways_if: tuple[str, str] | None = None
    type_ids: str = "token_type_ids"
    framed: bool = False  # each image's tokens between its begin and end tokens, counted from its size (Gemma 4)


VISION = {
    "qwen2_vl": Vision("mrope", always=True),
    "qwen2_5_vl": Vision("mrope", always=True),
    "qwen3_vl": Vision("mrope", always=True),
    "smolvlm": Vision("positions", always=True, tiles=True),
    "idefics3": Vision("positions", always=True, tiles=True),
    "gemma3": Vision("masks", always=False, text_expansion=True),  # Gemma 3's 4B-27B checkpoints are `gemma3` configs
    # Gemma 4 (dense, MoE): image tokens per image from its size, both ways in the sliding layers only
    "gemma4": Vision(
        "masks",
        always=False,
        both_ways=("sliding_attention",),
        type_ids="mm_token_type_ids",
        both_ways_if=("use_bidirectional_attention", "vision"),
        framed=True,
    ),
    # Qwen3.5 and Qwen3.6 (dense, MoE): image+text checkpoints often fine-tuned on text; their linear-attention layers
    # run one sample at a time (`sft.model.linear_attention`) in image rows too
    "qwen3_5": Vision("mrope", always=False),
    "qwen3_5_moe": Vision("mrope", always=False),
}
# read from the table: the families every run of which is image+text, and those image+text where the data has images
VISION_FAMILIES = {family for family, v in VISION.items() if v.always}
IMAGE_DATA_FAMILIES = {family for family, v in VISION.items() if not v.always}
# the encoder module's name: Qwen-VL's `visual`, Gemma 3's `vision_tower`, SmolVLM's and Idefics3's `vision_model`
_ENCODERS = ("visual", "vision_tower", "vision_model")
_PROJECTORS = ("merger", "multi_modal_projector", "connector", "embed_vision")  # what maps its features into the text
_BESIDE = ("multi_modal_projector", "connector", "embed_vision")  # beside the encoder (Gemma 3, 4; SmolVLM, Idefics3)


_UNBUILT = ("audio_tower", "embed_audio")  # encoders of inputs sft builds no rows of (Gemma 4's audio): never trained


def unbuilt_input_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights of an encoder whose inputs sft never builds (Gemma 4's audio tower and its projector): no row of an
    sft run reaches them, so they are frozen (no gradient, no optimizer state) and the memory plan counts them so."""
    return [(n, p) for n, p in model.named_parameters() if any(part in _UNBUILT for part in n.split("."))]


def is_vision(config) -> bool:
    """Whether sft trains this config as a vision-language model whatever the data (image+text chats)."""
    return getattr(config, "model_type", None) in VISION_FAMILIES


def vision_tower_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """A vision family's encoder weights: what `train_vision_tower: false` freezes. Qwen2-VL, Qwen2.5-VL and Qwen3-VL
    keep the encoder in `visual` and its projector(s) there too (`merger`, Qwen3-VL's `deepstack_merger_list`); Gemma 3
    its encoder in `vision_tower` and its projector beside it (`multi_modal_projector`); SmolVLM and Idefics3 in
    `vision_model`, `connector` beside it. The projectors stay trainable: they map the encoder's features into the
    language model."""
    inside = tuple(f".{name}." for name in _ENCODERS)
    return [(n, p) for n, p in model.named_parameters()
            if any(part in f".{n}" for part in inside) and not any(x in n for x in _PROJECTORS)]  # fmt: skip


def vision_encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision family's encoder module (Qwen-VL's `visual`, with its projectors; Gemma 3's `vision_tower`; SmolVLM's
    and Idefics3's `vision_model`), under any wrapping (PEFT), or None."""
    for name, module in model.named_modules():
        if name.split(".")[-1] in _ENCODERS:
            return module
    return None


def vision_projector(model: torch.nn.Module) -> torch.nn.Module | None:
    """A projector that sits beside the encoder (Gemma 3's `multi_modal_projector`, SmolVLM's and Idefics3's
    `connector`), or None (Qwen-VL's are inside it)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] in _BESIDE:
            return module
    return None


def lora_targets(config, image_text: bool = False) -> str | None:
    """LoRA's target modules when the recipe names none: for an image+text run the language model's projections (PEFT
    knows no default for these families, and the vision encoder stays frozen); None elsewhere (PEFT's default)."""
    if not (is_vision(config) or image_text):
        return None
    return r".*\.(language_model|text_model)\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def model_class(config, image_text: bool = False):
    """The transformers auto class a config is built with: image-text-to-text for a vision family or an image+text
    run (`image_text`: Qwen3.5's causal-LM class is its text model alone), else causal LM."""
    import transformers

    vision = is_vision(config) or image_text
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT's wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder layers of a causal LM (transformers' `get_decoder().layers`), or None if it has none."""
    model = base_model(model)
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def decoder_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """The qualified names of the decoder layers in `model` (with a trailing dot): what is inside the decoder."""
    layers = {id(m) for m in decoder_layers(model) or ()}
    return tuple(f"{name}." for name, m in model.named_modules() if id(m) in layers)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' fused expert modules (`<Family>Experts`: 3-D weights, one slice per expert; under ZeRO-3 by their
    full shape, a rank's slice being flat)."""
    return [m for m in model.modules() if getattr(m, "num_experts", None) and any(
        len(_shape(p)) == 3 for p in m.parameters(recurse=False))]  # fmt: skip


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 partitions the data; the full shape stays here


def matmul_flops_per_token(model: torch.nn.Module, arch: Architecture | None = None) -> int:
    """Training FLOPs per token of the weights a token multiplies: every `nn.Linear` (6 x in x out, 4 x when frozen:
    no weight gradient), a router that holds a plain 2-D weight, and of each fused experts module only the `active`
    experts' share. Never the input embedding (a lookup), nor a vision encoder's weights (counted per image patch).

    in_features x out_features and the ZeRO-3 full shape, not `weight.numel()`: under ZeRO-3 a rank holds a slice of
    each weight, and 4-bit weights are packed."""
    experts = {id(m): m for m in experts_modules(model)}
    parts = [p for p in (vision_encoder(model), vision_projector(model)) if p is not None]  # `flops.VisionFlops`
    per_image = {id(m) for part in parts for m in part.modules()}
    total = 0.0
    for module in model.modules():
        if id(module) in per_image:
            continue
        if isinstance(module, torch.nn.Linear):
            total += (6 if module.weight.requires_grad else 4) * module.in_features * module.out_features
        elif id(module) in experts:
            share = (arch.experts.active if arch and arch.experts else module.num_experts) / module.num_experts
            for p in module.parameters(recurse=False):
                if len(_shape(p)) == 3:
                    total += (6 if p.requires_grad else 4) * math.prod(_shape(p)) * share
        elif type(module).__name__.endswith("Router"):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and len(_shape(weight)) == 2:
                total += (6 if weight.requires_grad else 4) * math.prod(_shape(weight))
    return round(total)
