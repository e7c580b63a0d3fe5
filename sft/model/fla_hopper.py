"""flash-linear-attention's gated delta rule trained on Hopper GPUs under Triton 3.4-3.7.0 (torch 2.10-2.11's).

fla-core refuses the backward of its gated delta rule there (fla issue #640): one of its kernels,
`chunk_bwd_kernel_dqkwg` (the gradients of queries, keys, the WY weights and the gates, per chunk of 64 tokens),
is miscompiled by those Tritons on Hopper (a transpose of a matrix-multiply result), and its Python entry point
`fla.ops.common.chunk_o.chunk_bwd_dqkwg` raises rather than return wrong gradients. Every other kernel of the layer,
forward and backward, runs. fla routes that entry point through its backend registry (`fla.backends`: the first
enabled backend whose verifier accepts the call, else fla's own); this module registers one more backend for it,
`chunk_bwd_dqkwg` below: the same arithmetic in batched torch matrix products over the chunks, in fp32, on the
inputs fla's kernels give it. It is registered only where fla would refuse (a Hopper GPU and a Triton in
`BAD_TRITON`), so elsewhere fla runs as shipped.

Checked on the CPU (`tests/test_fla_hopper.py`) against the gradients that autograd takes of the terms that kernel
differentiates (each chunk's output, its state update and the WY correction), packed rows and single sequences,
grouped value heads, both state layouts, within 1e-5; and against fla-core 0.6.0's own Triton kernel run through
Triton's interpreter, within 2e-7. On one H100 under Triton 3.6 (benchmarks/results/families_2026, calls 28-30):
Qwen3.5's layers through fla with this piece give every gradient within 0.079 of the fp32 per-sample torch path's
(bf16 torch 0.053; fla's own under Triton 3.7.1, 0.067), and train 2.08x the batched torch path's tokens/s (the whole
8-layer step 1.94x, its losses within 0.0042 of the torch path's over 8 steps).
"""

from __future__ import annotations

import importlib.util

import torch

# fla-core 0.6 refuses its gated `chunk_bwd_dqkwg` on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 (fla issue #640)
BAD_TRITON = ("3.4.0", "3.7.1")
BACKEND = "sft_torch"  # the backend's name in fla's registry (and its log line, "[FLA Backend] ... -> sft_torch")
NOTE = (f"; fla's gated chunk_bwd_dqkwg, which fla refuses on Hopper under Triton {BAD_TRITON[0]}-{BAD_TRITON[1]} "
        "(fla issue #640), through sft's torch form of it (sft.model.fla_hopper)")  # fmt: skip


def needed() -> bool:
    """Whether fla, as installed here, would refuse its gated delta rule's backward: fla installed, a Hopper GPU,
    a Triton in `BAD_TRITON`."""
    if importlib.util.find_spec("fla") is None or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    import triton
    from packaging.version import Version

    low, high = (Version(v) for v in BAD_TRITON)
    return low <= Version(triton.__version__) < high


def _chunks(batch: int, tokens: int, chunk: int, cu_seqlens, chunk_indices, device):
    """Each chunk's token positions in the flattened (batch x tokens) rows, `[chunks, chunk]`, where each is valid,
    and each chunk's last valid position: fla's chunks, 64 tokens from each sequence's start, the last one short."""
    if cu_seqlens is None:
        per_row = -(-tokens // chunk)
        first = (torch.arange(batch, device=device)[:, None] * tokens
                 + torch.arange(per_row, device=device)[None] * chunk).reshape(-1)  # fmt: skip
        end = (torch.arange(batch, device=device)[:, None] * tokens + tokens).expand(batch, per_row).reshape(-1)
    else:
        bounds = cu_seqlens.to(device=device, dtype=torch.long)
        if chunk_indices is None:
            lengths = bounds.diff()
            counts = (lengths + chunk - 1) // chunk
            sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
            index = torch.arange(int(counts.sum()), device=device) - torch.repeat_interleave(counts.cumsum(0) - counts,
                                                                                              counts)  # fmt: skip
        else:
            sequence, index = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        first = bounds[sequence] + index * chunk
        end = bounds[sequence + 1]
    positions = first[:, None] + torch.arange(chunk, device=device)
    valid = positions < end[:, None]
    return torch.where(valid, positions, first[:, None]), valid, torch.minimum(first + chunk, end) - 1


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):  # fmt: skip
    """fla's `chunk_bwd_dqkwg` for the gated case (`g` given, in log2 units and cumulated within each chunk, as fla
    passes it): q, k `[B, T, H, K]`, v (the corrected values), do, dv `[B, T, HV, V]`, w `[B, T, HV, K]`, the states
    entering each chunk h and their gradients dh `[B, chunks, HV, K, V]` (or `[chunks, ...]`; `V, K` with
    `state_v_first`).
    Returns dq, dk `[B, T, H, K]`, dw (or None) and dg `[B, T, HV]` before fla's reverse cumulative sum, as fla's
    kernel does."""
    batch, tokens, heads, k_dim = k.shape
    v_heads = v.shape[2]
    group = v_heads // heads
    positions, valid, last = _chunks(batch, tokens, chunk_size, cu_seqlens, chunk_indices, k.device)
    flat = positions.reshape(-1)
    qc, kc = _rows(q, positions, valid, group), _rows(k, positions, valid, group)
    vc, doc = _rows(v, positions, valid), _rows(do, positions, valid)
    gates = g.reshape(batch * tokens, v_heads).float()
    gc = gates[flat].view(*positions.shape, v_heads).masked_fill(~valid[:, :, None], 0).transpose(1, 2)  # [C, HV, BT]
    g_last = gates[last]  # [C, HV]
    # fla keeps the states [B, chunks, HV, ...] (one row for packed sequences): chunk by chunk in its order
    state, state_grad = (x.reshape(-1, v_heads, *x.shape[-2:]).float() for x in (h, dh))
    if state_v_first:
        state, state_grad = state.transpose(-1, -2), state_grad.transpose(-1, -2)
    # what the kernel sums over the value blocks: [C, HV, BT, K] and [C, HV, BT, BT]
    dq = doc @ state.transpose(-1, -2)
    dk = vc @ state_grad.transpose(-1, -2)
    ds = doc @ vc.transpose(-1, -2)
    dg_last = (state * state_grad).sum((-1, -2)) * torch.exp2(g_last)
    dw = None
    if w is not None:
        dw = -(_rows(dv, positions, valid) @ state.transpose(-1, -2))
    dq = dq * (torch.exp2(gc) * scale)[..., None]
    dk = dk * torch.where(valid[:, None, :], torch.exp2(g_last[..., None] - gc), 0)[..., None]
    dg_last = dg_last + (dk * kc).sum((-1, -2))
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    pairs = causal & valid[:, None, :, None] & valid[:, None, None, :]
    ds = torch.where(pairs, ds * torch.exp2(gc[..., :, None] - gc[..., None, :]), 0) * scale
    ds = ds.to(k.dtype).float()  # the kernel rounds these to the inputs' precision before its last two products
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [C, HV, BT]
    at_last = torch.arange(chunk_size, device=k.device)[None] == (last - positions[:, 0])[:, None]
    dg = dg + torch.where(at_last[:, None, :], dg_last[..., None], 0)

    dq, dk = (_unchunk(x, positions, valid, batch * tokens).to(y.dtype) for x, y in ((dq, q), (dk, k)))
    if group > 1:  # [B * T, HV, K] -> [B * T, H, K]: each query-key head's value heads summed
        dq, dk = (x.view(batch * tokens, heads, group, k_dim).sum(2) for x in (dq, dk))
    dw = _unchunk(dw, positions, valid, batch * tokens).to(w.dtype) if dw is not None else None
    shape = (batch, tokens, v_heads)
    return (
        dq.view(*shape[:2], heads, k_dim),
        dk.view(*shape[:2], heads, k_dim),
        (dw.view(*shape, k_dim) if dw is not None else None),
        _unchunk(dg, positions, valid, batch * tokens).view(shape),
    )


def _rows(x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """`x` [B, T, heads, d] as chunks [C, heads * repeat, chunk, d] in fp32, zero where a chunk runs short."""
    out = x.reshape(-1, *x.shape[2:])[positions.reshape(-1)].float().view(*positions.shape, *x.shape[2:])
    out = out.masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)
    return out.repeat_interleave(repeat, dim=1) if repeat > 1 else out


def _unchunk(x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, tokens: int) -> torch.Tensor:
    """Chunks [C, HV, BT, ...] back to tokens [B * T, HV, ...] (each token in exactly one chunk's valid slots)."""
    per_token = x.transpose(1, 2)[valid]
    out = per_token.new_zeros(tokens, *per_token.shape[1:])
    out[positions[valid]] = per_token
    return out


_REGISTERED = False


def registered() -> bool:
    """Whether `register` has put the torch form in fla's registry in this process."""
    return _REGISTERED


def register() -> bool:
    """Add `chunk_bwd_dqkwg` to fla's backends for its gated calls where fla would refuse them (`needed`); returns
    whether it is registered. Once per process."""
    global _REGISTERED
    if _REGISTERED or not needed():
        return _REGISTERED
    import fla.ops.common.chunk_o  # noqa: F401  (creates fla's registry for the 'common' operations first)
    from fla.backends import BaseBackend
    from fla.backends import register as fla_register

    class TorchDqkwg(BaseBackend):
        backend_type = BACKEND
        priority = 6  # after fla's TileLang backend (5), which takes these calls where tilelang is installed

        def chunk_bwd_dqkwg_verifier(self, *args, g=None, g_gamma=None, **kwargs):
            if g is None or g_gamma is not None:
                return False, "only the gated case (g given, no g_gamma), which fla refuses on this Triton"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)

    fla_register("common")(TorchDqkwg)
    _REGISTERED = True
    return True
