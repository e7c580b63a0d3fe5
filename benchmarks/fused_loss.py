"""The LM-head loss three ways, side by side on one GPU: time (forward + backward) and peak memory.

    python -m benchmarks.fused_loss --out benchmarks/results

- `trl_fused`: TRL's chunked log-prob kernel as SFTTrainer uses it (`add_fused_lm_head`, also computing entropy and
  top-1 hits for its metrics); logits are never built; `trl_fused_loss_only`: the same kernel, log-probs only;
- `liger_flce`: Liger's fused linear cross-entropy (`LigerFusedLinearCrossEntropyLoss`);
- `plain`: logits, then `torch.nn.functional.cross_entropy` (the baseline both avoid).

Shapes are Llama-3.2-1B's head (hidden 2048, vocab 128256) and a packed micro-batch of 2 x 4096 tokens, bf16.
The mean token loss and the gradients of the three are also compared, so "faster" is at equal results.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def trl_fused(hidden, weight, labels, outputs=("log_probs", "entropy", "is_top1")):
    """As SFTTrainer calls it: with entropy and top-1 hits for its metrics."""
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction

    log_probs = _ChunkedLogProbFunction.apply(
        hidden, weight, None, labels, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs
    )[0]
    return -log_probs.float().mean()


def trl_fused_loss_only(hidden, weight, labels):
    return trl_fused(hidden, weight, labels, outputs=("log_probs",))


def liger_flce(hidden, weight, labels):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()(weight, hidden, labels)


def plain(hidden, weight, labels):
    return torch.nn.functional.cross_entropy((hidden @ weight.T).float(), labels)


def measure(fn, hidden, weight, labels, repeats: int) -> dict:
    for _ in range(3):  # warm-up, autotuning
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        fn(h, w, labels).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = fn(h, w, labels)
        loss.backward()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1e3
    return {
        "ms_forward_backward": round(ms, 3),
        "peak_extra_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3),
        "loss": loss.item(),
        "grad_hidden": h.grad.float(),
        "grad_weight": w.grad.float(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    runs = {name: measure(fn, hidden, weight, labels, args.repeats) for name, fn in
            (("plain", plain), ("trl_fused", trl_fused), ("trl_fused_loss_only", trl_fused_loss_only),
             ("liger_flce", liger_flce))}  # fmt: skip
    ref = runs["plain"]
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "bfloat16"},
    }
    for name, r in runs.items():
        report[name] = {
            "ms_forward_backward": r["ms_forward_backward"],
            "peak_extra_gib": r["peak_extra_gib"],
            "loss": r["loss"],
            "rel_grad_hidden_vs_plain": (
                (r["grad_hidden"] - ref["grad_hidden"]).norm() / ref["grad_hidden"].norm()
            ).item(),
            "rel_grad_weight_vs_plain": (
                (r["grad_weight"] - ref["grad_weight"]).norm() / ref["grad_weight"].norm()
            ).item(),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_loss.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
