"""Gemma 4's attention layers over packed rows on a GPU, kernel by kernel: which exact packed kernel each layer takes.

    python -m benchmarks.wide_heads --out FILE.json

Gemma 4's full-attention layers have heads of 512, which FlashAttention's kernels do not take; its sliding layers
heads of 256 (window 512 here), which they do. transformers' sdpa path runs the whole model with a block-diagonal
mask from the position ids (`masked_sdpa`, the dense row x row mask). Per layer kind, on rows of `--tokens` tokens of
SFT-like samples (`benchmarks.architectures.rows`), `--rows` rows per micro batch, bf16, Gemma 4 E4B-like heads (8
query, 4 key-value):

- full layers (head dim 512): `masked_sdpa`, `per_sample_sdpa` (`sft.model.attention.per_sample_sdpa`: causal sdpa
  once per sample), `efficient_varlen` (`sft.model.attention.efficient_varlen`: torch's memory-efficient kernel over
  the row's samples through its `cu_seqlens`, one call) and `flex` (`sft.model.attention._flex_scored`: flex_attention
  with the samples' block mask, compiled; `flex_small_tiles` the same with `SMALL_TILES`) and `wide_varlen`
  (`sft.model.wide_heads.wide_varlen`: batched matrix products over the samples padded by length; `wide_varlen_eager`
  without its compiled pointwise work);
- sliding layers (head dim 256): `masked_sdpa` (the window in the mask) and `varlen` (PyTorch's varlen
  FlashAttention-2 with the window, what `sft_varlen` runs).

Each: forward + backward milliseconds (median of `--repeats` after a warm-up) and the largest relative difference of
the output and of q/k/v's gradients from fp32 math one sample at a time, and the peak memory above the inputs. An
exception is a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

HEADS, KV_HEADS, WINDOW = 8, 4, 512


def _reference(q, k, v, cu, window):
    """fp32 math attention one sample at a time (causal, a left window of `window` tokens where given)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], device=q.device)
    groups = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[lo:hi].float().transpose(0, 1)
        ks, vs = (t[lo:hi].float().transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
        pos = torch.arange(hi - lo, device=q.device)
        distance = pos[:, None] - pos[None, :]
        allowed = (distance >= 0) & (distance < (window or hi - lo + 1))
        scores = (qs @ ks.transpose(1, 2) * qs.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _masked_sdpa(q, k, v, cu, window):
    sample = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), cu.diff().long())
    pos = torch.arange(q.shape[0], device=q.device)
    mask = (sample[:, None] == sample[None, :]) & (pos[:, None] >= pos[None, :])
    if window:
        mask &= pos[:, None] - pos[None, :] < window
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _per_sample(q, k, v, cu, window):
    from sft.model.attention import per_sample_sdpa

    return per_sample_sdpa(q, k, v, cu, cu, 0, 0, window_size=(-1 if window is None else window - 1, 0))


def _efficient(q, k, v, cu, window):
    from sft.model.attention import efficient_varlen

    max_len = int(cu.diff().max())
    return efficient_varlen(q, k, v, cu, cu, max_len, max_len, window_size=(-1 if window is None else window - 1, 0))


def _matmul(q, k, v, cu, window):
    from sft.model.wide_heads import wide_varlen

    return wide_varlen(q, k, v, cu, cu, 0, 0, window_size=(-1 if window is None else window - 1, 0))


def _matmul_eager(q, k, v, cu, window):
    from sft.model import wide_heads

    wide_heads.FUSED = False
    try:
        return _matmul(q, k, v, cu, window)
    finally:
        wide_heads.FUSED = True


def _flex(q, k, v, cu, window):
    from sft.model.attention import _flex_scored

    return _flex_scored(q, k, v, cu, None, window, None, None)


# flex_attention's Triton kernels at head dim 512 with tiles small enough for Hopper's shared memory (its defaults
# did not compile there): forward 32 x 32, backward 16 x 32 / 32 x 16, one stage
SMALL_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16,
               "num_stages": 1, "num_warps": 4}  # fmt: skip


def _flex_small_tiles(q, k, v, cu, window):
    import functools

    from torch.nn.attention.flex_attention import flex_attention

    from sft.model.attention import _flex_scored

    compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_scored(q, k, v, cu, None, window, None, None,
                        flex=functools.partial(compiled, kernel_options=SMALL_TILES))  # fmt: skip


def _varlen(q, k, v, cu, window):
    from torch.nn.attention.varlen import varlen_attn

    max_len = int(cu.diff().max())
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1 if window is None else window - 1, 0))


KERNELS = {512: {"masked_sdpa": _masked_sdpa, "per_sample_sdpa": _per_sample, "efficient_varlen": _efficient,
                 "wide_varlen": _matmul, "wide_varlen_eager": _matmul_eager, "flex": _flex,
                 "flex_small_tiles": _flex_small_tiles},
           256: {"masked_sdpa": _masked_sdpa, "varlen": _varlen}}  # fmt: skip


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(dim: int, tokens: int, rows: int, repeats: int, only: list[str] | None = None) -> dict:
    from benchmarks.architectures import rows as sample_rows

    lengths = [n for row in sample_rows(tokens, 7, rows) for n in row]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    window = WINDOW if dim == 256 else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, dim, device="cuda", generator=gen).bfloat16().requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    grad_out = torch.randn(total, HEADS, dim, device="cuda", generator=gen).bfloat16()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_in, cu, window)
    ref.backward(grad_out.float())
    result = {"samples": len(lengths), "tokens": total}
    for name, kernel in KERNELS[dim].items():
        if only and name not in only:
            continue
        try:
            seconds = []
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            for i in range(repeats + 1):
                for t in (q, k, v):
                    t.grad = None
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = kernel(q, k, v, cu, window)
                out.backward(grad_out)
                torch.cuda.synchronize()
                if i:
                    seconds.append(time.perf_counter() - start)
            grads = max(_rel(t.grad, r.grad) for t, r in zip((q, k, v), ref_in, strict=True))
            result[name] = {
                "ms": 1e3 * statistics.median(seconds),
                "out_rel": _rel(out, ref),
                "grad_rel": grads,
                "peak_mib_above_inputs": (torch.cuda.max_memory_allocated() - held) / 2**20,
            }
        except Exception:  # noqa: BLE001 - a kernel that cannot take the shape is the finding
            result[name] = {"error": traceback.format_exc()[-800:]}
        print(dim, name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", nargs="*", help="only these (default: every one)")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": HEADS, "kv_heads": KV_HEADS,
              "window": WINDOW, "tokens_per_row": args.tokens, "rows": args.rows}  # fmt: skip
    for dim in (512, 256):
        result[f"head_dim_{dim}"] = measure(dim, args.tokens, args.rows, args.repeats, args.kernels)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
