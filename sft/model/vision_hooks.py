"""A packed image+text row's forward hooks on the model (applied by `sft.model.converters` in its declared order):
the rows come from `sft.data.vision`'s packers, and these turn what a packer put in the batch into what transformers'
model reads. `join_positions` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the boundary row stacked over the M-RoPE rows;
`block_masks` (Gemma 3, Gemma 4): sft's attention masks (`masks`) built on the row's device."""

from __future__ import annotations

import torch

from sft.model.architectures import VISION


def masks(
    position_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    window: int | None,
    layer_types,
    eager_dtype=None,
    both_ways=("full_attention", "sliding_attention"),
):
    """sft's attention masks of a packed row of one batch, per layer type ([1, 1, tokens, tokens]), what transformers
    gives each sample alone (its own Gemma 3 and Gemma 4 masks let a packed row's samples see each other: measured in
    tests/test_vision_packing.py): a token sees the tokens of its own sample (`position_ids` restart at 0) only,
    causally, and in the layer types of `both_ways` the tokens of its own image both ways (a run of nonzero
    `token_type_ids`); in the sliding-window layers only those less than `window` before it. Boolean for sdpa;
    additive (0 or the minimum of `eager_dtype`) for eager."""
    positions, image = position_ids[0], token_type_ids[0].bool()
    sample = torch.cumsum((positions == 0).long(), 0)
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:-1]
    block = torch.where(image, torch.cumsum(starts.long(), 0), -1)  # each image's tokens one block id
    index = torch.arange(len(positions), device=positions.device)
    q, kv = index[:, None], index[None, :]
    same_sample = sample[:, None] == sample[None, :]
    same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    out = {}
    for kind in set(layer_types):
        seen = same_sample & ((kv <= q) | same_image) if kind in both_ways else same_sample & (kv <= q)
        mask = (seen & (kv > q - window) if kind == "sliding_attention" else seen)[None, None]
        if eager_dtype is not None:
            mask = torch.zeros(mask.shape, dtype=eager_dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(eager_dtype).min)  # fmt: skip
        out[kind] = mask
    return out


def both_ways(config) -> tuple[str, ...]:
    """The layer types in which a family's image tokens attend to each other both ways (`Vision.both_ways`): Gemma 4's
    only where its text config asks for it (`Vision.both_ways_if`: `use_bidirectional_attention: vision`; without it
    its images are causal as its text)."""
    vision, text = VISION[config.model_type], config.get_text_config()
    if vision.both_ways_if and getattr(text, vision.both_ways_if[0], None) != vision.both_ways_if[1]:
        return ()
    return vision.both_ways


def block_masks(model: torch.nn.Module):
    """A forward pre-hook on `model` that gives a packed Gemma 3 or Gemma 4 row (`BlockMaskPacker`: `position_ids` and
    the token types, no attention mask) sft's masks (`masks`), which the model then reads in place of its own; returns
    the hook's handle. Built on the row's device at every forward: nothing of [tokens, tokens] crosses the data
    loader."""
    text = model.config.get_text_config()
    key, kinds = VISION[model.config.model_type].type_ids, both_ways(model.config)

    def attach(module, args, kwargs):
        positions, types = kwargs.get("position_ids"), kwargs.get(key)
        if positions is None or types is None or kwargs.get("attention_mask") is not None:
            return args, kwargs
        eager = text._attn_implementation == "eager"
        dtype = next(module.parameters()).dtype if eager else None
        kwargs["attention_mask"] = masks(positions, types.to(positions.device), text.sliding_window,
                                         text.layer_types, dtype, kinds)  # fmt: skip
        return args, kwargs

    return model.register_forward_pre_hook(attach, with_kwargs=True)


def join_positions(model: torch.nn.Module):
    """A forward pre-hook on `model` that stacks a packed batch's boundary row (`position_ids`) over its M-RoPE rows
    (`mrope_position_ids`) into the [4, batch, tokens] positions transformers' M-RoPE models read; returns the
    hook's handle."""

    def stack(module, args, kwargs):
        rows = kwargs.pop("mrope_position_ids", None)
        if rows is not None:
            text = kwargs["position_ids"]
            kwargs["position_ids"] = torch.cat([text[None], rows.to(text.device)])
        return args, kwargs

    return model.register_forward_pre_hook(stack, with_kwargs=True)
