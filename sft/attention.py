"""The attention backend for padding-free packed batches, and the checks that keep samples apart.

`attn_implementation: auto` picks, in order: flash-attn's `flash_attention_2` (flash-attn installed, CUDA GPU of
compute capability 8.0 or newer); PyTorch's own varlen FlashAttention-2 (`torch.nn.attention.varlen.varlen_attn`,
CUDA), registered with transformers' `AttentionInterface` as `sft_varlen`; on CPU, `sdpa`, for which transformers
builds a block-diagonal mask from the packed `position_ids`. With sequence parallelism (`sft.sequence_parallel`)
`sdpa` cannot keep samples apart, and `auto` picks `sft_varlen` on CPU too.

transformers has no varlen backend of PyTorch's own, which is why `sft_varlen` is written here. It reads the sequence
boundaries (`cu_seq_lens_q/k`, `max_length_q/k`) that TRL's padding-free collator puts in every batch (sequence
parallelism hands them back for the whole row); without them it derives them from `position_ids` (a sample starts
where its position is 0);
it falls back to boundaries from a 2D padding mask, or to one sequence per row, for unpacked batches. On CPU (no
varlen kernel) the same boundaries run through sdpa one sample at a time: exact, and quadratic only per sample. A row
that holds one sample (long-context training) goes to plain causal sdpa instead, whose cuDNN kernel is much faster
than varlen FlashAttention-2 on Hopper.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

import torch

from sft.errors import ConfigError

logger = logging.getLogger(__name__)

VARLEN = "sft_varlen"
# Backends that keep packed samples apart: the flash kernels through sequence boundaries, sdpa/eager/flex through the
# block mask transformers derives from position_ids.
PACKING_SAFE = {
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    VARLEN,
    "sdpa",
    "eager",
    "flex_attention",
}


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _causal_kwargs(fn) -> dict:
    """torch 2.9 spelled causal masking `is_causal=True`; later releases `window_size=(-1, 0)`."""
    params = inspect.signature(fn).parameters
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def per_sample_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **_):
    """`varlen_attn`'s contract ([total, heads, dim] tensors, causal, GQA) on sdpa, one sample at a time: for CPU."""
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0]
        )
        out[start:end] = attended.transpose(0, 1)
    return out


def boundaries_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sample lengths of a flattened batch from its position ids (a sample starts at position 0)."""
    flat = position_ids.flatten()
    starts = (flat == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_full((1,), flat.numel())]).to(torch.int32)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function on `varlen_attn`: query [B, Hq, S, D], key/value [B, Hkv, S, D] (GQA ok)."""
    kernel = _varlen_attn() if query.is_cuda else None
    on_gpu = kernel is not None
    varlen_attn = kernel if on_gpu else per_sample_sdpa
    batch, heads, seq, dim = query.shape
    dtype = query.dtype
    if on_gpu and query.dtype not in (torch.float16, torch.bfloat16):  # fp32 weights under autocast: as flash does
        half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        query, key, value = query.to(half), key.to(half), value.to(half)
    device, keep = query.device, None
    if kwargs.get("cu_seq_lens_q") is not None:  # packed: TRL's collator gives the boundaries
        cu_q, cu_k = (
            kwargs["cu_seq_lens_q"].to(device, torch.int32),
            kwargs["cu_seq_lens_k"].to(device, torch.int32),
        )
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    elif kwargs.get("position_ids") is not None and attention_mask is None:  # packed, boundaries from positions
        cu_q = cu_k = boundaries_from_positions(kwargs["position_ids"]).to(device)
        max_q = max_k = int(cu_q.diff().max())
    elif attention_mask is not None and attention_mask.dim() == 2:  # right- or left-padded rows: drop the padding
        keep = attention_mask.flatten().bool()
        lengths = attention_mask.sum(-1, dtype=torch.int32)
        cu_q = cu_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_q = max_k = int(lengths.max())
    else:  # one whole sequence per row
        cu_q = cu_k = torch.arange(0, (batch + 1) * seq, seq, device=device, dtype=torch.int32)
        max_q = max_k = seq
    if dropout and module.training:
        logger.warning("sft_varlen applies no attention dropout (%.3g requested)", dropout)
    if on_gpu and batch == 1 and keep is None and cu_q.numel() == 2 and cu_k.numel() == 2:
        # One sample in the row (long-context rows; sequence-parallel padding is part of it, see
        # `sft.sequence_parallel.row_boundaries`): plain causal sdpa, whose cuDNN kernel runs at 1.7-1.9x the varlen
        # FlashAttention-2 kernel on H200 (benchmarks/results/attention_kernels)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != heads
        )
        return out.transpose(1, 2).to(dtype), None
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value))
    if keep is not None:
        q, k, v = q[keep], k[keep], v[keep]
    causal = _causal_kwargs(varlen_attn) if on_gpu else {}
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, **causal)
    if keep is not None:
        full = out.new_zeros(batch * seq, heads, dim)
        full[keep] = out
        out = full
    return out.reshape(batch, seq, heads, dim).to(dtype), None


def register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    # the mask function of the flash kernels: a 2D padding mask or none, never a dense 4D mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


def resolve_attn_implementation(requested: str | None, sequence_parallel: bool = False) -> str | None:
    """The backend for `attn_implementation` (`auto` or unset: the fastest available one); logs the choice."""
    if requested not in (None, "auto"):
        if requested == VARLEN:
            if torch.cuda.is_available() and _varlen_attn() is None:
                raise ConfigError(
                    f"`attn_implementation: {VARLEN}` on a GPU needs torch.nn.attention.varlen (torch >= 2.9). "
                    "Use `auto` to pick the best available backend."
                )
            register_varlen()
        return requested
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        if importlib.util.find_spec("flash_attn") is not None and major >= 8:
            chosen, why = "flash_attention_2", "flash-attn is installed"
        elif _varlen_attn() is not None:
            register_varlen()
            chosen, why = VARLEN, "PyTorch's varlen FlashAttention-2 (flash-attn is not installed)"
        else:
            chosen, why = "sdpa", "no varlen kernel in this torch and no flash-attn"
    elif sequence_parallel:
        register_varlen()
        chosen, why = VARLEN, "no GPU, sequence parallel: exact per-sample sdpa on the gathered rows"
    else:
        chosen, why = "sdpa", "no GPU; packed sequences are kept apart by a block mask from position_ids"
    logger.info("Attention backend: %s (%s)", chosen, why)
    return chosen


def check_packing(attn_implementation: str | None, padding_free: bool, model_init_kwargs: dict | None) -> None:
    """Refuse settings that would let packed samples attend to each other."""
    if not padding_free:
        return
    if attn_implementation not in PACKING_SAFE:
        raise ConfigError(
            f"`attn_implementation: {attn_implementation}` cannot keep packed samples apart. Use `auto` (or one of "
            f"{sorted(PACKING_SAFE)}), or set `packing: false` and `padding_free: false`."
        )
    if (model_init_kwargs or {}).get("use_cache"):
        raise ConfigError(
            "`model_init_kwargs.use_cache: true` with packing: a KV cache during training makes transformers skip "
            "the packed-sequence mask, so samples would attend to each other. Remove `use_cache` (sft turns it off)."
        )


def check_batch(inputs: dict) -> None:
    """A packed batch must not carry an attention_mask: the backends would mask padding, not sample boundaries."""
    position_ids = inputs.get("position_ids")
    if position_ids is None or "attention_mask" not in inputs:
        return
    if bool((position_ids[..., 1:] == 0).any()):
        raise ConfigError(
            "A packed batch (position_ids restart inside a row) came with an `attention_mask`; the attention would "
            "mix samples. Use TRL's padding-free collator (no custom `data_collator`) or drop the attention_mask."
        )
