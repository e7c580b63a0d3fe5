"""The fused 8-bit AdamW step's Triton kernel (`sft.run.optimizer` owns when it runs): torchao's `single_param_adam`
for one tensor, its 8-bit moments (`OptimState8bit`: uint8 codes, a fp32 scale per block of 256, torchao's dynamic
maps) read and written once. Imported only where it runs, so that Triton's interpreter can be chosen before."""

import triton
import triton.language as tl


@triton.jit
def _quantize(x, bounds, SIGNED: tl.constexpr):
    """torchao's `quantize_8bit_with_qmap`: the code of the largest map entry at or below `x` (0 below them all), then
    the one above it where `x - entry >= (next - entry) * 0.5` in fp32. That code is the number of the map's
    thresholds at or below `x` (`sft.run.optimizer.thresholds`: per pair of neighbours the least fp32 value that
    rounds up, found on the host by torchao's own comparison), so it is a guess computed from the map's form made
    exact by two threshold reads (torchao reads the map 10 times: an 8-step search, then the two neighbours).
    `bounds`: -inf, the 255 thresholds, +inf.

    torchao's dynamic maps (`create_dynamic_map`): for decades i = 0..6, 2^i (signed) or 2^(i+1) (unsigned) entries
    10^(i-6) x (0.1 + 0.9 (j + 0.5) / count), j < count, all in [10^(i-7), 10^(i-6)); then 0 and 1.0, and (signed)
    the negatives of the decades' entries. Sorted, a positive entry of rank r (0-based among the positives) has code
    128 + r (signed: 127 negatives and 0 below it) or 1 + r (unsigned: 0 below it); the guess is the code of the
    entry nearest to `x`, at most one from the true code (ties, and the float error of the decade's estimate at its
    edges, where the rank runs on into the next decade)."""
    magnitude = tl.abs(x)
    decade = tl.floor(tl.log2(tl.maximum(magnitude, 1e-30)) * 0.30102999566398120) + 7.0
    decade = tl.minimum(tl.maximum(decade, 0.0), 6.0)
    count = tl.exp2(decade + (0.0 if SIGNED else 1.0))  # entries in this decade
    below = count - (1.0 if SIGNED else 2.0)  # positive entries in the decades below
    within = magnitude * tl.exp2((6.0 - decade) * 3.3219280948873622)  # in [0.1, 1) where the decade is right
    j = tl.floor((within - 0.1) * (count * 1.1111111111111112))  # the decade's entry nearest to x
    j = tl.minimum(tl.maximum(j, -1.0), count)
    rank = (below + j).to(tl.int32)  # of the positive entry nearest to the magnitude (-1: zero)
    codes = tl.where(x >= 0, 128 + rank, 126 - rank) if SIGNED else 1 + rank
    codes = tl.where(magnitude >= 1.0, tl.where(x >= 0, 255, 0), codes)
    codes = tl.minimum(tl.maximum(codes, 0), 255)
    up = (x >= tl.load(bounds + codes + 1)).to(tl.int32)  # the threshold above the guess is at or below x
    down = (x < tl.load(bounds + codes)).to(tl.int32)  # the one below it is above x
    return codes + up - down


@triton.jit
def codes_of(x_ptr, out_ptr, bounds, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """`_quantize` alone over `n` values (the tests and benchmarks/optimizer_step.py check it against torchao's)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + offsets, _quantize(x, bounds, SIGNED).to(tl.uint8), mask=offsets < n)


@triton.jit
def _nearest_bf16(x):
    """fp32 `x` rounded to the nearest bf16 (ties to even, torch's `copy_`), still fp32, so that the cast to bf16 that
    follows is exact: done on the bits because Triton's interpreter truncates where the GPU rounds."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _draws(seed, offsets):
    """16 random bits per value: the low half of a 32-bit integer hash (Wellons' `lowbias32`, two multiply-xorshift
    rounds) of the value's place, keyed by a hash of the seed, as the weights are: a resumed step draws the same. The
    step over 2^30 weights took 8.11 ms on an H100 with it against 8.58 with Philox (`tl.randint4x`, one call per 8
    weights, each word split in two; benchmarks/results/optimizer_step). In int32, whose products wrap as uint32's
    do; the right shifts masked to be logical."""
    key = _mix(seed.to(tl.int32) + 0x6A09E667)
    return _mix(offsets.to(tl.int32) ^ key) & 0xFFFF


@triton.jit
def _mix(x):
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -2073254261  # 0x846CA68B as int32
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def adamw8bit_step(
    p_ptr, g_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, qmap_m, qmap_v, bounds_m, bounds_v, n, lr, lr_wd,
    one_minus_beta1, one_minus_beta2, bc1, bc2_sqrt, eps, seed,
    QUANTIZED: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if QUANTIZED:  # n counts blocks
        row_mask = rows < n
        mask = row_mask[:, None] & (offsets >= 0)
    else:  # n counts elements
        mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZED:
        m_codes = tl.load(m_ptr + offsets, mask=mask, other=0).to(tl.int32)
        v_codes = tl.load(v_ptr + offsets, mask=mask, other=0).to(tl.int32)
        m_scale = tl.load(m_scale_ptr + rows, mask=row_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + rows, mask=row_mask, other=0.0)
        m = tl.load(qmap_m + m_codes) * m_scale[:, None]
        v = tl.load(qmap_v + v_codes) * v_scale[:, None]
    else:
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = p - lr_wd * p
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight under 0.5
    v = v + one_minus_beta2 * (g * g - v)
    if QUANTIZED:
        m_new_scale = tl.maximum(tl.max(tl.abs(m), axis=1), 1e-12)
        v_new_scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
        tl.store(m_ptr + offsets, _quantize(m / m_new_scale[:, None], bounds_m, True).to(tl.uint8), mask=mask)
        tl.store(v_ptr + offsets, _quantize(v / v_new_scale[:, None], bounds_v, False).to(tl.uint8), mask=mask)
        tl.store(m_scale_ptr + rows, m_new_scale, mask=row_mask)
        tl.store(v_scale_ptr + rows, v_new_scale, mask=row_mask)
    else:
        if BF16:  # torchao keeps a small tensor's moments in its dtype
            tl.store(m_ptr + offsets, _nearest_bf16(m).to(tl.bfloat16), mask=mask)
            tl.store(v_ptr + offsets, _nearest_bf16(v).to(tl.bfloat16), mask=mask)
        else:
            tl.store(m_ptr + offsets, m, mask=mask)
            tl.store(v_ptr + offsets, v, mask=mask)
    denominator = tl.sqrt_rn(v) / bc2_sqrt + eps
    p = p - lr * (m / bc1) / denominator
    if ROUND:  # torchao's `_fp32_to_bf16_sr`: up with the probability of the dropped 16 bits
        bits = p.to(tl.int32, bitcast=True)
        low = bits & 0xFFFF
        towards_zero = bits & -65536  # 0xFFFF0000
        bits = tl.where(_draws(seed, offsets) < low, towards_zero + 0x10000, towards_zero)
        p = bits.to(tl.float32, bitcast=True)
    elif BF16:
        p = _nearest_bf16(p)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
