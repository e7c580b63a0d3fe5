"""Where the fused 8-bit AdamW step's time goes (issue #79, item 5): sft's kernel (`sft.run.adamw8bit_kernel`) over one
flat buffer of 2^30 weights, one launch, beside variants that each leave one part out or do it another way, and a
kernel that only moves the step's bytes (the floor this card reaches, not the spec's).

    python -m benchmarks.adamw8bit_variants --out benchmarks/results/optimizer_step/variants.json   # on a GPU

The variants are measurements, not candidates: a variant that drops a part (the 8-bit codes' threshold reads, the
map's reads, IEEE division) computes something else. Beside them, sft's `FusedAdamW8bit` step over the Llama-3.2-1B
set (one launch per tensor), whose weights per second against the flat launch's tell what the per-tensor launches
cost. Milliseconds per step, CUDA events over 20 steps after 3.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from sft.run.adamw8bit_kernel import _draws, _quantize

N = 1 << 30
BLOCK = 256


@triton.jit
def _quantize_pairs(x, pairs, SIGNED: tl.constexpr):
    """sft's `_quantize` (the same guess) with the guess's two thresholds read as one 64-bit word from a 256-entry
    table (per code, the threshold below it in the low 32 bits, the one above it in the high 32): measured, not
    taken (1% faster alone, nothing on top of the hash)."""
    magnitude = tl.abs(x)
    decade = tl.floor(tl.log2(tl.maximum(magnitude, 1e-30)) * 0.30102999566398120) + 7.0
    decade = tl.minimum(tl.maximum(decade, 0.0), 6.0)
    count = tl.exp2(decade + (0.0 if SIGNED else 1.0))
    below = count - (1.0 if SIGNED else 2.0)
    within = magnitude * tl.exp2((6.0 - decade) * 3.3219280948873622)
    j = tl.floor((within - 0.1) * (count * 1.1111111111111112))
    j = tl.minimum(tl.maximum(j, -1.0), count)
    rank = (below + j).to(tl.int32)
    codes = tl.where(x >= 0, 128 + rank, 126 - rank) if SIGNED else 1 + rank
    codes = tl.where(magnitude >= 1.0, tl.where(x >= 0, 255, 0), codes)
    codes = tl.minimum(tl.maximum(codes, 0), 255)
    pair = tl.load(pairs + codes)
    lower = pair.to(tl.int32).to(tl.float32, bitcast=True)
    upper = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return codes + (x >= upper).to(tl.int32) - (x < lower).to(tl.int32)


@triton.jit
def _philox_draws(seed, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """sft's random bits before 2026-12-07: one Philox call per 8 weights, each word's two halves."""
    counters = rows[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    pairs = (tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16), tl.join(r2 & 0xFFFF, r2 >> 16),
             tl.join(r3 & 0xFFFF, r3 >> 16))  # fmt: skip
    eights = tl.join(tl.join(pairs[0], pairs[1]), tl.join(pairs[2], pairs[3]))
    return tl.reshape(eights, (ROWS, BLOCK))


@triton.jit
def variant_step(
    p_ptr, g_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, qmap_m, qmap_v, bounds_m, bounds_v, pairs_m, pairs_v, n,
    lr, lr_wd, one_minus_beta1, one_minus_beta2, bc1, bc2_sqrt, eps, seed,
    DEQ: tl.constexpr, QUANT: tl.constexpr, QDIV: tl.constexpr, UPD: tl.constexpr, ROUND: tl.constexpr,
    PAIRS: tl.constexpr, HASH: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr = "",
    EVICT: tl.constexpr = "",
):  # fmt: skip
    """sft's `adamw8bit_step` (quantized, bf16) with switches: DEQ 1 the map's reads, 0 codes as linear values;
    QUANT 2 the guess and its two threshold reads, 1 the guess alone, 0 no quantization (codes 0); QDIV 1 IEEE
    division by the block's scale, 0 a multiply by its reciprocal; UPD 1 torchao's update (IEEE divisions, sqrt_rn), 0
    the reciprocals of the corrections and an approximate division; ROUND the stochastic rounding; PAIRS 1 the two
    thresholds read as one 64-bit word (`_quantize_pairs`), 0 as two loads (sft's `_quantize`); HASH 1 the random
    bits from an integer hash per weight (sft's `_draws` since 2026-12-07), 0 from Philox per 8 weights (before). sft's
    kernel is PAIRS 0, HASH 1 (`hash_bits`); `now` was the candidate with both (h100_variants_call2.json). STREAM,
    EVICT: the cache modifier and eviction policy of the loads that stream the tensor (weights, gradients, codes),
    which share the caches with the reads of the map and the thresholds (`hash_cg`, `hash_evict_first`: not measured
    yet)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    row_mask = rows < n
    mask = row_mask[:, None] & (offsets >= 0)
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0, cache_modifier=STREAM, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0, cache_modifier=STREAM, eviction_policy=EVICT).to(tl.float32)
    m_codes = tl.load(m_ptr + offsets, mask=mask, other=0, cache_modifier=STREAM, eviction_policy=EVICT)
    v_codes = tl.load(v_ptr + offsets, mask=mask, other=0, cache_modifier=STREAM, eviction_policy=EVICT)
    m_codes, v_codes = m_codes.to(tl.int32), v_codes.to(tl.int32)
    m_scale = tl.load(m_scale_ptr + rows, mask=row_mask, other=0.0)
    v_scale = tl.load(v_scale_ptr + rows, mask=row_mask, other=0.0)
    if DEQ:
        m = tl.load(qmap_m + m_codes) * m_scale[:, None]
        v = tl.load(qmap_v + v_codes) * v_scale[:, None]
    else:
        m = (m_codes.to(tl.float32) * (1 / 128) - 1.0) * m_scale[:, None]
        v = v_codes.to(tl.float32) * (1 / 256) * v_scale[:, None]
    p = p - lr_wd * p
    m = m + one_minus_beta1 * (g - m)
    v = v + one_minus_beta2 * (g * g - v)
    m_new_scale = tl.maximum(tl.max(tl.abs(m), axis=1), 1e-12)
    v_new_scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
    if QDIV:
        m_in, v_in = m / m_new_scale[:, None], v / v_new_scale[:, None]
    else:
        m_in, v_in = m * (1.0 / m_new_scale)[:, None], v * (1.0 / v_new_scale)[:, None]
    if QUANT == 2 and PAIRS:
        m_q, v_q = _quantize_pairs(m_in, pairs_m, True), _quantize_pairs(v_in, pairs_v, False)
    elif QUANT == 2:
        m_q, v_q = _quantize(m_in, bounds_m, True), _quantize(v_in, bounds_v, False)
    elif QUANT == 1:
        m_q = (m_in * 127.0 + 128.0).to(tl.int32)
        v_q = (v_in * 255.0).to(tl.int32)
    else:
        m_q, v_q = tl.zeros_like(m_codes), tl.zeros_like(v_codes)
    tl.store(m_ptr + offsets, m_q.to(tl.uint8), mask=mask)
    tl.store(v_ptr + offsets, v_q.to(tl.uint8), mask=mask)
    tl.store(m_scale_ptr + rows, m_new_scale, mask=row_mask)
    tl.store(v_scale_ptr + rows, v_new_scale, mask=row_mask)
    if UPD:
        denominator = tl.sqrt_rn(v) / bc2_sqrt + eps
        p = p - lr * (m / bc1) / denominator
    else:
        denominator = tl.sqrt(v) * (1.0 / bc2_sqrt) + eps
        p = p - tl.fdiv(m * (lr / bc1), denominator)
    if ROUND:
        bits = p.to(tl.int32, bitcast=True)
        draw = _draws(seed, offsets) if HASH else _philox_draws(seed, rows, ROWS, BLOCK).to(tl.int32)
        towards_zero = bits & -65536
        bits = tl.where(draw.to(tl.int32) < (bits & 0xFFFF), towards_zero + 0x10000, towards_zero)
        p = bits.to(tl.float32, bitcast=True)
    tl.store(p_ptr + offsets, p.to(tl.bfloat16), mask=mask)


@triton.jit
def bytes_only(p_ptr, g_ptr, m_ptr, v_ptr, n, BLOCK: tl.constexpr):
    """The step's traffic and nothing else: bf16 weights and gradients read, weights written, both codes read and
    written (the scales left out: 1/64 of the bytes)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    tl.store(p_ptr + offsets, (p + g).to(tl.bfloat16), mask=mask)
    tl.store(m_ptr + offsets, m + 1, mask=mask)
    tl.store(v_ptr + offsets, v + 1, mask=mask)


def timed(fn) -> float:
    """`benchmarks.optimizer_step.timed` over 20 steps after 3; on the CPU (the smoke run) one call, no time."""
    from benchmarks.optimizer_step import timed as cuda_timed

    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return cuda_timed(fn, warmup=3, steps=20)


VARIANTS = {  # name: DEQ, QUANT, QDIV, UPD, ROUND, PAIRS, HASH[, STREAM, EVICT]
    "before": (1, 2, 1, 1, 1, 0, 0),
    "threshold_pairs": (1, 2, 1, 1, 1, 1, 0),
    "hash_bits": (1, 2, 1, 1, 1, 0, 1),
    "now": (1, 2, 1, 1, 1, 1, 1),
    "now_no_rounding": (1, 2, 1, 1, 0, 1, 1),
    "now_fast_update": (1, 2, 1, 0, 1, 1, 1),
    "now_no_map_reads": (0, 2, 1, 1, 1, 1, 1),
    "now_no_threshold_reads": (1, 1, 1, 1, 1, 1, 1),
    "no_quantization": (1, 0, 1, 1, 1, 1, 1),
    "none_of_it": (0, 0, 0, 0, 0, 1, 1),
    "hash_cg": (1, 2, 1, 1, 1, 0, 1, ".cg", ""),
    "hash_evict_first": (1, 2, 1, 1, 1, 0, 1, "", "evict_first"),
}
SHAPED = ("before", "now")  # also at other program shapes


def main() -> None:
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    from benchmarks.optimizer_step import bandwidth
    from sft.run.optimizer import bounds_of, fused_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--weights",
        type=int,
        default=N,
        help="the flat buffer's size (a smoke run: small, with TRITON_INTERPRET=1 and --device cpu)",
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    n, dev = args.weights, args.device
    g = torch.Generator(device=dev).manual_seed(0)
    p = (torch.randn(n, device=dev, generator=g) * 0.02).bfloat16()
    grad = (torch.randn(n, device=dev, generator=g) * 1e-3).bfloat16()
    m_codes = torch.randint(0, 256, (n,), device=dev, dtype=torch.uint8, generator=g)
    v_codes = torch.randint(0, 256, (n,), device=dev, dtype=torch.uint8, generator=g)
    m_scale = torch.rand(n // BLOCK, device=dev, generator=g) * 1e-3
    v_scale = torch.rand(n // BLOCK, device=dev, generator=g) * 1e-6
    qmap_m, qmap_v = torch.tensor(get_qmap_signed(), device=dev), torch.tensor(get_qmap_unsigned(), device=dev)
    bounds_m, bounds_v = bounds_of(qmap_m), bounds_of(qmap_v)
    pairs_m, pairs_v = (
        torch.stack([b[:-1], b[1:]], 1).contiguous().view(torch.int64)[:, 0] for b in (bounds_m, bounds_v)
    )
    scalars = (1e-4, 1e-6, 0.1, 0.001, 0.271, 0.0773, 1e-8, 1234)
    floor = n * 10 / (bandwidth() if dev == "cuda" else 1e12) * 1e3
    rows = [
        {"variant": "bytes_only", "ms": timed(lambda: bytes_only[(n // 1024,)](p, grad, m_codes, v_codes, n, 1024))}
    ]
    print(json.dumps(rows[-1]), flush=True)

    from torchao.optim.subclass_8bit import OptimState8bit

    sm = OptimState8bit(m_codes, m_scale, qmap_m, True)
    sv = OptimState8bit(v_codes, v_scale, qmap_v, False)
    rows.append({"variant": "sft_fused_step", "ms": timed(lambda: fused_step(p, grad, sm, sv, scalars, True))})
    print(json.dumps(rows[-1]), flush=True)
    shapes = [(1, 1)] + [(r, w) for r in (1, 2, 4) for w in (1, 2, 4) if (r, w) != (1, 1) and w <= r * 2]
    for name, flags in VARIANTS.items():
        for shape in shapes if name in SHAPED else [(1, 1)]:
            r, w = shape

            def launch(flags=flags, r=r, w=w):
                variant_step[(n // BLOCK // r,)](
                    p, grad, m_codes, m_scale, v_codes, v_scale, qmap_m, qmap_v, bounds_m, bounds_v, pairs_m, pairs_v,
                    n // BLOCK, *scalars, DEQ=flags[0], QUANT=flags[1], QDIV=flags[2], UPD=flags[3], ROUND=flags[4],
                    PAIRS=flags[5], HASH=flags[6], ROWS=r, BLOCK=BLOCK, STREAM=(flags + ("", ""))[7],
                    EVICT=(flags + ("", ""))[8], num_warps=w,
                )  # fmt: skip

            rows.append({"variant": name, "rows": r, "warps": w, "ms": timed(launch)})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["x_floor"] = row["ms"] / floor
    if dev != "cuda":
        return
    torch.cuda.empty_cache()
    from torchao.optim import AdamW8bit

    from benchmarks.optimizer_step import make_params
    from sft.run.optimizer import fused_class

    params = make_params("llama-3.2-1b", torch.bfloat16)
    opt = fused_class(AdamW8bit)(params, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
    count = sum(x.numel() for x in params)
    per_tensor = timed(opt.step)
    flat_rate = n / next(r["ms"] for r in rows if r["variant"] == "sft_fused_step")
    rows.append({"variant": "llama-3.2-1b set, a launch per tensor", "ms": per_tensor, "tensors": len(params),
                 "weights_per_ms": count / per_tensor, "flat_weights_per_ms": flat_rate})  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "weights": n, "floor_ms": floor, "rows": rows},
                                   indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
