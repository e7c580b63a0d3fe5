"""The fused 8-bit AdamW step's Triton kernel (`sft.run.optimizer` owns when it runs): torchao's `single_param_adam`
for one tensor, its 8-bit moments (`OptimState8bit`: uint8 codes, a fp32 scale per block of 256, torchao's dynamic
maps) read and written once. Imported only where it runs, so that Triton's interpreter can be chosen before."""

import triton
import triton.language as tl


@triton.jit
def _quantize(x, qmap):
    """torchao's `quantize_8bit_with_qmap`: the code of the nearest map entry, by its 8-step search."""
    codes = tl.where(x >= tl.load(qmap + 128), 128, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 64), 64, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 32), 32, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 16), 16, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 8), 8, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 4), 4, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 2), 2, 0)
    codes += tl.where(x >= tl.load(qmap + codes + 1), 1, 0)
    up = tl.minimum(codes + 1, 255)
    down_value = tl.load(qmap + codes)
    up_value = tl.load(qmap + up)
    return tl.where(x - down_value >= (up_value - down_value) * 0.5, up, codes)


@triton.jit
def _narrowed(x, BF16: tl.constexpr):
    """`x` as the tensor's dtype: bf16 rounded to nearest even (torch's `copy_`), or fp32 as it is. The rounding is
    done on the bits, then the cast is exact: Triton's interpreter truncates where the GPU rounds."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x


@triton.jit
def adamw8bit_step(
    p_ptr, g_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, qmap_m, qmap_v, n, lr, lr_wd, one_minus_beta1,
    one_minus_beta2, bc1, bc2_sqrt, eps, seed,
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
        tl.store(m_ptr + offsets, _quantize(m / m_new_scale[:, None], qmap_m).to(tl.uint8), mask=mask)
        tl.store(v_ptr + offsets, _quantize(v / v_new_scale[:, None], qmap_v).to(tl.uint8), mask=mask)
        tl.store(m_scale_ptr + rows, m_new_scale, mask=row_mask)
        tl.store(v_scale_ptr + rows, v_new_scale, mask=row_mask)
    else:
        tl.store(m_ptr + offsets, _narrowed(m, BF16), mask=mask)
        tl.store(v_ptr + offsets, _narrowed(v, BF16), mask=mask)
    denominator = tl.sqrt_rn(v) / bc2_sqrt + eps
    p = p - lr * (m / bc1) / denominator
    if ROUND:  # torchao's `_fp32_to_bf16_sr`: up with the probability of the dropped 16 bits
        bits = p.to(tl.int32, bitcast=True)
        draw = tl.randint(seed, offsets) & 0xFFFF
        low = bits & 0xFFFF
        towards_zero = bits & -65536  # 0xFFFF0000
        bits = tl.where(draw.to(tl.int32) < low, towards_zero + 0x10000, towards_zero)
        p = bits.to(tl.float32, bitcast=True)
    tl.store(p_ptr + offsets, _narrowed(p, BF16), mask=mask)
