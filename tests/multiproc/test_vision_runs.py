"""Image+text runs of the vision-language demo on 2 processes from one saved random init (recipes/demo-vlm.yaml,
12 steps, a checkpoint every 4): SIGKILLed after checkpoint-4 and run again, bit-identical to the uninterrupted run,
and resumed by one process the same rows and schedule, the losses to the summation order; under ZeRO-3 and FSDP2 the
same losses as under ZeRO-2, and the saved model loads and generates."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, read_jsonl, run_cli
from tests.helpers import kill_after_checkpoint, losses, merge

STEPS = 12
DEMO = ROOT / "recipes" / "demo-vlm"


@pytest.fixture(scope="module")
def init_vlm(tmp_path_factory) -> Path:
    """The demo's Qwen2.5-VL with one random init on disk (ZeRO-3 would initialise inside `zero.Init` in its own RNG
    order), with its tokenizer and image processor."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = tmp_path_factory.mktemp("init-vlm")
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(DEMO / "model")).save_pretrained(path)
    AutoTokenizer.from_pretrained(DEMO / "model").save_pretrained(path)
    AutoImageProcessor.from_pretrained(DEMO / "model").save_pretrained(path)
    return path


def args_for(model: Path, out: Path, stage: int) -> list[str]:
    return [
        "--config", str(ROOT / "recipes" / "demo-vlm.yaml"), "--model_name_or_path", str(model), "--from_scratch",
        "false", "--output_dir", str(out), "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_strategy", "no",
        "--save_strategy", "steps", "--save_steps", "4", "--report", "false", "--deepspeed",
        f"ds_configs/zero{stage}.json",
    ]  # fmt: skip


def test_a_killed_image_text_run_resumes_bit_identically_and_zero3_trains_as_zero2(init_vlm, tmp_path):
    from transformers import AutoModelForImageTextToText

    names = ("reference", "killed", "zero3", "fewer", "fsdp2")
    reference, killed, zero3, fewer, fsdp2 = (tmp_path / name for name in names)
    for out, stage in ((reference, 2), (zero3, 3)):
        result = run_cli(args_for(init_vlm, out, stage), nproc=2)
        assert result.returncode == 0, result.stderr[-5000:]
    fsdp2_args = [*args_for(init_vlm, fsdp2, 2)[:-2], "--engine", "fsdp2", "--deepspeed", "none"]
    result = run_cli([*fsdp2_args, "--save_strategy", "no"], nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    kill_after_checkpoint(args_for(init_vlm, killed, 2), killed, step=4)
    shutil.copytree(killed, fewer)  # the same checkpoint, resumed below by one process
    result = run_cli(args_for(init_vlm, killed, 2), nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Resuming from" in result.stderr and "checkpoint-4" in result.stderr

    assert len(losses(reference)) == STEPS and losses(killed) == losses(reference)  # bit for bit, every step
    result = run_cli(args_for(init_vlm, fewer, 2), nproc=0)  # `python sft/train.py`: one process
    assert result.returncode == 0, result.stderr[-5000:]
    assert "on 1 processes (was 2): global batch 4 " in result.stderr  # the global batch kept: accumulation 2
    ref, one = read_jsonl(reference / "metrics.jsonl"), read_jsonl(fewer / "metrics.jsonl")
    for key in ("learning_rate", "num_tokens"):  # the same rows in every step, the same schedule
        assert [r[key] for r in ref if "loss" in r] == [r[key] for r in one if "loss" in r], key
    assert losses(fewer)[:4] == losses(reference)[:4]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses(fewer), losses(reference), strict=True))
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses(zero3), losses(reference), strict=True))
    norms = [[r["grad_norm"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] for out in (reference, fsdp2)]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses(fsdp2), losses(reference), strict=True))
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(*norms, strict=True))  # the output head's too
    assert sum(losses(reference)[-3:]) < sum(losses(reference)[:3])
    model = AutoModelForImageTextToText.from_pretrained(zero3)  # ZeRO-3's shards gathered into a model directory
    assert (zero3 / "preprocessor_config.json").is_file()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([[5, 20, 21]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


# the full tier: repeats, per family, of the kill and resume the demo's family proves per commit (above)
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.full) for f in
                                        ("qwen2_vl", "qwen3_vl", "gemma3", "gemma4", "smolvlm")])  # fmt: skip
def other_family(request, tmp_path_factory) -> tuple[str, Path]:
    """The demo's model for another family (`sft.tools.demo_vlm.write_model`: the M-RoPE ones, Gemma 3 packed by
    sft's masks, Gemma 4 too, SmolVLM in tiles), one random init on disk."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft.tools import demo_vlm

    path = demo_vlm.write_model(tmp_path_factory.mktemp(request.param), request.param)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    return request.param, path


def test_the_other_families_resume_bit_identically_and_save_under_zero3(other_family, tmp_path):
    """Qwen2-VL, Qwen3-VL, Gemma 3, Gemma 4 and SmolVLM on the demo's data under ZeRO-3 (2 processes, 8 steps):
    SIGKILLed after checkpoint-4 and run again, bit-identical to the uninterrupted run; the loss falls, the saved model
    (ZeRO-3's shards gathered) loads with its family's class. (ZeRO-3 against ZeRO-2 on the demo's family above.)

    Full tier: its per-commit counterpart is
    `test_a_killed_image_text_run_resumes_bit_identically_and_zero3_trains_as_zero2` (the same kill and resume under
    ZeRO-3, on the demo's image+text family); each family's packing is proven per commit in-process
    (tests/test_vision_packing.py, test_vision_run.py)."""
    from transformers import AutoModelForImageTextToText

    family, model = other_family
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    steps = ["--max_steps", "8"]
    result = run_cli([*args_for(model, reference, 3), *steps], nproc=2)
    assert result.returncode == 0, result.stderr[-5000:]
    kill_after_checkpoint([*args_for(model, killed, 3), *steps], killed, step=4)
    result = run_cli([*args_for(model, killed, 3), *steps], nproc=2)
    assert result.returncode == 0 and "checkpoint-4" in result.stderr, result.stderr[-5000:]
    assert len(losses(reference)) == 8 and losses(killed) == losses(reference), family  # bit for bit
    assert sum(losses(reference)[-2:]) < sum(losses(reference)[:2])
    loaded = AutoModelForImageTextToText.from_pretrained(reference)
    assert loaded.config.model_type == family and (reference / "preprocessor_config.json").is_file()


def test_lora_on_the_language_model_of_an_image_text_run_trains_and_merges(init_vlm, tmp_path):
    """`use_peft` on the demo's model (one process, 8 steps): adapters on the language model's projections only
    (PEFT knows no default targets for these families; the encoder stays frozen), and `sft merge` writes a model
    directory, with its image processor, whose language model changed and whose vision encoder did not."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out, merged = tmp_path / "lora", tmp_path / "merged"
    args = args_for(init_vlm, out, 2)[:-2] + ["--deepspeed", "none", "--use_peft", "true", "--lora_r", "8",
                                               "--max_steps", "8", "--save_strategy", "no"]  # fmt: skip
    result = run_cli(args, nproc=0)
    assert result.returncode == 0, result.stderr[-5000:]
    keys = list(load_file(out / "adapter_model.safetensors"))
    assert keys and all(".language_model." in k and ".lora_" in k for k in keys), keys[:3]
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # fmt: skip
    result = merge(out, merged)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (merged / "preprocessor_config.json").is_file()
    before, after = (AutoModelForImageTextToText.from_pretrained(p) for p in (init_vlm, merged))
    weights = dict(after.named_parameters())
    changed = {n for n, p in before.named_parameters() if not torch.equal(p, weights[n].to(p.dtype))}
    assert changed and all(".language_model." in n for n in changed), sorted(changed)[:3]
