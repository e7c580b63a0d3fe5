"""One MoE experts layer alone, forward + backward, per experts implementation (issue #38): time and agreement.

    python -m benchmarks.experts_layer --out $OUT            # 1 GPU: Qwen3-30B-A3B's and gpt-oss-20b's widths
    python -m benchmarks.experts_layer --tiny --out /tmp/e   # CPU smoke test

For each shape, the experts module of transformers' own model class at those widths (bf16 on a GPU), `--tokens`
tokens routed by a softmax top-k of random logits, the same inputs for every implementation: transformers'
`grouped_mm` (its default), sft's `sft_grouped` and `sft_grouped_fp8` (`sft.model.experts`; on the CPU and for
gpt-oss's layout the latter runs its bf16 path), and the per-expert loop
(`eager`) as the reference. Per implementation: median milliseconds of forward + backward over `--iters` after warm-up,
peak memory above the inputs, and the largest difference from the per-expert loop of the output and of every gradient,
relative to that tensor's largest magnitude. Output: experts_layer.json and experts_layer.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import environment
from sft.model import architectures, experts

IMPLEMENTATIONS = ("eager", "grouped_mm", experts.NAME, experts.NAME_FP8)


def build(shape: str, tiny: bool, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from benchmarks.architectures import config_for

    config = config_for(shape, 1, tiny)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layer = architectures.experts_modules(model)[0]
    for p in layer.parameters():  # zero-initialised biases: non-trivial values
        if not p.abs().sum():
            torch.nn.init.normal_(p, std=0.02)
    return config, layer


def step(layer, implementation: str, x, index, weights, grad_out):
    layer.config._experts_implementation = implementation
    x = x.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    out = layer(x, index, weights)
    out.backward(grad_out)
    return out.detach(), {"input": x.grad, "routing weights": weights.grad,
                          **{n: p.grad for n, p in layer.named_parameters()}}  # fmt: skip


def measure(shape: str, args, device: str) -> list[dict]:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config, layer = build(shape, args.tiny, device, dtype)
    tokens, k = args.tokens, config.num_experts_per_tok
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, layer.num_experts, generator=gen).to(device)
    top, index = logits.softmax(-1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(dtype)
    grad_out = torch.randn(tokens, config.hidden_size, generator=gen).to(device, dtype)
    ref_out, ref_grads = step(layer, "eager", x, index, weights, grad_out)
    rows = []
    for implementation in IMPLEMENTATIONS:
        row = {"shape": shape, "implementation": implementation, "tokens": tokens}
        try:
            out, grads = step(layer, implementation, x, index, weights, grad_out)
        except Exception as e:  # noqa: BLE001 - a row per implementation, the failure recorded
            rows.append({**row, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        diffs = {"output": ((out - ref_out).abs().max() / ref_out.abs().max()).item()}
        for name, g in grads.items():
            diffs[name] = ((g.float() - ref_grads[name].float()).abs().max() / ref_grads[name].abs().max()).item()
        times = []
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for i in range(args.warmup + args.iters):
            start = time.perf_counter()
            step(layer, implementation, x, index, weights, grad_out)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(1e3 * (time.perf_counter() - start))
        row.update(ms=statistics.median(times), max_relative_difference=diffs)
        if device == "cuda":
            row["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict], out: Path, env: dict) -> None:
    lines = [f"# One MoE experts layer, forward + backward, 1 x {env['gpu']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), "",
             "| shape | implementation | tokens | ms (median) | x grouped_mm | peak GiB above inputs | largest "
             "difference from the per-expert loop (relative to the tensor's max): output / input grad / worst grad |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    base = {r["shape"]: r["ms"] for r in rows if r["implementation"] == "grouped_mm" and "ms" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['implementation']} | {r['tokens']} | failed: {r['error'][:99]} | | | |")
            continue
        d = r["max_relative_difference"]
        speed = f"{base[r['shape']] / r['ms']:.2f}x" if r["shape"] in base else "-"
        lines.append(f"| {r['shape']} | {r['implementation']} | {r['tokens']} | {r['ms']:.2f} | {speed} | "
                     f"{r.get('peak_gib_above_inputs', 0):.2f} | {d['output']:.1e} / {d['input']:.1e} / "
                     f"{max(d.values()):.1e} |")  # fmt: skip
    (out / "experts_layer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="*", default=["qwen3_moe", "gpt_oss"])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of one micro batch (4 rows of 4096)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.warmup, args.iters = 64, 1, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for shape in args.shapes for r in measure(shape, args, device)]
    (args.out / "experts_layer.json").write_text(json.dumps(rows, indent=1))
    report(rows, args.out, environment())


if __name__ == "__main__":
    main()
