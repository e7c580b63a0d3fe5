"""The one-GPU optimizer step against its bytes-over-bandwidth time (issue #79, item 5): torchao's 8-bit AdamW, sft's
fused step of it (`sft.run.optimizer`), a flat compiled prototype and torch's fused fp32 AdamW, in one process.

    python -m benchmarks.optimizer_step --out benchmarks/results/optimizer_step/h200.json   # on a GPU

Parameter sets of three public shapes (Llama-3.2-1B, Qwen3-4B, Llama-3.1-8B: every weight matrix and norm), bf16
parameters with random gradients; per set, each variant's milliseconds per step (CUDA events, after warm-up steps
that compile), beside the bytes it must move over the card's bandwidth:
- `torchao_8bit_sr`: torchao's AdamW8bit with bf16 stochastic rounding (sft's one-GPU default), a compiled call per
  tensor;
- `torchao_8bit`: the same without stochastic rounding;
- `fused_8bit_sr` / `fused_8bit`: sft's `FusedAdamW8bit` (torchao's class and states, one Triton kernel per tensor),
  with and without stochastic rounding; without it, its weights and moments after 3 steps against torchao's
  (`fused_vs_torchao_*`);
- `torch_fused_fp32`: torch's fused AdamW on fp32 parameters and moments (1B and 4B: 8B's fp32 states are 128 GB);
- `flat_8bit_sr` / `flat_8bit`: a prototype, not in the package: torchao's own arithmetic and 8-bit block
  quantization (`single_param_adam`'s body, the same dynamic maps, blocks of 256) compiled once over flat buffers of
  2^28 elements that every matrix's parameter, gradient and moments are views into, so one kernel per bucket instead
  of one compiled call per tensor. Without stochastic rounding its parameters after 3 steps are compared with
  `torchao_8bit`'s (max abs difference in the result file).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, layers, intermediate, heads, kv heads, head dim, vocab, tied embeddings
    "llama-3.2-1b": (2048, 16, 8192, 32, 8, 64, 128256, True),
    "qwen3-4b": (2560, 36, 9728, 32, 8, 128, 151936, True),
    "llama-3.1-8b": (4096, 32, 14336, 32, 8, 128, 128256, False),
}
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # HBM3e, HBM3 (SXM), bytes/s


def bandwidth() -> float:
    """The card's memory bandwidth by its spec (bytes/s): H200 4.8 TB/s, H100 SXM 3.35 TB/s."""
    name = torch.cuda.get_device_name()
    return next(value for card, value in SPEC_BANDWIDTH.items() if card in name)


BUCKET = 1 << 28
BLOCK = 256


def parameter_shapes(name: str) -> list[tuple[int, ...]]:
    h, layers, inter, heads, kv, hd, vocab, tied = SHAPES[name]
    per_layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter),
                 (h,), (h,)] + ([(hd,), (hd,)] if name.startswith("qwen3") else [])  # fmt: skip
    return [(vocab, h)] + per_layer * layers + [(h,)] + ([] if tied else [(vocab, h)])


def make_params(name: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in parameter_shapes(name):
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=dtype, generator=g) * 0.02)
        p.grad = torch.randn(shape, device="cuda", dtype=dtype, generator=g) * 1e-3
        params.append(p)
    return params


def timed(step, warmup: int = 3, steps: int = 10) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


class FlatAdamW8bit:
    """The prototype: matrices (numel a multiple of 256, >= 4096, as torchao quantizes) as views of flat bf16 buffers
    of parameters and gradients, their moments as flat uint8 codes with a fp32 scale per 256; the rest (norms) with
    fp32 moments through torch's fused AdamW. torchao's arithmetic, compiled once per bucket shape."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, sr=True):
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

        self.big = [p for p in params if p.numel() >= 4096 and p.numel() % BLOCK == 0]
        small = [p for p in params if not (p.numel() >= 4096 and p.numel() % BLOCK == 0)]
        self.small = (
            torch.optim.AdamW(small, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
            if small
            else None
        )  # Llama-3.1-8B's norms (4,096) are quantized too
        total = sum(p.numel() for p in self.big)
        self.flat_p = torch.empty(total, device="cuda", dtype=torch.bfloat16)
        self.flat_g = torch.empty(total, device="cuda", dtype=torch.bfloat16)
        offset = 0
        for p in self.big:  # the parameters and gradients become views of the flat buffers
            n = p.numel()
            self.flat_p[offset : offset + n].copy_(p.data.view(-1))
            self.flat_g[offset : offset + n].copy_(p.grad.view(-1))
            p.data = self.flat_p[offset : offset + n].view_as(p)
            p.grad = self.flat_g[offset : offset + n].view_as(p)
            offset += n
        self.m_codes = torch.zeros(total, device="cuda", dtype=torch.uint8)  # as torchao's zeros: scale 0
        self.v_codes = torch.zeros(total, device="cuda", dtype=torch.uint8)
        self.m_scale = torch.zeros(total // BLOCK, device="cuda")
        self.v_scale = torch.zeros(total // BLOCK, device="cuda")
        self.qmap_s = torch.tensor(get_qmap_signed(), device="cuda")
        self.qmap_u = torch.tensor(get_qmap_unsigned(), device="cuda")
        self.step_t = torch.zeros((), device="cuda")
        self.lr = torch.tensor(lr, device="cuda")
        self.hyper = (betas[0], betas[1], weight_decay, eps, sr)
        self.kernel = torch.compile(_flat_step, fullgraph=True, dynamic=False)

    def step(self) -> None:
        self.step_t += 1
        beta1, beta2, wd, eps, sr = self.hyper
        total = self.flat_p.numel()
        for start in range(0, total, BUCKET):
            end = min(start + BUCKET, total)
            b0, b1 = start // BLOCK, end // BLOCK
            self.kernel(self.flat_p[start:end], self.flat_g[start:end], self.m_codes[start:end],
                        self.m_scale[b0:b1], self.v_codes[start:end], self.v_scale[b0:b1], self.qmap_s, self.qmap_u,
                        self.step_t, self.lr, beta1, beta2, wd, eps, sr)  # fmt: skip
        if self.small is not None:
            self.small.step()


def _flat_step(p, g, m_codes, m_scale, v_codes, v_scale, qmap_s, qmap_u, step, lr, beta1, beta2, wd, eps, sr):
    from torchao.optim.quant_utils import _fp32_to_bf16_sr, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

    p_f32, g_f32 = p.float(), g.float()
    p_f32 = p_f32 - lr * wd * p_f32
    m = dequant_with_qmap(m_codes, qmap_s, m_scale).lerp(g_f32, 1 - beta1)
    v = dequant_with_qmap(v_codes, qmap_u, v_scale).lerp(g_f32.square(), 1 - beta2)
    scaled, scale = scale_tensor(m, BLOCK)
    m_codes.copy_(quantize_8bit_with_qmap(scaled, qmap_s))
    m_scale.copy_(scale)
    scaled, scale = scale_tensor(v, BLOCK)
    v_codes.copy_(quantize_8bit_with_qmap(scaled, qmap_u))
    v_scale.copy_(scale)
    denom = (v.sqrt() / (1 - beta2**step).sqrt()) + eps
    p_f32 = p_f32 - lr * (m / (1 - beta1**step)) / denom
    p.copy_(_fp32_to_bf16_sr(p_f32) if sr else p_f32.bfloat16())


def eight_bit_bytes(params) -> float:
    """Parameters read and written (bf16), gradients read, both moments' codes read and written, their scales."""
    big = sum(p.numel() for p in params if p.numel() >= 4096 and p.numel() % BLOCK == 0)
    small = sum(p.numel() for p in params) - big
    return big * (2 + 2 + 2 + 2 * 2 + 2 * 2 * 4 / BLOCK) + small * (2 + 2 + 2 + 2 * 8)


def fits(nbytes: int) -> bool:
    """Whether `nbytes` more fit this GPU's free memory, with a tenth kept back."""
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.9 * free


def run_set(name: str, prototype: bool = True) -> dict:
    from torchao.optim import AdamW8bit

    row = {"set": name}
    params = make_params(name, torch.bfloat16)
    row["parameters"] = sum(p.numel() for p in params)
    row["floor_ms_8bit"] = eight_bit_bytes(params) / bandwidth() * 1e3
    for variant, sr in (("torchao_8bit_sr", True), ("torchao_8bit", False)):
        opt = AdamW8bit(params, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=sr)
        row[variant] = timed(opt.step)
        del opt
        torch.cuda.empty_cache()
    from sft.run.optimizer import fused_class

    for variant, sr in (("fused_8bit_sr", True), ("fused_8bit", False)):
        opt = fused_class(AdamW8bit)(params, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=sr)
        assert type(opt).__name__ == "FusedAdamW8bit", type(opt)
        started = time.time()
        opt.step()
        torch.cuda.synchronize()
        row[f"{variant}_first_step_s"] = time.time() - started  # Triton compiles its kernels
        row[variant] = timed(opt.step)
        del opt
        torch.cuda.empty_cache()
    del params
    torch.cuda.empty_cache()
    if not fits(row["parameters"] * (2 * 4 + 2 * 2 + 2)):  # two sets of weights and gradients, their moments
        row["fused_vs_torchao"] = "not run: two sets do not fit this card"
        return row
    a, b = make_params(name, torch.bfloat16), make_params(name, torch.bfloat16)
    reference = AdamW8bit(a, lr=1e-4, weight_decay=0.01)
    fused = fused_class(AdamW8bit)(b, lr=1e-4, weight_decay=0.01)
    for _ in range(3):
        reference.step()
        fused.step()
    pairs = list(zip(a, b, strict=True))
    row["fused_vs_torchao_max_abs_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in pairs)
    row["fused_vs_torchao_equal_tensors"] = sum(torch.equal(x, y) for x, y in pairs)
    row["fused_vs_torchao_weights_equal_share"] = sum(int((x == y).sum()) for x, y in pairs) / row["parameters"]
    codes = [(reference.state[x]["exp_avg"], fused.state[y]["exp_avg"]) for x, y in pairs]
    codes = [(u.codes, w.codes) for u, w in codes if hasattr(u, "codes")]
    row["fused_vs_torchao_codes_equal_share"] = sum(int((u == w).sum()) for u, w in codes) / sum(
        u.numel() for u, _ in codes
    )
    row["tensors"] = len(a)
    del a, b, reference, fused
    torch.cuda.empty_cache()
    for variant, sr in (("flat_8bit_sr", True), ("flat_8bit", False)) if prototype else ():
        fresh = make_params(name, torch.bfloat16)
        opt = FlatAdamW8bit(fresh, sr=sr)
        started = time.time()
        opt.step()
        torch.cuda.synchronize()
        row[f"{variant}_first_step_s"] = time.time() - started  # compiles
        row[variant] = timed(opt.step)
        del opt, fresh
        torch.cuda.empty_cache()
    if prototype:
        flat_exactness(name, row)
    if fits(row["parameters"] * 16):  # fp32 weights, gradients and two moments
        params = make_params(name, torch.float32)
        row["floor_ms_fp32"] = sum(p.numel() for p in params) * 28 / bandwidth() * 1e3
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        row["torch_fused_fp32"] = timed(opt.step)
        del opt, params
        torch.cuda.empty_cache()
    return row


def quantization_on_gpu(random: int = 1 << 24) -> dict:
    """The fused kernel's 8-bit quantization alone (`sft.run.adamw8bit_kernel._quantize`, the GPU's log2 and exp2)
    against torchao's `quantize_8bit_with_qmap` on the GPU, both maps: every entry, midpoint and rounding threshold,
    the floats next to them, and `random` values of every magnitude. Per map: codes that differ, values."""
    import triton
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    from sft.run.adamw8bit_kernel import codes_of
    from sft.run.optimizer import bounds_of, thresholds

    differ = {}
    for signed, qmap in ((True, get_qmap_signed()), (False, get_qmap_unsigned())):
        qmap = torch.tensor(qmap, device="cuda")
        points = torch.cat([qmap, (qmap[1:] + qmap[:-1]) / 2, thresholds(qmap).cuda()])
        two = torch.tensor(2.0, device="cuda")
        points = torch.cat([points, torch.nextafter(points, two), torch.nextafter(points, -two)])
        g = torch.Generator(device="cuda").manual_seed(0)
        values = 10 ** -(torch.rand(random, generator=g, device="cuda") * 9)
        values = values * (torch.randint(0, 2, (random,), generator=g, device="cuda") * 2 - 1 if signed else 1)
        x = torch.cat([points, values]).clamp(-1.0 if signed else 0.0, 1.0).float()
        out = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
        codes_of[(triton.cdiv(x.numel(), 1024),)](x, out, bounds_of(qmap), x.numel(), SIGNED=signed, BLOCK=1024)
        differ["signed" if signed else "unsigned"] = [int((out != quantize_8bit_with_qmap(x, qmap)).sum()),
                                                      x.numel()]  # fmt: skip
    return differ


def tune(name: str) -> list[dict]:
    """The fused step's milliseconds per step over `name`'s set for several program shapes (blocks per program,
    warps), with stochastic rounding."""
    from torchao.optim import AdamW8bit

    import sft.run.optimizer as fused

    rows, params = [], make_params(name, torch.bfloat16)
    default = fused.fused_step
    for blocks, warps in ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (8, 4), (8, 8), (16, 8)):
        fused.fused_step = lambda *a, b=blocks, w=warps, **k: default(*a, rows=b, warps=w, **k)
        opt = fused.fused_class(AdamW8bit)(params, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
        rows.append({"set": name, "rows": blocks, "warps": warps, "fused_8bit_sr": timed(opt.step)})
        print(json.dumps(rows[-1]), flush=True)
        del opt
    fused.fused_step = default
    return rows


def flat_exactness(name: str, row: dict) -> None:
    """The prototype without rounding against torchao's after 3 steps from the same start."""
    from torchao.optim import AdamW8bit

    a, b = make_params(name, torch.bfloat16), make_params(name, torch.bfloat16)
    reference = AdamW8bit(a, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=False)
    flat = FlatAdamW8bit(b, sr=False)
    for _ in range(3):
        reference.step()
        flat.step()
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x.numel() >= 4096]  # the quantized ones (norms: torch's)
    row["flat_vs_torchao_max_abs_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in pairs)
    row["flat_vs_torchao_equal_matrices"] = sum(torch.equal(x, y) for x, y in pairs)
    row["matrices"] = len(pairs)
    del a, b, reference, flat
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sets", nargs="+", default=list(SHAPES))
    parser.add_argument("--no-prototype", action="store_true", help="leave the flat prototype out")
    parser.add_argument("--tune", action="store_true", help="only the fused step's program shapes, per set")
    args = parser.parse_args()
    if args.tune:
        rows = [row for name in args.sets for row in tune(name)]
        args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
        return
    rows, quantization = [], quantization_on_gpu()
    print(json.dumps({"quantization": quantization}), flush=True)
    for name in args.sets:
        rows.append(run_set(name, not args.no_prototype))
        print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "quantization": quantization, "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
