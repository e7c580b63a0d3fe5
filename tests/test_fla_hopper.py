"""sft's torch form of flash-linear-attention's `chunk_bwd_dqkwg` (`sft.model.fla_hopper`, the backward piece that
fla refuses on Hopper GPUs under Triton 3.4-3.7.0) against autograd.

The kernel returns the gradients, with respect to the queries, keys, WY weights and gates, of three terms per chunk of
64 tokens, given the chunk's incoming state h, the gradients of the output `do`, of the next state `dh` and of the
corrected values `dv`: the chunk's output (the state read by each query, plus causal attention within the chunk, each
decayed by the gates), its state update, and the WY correction `v - w h`. The reference here writes those terms chunk
by chunk in float64 and lets autograd differentiate them (the gates in log2 units, so fla's `dg` is autograd's over
ln 2). On 2026-12-07 the torch form also equalled fla-core 0.6.0's own Triton kernel, run through Triton's
interpreter on the CPU, within 2e-7 relative (these shapes: packed, v-first, batched).
"""

import itertools
import math

import pytest
import torch

from sft.model.fla_hopper import chunk_bwd_dqkwg

CHUNK = 64


def _sequences(batch: int, tokens: int, bounds: list[int] | None):
    """(row, start, end) of each sequence, in fla's chunk order."""
    if bounds is None:
        return [(b, 0, tokens) for b in range(batch)]
    return [(0, lo, hi) for lo, hi in itertools.pairwise(bounds)]


def _reference(q, k, v, do, h, dh, w, dv, g, scale, bounds, state_v_first):
    batch, tokens, heads, _ = q.shape
    group = v.shape[2] // heads
    leaves = [x.double().requires_grad_() for x in (q, k, w, g)]
    q64, k64, w64, g64 = leaves
    v64, do64, dv64 = v.double(), do.double(), dv.double()
    h64, dh64 = (x.double().transpose(-1, -2) if state_v_first else x.double() for x in (h, dh))
    loss, c = 0.0, 0
    for row, start, end in _sequences(batch, tokens, bounds):
        for lo in range(start, end, CHUNK):
            s = slice(lo, min(lo + CHUNK, end))
            qc, kc = (x[row, s].repeat_interleave(group, dim=1) for x in (q64, k64))
            vc, doc, dvc, wc, gc = v64[row, s], do64[row, s], dv64[row, s], w64[row, s], g64[row, s]
            state, state_grad = h64[c], dh64[c]
            out = scale * torch.exp2(gc)[..., None] * torch.einsum("nhk,hkv->nhv", qc, state)
            decay = torch.exp2(gc.T[:, :, None] - gc.T[:, None, :]).tril()
            scores = torch.einsum("ihk,jhk->hij", qc, kc) * decay
            out = out + scale * torch.einsum("hij,jhv->ihv", scores, vc)
            g_last = gc[-1]
            new_state = torch.exp2(g_last)[:, None, None] * state + torch.einsum(
                "nhk,nhv->hkv", kc * torch.exp2(g_last - gc)[..., None], vc
            )
            correction = -torch.einsum("nhk,hkv->nhv", wc, state)
            loss = loss + (doc * out).sum() + (state_grad * new_state).sum() + (dvc * correction).sum()
            c += 1
    loss.backward()
    return q64.grad, k64.grad, w64.grad, g64.grad / math.log(2)


def _inputs(batch, tokens, heads, v_heads, bounds, state_v_first, seed=0, k_dim=16, v_dim=8):
    gen = torch.Generator().manual_seed(seed)
    chunks = sum(-(-(end - start) // CHUNK) for _, start, end in _sequences(batch, tokens, bounds))

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = r(batch, tokens, heads, k_dim), r(batch, tokens, heads, k_dim)
    v, do, dv = (r(batch, tokens, v_heads, v_dim) for _ in range(3))
    w = r(batch, tokens, v_heads, k_dim)
    state_shape = (chunks, v_heads, v_dim, k_dim) if state_v_first else (chunks, v_heads, k_dim, v_dim)
    h, dh = r(*state_shape), r(*state_shape)
    # the gates as fla passes them: log2 decays (negative), cumulated within each chunk
    step = -torch.rand(batch, tokens, v_heads, generator=gen) * 0.2
    g = torch.zeros_like(step)
    for row, start, end in _sequences(batch, tokens, bounds):
        for lo in range(start, end, CHUNK):
            hi = min(lo + CHUNK, end)
            g[row, lo:hi] = step[row, lo:hi].cumsum(0)
    return q, k, v, do, h, dh, w, dv, g


@pytest.mark.parametrize(
    "batch,tokens,heads,v_heads,bounds,state_v_first",
    [
        (1, 230, 2, 4, [0, 70, 200, 230], False),  # a packed row: sequences of 70, 130 and 30 tokens, grouped values
        (1, 230, 2, 2, [0, 64, 65, 230], True),  # a sequence of exactly one chunk, one of one token; v-first states
        (2, 100, 3, 3, None, False),  # rows of one sequence each, the last chunk short
    ],
)
def test_torch_dqkwg_equals_autograd_of_the_chunk_terms(batch, tokens, heads, v_heads, bounds, state_v_first):
    q, k, v, do, h, dh, w, dv, g = _inputs(batch, tokens, heads, v_heads, bounds, state_v_first)
    scale = q.shape[-1] ** -0.5
    cu = torch.tensor(bounds) if bounds is not None else None
    got = chunk_bwd_dqkwg(q=q, k=k, v=v, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale, cu_seqlens=cu,
                          chunk_size=CHUNK, state_v_first=state_v_first)  # fmt: skip
    want = _reference(q, k, v, do, h, dh, w, dv, g, scale, bounds, state_v_first)
    if bounds is None:  # fla's layout of the states of rows of one sequence each: [B, chunks per row, HV, ...]
        rowed = dict(h=h.view(batch, -1, *h.shape[1:]), dh=dh.view(batch, -1, *dh.shape[1:]))
        again = chunk_bwd_dqkwg(q=q, k=k, v=v, w=w, g=g, dv=dv, do=do, scale=scale, chunk_size=CHUNK,
                                state_v_first=state_v_first, **rowed)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert float((a.double() - b).norm() / b.norm()) < 1e-5, name


def test_torch_dqkwg_takes_fla_chunk_indices_and_keeps_the_dtypes():
    bounds = [0, 70, 200, 230]
    q, k, v, do, h, dh, w, dv, g = _inputs(1, 230, 2, 4, bounds, False, seed=1)
    cu = torch.tensor(bounds)
    # fla's chunk_indices: (sequence, chunk within it) per chunk
    indices = torch.tensor([[n, t] for n, (lo, hi) in enumerate(itertools.pairwise(bounds))
                            for t in range(-(-(hi - lo) // CHUNK))])  # fmt: skip
    kwargs = dict(q=q, k=k, v=v, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=0.25, cu_seqlens=cu, chunk_size=CHUNK)
    with_indices = chunk_bwd_dqkwg(**kwargs, chunk_indices=indices)
    without = chunk_bwd_dqkwg(**kwargs)
    for a, b in zip(with_indices, without, strict=True):
        assert torch.equal(a, b)
    # bf16 inputs: dq, dk and dw come back in the inputs' dtype, dg in fp32, as fla's kernel gives them
    half = {n: x.bfloat16() for n, x in dict(q=q, k=k, v=v, w=w, do=do, dv=dv, h=h, dh=dh).items()}
    dq, dk, dw, dg = chunk_bwd_dqkwg(**half, g=g, scale=0.25, cu_seqlens=cu, chunk_size=CHUNK)
    assert (dq.dtype, dk.dtype, dw.dtype, dg.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert float((dq.float() - without[0]).norm() / without[0].norm()) < 2e-2  # bf16 inputs, the same gradients
    # fla passes the states as [B, chunks, HV, K, V] (one row for packed sequences; call 28 on the GPU failed on it)
    rowed = {**kwargs, "h": h[None], "dh": dh[None]}
    for a, b in zip(chunk_bwd_dqkwg(**rowed), without, strict=True):
        assert torch.equal(a, b)
    # a wrong gate gives a wrong dq: the comparison can fail
    wrong = chunk_bwd_dqkwg(**{**kwargs, "g": g * 1.5})
    assert float((wrong[0] - without[0]).norm() / without[0].norm()) > 1e-2
