"""One forward + backward of `sft.model.wide_heads.wide_varlen` on Gemma 4's full-layer heads (2 rows of 4,096 tokens
of SFT-like samples, as benchmarks/wide_heads.py) under torch.profiler: the top CUDA kernels, and whether torch's
`bmm(..., out_dtype=float32)` runs here.

    python -m benchmarks.wide_heads_profile --out FILE.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args()
    from benchmarks.architectures import rows
    from sft.model import wide_heads

    lines = [f"bmm out_dtype works: {wide_heads._out_dtype_works('cuda')}"]
    lengths = [n for row in rows(4096, 7, args.rows) for n in row]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 4, 4))
    grad = torch.randn(total, 8, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        out = wide_heads.wide_varlen(q, k, v, cu, cu, 0, 0)
        out.backward(grad)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        step()
        torch.cuda.synchronize()
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=70))
    a = torch.randn(32, 1024, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32, 512, 1024, device="cuda", dtype=torch.bfloat16)
    for name, fn in {"bf16": lambda: torch.bmm(a, b), "out_fp32": lambda: torch.bmm(a, b, out_dtype=torch.float32),
                     "fp32": lambda: torch.bmm(a.float(), b.float())}.items():  # fmt: skip
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        lines.append(f"bmm {name}: {ms:.3f} ms, {2 * 32 * 1024 * 1024 * 512 / ms / 1e9:.0f} TFLOP/s")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
