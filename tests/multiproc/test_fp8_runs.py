"""FP8 (torchao float8) through the real CLI on 2 gloo processes: ZeRO-3 against ZeRO-2, against no FP8, and resume.

torch runs float8 matmuls on the CPU (slowly), so with `SFT_FP8_ON_CPU=1` these are the same torchao code paths a GPU
runs, minus the compile (`compile_decoder_layers: false` keeps the runs short). One set of runs, many checks: the
demo model in fp32 with every decoder linear in float8 (tensorwise) under ZeRO-2 and ZeRO-3 trains the same samples
to the same losses (ZeRO-3 gathers each partitioned weight before the cast); FP8 differs from the fp32 run, but
little; a SIGKILLed ZeRO-3 FP8 run, rerun, is bit-identical; the saved model is a plain transformers model.
"""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, run_cli
from tests.helpers import kill_after_checkpoint, train_records, weights

STEPS = 8
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--from_scratch", "false", "--max_steps", str(STEPS),
    "--max_length", "256", "--per_device_train_batch_size", "1", "--global_batch_size", "4",
    "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "4",
    "--report", "false",
    "--trace_data", "true", "--compile_decoder_layers", "false",
]  # fmt: skip
FP8 = ["--fp8", "true", "--fp8_recipe", "tensorwise"]
CPU_FP8 = {"SFT_FP8_ON_CPU": "1"}


def args_for(model, out, stage: int | str, fp8: bool = True) -> list[str]:
    """The run's arguments under ZeRO `stage`, or FSDP2 (`stage="fsdp2"`)."""
    extra = FP8 if fp8 else ["--fp8", "false"]
    engine = ["--engine", "fsdp2", "--deepspeed", "none"] if stage == "fsdp2" else [
        "--deepspeed", f"ds_configs/zero{stage}.json"]  # fmt: skip
    return ARGS + ["--model_name_or_path", str(model), "--output_dir", str(out), *engine, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, init_model):  # noqa: F811
    made = {}
    settings = (("fp32_zero2", 2, False), ("fp8_zero2", 2, True), ("fp8_zero3", 3, True), ("fp8_fsdp2", "fsdp2", True))
    for name, stage, fp8 in settings:
        out = tmp_path_factory.mktemp(name) / "out"
        result = run_cli(args_for(init_model, out, stage, fp8), nproc=2, env=CPU_FP8)
        assert result.returncode == 0, result.stderr[-5000:]
        made[name], made[name + "_log"] = out, result.stderr
    return made


@pytest.fixture(scope="module")
def compiled_zero3(tmp_path_factory, init_model):  # noqa: F811
    """The ZeRO-3 FP8 run with its decoder layers compiled (as `fp8: true` does), 4 steps."""
    out = tmp_path_factory.mktemp("fp8_zero3_compiled") / "out"
    args = args_for(init_model, out, 3) + ["--compile_decoder_layers", "true", "--max_steps", "4"]
    result = run_cli(args, nproc=2, env=CPU_FP8)
    assert result.returncode == 0, result.stderr[-5000:]
    return out, result.stderr


def test_fp8_is_on_and_logged(runs):
    log = runs["fp8_zero3_log"]
    assert "FP8: on, tensorwise scaling (fp8: true (SFT_FP8_ON_CPU=1: float8 matmuls on the CPU))" in log
    assert "FP8: 28 decoder linear layers in torchao float8 (tensorwise scaling)" in log  # 4 layers x 7, no LM head
    assert "FP8: off (fp8: false)" in runs["fp32_zero2_log"]
    assert "Compiling" not in log  # compile_decoder_layers: false holds against fp8's auto


def test_zero3_fp8_trains_as_zero2_fp8(runs):
    """Same samples and tokens, the same first loss (ZeRO-3 gathers the whole weight before the float8 cast), and a
    trajectory within FP8's own error.

    Measured here: the first step's grad norm differs by 1.1e-4 relative (4.821183 vs 4.821718); fp32 ZeRO-3 and
    ZeRO-2 agree to 1e-7 on the same runs, and 1-process FP8 runs agree to 1e-8 with 2 accumulated micro-batches but
    show the same 1.1e-4 with 4, so it comes with ZeRO-3's gradient accumulation, not from the ranks; its cause is not
    found (not the weight release: all-persistent parameters give the same figure). Later steps drift as float8
    roundings flip (grad norms 0.9% apart at step 8, losses 0.07%); for scale, FP8 and fp32 grad norms differ by 1-3%.
    """
    a, b = train_records(runs["fp8_zero2"]), train_records(runs["fp8_zero3"])
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    assert a[0]["loss"] == b[0]["loss"]
    assert math.isclose(a[0]["grad_norm"], b[0]["grad_norm"], rel_tol=5e-4)
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x["loss"], y["loss"], rel_tol=3e-3), (x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=3e-2), (x["grad_norm"], y["grad_norm"])
    wa, wb = weights(runs["fp8_zero2"]), weights(runs["fp8_zero3"])
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-2  # measured 2.8e-3; the drift is chaotic


def test_compiled_decoder_layers_under_zero3_keep_its_hooks_eager(runs, compiled_zero3):
    """Compiled under ZeRO-3, DeepSpeed's per-module hooks stay outside torch.compile: no recompile storm (traced,
    they recompiled per module into dynamo's recompile limit: 1,012 recompile lines in 3 demo steps, warnings on the
    console), and the run trains as the uncompiled one: the same tokens; the first loss (same weights, same data)
    moved by compile's rounding by less than float8's own rounding moves it from the fp32 run's (a compiled cast
    that rounds its fp32 input differently flips only some of the float8 roundings; measured on an AMD EPYC: 5.5e-5
    against 2.7e-4, where a fixed 1e-5 relative failed at 1.2e-5); every step within compile's rounding after."""
    out, log = compiled_zero3
    assert "Compiling 4 decoder layers with torch.compile" in log
    assert "DeepSpeed hooks run eagerly in between" in log
    assert "recompile_limit" not in log and "Recompiling" not in log
    compiled, eager = train_records(out), train_records(runs["fp8_zero3"])[:4]
    assert [r["num_tokens"] for r in compiled] == [r["num_tokens"] for r in eager]
    float8_rounding = abs(eager[0]["loss"] - train_records(runs["fp32_zero2"])[0]["loss"])
    assert abs(compiled[0]["loss"] - eager[0]["loss"]) < float8_rounding, (compiled[0], eager[0], float8_rounding)
    for x, y in zip(compiled, eager, strict=True):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-3), (x["loss"], y["loss"])


def test_fp8_differs_from_fp32_but_little(runs):
    """FP8 is really in the matmuls (the losses differ from fp32 from the first step) and trains the same way
    (every step within 2%, the last within 1%; measured up to 0.08%)."""
    ref, fp8 = train_records(runs["fp32_zero2"]), train_records(runs["fp8_zero2"])
    diffs = [abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(ref, fp8, strict=True)]
    assert max(diffs) > 1e-6, diffs
    assert max(diffs) < 0.02 and diffs[-1] < 0.01, diffs
    assert fp8[-1]["loss"] < fp8[0]["loss"]


def test_fp8_model_saves_as_plain_transformers_weights(runs, init_model):  # noqa: F811
    """The FP8 run's model.safetensors holds the same tensors as an fp32 run's and loads into a plain model."""
    saved = weights(runs["fp8_zero3"])
    assert saved.keys() == weights(runs["fp32_zero2"]).keys()
    model = AutoModelForCausalLM.from_pretrained(runs["fp8_zero3"])
    assert all(type(m).__name__ != "LeafWeightFloat8Linear" for m in model.modules())
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, saved["model.layers.0.mlp.up_proj.weight"])
    before = safetensors.torch.load_file(init_model / "model.safetensors")
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], saved["model.layers.0.mlp.up_proj.weight"])


def test_fsdp2_fp8_gathers_float8_and_trains_as_zero2_fp8(runs):
    """FSDP2 all-gathers the float8 weights in float8 (each shard cast with the whole weight's scale, precomputed after
    each step) and trains as ZeRO-2's FP8 run: the same float8 weights, so the same first two losses bit for bit;
    later steps within float8's rounding flips (measured: equal to step 6, 9e-5 relative at step 8; before accelerate's
    optimizer re-pointing was fixed, sft.model.fp8._addressable, the float8 weights never moved and step 4 was 2.4%
    off). Every weight moved from the init, and the model saves as plain transformers weights."""
    log = runs["fp8_fsdp2_log"]
    assert "FP8: 28 decoder linear layers in torchao float8 (tensorwise scaling, all-gathered by FSDP2" in log
    assert "their scales precomputed after each optimizer step" in log
    assert "FP8 under ZeRO-3 measured slower" not in log
    a, b = train_records(runs["fp8_zero2"]), train_records(runs["fp8_fsdp2"])
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    assert [r["loss"] for r in a[:2]] == [r["loss"] for r in b[:2]]
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-3), (x["step"], x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=1e-2), (x["step"], x["grad_norm"], y["grad_norm"])
    wa, wb = weights(runs["fp8_zero2"]), weights(runs["fp8_fsdp2"])
    assert wa.keys() == wb.keys() and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-2  # measured 5.4e-4


@pytest.mark.parametrize("stage", [3, "fsdp2"])
def test_fp8_sigkill_then_rerun_is_bit_exact(runs, init_model, tmp_path, stage):  # noqa: F811
    """Killed after checkpoint-4 and run again, under ZeRO-3 and under FSDP2 (whose resumed first step has no
    precomputed scales: they are computed in the all-gather): every step and the final weights equal the
    uninterrupted run's."""
    out, name = tmp_path / "out", "fp8_zero3" if stage == 3 else "fp8_fsdp2"
    kill_after_checkpoint(args_for(init_model, out, stage), out, step=4, env=CPU_FP8)
    result = run_cli(args_for(init_model, out, stage), nproc=2, env=CPU_FP8)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Resuming from" in result.stderr
    ref, res = train_records(runs[name]), train_records(out)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for key in ("loss", "learning_rate", "grad_norm", "num_tokens"):
        assert [r[key] for r in ref] == [r[key] for r in res], key
    a, b = weights(runs[name]), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
