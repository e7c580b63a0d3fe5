"""Sequence parallelism against the run without it, on the demo (fp32, CPU, gloo all-to-all).

One set of runs, many checks: 1 process with sp=1 is the reference; 2 processes with sp=2 under ZeRO-2 and ZeRO-3
must train the same samples at every step with the same per-step loss, grad norm and token counts (1e-5) and end
with the same weights; a SIGKILLed sp=2 run, rerun with the same command, is bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sft.metrics import samples_per_step
from tests.conftest import ROOT, read_jsonl, run_cli
from tests.multiproc.test_resume import kill_after_checkpoint

STEPS = 8
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--from_scratch", "false", "--max_steps", str(STEPS),
    "--max_length", "256", "--per_device_train_batch_size", "1", "--global_batch_size", "4",
    "--gradient_accumulation_steps", "1", "--logging_steps", "1", "--eval_strategy", "no",
    "--save_strategy", "steps", "--save_steps", "4", "--trace_data", "true",
]  # fmt: skip
RTOL = 1e-5


@pytest.fixture(scope="module")
def init_model(tmp_path_factory) -> Path:
    """One fixed random init on disk: ZeRO-3 would otherwise initialise inside `zero.Init` in its own RNG order."""
    path = tmp_path_factory.mktemp("init")
    torch.manual_seed(0)
    demo = ROOT / "recipes" / "demo" / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo)).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo).save_pretrained(path)
    return path


def args_for(init_model: Path, out: Path, sp: int, stage: int) -> list[str]:
    return ARGS + [
        "--model_name_or_path", str(init_model), "--output_dir", str(out),
        "--sequence_parallel_size", str(sp), "--deepspeed", f"ds_configs/zero{stage}.json",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, init_model) -> dict[str, Path]:
    made = {}
    for name, nproc, sp, stage in (("sp1", 1, 1, 2), ("sp2_zero2", 2, 2, 2), ("sp2_zero3", 2, 2, 3)):
        out = tmp_path_factory.mktemp(name) / "out"
        result = run_cli(args_for(init_model, out, sp, stage), nproc=nproc)
        assert result.returncode == 0, result.stderr[-5000:]
        made[name] = out
        made[name + "_log"] = result.stderr
    return made


def records(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(out / "model.safetensors")


@pytest.mark.parametrize("name", ["sp2_zero2", "sp2_zero3"])
def test_sp2_trains_as_sp1(runs, init_model, name):
    ref, sp2 = records(runs["sp1"]), records(runs[name])
    assert [r["step"] for r in sp2] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        for a, b in zip([r[key] for r in ref], [r[key] for r in sp2], strict=True):
            assert math.isclose(a, b, rel_tol=RTOL), (key, a, b)
    # tokens are the real ones, each counted once (the padding to a multiple of sp is not), FLOPs likewise
    assert [r["num_tokens"] for r in ref] == [r["num_tokens"] for r in sp2]
    for a, b in zip([r["num_flops"] for r in ref], [r["num_flops"] for r in sp2], strict=True):
        assert math.isclose(a, b, rel_tol=1e-9)
    assert samples_per_step(runs["sp1"]) == samples_per_step(runs[name])
    a, b = weights(runs["sp1"]), weights(runs[name])
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst
    before = safetensors.torch.load_file(init_model / "model.safetensors")
    assert any(not torch.equal(before[k], b[k]) for k in b), "training changed no weight"


def test_sp2_logs_its_geometry(runs):
    log = runs["sp2_zero2_log"]
    assert "Parallel sizes: 2 processes: data-parallel 1 x sequence-parallel 2" in log
    assert "data-parallel size 1 x micro batch 1 x accumulation 4 = global batch 4" in log
    assert "Attention backend: sft_varlen" in log


def test_sp2_sigkill_then_same_command_is_bit_exact(runs, init_model, tmp_path):
    out = tmp_path / "out"
    kill_after_checkpoint(args_for(init_model, out, 2, 2), out, step=4)
    result = run_cli(args_for(init_model, out, 2, 2), nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Resuming from" in result.stderr
    ref, res = records(runs["sp2_zero2"]), records(out)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for key in ("loss", "learning_rate", "grad_norm", "num_tokens", "num_flops"):
        assert [r[key] for r in ref] == [r[key] for r in res], key
    a, b = weights(runs["sp2_zero2"]), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert samples_per_step(runs["sp2_zero2"]) == samples_per_step(out)
