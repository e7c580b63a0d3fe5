"""The attention backend for padding-free packed batches, and the checks that keep samples apart.

`attn_implementation: auto` picks, in order: flash-attn's `flash_attention_2` (flash-attn installed, CUDA GPU of
compute capability 8.0 or newer); PyTorch's own varlen FlashAttention-2 (`torch.nn.attention.varlen.varlen_attn`,
CUDA), registered with transformers' `AttentionInterface` as `sft_varlen`; on CPU `sft_varlen` too for packed rows
(sdpa over the row's samples padded to a batch, `per_sample_sdpa`: a training step of the demo's model 2.2x sdpa over
the block-diagonal mask that transformers builds from the packed `position_ids` on one thread, 1.8x on two,
benchmarks/results/cpu_attention), `sdpa` for unpacked ones.

transformers has no varlen backend of PyTorch's own, which is why `sft_varlen` is written here. It reads the sequence
boundaries (`cu_seq_lens_q/k`, `max_length_q/k`) that TRL's padding-free collator puts in every batch (sequence
parallelism hands them back for the whole row); without them it derives them from `position_ids` (a sample starts
where its position is 0);
it falls back to boundaries from a 2D padding mask, or to one sequence per row, for unpacked batches. On CPU (no
varlen kernel) the same boundaries run through sdpa over the samples padded to a batch (`per_sample_sdpa`): exact, and
quadratic only per sample. On a GPU the kernel is chosen per layer (`packed_kernel`): FA2 where it takes the heads,
torch's memory-efficient kernel over the samples where they are wider (Gemma 4's 512-wide full layers). A row
that holds one sample (long-context training) goes to plain causal sdpa instead, whose cuDNN kernel is much faster
than varlen FlashAttention-2 on Hopper.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os

import torch

from sft.errors import ConfigError
from sft.model.architectures import FLASH_HEAD_DIM
from sft.model.wide_heads import length_groups, wide_varlen

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


def varlen_has_window(fn=None) -> bool:
    """Whether PyTorch's varlen kernel takes a window (`window_size`, after torch 2.9's `is_causal`)."""
    fn = fn or _varlen_attn()
    return fn is not None and "window_size" in inspect.signature(fn).parameters


def _causal_kwargs(fn, window: int | None = None, causal: bool = True) -> dict:
    """torch 2.9 spelled causal masking `is_causal=True`; later releases `window_size=(-1, 0)`, which also takes a
    left window: transformers' `sliding_window` w (a token sees `kv > q - w`) is `window_size=(w - 1, 0)`. Not
    causal (a vision encoder's patches within their image): `window_size=(-1, -1)`, torch 2.9's `is_causal=False`."""
    if not varlen_has_window(fn):
        if window is not None:  # refused at start by check_backend; a safeguard
            raise ConfigError(f"{VARLEN}: this torch's varlen kernel has no window; the sliding window would be lost.")
        return {"is_causal": causal}
    return {"window_size": (-1 if window is None else window - 1, 0 if causal else -1)}


def per_sample_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **_):
    """`varlen_attn`'s contract ([total, heads, dim] tensors, causal or both ways (`window_size=(-1, -1)`), GQA, a
    left window) on sdpa, each sample attending only to itself: for CPU. The row's samples are padded into a batch,
    one sdpa call per group of samples whose lengths share a power of two (so a sample's padded square is at most 4x
    its own): the work of one sample at a time in a handful of calls (a training step of the demo's model 1.35-1.46x
    faster than one call per sample, 1.8-2.2x sdpa over the row's block mask: benchmarks/results/cpu_attention). A
    real query sees only its own sample's keys: causal masking keeps it off the padding after its sample, an explicit
    mask elsewhere (both ways, a window); padded queries are dropped, so nothing flows into another sample's
    gradients."""
    lengths = cu_q.diff().tolist()
    left, causal = window_size[0], window_size[1] == 0
    total, starts = q.shape[0], cu_q[:-1].long()
    out = q.new_zeros(total, q.shape[1], v.shape[-1])
    for members in length_groups(lengths):
        index = torch.tensor(members, device=q.device)
        sizes = torch.tensor([lengths[i] for i in members], device=q.device)
        width = int(sizes.max())
        pos = torch.arange(width, device=q.device)
        tokens = (starts[index, None] + pos).clamp(max=total - 1)  # [samples, width]; past a sample: any token
        qs, ks, vs = (t[tokens].transpose(1, 2) for t in (q, k, v))  # [samples, heads, width, dim]
        mask = None
        windowed = causal and 0 <= left < width - 1
        if windowed or not causal:
            real_key = pos[None, :] < sizes[:, None]  # [samples, keys]
            allowed = real_key[:, None, :].expand(-1, width, -1)
            if windowed:
                distance = pos[:, None] - pos[None, :]
                # a padded query sees its sample's keys: no empty row, no NaN
                padded_query = pos[None, :, None] >= sizes[:, None, None]
                allowed = allowed & (((distance >= 0) & (distance <= left))[None] | padded_query)
            mask = allowed[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=ks.shape[1] != qs.shape[1],
        ).transpose(1, 2)  # fmt: skip
        real = pos[None, :] < sizes[:, None]
        out[tokens[real]] = attended[real]
    return out


class _EfficientVarlen(torch.autograd.Function):
    """torch's memory-efficient (CUTLASS) attention kernel over a packed row, each sample its own causal block through
    the kernel's `cu_seqlens` (as xformers' block-diagonal masks run): one kernel forward and one backward per layer,
    no mask built, any head dim. [total, heads, dim] in and out, as many key-value heads as query heads."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        mask_type = 1 if causal else 0  # 1: causal from the top left of each sample's block
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, cu_q, cu_k, max_q, max_k, 0.0, mask_type, True, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.args = (max_q, max_k, scale, mask_type)
        return out[0]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale, mask_type = ctx.args
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            grad[None].contiguous(), q[None], k[None], v[None], None, out, cu_q, cu_k, max_q, max_k, lse, 0.0, seed,
            offset, mask_type, False, scale=scale,
        )  # fmt: skip
        return dq[0], dk[0], dv[0], None, None, None, None, None, None


def efficient_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **kwargs):
    """`varlen_attn`'s contract on torch's memory-efficient kernel (`_EfficientVarlen`), CUDA only: for heads wider
    than FlashAttention takes. Grouped key-value heads are repeated to the query heads (the kernel has no GQA; the
    backward sums their gradients back). A left window goes to `per_sample_sdpa` (no family has one on such heads)."""
    if window_size[0] >= 0:
        return per_sample_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, **kwargs)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    return _EfficientVarlen.apply(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale, window_size[1] == 0)


def packed_kernel(head_dim: int, on_gpu: bool):
    """The kernel `sft_varlen` runs a layer's packed row through, decided per layer by its head dim: on a GPU PyTorch's
    varlen FlashAttention-2 where it takes the heads, else `wide_kernel()` (`wide_varlen` unless `SFT_WIDE_HEADS`
    says otherwise). Before `wide_varlen`, for Gemma 4's full layers (8 query / 4 key-value heads of 512, 2 rows of
    4,096 tokens of SFT-like samples, bf16, 1 x H200) `efficient_varlen`'s forward and backward took 12.1 ms against
    16.2 ms through sdpa once per sample (whose GQA took torch's math kernel, in fp32) and 77.8 ms through one sdpa
    call with the row's block mask, all within bf16 noise of fp32 math one sample at a time (gradients 0.0035, 0.0017,
    0.0017 relative); its sliding layers (heads of 256, window 512) 1.4 ms on FA2 against 9.9 ms masked; flex_attention
    failed to compile at 512 with its default tiles and took 12.7 against 12.0 ms with small ones
    (benchmarks/wide_heads.py, benchmarks/results/families_2026/wide_heads_call6.json, wide_heads_call16.json). On the
    CPU `per_sample_sdpa`."""
    if not on_gpu:
        return per_sample_sdpa
    kernel = _varlen_attn() if head_dim <= FLASH_HEAD_DIM else None
    return kernel or wide_kernel()


# The wide heads' kernels by name; `SFT_WIDE_HEADS` picks one (the benchmarks' switch), else `WIDE_DEFAULT`.
# `wide_varlen` against `efficient_varlen`, forward + backward of Gemma 4's full layers on rows of 4,096 (1 x H100,
# benchmarks/results/families_2026 call 25): 9.8 against 12.6 ms at 2 rows, 20.9 against 53.3 ms at 8; through
# sft/train.py at 8 layers of Gemma 4's widths (sft's one-GPU plan, the same call): 72,343 against 60,752 tokens/s
# (1.19x), every loss within 0.0063 of the other's
WIDE_KERNELS = {
    "matmul": "wide_varlen (batched matrix products over the samples)",
    "efficient": "torch's memory-efficient kernel over the samples (SFT_WIDE_HEADS=efficient)",
}
WIDE_DEFAULT = "matmul"


def wide_kernel_name() -> str:
    """The name (a key of `WIDE_KERNELS`, which says what each is) of the kernel for heads wider than FlashAttention
    takes."""
    name = os.environ.get("SFT_WIDE_HEADS", WIDE_DEFAULT)
    if name not in WIDE_KERNELS:
        raise ConfigError(f"SFT_WIDE_HEADS={name!r}: use one of {', '.join(WIDE_KERNELS)}.")
    return name


def wide_kernel():
    """The kernel for heads wider than FlashAttention takes: `sft.model.wide_heads.wide_varlen` (batched matrix
    products over the row's samples), or `efficient_varlen` where `SFT_WIDE_HEADS=efficient`."""
    return wide_varlen if wide_kernel_name() == "matmul" else efficient_varlen


def boundaries_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sample lengths of a flattened batch from its position ids (a sample starts at position 0)."""
    flat = position_ids.flatten()
    starts = (flat == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_full((1,), flat.numel())]).to(torch.int32)


@torch.compiler.disable
def scored_attention(q, k, v, cu, scale, window: int | None, softcap: float | None, sinks: torch.Tensor | None):
    """Attention whose scores a model changes (soft-capping, sinks), sample by sample on the boundaries `cu`: exact
    where the model's own mask code would mix packed samples (transformers' gpt-oss builds its mask without the
    position ids). On a GPU flex_attention with a block mask of the samples (and window); on the CPU the eager
    arithmetic of transformers' Gemma 2 / gpt-oss attention, one sample at a time. [total, heads, dim] tensors.

    Never traced into a compiled decoder layer (`compile_decoder_layers`): the layer's graph breaks around it, and
    flex_attention and its block mask are compiled on their own as in an eager layer (traced into gpt-oss's layers,
    the first backward failed in Inductor, benchmarks/results/families_2026; the CPU path is a loop over samples)."""
    if q.is_cuda:
        return _flex_scored(q, k, v, cu, scale, window, softcap, sinks)
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_empty(q.shape[0], heads, v.shape[-1])
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        qs = q[start:end].transpose(0, 1)
        ks, vs = (t[start:end].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(end - start, device=q.device)
        distance = pos[:, None] - pos[None, :]
        allowed = (distance >= 0) & (distance < (window or end - start + 1))
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if sinks is not None:
            scores = torch.cat([scores, sinks.reshape(heads, 1, 1).expand(heads, end - start, 1).to(scores)], -1)
            scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        out[start:end] = (probs.to(vs.dtype) @ vs).transpose(0, 1)
    return out


# Packed micro batches are padded to a multiple of this many tokens for flex_attention, a sample of their own: the
# compiled kernels and block mask see a few shapes instead of one per micro batch (benchmarks/scored_attention.py)
FLEX_MULTIPLE = 2048


def _flex_scored(q, k, v, cu, scale, window, softcap, sinks, flex=None, multiple=FLEX_MULTIPLE):
    """The GPU path of `scored_attention`: flex_attention (compiled, as transformers calls it; `flex` another one)
    over the whole row with a document-causal block mask, soft-capping as its score function, sinks by renormalising
    with its log-sum-exp (as transformers' flex_attention does for gpt-oss). The tokens are padded to a multiple of
    `multiple` (None: not padded), the padding one more sample that no real token sees."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import compile_friendly_flex_attention, get_flex_attention_lse_kwargs

    if flex is None:
        flex = functools.partial(compile_friendly_flex_attention, training=torch.is_grad_enabled())

    real = q.shape[0]
    total = -(-real // multiple) * multiple if multiple else real
    if total > real:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, total - real)) for t in (q, k, v))
        cu = torch.cat([cu, cu.new_full((1,), total)])
    sample = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), cu.diff().long())

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (sample[q_idx] == sample[kv_idx]) & (kv_idx <= q_idx)
        return keep & (q_idx - kv_idx < window) if window is not None else keep

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap) if softcap is not None else score

    # compiled on a GPU: the block sums without the dense total x total mask (32 GiB for a micro batch of 16 rows of
    # 4,096, measured on 1 x H100 with gpt-oss's widths); elsewhere (the CPU's check of this path) uncompiled, which
    # builds the same mask without a minute of compiling
    block_mask = create_block_mask(mask_mod, None, None, total, total, device=q.device, _compile=q.is_cuda)
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, aux = flex(
        query, key, value, score_mod=score_mod, block_mask=block_mask, enable_gqa=key.shape[1] != query.shape[1],
        scale=scale, **get_flex_attention_lse_kwargs(True),
    )  # fmt: skip
    if sinks is not None:
        lse = (aux.lse if hasattr(aux, "lse") else aux).unsqueeze(-1).float()
        combined = torch.logsumexp(torch.cat([lse, sinks.float().view(1, -1, 1, 1).expand_as(lse)], -1), -1, True)
        out = out * torch.exp(lse - combined).to(out.dtype)
    return out[0, :, :real].transpose(0, 1)


# What transformers' attention layers of the model matrix pass besides q, k, v and the mask (tests/test_architectures
# records every argument they pass): honoured by `sft_varlen` ...
# (`seq_idx`, the sample index of each token from TRL's collator, is the same boundaries as `cu_seq_lens_q`)
HANDLED = frozenset({"scaling", "dropout", "sliding_window", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                     "max_length_k", "position_ids", "seq_idx"})  # fmt: skip
# ... or carrying nothing the attention computes with (the model's own switches, passed down through **kwargs)
# (Liger's patched forwards pass `output_hidden_states` and `return_dict` down; measured on 1 x H100)
INERT = frozenset({"use_cache", "output_router_logits", "output_attentions", "output_hidden_states", "return_dict",
                   "cache_position"})  # fmt: skip


def refused_arguments(kwargs: dict) -> list[str]:
    """The attention arguments `sft_varlen` cannot honour: any argument it does not know (a newer transformers may
    pass one that changes the result: refused, never ignored). `is_causal=False` (a vision encoder) it honours."""
    return sorted(k for k, v in kwargs.items() if v is not None and k not in HANDLED | INERT | {"is_causal"})


def _boundaries(kwargs: dict, attention_mask, batch: int, seq: int, device):
    """The sample boundaries of a batch for `varlen_attention_forward`: (cu_q, cu_k, max_q, max_k, keep), `keep` the
    tokens that are not padding (None: all are)."""
    keep = None
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
    return cu_q, cu_k, max_q, max_k, keep


def _refuse_unknown(module, kwargs: dict) -> None:
    refused = refused_arguments(kwargs)
    if refused:
        raise ConfigError(
            f"`attn_implementation: {VARLEN}`: {type(module).__name__} asks for {', '.join(refused)}, which this "
            "backend cannot honour (it would be dropped and the model would train on other attention than it runs "
            f"with). Use `attn_implementation: auto`, which picks a backend that has "
            f"{' and '.join(refused)}."
        )


def _unscored(varlen_attn, q, k, v, bounds, scaling, window: int | None, causal: bool) -> torch.Tensor:
    """A packed row's attention through the layer's kernel (`packed_kernel`), [total, heads, dim] in and out; `bounds`
    (cu_q, cu_k, max_q, max_k)."""
    flash = varlen_attn is not per_sample_sdpa
    if flash:
        masking = _causal_kwargs(varlen_attn, window, causal)
    else:
        masking = {"window_size": (-1 if window is None else window - 1, 0 if causal else -1)}
    dim, v_dim = q.shape[-1], v.shape[-1]
    # MLA (DeepSeek-V3): FlashAttention needs one head dim; pad values, cut after
    if flash and v_dim != dim:
        v = torch.nn.functional.pad(v, (0, dim - v_dim))
    return varlen_attn(q, k, v, *bounds, scale=scaling, **masking)[..., :v_dim]


def varlen_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None,
    s_aux=None, **kwargs,
):  # fmt: skip
    """transformers attention function on `varlen_attn`: query [B, Hq, S, D], key/value [B, Hkv, S, D] (GQA ok),
    causal (both ways where the layer says `is_causal=False`: a vision encoder), with the layer's sliding window
    (transformers' `sliding_window`: a token sees itself and the `w - 1` before it); soft-capping and sinks through
    `scored_attention`."""
    _refuse_unknown(module, kwargs)
    on_gpu = query.is_cuda and _varlen_attn() is not None
    batch, heads, seq, dim = query.shape
    varlen_attn = packed_kernel(dim, on_gpu)
    dtype = query.dtype
    if on_gpu and query.dtype not in (torch.float16, torch.bfloat16):  # fp32 weights under autocast: as flash does
        half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        query, key, value = query.to(half), key.to(half), value.to(half)
    cu_q, cu_k, max_q, max_k, keep = _boundaries(kwargs, attention_mask, batch, seq, query.device)
    if dropout and module.training:
        logger.warning("sft_varlen applies no attention dropout (%.3g requested)", dropout)
    windowed = sliding_window is not None and max_k > sliding_window
    scored = softcap is not None or s_aux is not None
    # causal unless the layer says otherwise (a vision encoder: each image's patches attend to each other both ways),
    # read as transformers' sdpa reads it
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    if not causal and (windowed or scored):  # no family asks for both; a safeguard, never a dropped feature
        raise ConfigError(f"{VARLEN}: attention both ways with a window, soft-capping or sinks is not implemented.")
    if (
        on_gpu
        and batch == 1
        and not scored
        and keep is None
        and cu_q.numel() == 2
        and cu_k.numel() == 2
        and not windowed
    ):
        # One sample in the row (long-context rows; sequence-parallel padding is part of it, see
        # `sft.parallel.sequence.row_boundaries`): plain causal sdpa, whose cuDNN kernel runs at 1.7-1.9x the varlen
        # FlashAttention-2 kernel on H200 (benchmarks/results/attention_kernels)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=causal, scale=scaling, enable_gqa=key.shape[1] != heads
        )
        return out.transpose(1, 2).to(dtype), None
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1]) for t in (query, key, value))
    if keep is not None:
        q, k, v = q[keep], k[keep], v[keep]
    if scored and on_gpu and dim > FLASH_HEAD_DIM:  # no family asks for both; flex_attention failed at 512
        raise ConfigError(f"{VARLEN}: soft-capping or sinks on heads wider than {FLASH_HEAD_DIM} is not implemented.")
    window = sliding_window if windowed else None
    if scored:
        out = scored_attention(q, k, v, cu_q, scaling, window, softcap, s_aux)
    else:
        out = _unscored(varlen_attn, q, k, v, (cu_q, cu_k, max_q, max_k), scaling, window, causal)
    dim = out.shape[-1]
    if keep is not None:
        full = out.new_zeros(batch * seq, heads, dim)
        full[keep] = out
        out = full
    return out.reshape(batch, seq, heads, dim).to(dtype), None


# transformers hands a vision encoder all its images' boundaries (`cu_seqlens`) in one attention call per layer only
# where the backend's name says "flash" (`is_flash_attention_requested`); any other backend is called once per image
# (and per window of Qwen2.5-VL's windowed layers). The same function under this name takes the one call.
VISION_VARLEN = "sft_flash_varlen"


def vision_encoder_on_varlen(model) -> bool:
    """Give the vision encoder of an image-text model on `sft_varlen` the name under which transformers passes it the
    boundaries of every image at once (`VISION_VARLEN`): one kernel call per layer instead of one per image or window.
    Set on the built model's config, where transformers' own loading (which reads a "flash" name as flash-attn) does
    not check it. Returns whether it did."""
    from transformers import AttentionInterface

    vision_config = getattr(model.config, "vision_config", None)
    if vision_config is None or vision_config._attn_implementation != VARLEN:
        return False
    AttentionInterface.register(VISION_VARLEN, varlen_attention_forward)
    vision_config._attn_implementation = VISION_VARLEN
    return True


def register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    # the mask function of the flash kernels: a 2D padding mask or none, never a dense 4D mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


# What each backend honours of what a model's attention asks (`sft.model.architectures.Attention`). transformers' sdpa
# takes the window from its mask but has no soft-capping or sinks; flash-attn has soft-capping but no sinks; eager (the
# family's own function) and flex_attention (score and mask functions) have all three.
HONOURS = {
    "eager": {"window", "softcap", "sinks", "wide_heads"},
    "flex_attention": {"window", "softcap", "sinks"},
    "sdpa": {"window", "wide_heads"},
    "flash_attention_2": {"window", "softcap"},
    "flash_attention_3": {"window", "softcap"},
    VARLEN: {"window", "softcap", "sinks", "wide_heads"},  # wide heads per sample (`packed_kernel`)
}


# Backends that keep packed samples apart only through the mask the model's own code builds from position_ids
MASKED = {"sdpa", "eager", "flex_attention"}


def _needs(attention) -> set[str]:
    wanted = set()
    if attention.sliding:
        wanted.add("window")
    if attention.softcap is not None:
        wanted.add("softcap")
    if attention.sinks:
        wanted.add("sinks")
    if attention.wide_heads:
        wanted.add("wide_heads")
    return wanted


def honours(backend: str | None, on_gpu: bool) -> set[str]:
    """The attention features `backend` honours here (sft_varlen's window needs a torch whose kernel takes one)."""
    have = set(HONOURS.get(backend or "", set()))
    if backend == VARLEN and on_gpu and not varlen_has_window():
        have.discard("window")
    return have


def check_backend(arch, backend: str | None, padding_free: bool, on_gpu: bool | None = None) -> None:
    """Refuse, before the model is built, a backend that cannot honour what the model's attention asks (a window,
    soft-capping, sinks), and packing on layers that are not softmax attention."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    missing = _needs(arch.attention) - honours(backend, on_gpu)
    if missing:
        able = sorted(b for b in HONOURS if _needs(arch.attention) <= honours(b, on_gpu))
        raise ConfigError(
            f"`attn_implementation: {backend}` cannot honour what {arch.family}'s attention asks: "
            f"{'; '.join(arch.attention.needs())}. It would be dropped, and the model would train on other attention "
            f"than it runs with. Use `auto`, or one of {able}."
        )
    if padding_free and backend in MASKED and not arch.packed_mask:
        raise ConfigError(
            f"`attn_implementation: {backend}` with packing: transformers' {arch.family} builds its attention mask "
            "without the position ids, so this mask-based backend would let packed samples attend to each other. "
            f"Use `auto` ({VARLEN}: the samples' boundaries), or set packing: false and padding_free: false."
        )
    if padding_free and arch.attention.other_layers:
        raise ConfigError(
            f"Packing: {arch.family} has {', '.join(arch.attention.other_layers)} layers, to which sft cannot pass "
            "the sample boundaries of a packed row (a recurrent state, or keys compressed or selected over the whole "
            "row, would flow from one sample into the next). Set packing: false and padding_free: false."
        )


def resolve_attn_implementation(
    requested: str | None, sequence_parallel: bool = False, arch=None, padding_free: bool = False
) -> str | None:
    """The backend for `attn_implementation` (`auto` or unset: the fastest available one that honours what the
    model's attention asks, `arch`); logs the choice and refuses one that would drop a feature."""
    on_gpu = torch.cuda.is_available()
    needs = _needs(arch.attention) if arch is not None else set()
    scored = needs - {"window", "wide_heads"}  # soft-capping, sinks: sft_varlen's scored path (flex_attention on GPUs)
    mask_leaks = arch is not None and padding_free and not arch.packed_mask
    if requested not in (None, "auto"):
        chosen = requested
        if requested == VARLEN:
            if on_gpu and _varlen_attn() is None:
                raise ConfigError(
                    f"`attn_implementation: {VARLEN}` on a GPU needs torch.nn.attention.varlen (torch >= 2.9). "
                    "Use `auto` to pick the best available backend."
                )
            register_varlen()
    elif on_gpu:
        major, _ = torch.cuda.get_device_capability()
        if importlib.util.find_spec("flash_attn") is not None and major >= 8 and not needs - {"window"}:
            chosen, why = "flash_attention_2", "flash-attn is installed"
        elif _varlen_attn() is not None and (varlen_has_window() or "window" not in needs):
            register_varlen()
            chosen, why = VARLEN, "PyTorch's varlen FlashAttention-2 (flash-attn is not installed)"
            if "wide_heads" in needs:
                why = (f"{'; '.join(arch.attention.needs())}: per layer, varlen FlashAttention-2 where it takes the "
                       f"heads, {WIDE_KERNELS[wide_kernel_name()]} on the wider ones")  # fmt: skip
            if scored:
                why = (
                    f"{'; '.join(arch.attention.needs())}: flex_attention over the samples' block mask, compiled "
                    "on the first micro batch (197 s at Gemma-2-9B's widths on 1 x H200, "
                    "benchmarks/results/scored_attention; torch.compile's cache keeps it for later runs)"
                )
        else:
            chosen, why = "sdpa", "no varlen kernel (with a window, where the model has one) and no flash-attn"
    elif sequence_parallel or scored or mask_leaks or padding_free:
        register_varlen()
        chosen = VARLEN
        why = ("no GPU: sdpa over the row's samples padded to a batch, each sample its own keys; 1.8-2.2x sdpa over "
               "the row's block mask, benchmarks/results/cpu_attention")  # fmt: skip
    else:
        chosen, why = "sdpa", "no GPU, no packed rows: sdpa with the padding mask"
    if arch is not None:
        check_backend(arch, chosen, padding_free, on_gpu)
    if requested in (None, "auto"):
        logger.info("Attention backend: %s (%s)", chosen, why)
    return chosen


def by_submodel(config, attn_implementation: str | None):
    """The backend as transformers takes it for this config: one name, or per sub-model where one cannot take the
    run's. Gemma 4's audio encoder supports only eager and sft never runs it (no audio rows: frozen by
    `sft.model.converters`), so it gets eager and every other sub-model the run's backend."""
    if getattr(config, "audio_config", None) is None or attn_implementation in (None, "eager"):
        return attn_implementation
    subs = {key: attn_implementation for key in ("text_config", "vision_config") if getattr(config, key, None)}
    return {"": attn_implementation, **subs, "audio_config": "eager"}


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
