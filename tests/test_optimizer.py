"""sft's fused 8-bit AdamW step (`sft.run.optimizer`) against torchao's own (`single_param_adam`, run eagerly), on the
CPU through Triton's interpreter: the same weights and 8-bit moments step after step, stochastic rounding to a
neighbour in proportion, checkpoints that torchao's class reads and that resume bit-identically.

The interpreter must be chosen before Triton is first imported (its own jit functions, `tl.max`, `tl.randint`, are
made then), so the checks run in one child process (`python tests/test_optimizer.py`, `TRITON_INTERPRET=1`) that
prints their figures, and the tests assert on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("torchao")

from torchao.optim import AdamW8bit  # noqa: E402
from torchao.optim.adam import single_param_adam  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

from sft.run import optimizer  # noqa: E402
from sft.run.adamw8bit_kernel import codes_of  # noqa: E402

# a quantized matrix (>= 4,096 values, a multiple of 256), a norm torchao leaves unquantized (bf16 states), a second
# matrix whose blocks do not fill the kernel's last program
SHAPES = [(64, 256), (300,), (36, 128)]


def params(dtype=torch.bfloat16) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in SHAPES]


def set_grads(ps, step: int, scale: float = 1e-2) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def torchao_steps(ps, steps: int, **kw) -> AdamW8bit:
    """torchao's arithmetic, eagerly (its `step` compiles each tensor's; the same function)."""
    opt = AdamW8bit(ps, lr=1e-3, weight_decay=0.01, **kw)
    for step in range(steps):
        set_grads(ps, step)
        for p in ps:
            state = opt.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=opt._new_buffer(p, True),
                             exp_avg_sq=opt._new_buffer(p, False))  # fmt: skip
            state["step"] += 1
            group = opt.param_groups[0]
            moments = (state["exp_avg"], state["exp_avg_sq"], None)
            single_param_adam(p.detach(), p.grad, state["step"], *moments, group["lr"], *group["betas"],
                              group["weight_decay"], group["eps"], True, False)  # fmt: skip
    return opt


def fused_steps(ps, steps: int, first: int = 0, opt=None, **kw):
    opt = opt or optimizer.fused_class(AdamW8bit)(ps, lr=1e-3, weight_decay=0.01, **kw)
    for step in range(first, first + steps):
        set_grads(ps, step)
        opt.step()
    return opt


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are (same sign assumed near these values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def equal_to_torchao() -> dict:
    """Six steps of each from the same weights and gradients: per tensor, the weights' largest distance in bf16 steps
    and the share equal, the 8-bit codes' share equal and the scales' largest relative difference, or the plain
    states' distance."""
    reference, fused = params(), params()
    ref_opt, opt = torchao_steps(reference, 6), fused_steps(fused, 6)
    rows = []
    for a, b, start in zip(reference, fused, params(), strict=True):
        row = {"shape": list(a.shape), "moved": not torch.equal(a, start), "ulps": int(ulps(a, b).max()),
               "equal": float((a == b).float().mean()), "step": float(opt.state[b]["step"])}  # fmt: skip
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = ref_opt.state[a][key], opt.state[b][key]
            if isinstance(x, OptimState8bit) and isinstance(y, OptimState8bit):
                row[key] = {"codes_equal": float((x.codes == y.codes).float().mean()),
                            "scale_rel": float(((x.scale - y.scale).abs() / x.scale).max())}  # fmt: skip
            else:
                row[key] = {"dtypes": [str(x.dtype), str(y.dtype)], "ulps": int(ulps(x, y).max())}
        rows.append(row)
    return {"class": type(opt).__name__, "rows": rows}


def fp32_weights() -> float:
    """fp32 weights, four steps each: per tensor the share of weights equal and the largest difference against the
    largest distance a weight moved."""
    start, reference, fused = params(torch.float32), params(torch.float32), params(torch.float32)
    torchao_steps(reference, 4)
    fused_steps(fused, 4)
    triples = zip(reference, fused, start, strict=True)
    return [{"equal": float((a == b).float().mean()), "moved": float((a - s).abs().max()),
             "differ": float((a - b).abs().max())} for a, b, s in triples]  # fmt: skip


def stochastic_rounding() -> dict:
    """One step's fp32 result (the same step on fp32 copies of the bf16 weights: their 8-bit moments are the same)
    against the step rounded stochastically: whether each landed on the bf16 below or above it, the share that went
    up against the mean of the dropped bits' fractions, and how often it took the nearest."""
    exact, rounded = params(torch.float32), params()
    for p in exact:
        p.data = p.data.bfloat16().float()
    fused_steps(exact, 1)
    fused_steps(rounded, 1, bf16_stochastic_round=True)
    x, y = exact[0].detach(), rounded[0].detach().float()
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = ((x.view(torch.int32) & -65536) + 0x10000).view(torch.float32)
    landed_up = y == up
    share = (x.view(torch.int32) & 0xFFFF).double() / 65536
    nearest = float((landed_up == (share >= 0.5)).double().mean())
    return {"neighbours": bool(((y == down) | landed_up).all()), "up": float(landed_up.double().mean()),
            "expected_up": float(share.mean()), "nearest": nearest}  # fmt: skip


def resumed() -> dict:
    """Four steps straight against two, the optimizer's state dict into a fresh one, two more; and torchao's own
    class loading that state dict."""
    straight = params()
    fused_steps(straight, 4, bf16_stochastic_round=True)
    first = params()
    saved = fused_steps(first, 2, bf16_stochastic_round=True).state_dict()
    again = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = optimizer.fused_class(AdamW8bit)(again, lr=1e-3, weight_decay=0.01, bf16_stochastic_round=True)
    opt.load_state_dict(saved)
    fused_steps(again, 2, first=2, opt=opt)
    plain = AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in first], lr=1e-3)
    plain.load_state_dict(saved)
    return {"bit_identical": all(torch.equal(a, b) for a, b in zip(straight, again, strict=True)),
            "moved": not all(torch.equal(a, b) for a, b in zip(straight, first, strict=True)),
            "torchao_reads": type(plain.state_dict()["state"][0]["exp_avg"]).__name__}  # fmt: skip


def quantization() -> dict:
    """The kernel's 8-bit quantization alone against torchao's `quantize_8bit_with_qmap`, both maps, over every map
    entry, each midpoint between neighbours, each threshold where torchao's rounding turns up, the floats just below
    and above those, and random values of every magnitude: how many codes differ."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    differ = {}
    for signed, qmap in ((True, get_qmap_signed()), (False, get_qmap_unsigned())):
        qmap = torch.tensor(qmap)
        points = torch.cat([qmap, (qmap[1:] + qmap[:-1]) / 2, optimizer.thresholds(qmap)])
        points = torch.cat([points, torch.nextafter(points, torch.tensor(2.0)), torch.nextafter(points, -points - 1)])
        g = torch.Generator().manual_seed(0)
        random = 10 ** -(torch.rand(20_000, generator=g) * 8)
        random = random * (torch.randint(0, 2, (20_000,), generator=g) * 2 - 1 if signed else 1)
        x = torch.cat([points, random, torch.zeros(1)]).clamp(-1.0 if signed else 0.0, 1.0).float()
        out = torch.empty(x.shape, dtype=torch.uint8)
        codes_of[(triton.cdiv(x.numel(), 1024),)](x, out, optimizer.bounds_of(qmap), x.numel(), SIGNED=signed,
                                                  BLOCK=1024)  # fmt: skip
        differ["signed" if signed else "unsigned"] = [int((out != quantize_8bit_with_qmap(x, qmap)).sum()), x.numel()]
    return differ


@pytest.fixture(scope="module")
def figures() -> dict:
    """The checks above, run by Triton's interpreter in a child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("SFT_FUSED_ADAMW", None)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_fused_step_equals_torchaos_arithmetic(figures):
    result = figures["equal"]
    assert result["class"] == "FusedAdamW8bit"
    for row in result["rows"]:
        assert row["moved"] and row["step"] == 6
        assert row["ulps"] <= 1 and row["equal"] >= 0.999, row
        for key in ("exp_avg", "exp_avg_sq"):
            if "codes_equal" in row[key]:
                assert row[key]["codes_equal"] >= 0.999 and row[key]["scale_rel"] <= 1e-6, row
            else:  # torchao keeps a small tensor's states in its dtype
                assert row[key]["dtypes"] == ["torch.bfloat16"] * 2 and row[key]["ulps"] <= 1, row
    assert [len(row["shape"]) for row in result["rows"]] == [2, 1, 2]
    assert "codes_equal" in result["rows"][0]["exp_avg"] and "dtypes" in result["rows"][1]["exp_avg"]


def test_the_kernels_quantization_is_torchaos_code_for_code(figures):
    assert {name: differ for name, (differ, _) in figures["quantization"].items()} == {"signed": 0, "unsigned": 0}
    assert all(n > 21_700 for _, n in figures["quantization"].values())


def test_fp32_weights_step_as_torchao_does(figures):
    for row in figures["fp32"]:
        assert row["equal"] >= 0.8 and row["differ"] <= 1e-5 * row["moved"], row  # fp32's last bit


def test_stochastic_rounding_lands_on_a_neighbour_in_proportion(figures):
    result = figures["rounding"]
    assert result["neighbours"]
    assert abs(result["up"] - result["expected_up"]) < 0.01
    assert result["nearest"] < 0.9  # round-to-nearest would be 1.0


def test_a_checkpoint_resumes_bit_identically_and_torchao_reads_it(figures):
    assert figures["resume"] == {"bit_identical": True, "moved": True, "torchao_reads": "OptimState8bit"}


def test_where_the_fused_step_cannot_run_torchaos_class_is_kept(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SFT_FUSED_ADAMW", "0")
    with caplog.at_level("INFO", logger="sft.run.optimizer"):
        assert optimizer.fused_class(AdamW8bit) is AdamW8bit
        assert "SFT_FUSED_ADAMW=0" in caplog.text
        monkeypatch.delenv("SFT_FUSED_ADAMW")
        if not torch.cuda.is_available():
            assert optimizer.fused_class(AdamW8bit) is AdamW8bit
            assert "no CUDA GPU" in caplog.text
    assert optimizer.fused_class(torch.optim.AdamW) is torch.optim.AdamW


if __name__ == "__main__":
    # 8 blocks per program, not the GPU's 1: Triton's interpreter runs each program apart (8x fewer here), and the
    # last program of a 36 x 128 tensor (18 blocks) is then partly masked, which the checks cover that way
    optimizer.ROWS = 8
    print(json.dumps({"equal": equal_to_torchao(), "fp32": fp32_weights(), "rounding": stochastic_rounding(),
                      "resume": resumed(), "quantization": quantization()}))  # fmt: skip
