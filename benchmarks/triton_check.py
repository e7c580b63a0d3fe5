"""Whether the GPU's torch runs with this process's Triton: its compiler, flex_attention and Liger's kernels, each
against torch's eager result, forward and backward.

    python -m benchmarks.triton_check --out FILE.json

For a Triton newer than the one torch was built with (torch 2.11 with Triton 3.7.1, brought for
flash-linear-attention's backward, fla issue #640): `torch.compile` of a small MLP, flex_attention with a block mask
of three samples (compiled), Liger's RMSNorm and its fused linear cross-entropy, each in bf16 on the GPU, the largest
difference from the eager path beside the inputs' scale. An exception is a result (written, not raised).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compiled_mlp() -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    net = net.cuda().bfloat16()
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = net(x)
    eager.square().mean().backward()
    g_eager, x.grad = x.grad, None
    fast = torch.compile(net)(x)
    fast.square().mean().backward()
    return {"forward_rel": _rel(fast, eager), "grad_rel": _rel(x.grad, g_eager)}


def flex() -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    lengths = (700, 1300, 2096)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    tokens = doc.numel()

    def causal_doc(b, h, q, k):
        return (doc[q] == doc[k]) & (q >= k)

    mask = create_block_mask(causal_doc, None, None, tokens, tokens, device="cuda")
    q, k, v = (torch.randn(1, 8, tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    out.square().mean().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    dense = (doc[:, None] == doc[None, :]) & torch.ones(tokens, tokens, device="cuda", dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    ref.square().mean().backward()
    return {"forward_rel": _rel(out, ref),
            "grad_rel": max(_rel(a, t.grad) for a, t in zip(grads, (q, k, v), strict=True))}  # fmt: skip


def liger() -> dict:
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    torch.manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = LigerRMSNorm(2048).cuda().bfloat16()
    # the loss: a fixed random projection of the output (the mean of its squares, used before 2026-12-02, is 1 for
    # every input up to eps: its true gradient is ~1e-9 and the relative difference only rounding noise, 1,562x)
    project = torch.randn(4096, 2048, device="cuda")
    out = norm(x)
    (out.float() * project).sum().backward()
    g, x.grad = x.grad, None
    ref = torch.nn.functional.rms_norm(x.float(), (2048,), norm.weight.float(), eps=norm.variance_epsilon)
    (ref * project).sum().backward()
    result = {"rms_norm_forward_rel": _rel(out, ref), "rms_norm_grad_rel": _rel(g, x.grad)}
    weight = torch.randn(32768, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32768, (4096,), device="cuda")
    h = (x.detach() * 0.05).requires_grad_()
    loss = LigerFusedLinearCrossEntropyLoss()(weight, h, labels)
    loss.backward()
    gh, h.grad = h.grad, None
    plain = torch.nn.functional.cross_entropy((h.float() @ weight.float().T), labels)
    plain.backward()
    result.update(flce_loss_diff=abs(float(loss) - float(plain)), flce_grad_rel=_rel(gh, h.grad))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    for name, check in (("compiled_mlp", compiled_mlp), ("flex_attention", flex), ("liger", liger)):
        try:
            result[name] = check()
        except Exception:  # noqa: BLE001 - whatever breaks is the finding
            result[name] = {"error": traceback.format_exc()[-1500:]}
        print(name, result[name], flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
