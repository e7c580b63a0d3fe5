"""The tiled MLP of DeepSpeed ALST on sft's model: each decoder layer's MLP computed over the row in tiles.

On long rows the MLP's intermediate activations (gate, up and their product, 3 x `intermediate_size` values per token:
86 KB per token for the Llama-3.1-8B shape in bf16) are most of what one decoder layer holds while it runs, and with
activation checkpointing that one layer's worth is the peak. DeepSpeed's `TiledMLP`
(`deepspeed.runtime.sequence_parallel.ulysses_sp`) runs the MLP one tile of the sequence at a time without keeping
them and recomputes each tile in the backward, holding ZeRO's gradient reduction back until the last tile. The cost
is one more MLP forward per layer (`sft.plan.memory` uses it only after checkpointing and offloading).

What sft adds to DeepSpeed's class:
- **The tile count is fixed for the run** (`tiles_for`: the rank's share of `max_length` over `hidden_size`, as
  DeepSpeed's example sizes it), and each row is padded to a multiple of it for the call (zeros, cut from the output;
  the MLP works token by token, so this is exact). Every rank then calls each MLP's projections the same number of
  times whatever its row's length, which ZeRO-3's parameter gathering needs, without the collective per layer and
  call that DeepSpeed's example uses to agree on the count.
- **It wraps whatever forward the module has**, after Liger has patched it (its SwiGLU kernel), on the model
  instance: no model class is changed.
"""

from __future__ import annotations

import math

import torch

from sft.errors import ConfigError
from sft.model import architectures


def tiles_for(max_length: int, sp: int, hidden: int) -> int:
    """Tiles per MLP call: one per `hidden` tokens of this rank's share of a full row."""
    return max(1, math.ceil(math.ceil(max_length / sp) / hidden))


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `mlp` module of every decoder layer (`sft.model.architectures.decoder_layers`, under PEFT's wrappers
    too)."""
    layers = architectures.decoder_layers(model) or (model,)  # a model's layers, or one decoder layer given alone
    return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]


def apply_tiled_mlp(model: torch.nn.Module, tiles: int, multiple: int = 1) -> int:
    """Make every decoder layer's MLP run in `tiles` tiles along the sequence, each a multiple of `multiple` tokens
    (16 with FP8: `sft.model.fp8`); returns how many were changed."""
    from sft.engines import tiled_mlp

    TiledMLP = tiled_mlp()

    mlps = decoder_mlps(model)
    if not mlps:
        raise ConfigError(
            f"`tiled_mlp: true`: {type(model).__name__} has no decoder layers with an `mlp` module to tile. Set "
            "tiled_mlp: false."
        )
    routed = [type(m).__name__ for m in mlps if hasattr(m, "experts") or hasattr(m, "router")]
    if routed:
        raise ConfigError(
            f"`tiled_mlp: true`: {routed[0]} routes tokens to experts; tiling it along the sequence changes which "
            "tokens an expert sees together (capacity, load balancing). Set tiled_mlp: false."
        )
    changed = 0
    for mlp in mlps:
        if getattr(mlp, "_sft_tiles", None) == tiles:
            continue
        inner = mlp.__dict__.get("_sft_untiled_forward", mlp.forward)  # Liger's bound forward, or the class's
        params = list(mlp.parameters())

        def forward(x, *args, _inner=inner, _mlp=mlp, _params=params, **kwargs):
            length = x.shape[-2]
            pad = -length % (tiles * multiple)  # torch.chunk: exactly `tiles` pieces of a multiple of `tiles` rows
            if pad:
                x = torch.nn.functional.pad(x, (0, 0, 0, pad))
            out = TiledMLP.apply(lambda _, piece: _inner(piece, *args, **kwargs), _mlp, x, tiles, _params)
            return out[..., :length, :] if pad else out

        mlp.__dict__["_sft_untiled_forward"] = inner
        mlp.__dict__["forward"] = forward
        mlp._sft_tiles = tiles
        changed += 1
    return changed
