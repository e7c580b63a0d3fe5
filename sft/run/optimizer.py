"""The one-GPU optimizer step: torchao's 8-bit AdamW stepped by one fused Triton kernel per tensor.

Without a sharding engine sft's default steps bf16 weights in place with torchao's `AdamW8bit` and stochastic
rounding (`sft.plan.preflight._precision`). torchao compiles its step once per tensor shape and calls it per tensor,
each call several kernels (dequantize, lerp, block max, an 8-step search of the 256-entry map, the update, random
bits): on an H200 that took 11-38x the time its bytes need (benchmarks/results/optimizer_step). `FusedAdamW8bit` is
torchao's class with the same states (uint8 codes, a fp32 scale per 256 values, torchao's dynamic maps; tensors torchao
leaves unquantized keep its plain states), the same checkpoints and the same arithmetic (`single_param_adam`: the
weight decay, lerp, bias corrections, the same 8-bit codes: each the count of the map's rounding thresholds at or
below the value, `thresholds`, which equals torchao's search code for code), done in one Triton kernel per tensor that
reads each byte once and writes it once. What differs: the stochastic rounding's random bits are an integer hash of
each weight's place (keyed by the run's seed, the step and the tensor's place), not torch's generator, so a
rounded weight goes up or down with the same probabilities but not at the same draws; the float arithmetic may differ
from torchao's compiled kernels in a last bit, whence a moment's code on a decision boundary (tests/test_optimizer.py
bounds both).

Used where it can run (a CUDA tensor, Triton installed, AdamW without amsgrad, plain contiguous tensors); elsewhere
the step is torchao's own, and `SFT_FUSED_ADAMW=0` keeps torchao's everywhere. `fused_class` is the seam the trainer
asks (`sft.run.trainer`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from sft.plan.memory import FUSED_STEP_MAX_ELEMENTS, fused_step_off

logger = logging.getLogger(__name__)

BLOCK = 256  # torchao's block: one fp32 scale per 256 codes
ROWS = 1  # blocks per Triton program (benchmarks/results/optimizer_step/h200_tune.json: the fastest of 8 shapes)
WARPS = 1  # warps per program
TRITON = importlib.util.find_spec("triton") is not None


def torchao_adamw8bit():
    from torchao.optim import AdamW8bit

    return AdamW8bit


def fused_class(optimizer_cls):
    """The class the trainer builds for `optimizer_cls` (transformers' choice for `optim`): `FusedAdamW8bit` for
    torchao's AdamW8bit where the fused kernel can run on this machine, else `optimizer_cls` itself (the reason
    logged once)."""
    if importlib.util.find_spec("torchao") is None or optimizer_cls is not torchao_adamw8bit():
        return optimizer_cls
    why = cannot_fuse()
    if why:
        logger.info("Optimizer: torchao's AdamW8bit steps each tensor itself (%s)", why)
        return optimizer_cls
    logger.info("Optimizer: torchao's AdamW8bit, its step one fused Triton kernel per tensor (sft.run.optimizer; "
                "same states and checkpoints as torchao's)")  # fmt: skip
    return _fused_adamw8bit()


def interpreted() -> bool:
    """Whether Triton runs its interpreter (`TRITON_INTERPRET=1`, on the CPU: the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cannot_fuse() -> str | None:
    """Why the fused step cannot run here, or None. `SFT_FUSED_ADAMW=0` keeps torchao's own step (the benchmarks'
    baseline arm)."""
    if off := fused_step_off():
        return off
    if not TRITON:
        return "Triton is not installed"
    if not torch.cuda.is_available() and not interpreted():
        return "no CUDA GPU here: the fused step is a Triton kernel"
    return None


@functools.cache
def _fused_adamw8bit():
    base = torchao_adamw8bit()

    class FusedAdamW8bit(base):
        """torchao's AdamW8bit whose step is `fused_step` per tensor where it applies (see the module's docstring)."""

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            fallback = []
            for g_index, group in enumerate(self.param_groups):
                lr = group["lr"]
                if not isinstance(lr, torch.Tensor):  # torchao's own check
                    raise RuntimeError("lr was changed to a non-Tensor object: use param_groups[i]['lr'].fill_(lr)")
                beta1, beta2 = group["betas"]
                lr_f, lr_wd = float(lr), float(lr * group["weight_decay"])
                for p_index, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    if not _fusable(p, state, group, self.is_adamw):
                        fallback.append((group, p))
                        continue
                    state["step"] += 1
                    step = int(state["step"])
                    bc1, bc2_sqrt = _corrections(step, beta1, beta2)
                    rounding = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                    scalars = (lr_f, lr_wd, 1 - beta1, 1 - beta2, bc1, bc2_sqrt, group["eps"],
                               _seed(step, g_index, p_index))  # fmt: skip
                    fused_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], scalars, rounding)
            if fallback:
                self._step_torchao(fallback)
            return loss

        def _step_torchao(self, pairs) -> None:
            """torchao's own step for the tensors the kernel does not take, as torchao's `step` runs it."""
            from torchao.optim.adam import single_param_adam

            with torch._dynamo.utils.disable_cache_limit():
                for group, p in pairs:
                    state = self.state[p]
                    state["step"] += 1
                    torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
                        p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                        state.get("max_exp_avg_sq", None), group["lr"], group["betas"][0], group["betas"][1],
                        group["weight_decay"], group["eps"], self.is_adamw,
                        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                    )  # fmt: skip

    return FusedAdamW8bit


def _seed(step: int, group: int, index: int) -> int:
    """The stochastic rounding's seed for one tensor's step: from the run's seed (`torch.initial_seed`, which
    transformers sets from `seed`), the step and the tensor's place, so a resumed run draws what the run would have."""
    return (torch.initial_seed() * 1_000_003 + step * 65_537 + group * 4_099 + index) % (2**31 - 1)


def _fusable(p: torch.Tensor, state: dict, group: dict, is_adamw: bool) -> bool:
    from torchao.optim.subclass_8bit import OptimState8bit

    m, v = state["exp_avg"], state["exp_avg_sq"]
    plain = type(p) is torch.nn.Parameter or type(p) is torch.Tensor
    quantized = isinstance(m, OptimState8bit) and isinstance(v, OptimState8bit)
    same = type(m) is torch.Tensor and type(v) is torch.Tensor
    return (plain and is_adamw and not group["amsgrad"] and (p.is_cuda or interpreted()) and p.is_contiguous()
            and p.grad.is_contiguous() and p.grad.dtype == p.dtype and isinstance(group["lr"], torch.Tensor)
            and p.dtype in (torch.bfloat16, torch.float32) and p.numel() < FUSED_STEP_MAX_ELEMENTS
            and (quantized and m.block_size == BLOCK and v.block_size == BLOCK or same))  # fmt: skip


@functools.lru_cache(maxsize=8)  # a step's tensors share one; a run of 100,000 steps would keep 100,000
def _corrections(step: int, beta1: float, beta2: float) -> tuple[float, float]:
    """`1 - beta1**step` and `sqrt(1 - beta2**step)` in fp32, as torchao computes them from its fp32 step tensor."""
    t = torch.tensor(float(step))
    return float(1 - beta1**t), float((1 - beta2**t).sqrt())


def fused_step(p, grad, m, v, scalars: tuple, stochastic_round: bool, rows: int | None = None,
               warps: int | None = None) -> None:  # fmt: skip
    """One AdamW step of tensor `p` in place, its moments `m`, `v` (torchao's 8-bit states or plain tensors):
    torchao's `single_param_adam` in one kernel. `scalars`: lr, lr x weight decay, 1 - beta1, 1 - beta2, the bias
    corrections `1 - beta1**step` and `sqrt(1 - beta2**step)`, eps, the rounding's seed. `rows` blocks of 256 per
    Triton program, `warps` warps each (default `ROWS`, `WARPS`)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    rows, warps = rows or ROWS, warps or WARPS
    kernel, half = _kernel(), p.dtype is torch.bfloat16
    if isinstance(m, OptimState8bit):
        blocks = p.numel() // BLOCK
        kernel[(triton_cdiv(blocks, rows),)](
            p, grad, m.codes, m.scale, v.codes, v.scale, m.qmap, v.qmap, bounds_of(m.qmap), bounds_of(v.qmap), blocks,
            *scalars,
            QUANTIZED=True, BF16=half, ROUND=stochastic_round, ROWS=rows, BLOCK=BLOCK, num_warps=warps,
        )  # fmt: skip
    else:
        kernel[(triton_cdiv(triton_cdiv(p.numel(), BLOCK), rows),)](
            p, grad, m, m, v, v, m, v, m, v, p.numel(), *scalars,
            QUANTIZED=False, BF16=half, ROUND=stochastic_round, ROWS=rows, BLOCK=BLOCK, num_warps=warps,
        )  # fmt: skip


_BOUNDS = WeakIdKeyDictionary()  # a state's map -> its `thresholds` on its device, made at its first step


def bounds_of(qmap: torch.Tensor) -> torch.Tensor:
    """`thresholds(qmap)` with -inf before and +inf after, on qmap's device (the kernel's `_quantize` reads them)."""
    if qmap not in _BOUNDS:
        inf = torch.tensor([float("inf")])
        _BOUNDS[qmap] = torch.cat([-inf, thresholds(qmap), inf]).to(qmap.device)
    return _BOUNDS[qmap]


def thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """Per pair of neighbours `qmap[c]`, `qmap[c + 1]` of a sorted 256-entry map, the least fp32 `x` that torchao's
    `quantize_8bit_with_qmap` rounds up to `c + 1`: `x - qmap[c] >= (qmap[c + 1] - qmap[c]) * 0.5` in fp32. That test
    is monotone in `x`, so its least solution is found by bisection over the fp32 values between the two, and a
    value's code is how many of these 255 thresholds are at or below it."""
    return _thresholds(tuple(qmap.tolist()))


@functools.lru_cache(maxsize=4)  # torchao's two maps
def _thresholds(values: tuple[float, ...]) -> torch.Tensor:
    import numpy as np

    q = np.asarray(values, dtype=np.float32)
    down, up = q[:-1], q[1:]
    half = (up - down) * np.float32(0.5)

    def key(x):  # fp32 -> int64 in the floats' order
        bits = x.view(np.int32).astype(np.int64)
        return np.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))

    def value(k):
        bits = np.where(k >= 0, k, (-k) | 0x80000000).astype(np.uint32)
        return bits.view(np.float32)

    low, high = key(down), key(up)  # high always rounds up: up - down >= half
    while (low < high).any():
        mid = (low + high) // 2
        rounds_up = (value(mid) - down) >= half
        high, low = np.where(rounds_up, mid, high), np.where(rounds_up, low, mid + 1)
    return torch.from_numpy(value(high).copy())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel():
    """The Triton kernel (`sft.run.adamw8bit_kernel`), imported on first use: Triton's interpreter, which the CPU test
    takes, is chosen when the kernel is defined."""
    from sft.run.adamw8bit_kernel import adamw8bit_step

    return adamw8bit_step
