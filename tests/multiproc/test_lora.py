"""LoRA and QLoRA (bitsandbytes 4-bit, which runs on the CPU) through TRL's ModelConfig flags: ZeRO-2/3,
checkpointing, packing, resume, and `python -m sft.tools.merge`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from sft.run.checkpoint import KILL_DURING_SAVE_ENV, MARKER
from sft.tools.merge import main as merge_main
from tests.conftest import ROOT, run_cli
from tests.helpers import losses, merge, merge_side_by_side

STEPS = 12
ARGS = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--from_scratch", "false", "--use_peft", "--lora_r", "8",
    "--lora_alpha", "16", "--lora_target_modules", "all-linear", "--max_steps", str(STEPS), "--logging_steps", "1",
    "--save_strategy", "steps", "--save_steps", "4", "--eval_strategy", "no", "--learning_rate", "1e-2",
    "--report", "false",
    "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_length", "256",
]  # fmt: skip


ZERO2 = ["--deepspeed", "ds_configs/zero2.json"]
ZERO3 = ["--deepspeed", "ds_configs/zero3.json"]
QLORA = ["--load_in_4bit", "true"]  # NF4, compute in the run's dtype (fp32 here)


@pytest.fixture(scope="module")
def base(saved_demo_model) -> Path:
    return saved_demo_model


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("lora")
    out = {}
    for name, extra in (
        ("zero2", ZERO2),
        ("zero3_ckpt", [*ZERO3, "--activation_checkpointing", "true"]),
        ("qlora_zero2", [*ZERO2, *QLORA]),
        ("qlora_zero3_ckpt", [*ZERO3, *QLORA, "--activation_checkpointing", "true"]),
    ):
        out[name] = work / name
        result = run_cli([*ARGS, "--model_name_or_path", str(base), "--output_dir", str(out[name]), *extra], nproc=2)
        assert result.returncode == 0, result.stderr[-4000:]
        (out[name] / "stderr.log").write_text(result.stderr)
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def test_lora_trains_under_zero2_and_zero3_with_checkpointing(runs):
    zero2, zero3 = losses(runs["zero2"]), losses(runs["zero3_ckpt"])
    assert len(zero2) == len(zero3) == STEPS
    assert sum(zero2[-3:]) < 0.97 * sum(zero2[:3])  # the adapter learns
    assert zero3 == pytest.approx(zero2, rel=1e-4)  # ZeRO-3 + activation checkpointing trains the same adapter
    for out in runs.values():
        assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()


def test_qlora_trains_under_zero3_as_under_zero2(runs):
    """The 4-bit base partitioned by ZeRO-3 (packed in fp32, ZeRO-3's dtype here) trains the adapter as ZeRO-2 does,
    where each rank holds the whole 4-bit base; and the quantization shows in the loss (not the 16-bit LoRA run)."""
    zero2, zero3 = losses(runs["qlora_zero2"]), losses(runs["qlora_zero3_ckpt"])
    assert len(zero2) == len(zero3) == STEPS
    assert sum(zero3[-3:]) < 0.97 * sum(zero3[:3])
    assert zero3 == pytest.approx(zero2, rel=1e-3)
    assert abs(zero2[0] - losses(runs["zero2"])[0]) > 1e-5  # the base really is in 4 bits
    log = (runs["qlora_zero3_ckpt"] / "stderr.log").read_text()
    assert "28 linear layers in 4 bits (packed in float32; loaded in host memory, then partitioned by ZeRO-3" in log
    assert not (runs["qlora_zero3_ckpt"] / "model.safetensors").exists()
    assert (runs["qlora_zero3_ckpt"] / "adapter_model.safetensors").exists()


def test_merge_equals_base_plus_adapter(runs, base, tmp_path, capsys):
    result = merge(runs["zero3_ckpt"], tmp_path / "merged")
    assert result.returncode == 0, result.stderr[-3000:]
    ids = torch.randint(5, 60, (2, 48))
    with_adapter = logits(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), runs["zero3_ckpt"]), ids
    )
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids)
    assert (merged - with_adapter).abs().max() < 1e-5
    assert (merged - logits(AutoModelForCausalLM.from_pretrained(base), ids)).abs().max() > 1e-2  # it did change
    capsys.readouterr()
    again = merge_main(["--adapter", str(runs["zero3_ckpt"]), "--output", str(tmp_path / "merged")])  # refused
    assert again == 2 and "exists and is not empty" in capsys.readouterr().err  # in this process: nothing to load


def test_merge_from_a_zero3_checkpoint_without_adapter_files(runs, base, tmp_path):
    """DeepSpeed's zero_to_fp32 rebuilds the adapter from the ZeRO-3 shards: the same merged model."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(runs["zero3_ckpt"] / f"checkpoint-{STEPS}", checkpoint)
    (checkpoint / "adapter_model.safetensors").unlink()
    results = merge_side_by_side(
        (checkpoint, tmp_path / "from_shards"), (runs["zero3_ckpt"] / f"checkpoint-{STEPS}", tmp_path / "from_adapter")
    )
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    ids = torch.randint(5, 60, (2, 48))
    a = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "from_shards"), ids)
    b = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "from_adapter"), ids)
    assert (a - b).abs().max() < 1e-6


@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=pytest.mark.full)])
def test_resume_after_a_kill_under_zero3_matches(runs, base, tmp_path, method):
    """Killed while saving step 8 and rerun under ZeRO-3, without activation checkpointing: the losses of the
    uninterrupted run with checkpointing, bit for bit (checkpointing recomputes the same forward). [qlora] is in the
    `full` tier: the same kill and rerun of an adapter under ZeRO-3 as [lora], over a 4-bit base that is frozen and not
    in the checkpoint (QLoRA's own training under ZeRO-3 is per commit in `test_lora_trains_under_zero2_and_zero3_with_
    checkpointing`, its merge in `test_merge_of_a_qlora_adapter_is_the_full_precision_base_plus_adapter`)."""
    out = tmp_path / "out"
    extra = QLORA if method == "qlora" else []
    args = [*ARGS, "--model_name_or_path", str(base), "--output_dir", str(out), *ZERO3, *extra]
    killed = run_cli(args, nproc=2, env={KILL_DURING_SAVE_ENV: "8"})
    assert killed.returncode != 0 and (out / "checkpoint-4" / MARKER).exists()
    resumed = run_cli(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Resuming from" in resumed.stderr
    uninterrupted = runs["qlora_zero3_ckpt" if method == "qlora" else "zero3_ckpt"]
    assert losses(out) == losses(uninterrupted)


def test_merge_of_a_qlora_adapter_is_the_full_precision_base_plus_adapter(runs, base, tmp_path):
    """QLoRA trains on the 4-bit base; `sft.tools.merge` merges into the full-precision base (as PEFT's merge does)."""
    assert merge(runs["qlora_zero3_ckpt"], tmp_path / "merged").returncode == 0
    ids = torch.randint(5, 60, (2, 48))
    full = AutoModelForCausalLM.from_pretrained(base)
    with_adapter = logits(PeftModel.from_pretrained(full, runs["qlora_zero3_ckpt"]), ids)
    assert (logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids) - with_adapter).abs().max() < 1e-5
