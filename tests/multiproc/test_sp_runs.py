"""Sequence parallelism against the run without it, on the demo (fp32, CPU, gloo all-to-all).

One set of runs, many checks: 1 process with sp=1 is the reference; 2 processes with sp=2 under ZeRO-2 and ZeRO-3 (the
latter with the memory tools on) must train the same samples at every step with the same per-step loss, grad norm
and token counts (1e-5) and end with the same weights; so must LoRA with sp=2 against LoRA with sp=1. A SIGKILLed
sp=2 run (torchrun), rerun with the same arguments under the deepspeed launcher, is bit-identical to the
uninterrupted one; its checkpoint resumed on 4 processes (data-parallel 2 x sequence-parallel 2) keeps the global
batch and the samples and trains on as it did.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig

from sft.run.metrics import samples_per_step
from tests.conftest import ROOT, cli_env, free_port, run_cli, run_cli_side_by_side
from tests.helpers import kill_after_checkpoint, train_records, weights

STEPS = 8
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--from_scratch", "false", "--max_steps", str(STEPS),
    "--max_length", "256", "--per_device_train_batch_size", "1", "--global_batch_size", "4",
    "--gradient_accumulation_steps", "1", "--logging_steps", "1", "--eval_strategy", "no", "--report", "false",
    "--save_strategy", "steps", "--save_steps", "4", "--trace_data", "true",
]  # fmt: skip
RTOL = 1e-5
# no LoRA dropout: its masks are drawn per rank, so sp=2 and sp=1 would drop different activations
# every memory tool of the plan on: checkpointing, its checkpoints offloaded, the tiled MLP
TOOLS = ["--activation_checkpointing", "true", "--offload_checkpoints", "true", "--tiled_mlp", "true"]
# every lever of the long-context plan that acts on a CPU (offloading checkpoints needs a GPU's pinned memory, and
# excludes keeping attention outputs): checkpointing that keeps attention outputs, the tiled MLP, ZeRO-3 with the
# optimizer and the weights offloaded (`offloaded_config`)
LEVERS = [
    "--activation_checkpointing", "true", "--keep_attention_outputs", "true", "--offload_checkpoints", "false",
    "--tiled_mlp", "true",
]  # fmt: skip


def offloaded_config(folder: Path) -> Path:
    """ds_configs/zero3_offload.json with torch's AdamW stepping the offloaded states on the CPU instead of the
    DeepSpeed optimizer it names, which there is DeepSpeed's CPU Adam: a C++ op compiled on a machine's first use
    (170 CPU-seconds of g++ on these 2 cores, not counted by the suite's census). The offloading is the same;
    `test_the_shipped_offload_config_trains_as_sp1` (full tier) runs the config as shipped."""
    config = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())
    del config["optimizer"]  # transformers builds its AdamW, which DeepSpeed then steps on the CPU
    config["zero_force_ds_cpu_optimizer"] = False
    path = folder / "zero3_offload_torch_adamw.json"
    path.write_text(json.dumps(config))
    return path


LORA = [
    "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear", "--lora_dropout", "0",
]  # fmt: skip


def args_for(init_model: Path, out: Path, sp: int, stage: int) -> list[str]:
    return ARGS + [
        "--model_name_or_path", str(init_model), "--output_dir", str(out),
        "--sequence_parallel_size", str(sp), "--deepspeed", f"ds_configs/zero{stage}.json",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, init_model) -> dict[str, Path]:
    """Every run of the module; the one-process runs two at a time."""
    made = {}
    levers = [*LEVERS, "--deepspeed", str(offloaded_config(tmp_path_factory.mktemp("config")))]
    settings = (
        ("sp1", 1, 1, 2, []),
        ("sp1_tools", 1, 1, 2, TOOLS),
        ("sp1_zero3_tools", 1, 1, 3, TOOLS),
        ("lora_sp1", 1, 1, 2, LORA),
        ("sp2_zero2", 2, 2, 2, []),
        ("sp2_zero3_tools", 2, 2, 3, TOOLS),
        ("dp2_every_lever", 2, 1, 3, levers),
        ("lora_sp2", 2, 2, 2, LORA),
    )
    outs = {name: tmp_path_factory.mktemp(name) / "out" for name, *_ in settings}
    jobs = {
        name: (args_for(init_model, outs[name], sp, stage) + extra, nproc)
        for name, nproc, sp, stage, extra in settings
    }
    single = [name for name, (_, nproc) in jobs.items() if nproc == 1]
    results = dict(zip(single, run_cli_side_by_side([jobs[name] for name in single]), strict=True))
    for name, (args, nproc) in jobs.items():
        if name not in results:
            results[name] = run_cli(args, nproc=nproc)
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-5000:])
        made[name] = outs[name]
        made[name + "_log"] = result.stderr
    return made


def assert_same_steps(ref: list[dict], other: list[dict], rtol: float = RTOL) -> None:
    for key in ("loss", "grad_norm"):
        for a, b in zip([r[key] for r in ref], [r[key] for r in other], strict=True):
            assert math.isclose(a, b, rel_tol=rtol), (key, a, b)


@pytest.mark.parametrize("name", ["sp2_zero2", "sp1_tools", "sp1_zero3_tools", "sp2_zero3_tools", "dp2_every_lever"])
def test_sp2_trains_as_sp1(runs, init_model, name):
    """sp=2 under ZeRO-2, and under ZeRO-3 with the memory tools (1 process under ZeRO-2 and ZeRO-3: two tiles per
    MLP, ZeRO's gradient hooks held to the last; sp=2 under ZeRO-3 with them: one run for both), and 2 processes with
    every long-context lever on, train as sp=1 with none."""
    ref, sp2 = train_records(runs["sp1"]), train_records(runs[name])
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


@pytest.mark.full
def test_the_shipped_offload_config_trains_as_sp1(runs, init_model, tmp_path):
    """ds_configs/zero3_offload.json as shipped (DeepSpeed's CPU Adam, its C++ op compiled on first use) with every
    lever, 2 processes: trains as sp=1, as `test_sp2_trains_as_sp1[dp2_every_lever]` proves per commit for the same
    offloading with torch's AdamW on the CPU."""
    out = tmp_path / "out"
    args = args_for(init_model, out, 1, 3) + [*LEVERS, "--deepspeed", "ds_configs/zero3_offload.json"]
    result = run_cli(args, nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    ref, shipped = train_records(runs["sp1"]), train_records(out)
    assert [r["step"] for r in shipped] == list(range(1, STEPS + 1))
    assert_same_steps(ref, shipped)
    a, b = weights(runs["sp1"]), weights(out)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_sp2_logs_its_geometry(runs):
    log = runs["sp2_zero2_log"]
    assert "Parallel sizes: 2 processes: data-parallel 1 x sequence-parallel 2" in log
    assert "data-parallel size 1 x micro batch 1 x accumulation 4 = global batch 4" in log
    assert "Attention backend: sft_varlen" in log
    # DeepSpeed's overlapped ZeRO-1/2 reduction gives wrong gradients under SP on GPUs (benchmarks/sp_gradients)
    assert "DeepSpeed zero_optimization.overlap_comm: auto -> false (2 processes)" in log


def test_memory_tools_are_on(runs):
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "demo" / "model")
    assert config.hidden_size == 128
    for name, tiles in (("sp1_tools", 2), ("sp1_zero3_tools", 2), ("sp2_zero3_tools", 1)):  # rank's tokens / hidden
        log = runs[name + "_log"]
        assert f"Tiled MLP: {config.num_hidden_layers} decoder-layer MLPs run in {tiles} tiles per row" in log
        assert "Activation checkpoints not offloaded: no GPU" in log  # offloading is shown on GPUs (benchmarks)


def test_every_lever_is_on(runs):
    log = runs["dp2_every_lever_log"]
    assert "Activation checkpointing keeps the attention kernels' outputs" in log
    assert "Tiled MLP: 4 decoder-layer MLPs run in 2 tiles per row" in log
    states = runs["dp2_every_lever"] / "checkpoint-8" / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    zero = torch.load(states, map_location="cpu", weights_only=False)["ds_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"


def test_lora_with_sp2_trains_as_lora_with_sp1(runs):
    ref, sp2 = train_records(runs["lora_sp1"]), train_records(runs["lora_sp2"])
    assert [r["step"] for r in sp2] == list(range(1, STEPS + 1))
    assert_same_steps(ref, sp2)
    assert samples_per_step(runs["lora_sp1"]) == samples_per_step(runs["lora_sp2"])
    a, b = (safetensors.torch.load_file(runs[n] / "adapter_model.safetensors") for n in ("lora_sp1", "lora_sp2"))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert any(float(b[k].abs().max()) > 0 for k in b if "lora_B" in k), "LoRA B stayed at its zero init"


def test_sp2_sigkill_then_resume_under_deepspeed_launcher_and_on_another_dp(runs, init_model, tmp_path):
    """Killed under torchrun after checkpoint-4; the same arguments under the deepspeed launcher resume it bit for bit;
    a copy of the killed run resumed on 4 processes (dp 2 x sp 2) trains steps 5-8 on the same samples."""
    out = tmp_path / "out"
    kill_after_checkpoint(args_for(init_model, out, 2, 2), out, step=4)
    wider = tmp_path / "wider"
    shutil.copytree(out, wider)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    result = subprocess.run(
        [*cmd, str(ROOT / "sft" / "train.py"), *args_for(init_model, out, 2, 2)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Resuming from" in result.stderr
    ref, res = train_records(runs["sp2_zero2"]), train_records(out)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for key in ("loss", "learning_rate", "grad_norm", "num_tokens", "num_flops"):
        assert [r[key] for r in ref] == [r[key] for r in res], key
    a, b = weights(runs["sp2_zero2"]), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert samples_per_step(runs["sp2_zero2"]) == samples_per_step(out)

    result = run_cli(args_for(init_model, wider, 2, 2), nproc=4)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Parallel sizes: 4 processes: data-parallel 2 x sequence-parallel 2" in result.stderr
    assert "global batch 4 = 2 x 1 x 2 accumulation" in result.stderr
    res = train_records(wider)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert_same_steps(ref, res)
    assert [r["num_tokens"] for r in ref] == [r["num_tokens"] for r in res]
    assert samples_per_step(runs["sp2_zero2"]) == samples_per_step(wider)
    a, b = weights(runs["sp2_zero2"]), weights(wider)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
