"""Gated DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5) over packed rows, one sample at a time.

A linear-attention layer carries a recurrent state along the sequence, and its short causal convolution a window of
the last tokens: over a packed row both must restart at every sample. transformers passes the boundaries to the fast
kernels (flash-linear-attention's `chunk_gated_delta_rule(cu_seqlens=...)`, `causal_conv1d`'s `seq_idx`) where they are
installed, and refuses a packed row on its torch fallback ("can't keep packed sequences apart without
causal_conv1d"). sft runs each such layer once per sample of the row (the layer's own forward on the sample's slice,
which starts from a zero state and a zero-padded convolution, as the sample alone would): exact on any machine, one
forward per sample (tests/test_linear_attention.py: packed rows equal their samples one by one).
"""

from __future__ import annotations

import functools
import itertools

import torch

from sft.model.attention import boundaries_from_positions

# transformers' classes of the layer (`<family>GatedDeltaNet`: Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
# Qwen3_5MoeGatedDeltaNet), which take (hidden_states, cache, attention_mask, **kwargs)
CLASS_SUFFIX = "GatedDeltaNet"
# the keyword arguments that describe the packed row's boundaries; none of them reaches a sample's own forward
BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(CLASS_SUFFIX)]


def by_sample(model: torch.nn.Module) -> int:
    """Each Gated DeltaNet layer of `model` run once per sample of a packed row; returns how many layers. A decoder
    layer given only the row's positions (transformers keeps `position_ids` from its linear-attention layer) hands
    that layer the boundaries they mark."""
    found = layers(model)
    for layer in found:
        layer.forward = _per_sample(layer.forward)
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


def _per_sample(forward):
    @functools.wraps(forward)
    def run(hidden_states, cache=None, attention_mask=None, **kwargs):
        bounds = _bounds(kwargs) if hidden_states.shape[0] == 1 and cache is None else None
        if bounds is None or len(bounds) <= 2:  # one sample (or a cache: generation), as transformers runs it
            rest = {k: v for k, v in kwargs.items() if k not in BOUNDARIES} if bounds else kwargs
            return forward(hidden_states, cache=cache, attention_mask=attention_mask, **rest)
        rest = {k: v for k, v in kwargs.items() if k not in BOUNDARIES}
        outputs = [forward(hidden_states[:, lo:hi], **rest) for lo, hi in itertools.pairwise(bounds)]
        return torch.cat(outputs, dim=1)

    return run
