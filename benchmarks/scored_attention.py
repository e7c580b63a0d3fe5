"""How long sft's soft-capped attention (flex_attention over packed samples) takes per micro batch, compile included.

    python -m benchmarks.scored_attention --out $OUT              # 1 GPU: Gemma-2-9B's attention, micro batch 4 x 4096
    python -m benchmarks.scored_attention --out /tmp/s --tiny     # CPU smoke test (forward, uncompiled, small widths)

Session 35 measured Gemma-2-9B's default (soft-capped attention, so `sft_varlen`'s scored path: flex_attention,
compiled) make no optimizer step in 4 minutes on 1 x H200. A packed micro batch's token count changes from one micro
batch to the next, and flex_attention and its block mask are compiled per shape. This runs one layer's attention
(forward and backward, the sliding-window layer and the global one) over `--batches` micro batches of packed rows as
the training data makes them, each variant in a fresh process (torch.compile's caches empty): `--multiples` the
token multiple the rows are padded to (`sft.model.attention.FLEX_MULTIPLE`; 0: not padded). Prints and writes
`scored_attention.json` and `.md`: seconds per micro batch and the graphs torch.compile built.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# Gemma-2-9B's attention widths (google/gemma-2-9b config.json): 16 query heads, 8 key/value heads, head dim 256,
# attention logits soft-capped at 50, a window of 4,096 on every other layer, scaled by query_pre_attn_scalar 256
GEMMA2_9B = {"heads": 16, "kv_heads": 8, "head_dim": 256, "softcap": 50.0, "window": 4096, "scale": 256**-0.5}
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16, "softcap": 50.0, "window": 64, "scale": 0.25}


def micro_batches(count: int, rows: int, length: int, seed: int) -> list[list[int]]:
    """Sample lengths of `count` packed micro batches: `rows` rows each filled to within 3% of `length` tokens by
    samples of 64..length/2 tokens (the shape of the sweeps' data at 99% packing efficiency)."""
    import random

    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        samples = []
        for _ in range(rows):
            room = length - rng.randrange(0, length // 32)
            while room > 64:
                size = min(room, rng.randrange(64, length // 2))
                samples.append(size)
                room -= size
        batches.append(samples)
    return batches


def inner(args) -> dict:
    import torch
    import torch._dynamo.utils
    from torch.nn.attention.flex_attention import flex_attention

    from sft.model.attention import _flex_scored

    device = "cpu" if args.tiny else "cuda"
    dims = TINY if args.tiny else GEMMA2_9B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    times = []
    for samples in micro_batches(args.batches, args.rows, args.length, seed=0):
        total = sum(samples)
        cu = torch.tensor([0, *torch.tensor(samples).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(total, heads, dims["head_dim"], device=device, dtype=dtype, requires_grad=not args.tiny)
                   for heads in (dims["heads"], dims["kv_heads"], dims["kv_heads"]))  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for window in (dims["window"], None):  # the sliding layer and the global one
            out = _flex_scored(q, k, v, cu, dims["scale"], window, dims["softcap"], None,
                               flex=flex_attention if args.tiny else None, multiple=args.multiple or None)  # fmt: skip
            if not args.tiny:
                out.float().pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - start, 4))
    counters = torch._dynamo.utils.counters
    return {"multiple": args.multiple, "seconds": times,
            "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "frames": counters["stats"].get("unique_frames", counters["frames"].get("total", 0))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--multiples", type=int, nargs="*", default=[0, 128, 2048])
    parser.add_argument("--multiple", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--rows", type=int, default=4, help="rows per micro batch")
    parser.add_argument("--length", type=int, default=4096, help="tokens per packed row")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per variant")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.multiple is not None:
        print(json.dumps(inner(args)))
        return
    if args.tiny:
        args.rows, args.length, args.batches = 2, 256, 3
    args.out.mkdir(parents=True, exist_ok=True)
    totals = [sum(s) for s in micro_batches(args.batches, args.rows, args.length, seed=0)]
    results = []
    for multiple in args.multiples:
        cmd = [sys.executable, "-m", "benchmarks.scored_attention", "--out", str(args.out), "--multiple",
               str(multiple), "--batches", str(args.batches), "--rows", str(args.rows),
               "--length", str(args.length)]  # fmt: skip
        cmd += ["--tiny"] if args.tiny else []
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None
            error = f"exit {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
            result = json.loads(line) if line else {"multiple": multiple, "error": error}
        except subprocess.TimeoutExpired:
            result = {"multiple": multiple, "error": f"no result within {args.timeout} s"}
        result.update(totals=totals, wall_s=round(time.perf_counter() - start, 1))
        results.append(result)
        print(json.dumps(result), flush=True)
    (args.out / "scored_attention.json").write_text(json.dumps(results, indent=1))
    head = "| padded to a multiple of | first micro batch s | later micro batches s (mean, max) | graphs | frames |"
    lines = [head, "| --- | --- | --- | --- | --- |"]
    for r in results:
        if "seconds" not in r:
            lines.append(f"| {r['multiple'] or 'not padded'} | {r['error'][-200:]!r} | | | |")
            continue
        later = r["seconds"][1:] or [0.0]
        lines.append(f"| {r['multiple'] or 'not padded'} | {r['seconds'][0]:.1f} | {sum(later) / len(later):.3f}, "
                     f"{max(later):.3f} | {r['unique_graphs']} | {r['frames']} |")  # fmt: skip
    (args.out / "scored_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
