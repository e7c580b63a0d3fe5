"""Gated DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5) over packed rows, one sample at a time.

A linear-attention layer carries a recurrent state along the sequence, and its short causal convolution a window of
the last tokens: over a packed row both must restart at every sample. transformers passes the boundaries to the fast
kernels (flash-linear-attention's `chunk_gated_delta_rule(cu_seqlens=...)`, `causal_conv1d`'s `seq_idx`) where they are
installed, and refuses a packed row on its torch fallback ("can't keep packed sequences apart without
causal_conv1d"), and passes none to the torch convolution it falls back to. Two paths, both exact:

- **varlen** (on a GPU with flash-linear-attention installed, `pip install 'sft[fla]'`, where fla can train): the
  layer's own forward on the whole row, given the boundaries: transformers hands them to fla's
  `chunk_gated_delta_rule(cu_seqlens=...)`, and the module's short convolution is fla's `causal_conv1d(cu_seqlens=...)`
  (its torch fallback would slide its window over the boundary). Forward measured on an H200 against the per-sample
  path (benchmarks/linear_attention.py); its training speed not yet (see `fla_cannot_train`).
- **per sample** (anywhere else): each such layer run once per sample of the row (the layer's own forward on the
  sample's slice, which starts from a zero state and a zero-padded convolution, as the sample alone would): one
  forward per sample (tests/test_linear_attention.py: packed rows equal their samples one by one). Where fla is
  installed but cannot train, the layers get transformers' torch functions back (transformers picks fla's at import,
  and fla would stop the first backward).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import sys

import torch

from sft.model.attention import boundaries_from_positions

# transformers' classes of the layer (`<family>GatedDeltaNet`: Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
# Qwen3_5MoeGatedDeltaNet), which take (hidden_states, cache, attention_mask, **kwargs)
CLASS_SUFFIX = "GatedDeltaNet"
# the keyword arguments that describe the packed row's boundaries; none of them reaches a sample's own forward
BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")
# flash-linear-attention (`fla-core`): transformers resolves `chunk_gated_delta_rule` to it at import where installed
FLA = importlib.util.find_spec("fla") is not None


# fla-core 0.6's gated delta rule stops its backward on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1, whose kernels
# give it wrong gradients there (fla's issue #640; torch 2.11's Triton on the H200 measured, 2026-11-29)
BAD_TRITON = ("3.4.0", "3.7.1")


def fla_cannot_train() -> str | None:
    """Why flash-linear-attention's kernels cannot train on this machine, or None where they can."""
    if not FLA:
        return "flash-linear-attention is not installed (`pip install 'sft[fla]'`)"
    if not torch.cuda.is_available():
        return "no CUDA GPU here (its kernels are Triton's)"
    if torch.cuda.get_device_capability()[0] != 9:
        return None
    import triton
    from packaging.version import Version

    low, high = (Version(v) for v in BAD_TRITON)
    if low <= Version(triton.__version__) < high:
        return (f"Triton {triton.__version__} on a Hopper GPU: flash-linear-attention refuses its gated delta rule's "
                f"backward there (wrong gradients below Triton {BAD_TRITON[1]}, fla issue #640); upgrade Triton to "
                "use it")  # fmt: skip
    return None


def path(varlen: bool | None = None) -> str:
    """Which path a packed row takes on a GPU: "varlen" (fla installed and able to train, or `varlen` forced) or
    "per sample"."""
    return "varlen" if (fla_cannot_train() is None if varlen is None else varlen) else "per sample"


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(CLASS_SUFFIX)]


def by_sample(model: torch.nn.Module, varlen: bool | None = None) -> int:
    """Each Gated DeltaNet layer of `model` given the boundaries of a packed row: on a GPU through fla's varlen kernels
    where fla is installed (`varlen` None) or asked for (True), else once per sample; returns how many layers. A
    decoder layer given only the row's positions (transformers keeps `position_ids` from its linear-attention layer)
    hands that layer the boundaries they mark."""
    found = layers(model)
    varlen = path(varlen) == "varlen"
    for layer in found:
        module = sys.modules[type(layer).__module__]
        if varlen:
            _convolution_by_sample(module)
        elif FLA:  # fla installed but not used: transformers' own torch path (see the module's docstring)
            for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
                setattr(module, name, inspect.unwrap(getattr(module, name)))
        layer.forward = _per_sample(layer.forward, varlen)
    for parent in model.modules():
        if any(child in found for child in parent.children()):
            parent.register_forward_pre_hook(_boundaries_from_positions, with_kwargs=True)
    return len(found)


def _boundaries_from_positions(module, args, kwargs):
    positions = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is None and positions is not None and positions.dim() == 2 and len(positions) == 1:
        return args, {**kwargs, "cu_seq_lens_q": boundaries_from_positions(positions)}
    return args, kwargs


def _bounds(kwargs: dict) -> list[int] | None:
    if kwargs.get("cu_seq_lens_q") is not None:
        return kwargs["cu_seq_lens_q"].tolist()
    if kwargs.get("position_ids") is not None:
        return boundaries_from_positions(kwargs["position_ids"]).tolist()
    return None


def _per_sample(forward, varlen: bool):
    @functools.wraps(forward)
    def run(hidden_states, cache=None, attention_mask=None, **kwargs):
        bounds = _bounds(kwargs) if hidden_states.shape[0] == 1 and cache is None else None
        if bounds is None or len(bounds) <= 2:  # one sample (or a cache: generation), as transformers runs it
            rest = {k: v for k, v in kwargs.items() if k not in BOUNDARIES} if bounds else kwargs
            return forward(hidden_states, cache=cache, attention_mask=attention_mask, **rest)
        rest = {k: v for k, v in kwargs.items() if k not in BOUNDARIES}
        if varlen and hidden_states.is_cuda:
            cu = torch.tensor(bounds, dtype=torch.long, device=hidden_states.device)
            return forward(hidden_states, attention_mask=attention_mask, cu_seq_lens_q=cu, **rest)
        outputs = [forward(hidden_states[:, lo:hi], **rest) for lo, hi in itertools.pairwise(bounds)]
        return torch.cat(outputs, dim=1)

    return run


def _convolution_by_sample(module) -> None:
    """The short convolution of transformers' `module` (its `causal_conv1d_fn`, called with the layer's keyword
    arguments) restarted at each boundary of `cu_seq_lens_q` on a GPU through fla's `causal_conv1d`; as before
    elsewhere. Once per module."""
    original = module.causal_conv1d_fn
    if getattr(original, "sft_by_sample", False):
        return

    @functools.wraps(original)
    def convolution(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or not hidden_states.is_cuda:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from fla.modules.causal_conv1d import causal_conv1d

        # transformers' layout is [batch, channels, tokens], fla's [batch, tokens, channels]; weight [channels, width]
        out, _ = causal_conv1d(hidden_states.transpose(1, 2).contiguous(), weight=weight, bias=bias,
                               activation=activation, cu_seqlens=cu.long())  # fmt: skip
        return out.transpose(1, 2)

    convolution.sft_by_sample = True
    module.causal_conv1d_fn = convolution
