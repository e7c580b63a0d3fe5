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
- **the kernels known good for the family** (`KERNELS`, a view of the family records of `sft.model.families`, like
  every table here): Liger, FP8 and compiled decoder layers are on by default only
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

import torch

from sft.errors import ConfigError
from sft.model import families
from sft.model.families import (  # noqa: F401 (the records' parts, named here as before)
    GENERIC,
    SPEED_FROM_SHAPES,
    UNMEASURED,
    Kernel,
    LayerKeeps,
    Vision,
)

logger = logging.getLogger(__name__)

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


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


# What a layer of transformers' per-layer configs may override and sft still plan (Gemma 4's full-attention layers:
# head dim 512, fewer key-value heads); the largest head dim FlashAttention's kernels take
PER_LAYER_WIDTHS = {"head_dim", "num_key_value_heads"}
FLASH_HEAD_DIM = 256

# The tables every other module reads, each a view of the family records (`sft.model.families`: one per model_type):
# the measured kernels (`KERNELS`, a MoE's own `KERNELS_MOE`), what a layer keeps (`LAYER_KEEPS`), the families whose
# attention takes `softcap` / `s_aux` (checked against transformers' calls in tests/test_architectures.py: an unknown
# family that passes either is caught by the backend at its first call), Gated DeltaNet's (`sft.model.
# linear_attention`), GLM-5's sparse attention that padding changes (one unpadded row per micro batch), the masks built
# without positions (gpt-oss), the MLPs that keep more than SwiGLU, the image+text families (`VISION`)
KERNELS: dict[str, dict[str, Kernel]] = {}
KERNELS_MOE: dict[str, dict[str, Kernel]] = {}
LAYER_KEEPS: dict[str, LayerKeeps] = {}
NORMS_FROM_MODULES: set[str] = set()
SOFTCAP_FAMILIES: set[str] = set()
SINK_FAMILIES: set[str] = set()
MASK_WITHOUT_POSITIONS: set[str] = set()
GATED_DELTANET_FAMILIES: set[str] = set()
PADDING_CHANGES_ATTENTION: set[str] = set()
MLP_KEPT: dict[str, int] = {}
VISION: dict[str, Vision] = {}
VISION_FAMILIES: set[str] = set()  # every run image+text
IMAGE_DATA_FAMILIES: set[str] = set()  # image+text where the data has images


def register(family: families.Family) -> families.Family:
    """Add a record (a family sft did not know: one outside sft's table) and its views; a second record of the same
    model_type is refused."""
    if family.model_type in families.FAMILIES:
        raise ValueError(f"{family.model_type}: a record exists (sft.model.families.FAMILIES)")
    families.FAMILIES[family.model_type] = family
    _index(family)
    return family


def _index(family: families.Family) -> None:
    """The views of one family record."""
    name = family.model_type
    if family.kernels is not None:
        KERNELS[name] = dict(family.kernels)
    if family.kernels_moe:
        KERNELS_MOE[name] = dict(family.kernels_moe)
    if family.keeps is not None:
        LAYER_KEEPS[name] = family.keeps
    if family.mlp_kept:
        MLP_KEPT[name] = family.mlp_kept
    for flag, view in ((family.norms_from_modules, NORMS_FROM_MODULES), (family.softcap, SOFTCAP_FAMILIES),
                       (family.sinks, SINK_FAMILIES), (family.mask_without_positions, MASK_WITHOUT_POSITIONS),
                       (family.gated_deltanet, GATED_DELTANET_FAMILIES),
                       (family.padding_changes_attention, PADDING_CHANGES_ATTENTION)):  # fmt: skip
        if flag:
            view.add(name)
    if family.vision is not None:
        VISION[name] = family.vision
        (VISION_FAMILIES if family.vision.always else IMAGE_DATA_FAMILIES).add(name)


for _family in families.FAMILIES.values():
    _index(_family)


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
