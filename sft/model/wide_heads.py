"""Exact attention over packed rows for heads wider than FlashAttention takes (Gemma 4's full layers: 512), on the
GPU's tensor cores.

torch's memory-efficient kernel (`sft.model.attention.efficient_varlen`) takes any head dim, but at 512 it runs its
SM80 CUTLASS tiles: Gemma 4's full layers (8 query / 4 key-value heads, 2 rows of 4,096 tokens of SFT-like samples)
took 12.0 ms forward and backward on an H200, about 20 TFLOP/s, the largest kernel of a Gemma 4 step
(benchmarks/results/families_2026). Here the same arithmetic as FlashAttention's, written as batched matrix products
(cuBLAS, bf16 in, fp32 accumulation) over each sample's whole score square:

- the row's samples are padded into batches by length (lengths within a factor of 2 share one, so a padded square
  is at most 4x its sample's), a batch split where its scores would pass `SCORE_BUDGET` elements (or its
  tokens `TOKEN_BUDGET`), and a sample alone over it in blocks of query rows (its keys' gradients summed over the
  blocks in fp32);
- grouped key-value heads are not repeated: a key-value head's query heads are one matrix of `group x width` rows;
- forward: scores in fp32, the causal mask (and a left window, or the padding keys for attention both ways), the
  log-sum-exp per query kept, probabilities in the inputs' dtype times the values;
- backward: the scores recomputed from q and k and the kept log-sum-exp (nothing quadratic is kept between the
  forward and the backward), then FlashAttention's gradients (dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
  dQ = dS K, dK = dS^T Q), each token's written once: no atomics, no row-sized gradient per batch.

A padded query is never read back: its log-sum-exp is set to infinity in the backward, so its probabilities are
zero and nothing flows from it into any key or value. Exact against transformers' eager attention one sample at a
time (tests/test_wide_heads.py: fp32 on the CPU, 1e-5); which kernel a layer takes is `attention.packed_kernel`'s
(this one, unless `SFT_WIDE_HEADS=efficient`). Measured on 1 x H100 against `efficient_varlen`
(benchmarks/wide_heads.py, call 25): 9.8 against 12.6 ms at 2 rows of 4,096, 20.9 against 53.3 ms at 8; a whole
Gemma 4 step at 8 layers 1.19x (benchmarks/results/families_2026). At 2 rows the GPU's share is small (3.6 ms, call
23), the rest the host's launches, one batch at a time.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

# Score elements (batch x heads x width x width) per batched product: the backward's transients are about 12 bytes
# per element (fp32 scores and the probabilities' gradient, 16-bit probabilities and score gradients), 1.5 GiB here
SCORE_BUDGET = 1 << 27
# Tokens per batch: each batch gathers its queries, keys, values, outputs and their gradients in the heads-first layout
# (at 8 x 512 query heads, ~8 KiB a token per tensor)
TOKEN_BUDGET = 1 << 14
# A batch's width is padded to a multiple of this: 16-bit rows whose length is not a multiple of 8 elements take
# cuBLAS's SM75 kernels on Hopper (1 x H100: benchmarks/results/families_2026/profile_call22_wide_varlen.txt)
ALIGN = 32


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Sample indices grouped by length: lengths in (2^(j - 1), 2^j] share group j (a padded square at most 4x its
    sample's): fewer batches, where each batch's launches cost the host more than its padding costs the GPU (1 x
    H100, benchmarks/results/families_2026: call 24 with these groups and host-built indices against call 23's
    groups within sqrt(2))."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            groups.setdefault((n - 1).bit_length(), []).append(i)
    return [groups[key] for key in sorted(groups)]


@functools.lru_cache(maxsize=256)
def _causal_mask(width: int, group: int, left: int, device: torch.device) -> torch.Tensor:
    """The allowed (query row, key) pairs of a `group x width` block of query rows: causal, a left window if any."""
    pos = torch.arange(width, device=device)
    query = pos.repeat(group)[:, None]  # a query row's position: the rows are group x width
    allowed = pos[None, :] <= query
    if 0 <= left < width - 1:
        allowed = allowed & (query - pos[None, :] <= left)
    return allowed


class Batch:
    """One batch of samples padded to `width`: the flat (token, head) rows it reads and writes, in the heads-first
    order ([samples, kv heads, group, width] for queries, [samples, kv heads, width] for keys and values; past a
    sample's end it reads its last token and writes a spare row), and the allowed (query, key) pairs."""

    def __init__(self, index: dict, samples: int, width: int, group: int, left: int, causal: bool):
        self.samples, self.width, self.group = samples, width, group
        self.q_read, self.q_write, self.kv_read, self.kv_write = (index[k] for k in ("qr", "qw", "kr", "kw"))
        if causal:
            self.allowed = _causal_mask(width, group, left, self.q_read.device)  # [group x width, width]
        else:  # both ways within the sample: its real keys
            self.allowed = index["real"].view(samples, 1, 1, width)

    def gather(self, x: torch.Tensor, query: bool) -> torch.Tensor:
        """[tokens, heads, dim] -> [samples x kv heads, rows, dim] in one gather: for queries a key-value head's
        query heads stacked in `group x width` rows, for keys and values `width` rows."""
        rows = self.group * self.width if query else self.width
        index = self.q_read if query else self.kv_read
        return x.reshape(-1, x.shape[-1]).index_select(0, index).view(-1, rows, x.shape[-1])

    def scatter(self, into: torch.Tensor, x: torch.Tensor, query: bool) -> None:
        """Writes a heads-first batch back into `into` ([tokens + 1, heads, dim]: padding lands on the spare row)."""
        index = self.q_write if query else self.kv_write
        into.view(-1, into.shape[-1]).index_copy_(0, index, x.reshape(-1, x.shape[-1]).to(into.dtype))

    def row_blocks(self, batch_heads: int) -> list[slice]:
        """Slices of the `group x width` query rows whose scores stay within `SCORE_BUDGET`: all at once unless one
        sample alone is over it (a long sample in a packed row)."""
        step = max(1, SCORE_BUDGET // (batch_heads * self.width))
        rows = self.group * self.width
        if step >= rows:
            return [slice(None)]
        return [slice(lo, min(lo + step, rows)) for lo in range(0, rows, step)]

    def mask(self, rows: slice) -> torch.Tensor:
        """The allowed pairs of the query rows `rows`, broadcast against scores [samples, kv heads, rows, width]."""
        return self.allowed[rows][None, None] if self.allowed.dim() == 2 else self.allowed

    def scores(self, qs, ks, rows: slice) -> torch.Tensor:
        """fp32 scores (unscaled, unmasked) of the query rows `rows`: [samples, kv heads, rows, width]."""
        raw = _matmul_fp32(qs[:, rows], ks.transpose(1, 2))
        return raw.view(self.samples, -1, raw.shape[1], raw.shape[2])


def softmax_rows(scores, allowed, scale: float, dtype: torch.dtype):
    """(log-sum-exp per query row, probabilities in `dtype`) of scaled, masked fp32 scores."""
    scores = (scores * scale if scale != 1.0 else scores).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return lse, torch.exp(scores - lse).to(dtype)


def score_grads(scores, allowed, scale: float, lse, d_probs, d_out, out, dtype: torch.dtype):
    """(probabilities, the scores' gradient), both in `dtype`, from the unscaled fp32 scores recomputed, the kept
    log-sum-exp, the probabilities' gradient dO V^T, and dO and O of the same query rows: FlashAttention's
    dS = P * (dP - rowsum(dO * O))."""
    delta = (d_out.float() * out.float()).sum(-1).view(lse.shape)
    scores = (scores * scale if scale != 1.0 else scores).masked_fill(~allowed, float("-inf"))
    probs = torch.exp(scores - lse)
    d_scores = probs * (d_probs - delta)
    return probs.to(dtype), (d_scores * scale if scale != 1.0 else d_scores).to(dtype)


# On a GPU the pointwise work between the products runs compiled: a few fused passes over the scores instead of one
# per operation (`FUSED = False`: eager, as on the CPU; benchmarks/wide_heads.py measures both)
FUSED = True


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _pointwise(fn, scores: torch.Tensor):
    return _compiled(fn) if FUSED and scores.is_cuda else fn


@functools.cache
def _out_dtype_works(device_type: str) -> bool:
    a = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 results: 16-bit inputs stay 16-bit on the tensor cores where torch has `out_dtype`."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if _out_dtype_works(a.device.type):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def plan(cu: torch.Tensor, heads: int, kv_heads: int, left: int, causal: bool, total: int) -> list[Batch]:
    """The `Batch`es of a packed row's samples (boundaries `cu`), each within `SCORE_BUDGET` and `TOKEN_BUDGET` (or
    one sample), their widths padded to `ALIGN`. Built on the host from the lengths (read once: the call's only wait
    for the GPU), every batch's indices copied in one transfer: a batch costs the host its kernels' launches only."""
    lengths = cu.diff().tolist()
    starts = np.cumsum([0, *lengths])
    group = heads // kv_heads
    q_heads = np.arange(heads).reshape(1, kv_heads, group, 1)
    kv = np.arange(kv_heads).reshape(1, kv_heads, 1)
    shapes, parts = [], []
    for members in length_groups(lengths):
        width = -(-max(lengths[i] for i in members) // ALIGN) * ALIGN
        per_batch = max(1, min(SCORE_BUDGET // (heads * width * width), TOKEN_BUDGET // width))
        for lo in range(0, len(members), per_batch):
            chosen = members[lo : lo + per_batch]
            first, size = starts[chosen][:, None], np.asarray([lengths[i] for i in chosen])[:, None]
            pos = np.arange(width)[None, :]
            real = pos < size
            tokens, dest = first + np.minimum(pos, size - 1), np.where(real, first + pos, total)
            part = {
                "qr": (tokens[:, None, None, :] * heads + q_heads).ravel(),
                "qw": (dest[:, None, None, :] * heads + q_heads).ravel(),
                "kr": (tokens[:, None, :] * kv_heads + kv).ravel(),
                "kw": (dest[:, None, :] * kv_heads + kv).ravel(),
            }
            if not causal:  # attention both ways masks the padding keys
                part["real"] = real.ravel()
            shapes.append((len(chosen), width, {k: v.size for k, v in part.items()}))
            parts.append(part)
    flat = torch.from_numpy(np.concatenate([v.astype(np.int64) for part in parts for v in part.values()]))
    if cu.is_cuda:
        flat = flat.pin_memory().to(cu.device, non_blocking=True)
    batches, offset = [], 0
    for samples, width, sizes in shapes:
        index = {}
        for key, size in sizes.items():
            index[key] = flat[offset : offset + size]
            offset += size
        if "real" in index:
            index["real"] = index["real"].bool()
        batches.append(Batch(index, samples, width, group, left, causal))
    return batches


class _LastPlan:
    """The last call's batches, for the next layer of the same micro batch: every wide layer of a forward gets the
    same boundaries tensors, so the host reads the lengths, checks that the keys' boundaries are the queries', and
    builds the indices once per micro batch, not per layer. Kept while they are the same tensor objects, unchanged in
    place (their versions), with the same heads and mask."""

    def __init__(self):
        self.held, self.key, self.batches = (), None, None

    def get(self, cu_q: torch.Tensor, cu_k: torch.Tensor, args: tuple) -> list[Batch]:
        """`plan(cu_q, *args)`, or the last call's where it would be the same."""
        key = (*args, cu_q._version, cu_k._version, SCORE_BUDGET, TOKEN_BUDGET, ALIGN)
        held = [ref() for ref in self.held]
        if len(held) == 2 and held[0] is cu_q and held[1] is cu_k and self.key == key:
            return self.batches
        if cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise ValueError("wide_varlen: self-attention only (the query and key boundaries differ)")
        self.batches = plan(cu_q, *args)
        self.held, self.key = (weakref.ref(cu_q), weakref.ref(cu_k)), key
        return self.batches


_last_plan = _LastPlan()


class _WideAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale: float, left: int, causal: bool):
        total, heads = q.shape[0], q.shape[1]
        batches = _last_plan.get(cu_q, cu_k, (heads, k.shape[1], left, causal, total))
        out = q.new_zeros(total + 1, heads, v.shape[-1])  # the last row: where padding is written
        lse = q.new_zeros(total + 1, heads, 1, dtype=torch.float32)
        for b in batches:
            qs, ks, vs = b.gather(q, True), b.gather(k, False), b.gather(v, False)
            lses, outs = [], []
            for rows in b.row_blocks(qs.shape[0]):
                scores = b.scores(qs, ks, rows)
                row_lse, probs = _pointwise(softmax_rows, scores)(scores, b.mask(rows), scale, v.dtype)
                lses.append(row_lse.view(qs.shape[0], -1, 1))
                outs.append(torch.bmm(probs.view(qs.shape[0], -1, ks.shape[1]), vs))
            b.scatter(out, _joined(outs), True)
            b.scatter(lse, _joined(lses), True)
        # a padded query reads an infinite log-sum-exp in the backward: its probabilities are 0, so it sends no
        # gradient anywhere
        lse[total] = float("inf")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.batches, ctx.args = batches, (scale,)
        return out[:total]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        (scale,) = ctx.args
        total = q.shape[0]
        grad = grad.contiguous()
        dq, dk, dv = (t.new_zeros(total + 1, *t.shape[1:]) for t in (q, k, v))
        for b in ctx.batches:
            qs, ks, vs = b.gather(q, True), b.gather(k, False), b.gather(v, False)
            d_out, outs = b.gather(grad, True), b.gather(out, True)
            row_lse = lse.view(-1, 1).index_select(0, b.q_write).view(qs.shape[0], -1, 1)
            d_qs, d_ks, d_vs = [], None, None
            for rows in b.row_blocks(qs.shape[0]):
                scores = b.scores(qs, ks, rows)
                d_probs = _matmul_fp32(d_out[:, rows], vs.transpose(1, 2)).view_as(scores)
                shaped = (t[:, rows].view(*scores.shape[:3], -1) for t in (row_lse, d_out, outs))
                lse_rows, d_out_rows, out_rows = shaped
                grads = _pointwise(score_grads, scores)
                probs, d_scores = grads(scores, b.mask(rows), scale, lse_rows, d_probs, d_out_rows, out_rows, q.dtype)
                probs, d_scores = (t.view(qs.shape[0], -1, ks.shape[1]) for t in (probs, d_scores))
                d_vs = _add(d_vs, torch.bmm(probs.transpose(1, 2), d_out[:, rows]))
                d_qs.append(torch.bmm(d_scores, ks))
                d_ks = _add(d_ks, torch.bmm(d_scores.transpose(1, 2), qs[:, rows]))
            b.scatter(dq, _joined(d_qs), True)
            b.scatter(dk, d_ks, False)
            b.scatter(dv, d_vs, False)
        return dq[:total], dk[:total], dv[:total], None, None, None, None, None


def _joined(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The query-row blocks of a batch as one tensor (the one block itself where the batch is one)."""
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Sums the keys' gradients over blocks of query rows, in fp32 from the second block on."""
    return part if total is None else total.float().add_(part)


def in_flight_bytes(heads: int, head_dim: int, tokens: int, row: int) -> float:
    """What one call holds at most beyond its inputs, outputs and their gradients, for the memory plan: one batch's
    scores (12 bytes each in the backward: fp32 scores and the probabilities' gradient, 16-bit probabilities and
    score gradients) and its heads-first copies (queries, keys, values, output, their gradients: 16 bytes a token per
    query head's dim, keys and values counted as query heads), for `tokens` tokens in rows of `row`."""
    width = -(-row // ALIGN) * ALIGN
    scores = min(SCORE_BUDGET, heads * width * width)
    return 12.0 * scores + 16.0 * min(tokens, max(TOKEN_BUDGET, width)) * heads * head_dim


@torch.compiler.disable  # data-dependent batches: run eagerly inside compiled decoder layers (a graph break)
def wide_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **_):
    """`varlen_attn`'s contract ([total, heads, dim] tensors, causal or both ways (`window_size=(-1, -1)`), GQA, a
    left window) on batched matrix products: for heads wider than FlashAttention takes. Queries and keys share the
    boundaries (`cu_k` must equal `cu_q`: self-attention of packed rows; checked once per micro batch, `_LastPlan`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _WideAttention.apply(q, k, v, cu_q, cu_k, scale, int(window_size[0]), window_size[1] == 0)
