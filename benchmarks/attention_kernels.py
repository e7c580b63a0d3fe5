"""Attention kernels at long-context shapes: forward and forward+backward time of each backend PyTorch offers.

    python -m benchmarks.attention_kernels --out $OUT

The shape is one rank's attention under Ulysses sequence parallelism for the Llama-3.1-8B shape (32 query heads, 8
key/value heads, head dim 128) at sp=2: 16 query and 4 key/value heads over the whole row, causal, bf16. For each
row length: `varlen` (torch.nn.attention.varlen.varlen_attn, PyTorch's varlen FlashAttention-2, what `sft_varlen`
runs; one sample per row and the same row cut into 8 samples) and `sdpa` with each backend forced (flash, cuDNN,
memory-efficient; key/value heads repeated where a backend does not take GQA). TFLOP/s counts causal attention as
half the square (forward 2 x 2 x S^2/2 x heads x dim, backward 2.5 x forward). Results: attention_kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from benchmarks.common import environment, write_results


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` runs after two warm-ups (CUDA events)."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cases(seq: int, heads: int, kv_heads: int, dim: int):
    """(name, forward callable taking q, k, v in [1, heads, S, D] layout, sample lengths) for each backend."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    causal = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {}
    causal = causal or {"is_causal": True}

    def varlen(samples: int):
        cu = torch.linspace(0, seq, samples + 1, device="cuda").round().to(torch.int32)
        longest = int(cu.diff().max())

        def fn(q, k, v):
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
            return varlen_attn(q, k, v, cu, cu, longest, longest, **causal)

        return fn

    def sdpa(backend, gqa: bool):
        def fn(q, k, v):
            if not gqa:
                k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return fn

    yield "varlen FA2, 1 sample", varlen(1), 1
    yield "varlen FA2, 8 samples", varlen(8), 8
    yield "sdpa flash, GQA", sdpa(SDPBackend.FLASH_ATTENTION, True), 1
    yield "sdpa flash, kv repeated", sdpa(SDPBackend.FLASH_ATTENTION, False), 1
    yield "sdpa cuDNN, kv repeated", sdpa(SDPBackend.CUDNN_ATTENTION, False), 1
    yield "sdpa cuDNN, GQA", sdpa(SDPBackend.CUDNN_ATTENTION, True), 1
    yield "sdpa efficient, kv repeated", sdpa(SDPBackend.EFFICIENT_ATTENTION, False), 1
    yield "sdpa default choice, GQA", sdpa([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                            SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], True), 1  # fmt: skip


def measure(seqs: list[int], heads: int, kv_heads: int, dim: int, repeats: int) -> list[dict]:
    import torch

    rows = []
    for seq in seqs:
        q = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))  # fmt: skip
        grad = None
        for name, fn, samples in cases(seq, heads, kv_heads, dim):
            row = {"seq": seq, "backend": name, "samples": samples}
            try:
                out = fn(q, k, v)
                grad = torch.randn_like(out) if grad is None or grad.shape != out.shape else grad
                inputs = (q, k, v)
                forward = timed(lambda fn=fn, x=inputs: fn(*x), repeats)
                both = timed(lambda fn=fn, x=inputs, g=grad: torch.autograd.grad(fn(*x), x, g), repeats)
                flops = 2 * 2 * seq * seq / 2 * heads * dim / samples  # causal forward, per sample squares
                row.update(forward_ms=forward, forward_backward_ms=both, forward_tflops=flops / forward / 1e9)
                row["forward_backward_tflops"] = 3.5 * flops / both / 1e9
            except Exception as error:  # a backend that cannot take this shape: recorded, not fatal
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def agreement(seq: int, heads: int, kv_heads: int, dim: int) -> dict:
    """sft_varlen's two paths on one row of one sample: plain causal sdpa (cuDNN) against varlen FlashAttention-2,
    outputs and input gradients (bf16), as max |difference| / max |value|."""
    import torch

    from sft.model.attention import varlen_attention_forward

    torch.manual_seed(0)
    q = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    module = torch.nn.Module()
    one = {"cu_seq_lens_q": torch.tensor([0, seq], device="cuda", dtype=torch.int32), "max_length_q": seq}
    one.update(cu_seq_lens_k=one["cu_seq_lens_q"], max_length_k=seq)
    # the same row with a zero-length sample at its end: the boundaries of two samples, so the varlen kernel runs
    two = {"cu_seq_lens_q": torch.tensor([0, seq, seq], device="cuda", dtype=torch.int32), "max_length_q": seq}
    two.update(cu_seq_lens_k=two["cu_seq_lens_q"], max_length_k=seq)
    grad = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    results = []
    for given in (one, two):
        out, _ = varlen_attention_forward(module, q, k, v, None, scaling=dim**-0.5, **given)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731
    names = ("output", "grad_q", "grad_k", "grad_v")
    return {"seq": seq, **{n: rel(a, b) for n, a, b in zip(names, *results, strict=True)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqs", default="16384,32768,65536")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    agree = [agreement(seq, args.heads, args.kv_heads, args.dim) for seq in seqs]
    rows = measure(seqs, args.heads, args.kv_heads, args.dim, args.repeats)
    env = environment()
    lines = [f"# Attention kernels, {env['device']}", "",
             f"{args.heads} query heads, {args.kv_heads} key/value heads, head dim {args.dim}, causal, bf16 "
             "(one rank of the 8B shape at sp=2)", "",
             "| row tokens | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |",
             "|---" * 6 + "|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['backend']} | {r['error']} | | | |")
        else:
            lines.append(f"| {r['seq']} | {r['backend']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | "
                         f"{r['forward_tflops']:.0f} | {r['forward_backward_tflops']:.0f} |")  # fmt: skip
    lines += ["", "sft_varlen on a row of one sample: causal sdpa (cuDNN) vs varlen FlashAttention-2, bf16, "
              "max |diff| / max |value|:", "", "| row tokens | output | grad q | grad k | grad v |",
              "|---" * 5 + "|"]  # fmt: skip
    lines += [f"| {a['seq']} | {a['output']:.2e} | {a['grad_q']:.2e} | {a['grad_k']:.2e} | {a['grad_v']:.2e} |"
              for a in agree]  # fmt: skip
    result = {"environment": env, "rows": rows, "agreement": agree}
    write_results(args.out, "attention_kernels", result, "\n".join(lines))


if __name__ == "__main__":
    main()
