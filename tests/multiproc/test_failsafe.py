"""Runs that go wrong end as failures (`sft.run.failsafe`), through the real launcher on 2 gloo processes."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from sft.core.retry import NONFINITE_EXIT_CODE
from sft.run import report
from sft.run.checkpoint import MARKER, RUN_MANIFEST
from sft.run.failsafe import OOM_TEST_ENV
from sft.run.metrics import samples_per_step
from tests.conftest import ROOT, cli_env, read_jsonl, run_cli, run_cli_side_by_side

# A learning rate of 1,000 (warmed up over 6 steps) drives the demo model's gradients to NaN within a few steps; a
# checkpoint at every step, all kept, to compare the weights before and after a skipped step
DIVERGES = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--max_steps", "12", "--save_steps", "1", "--logging_steps", "1",
    "--save_total_limit", "20", "--eval_strategy", "no", "--learning_rate", "1e3", "--warmup_steps", "6",
    "--max_length", "256", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
    "--max_nonfinite_steps", "2", "--report", "false",
]  # fmt: skip


def _stopped(result, out: Path) -> tuple[int, list[int]]:
    """Checks shared by both stops; returns (the step it stopped at, the skipped steps)."""
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == NONFINITE_EXIT_CODE == 3, result.stderr[-4000:]
    assert "Traceback" not in result.stderr and lines[-1].startswith("sft: error: step ")
    stopped = int(re.match(r"sft: error: step (\d+) was not finite", lines[-1]).group(1))
    assert "the run stopped there, the step not applied" in lines[-1] and "No final model was written" in lines[-1]
    assert not (out / "model.safetensors").exists()
    records = read_jsonl(out / "metrics.jsonl")
    skipped = [r["step"] for r in records if "nonfinite_skipped" in r]
    assert len(skipped) == 1 and skipped[0] < stopped  # max_nonfinite_steps 2: one skipped, stopped at the second
    assert f"Skipped before it: steps {skipped[0]}." in lines[-1]
    assert f"step {skipped[0]} was not finite" in result.stderr
    assert "skipped, not applied to the weights" in result.stderr
    assert records[-1]["stopped"] == "non-finite" and records[-1]["step"] == stopped
    logged = [r["step"] for r in records if "loss" in r]
    assert stopped >= 2 and logged == list(range(1, stopped))  # the stopping step is not in the log
    manifest = json.loads((out / RUN_MANIFEST).read_text())
    assert manifest["stopped"]["step"] == stopped and manifest["stopped"]["reason"] == "non-finite"
    assert manifest["stopped"]["message"] == lines[-1].removeprefix("sft: error: ")
    assert manifest["finished_step"] is None
    complete = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / MARKER).exists())
    assert complete == list(range(1, stopped)) and not (out / f"checkpoint-{stopped}").exists()
    assert f"The newest complete checkpoint, checkpoint-{max(complete)}, is from before it and intact" in lines[-1]
    weights = safetensors.torch.load_file(out / f"checkpoint-{max(complete)}" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    # the skipped step left the weights as they were: the checkpoint after it holds the bytes of the one before
    before, after = (out / f"checkpoint-{s}" / "model.safetensors" for s in (skipped[0] - 1, skipped[0]))
    assert before.read_bytes() == after.read_bytes()
    return stopped, skipped


def test_a_non_finite_step_is_skipped_then_stops_the_run_and_keeps_the_checkpoints(tmp_path):
    """ZeRO-2 on 2 processes under `sft train`, max_nonfinite_steps 2: the first step whose gradient norm is not
    finite is skipped (DeepSpeed's overflow check: the weights after it are those before it), the second stops every
    rank there, unlogged and unsaved; the command exits 3 (not 2, a configuration error) with one paragraph last; the
    stop is in metrics.jsonl and sft_run.json; no final model is written; the complete checkpoints are from before."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sft", "train", "--nproc-per-node", "2", *DIVERGES, "--output_dir", str(out)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    stopped, skipped = _stopped(result, out)
    page = report.write([out]).read_text()  # `sft report` on the stopped run
    assert f"<th>non-finite steps skipped</th><td>{skipped[0]}</td>" in page
    assert f"<th>stopped</th><td>at step {stopped}: non-finite (" in page
    assert re.search(r"gradient norm (nan|inf); 2 of 2 rank\(s\) saw it\)", result.stderr.strip().splitlines()[-1])


def test_without_deepspeed_a_skipped_step_is_not_applied_and_a_rerun_changes_no_checkpoint(tmp_path):
    """One process with `--deepspeed none`: sft itself drops the skipped step's gradients before the optimizer step.
    Run again (max_nonfinite_steps 1), the same command resumes from the newest checkpoint, stops at the same step
    with the same paragraph, and every file of the checkpoints it found is byte for byte as it was."""
    out = tmp_path / "out"
    args = [*DIVERGES, "--deepspeed", "none", "--output_dir", str(out)]
    first = run_cli(args, nproc=0)
    stopped, skipped = _stopped(first, out)
    files = {p: p.read_bytes() for p in sorted(out.glob("checkpoint-*/**/*")) if p.is_file()}
    again = run_cli([*args, "--max_nonfinite_steps", "1"], nproc=0)
    assert again.returncode == NONFINITE_EXIT_CODE, again.stderr[-3000:]
    assert f"Resuming from {out}/checkpoint-{stopped - 1}: step {stopped - 1}" in again.stderr
    assert again.stderr.strip().splitlines()[-1] == first.stderr.strip().splitlines()[-1].replace(
        f" Skipped before it: steps {skipped[0]}.", ""
    )  # the skipped step is before the checkpoint it resumed from
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(p for p in out.glob("checkpoint-*/**/*") if p.is_file()) == list(files)


# The demo at a global batch of 8 rows; `per_device_train_batch_size: auto` planned for an 80 GiB GPU takes 4 rows
# per process on 2 processes. SFT_TEST_OOM_ABOVE_MICRO_BATCH=1 raises CUDA's out-of-memory error in every micro
# batch above 1 row from step 3 on (checkpoint-2 is complete by then).
PLANNED = [
    "--config", str(ROOT / "recipes" / "demo.yaml"), "--max_steps", "8", "--save_steps", "2", "--logging_steps", "1",
    "--eval_strategy", "no", "--max_length", "256", "--global_batch_size", "8", "--plan_gpu_memory_gib", "80",
    "--trace_data", "true",
]  # fmt: skip
OOM = {OOM_TEST_ENV: "1"}


@pytest.fixture(scope="module")
def micro_batch_1(tmp_path_factory) -> Path:
    """The planned run with micro batch 1 from the start (ZeRO-2, the demo recipe's engine)."""
    small = tmp_path_factory.mktemp("small") / "out"
    reference = run_cli([*PLANNED, "--per_device_train_batch_size", "1", "--output_dir", str(small)], nproc=2)
    assert reference.returncode == 0, reference.stderr[-5000:]
    return small


@pytest.mark.parametrize("engine", ["deepspeed", pytest.param("fsdp2", marks=pytest.mark.full)])
def test_out_of_memory_with_sfts_micro_batch_is_retried_with_half_and_trains_the_same_samples(
    tmp_path, micro_batch_1, engine
):
    """`sft train` runs the command again with micro batch 4 -> 2 -> 1 (accumulation 1 -> 2 -> 4), each time from
    checkpoint-2, and the run trains the samples of a run with micro batch 1 from the start, step for step: under
    DeepSpeed (ZeRO-2) and under FSDP2 (its sharded checkpoint resumed with the new accumulation). `full` tier:
    [fsdp2], the same relaunch as [deepspeed] (`sft train`'s, whatever the engine) over an FSDP2 checkpoint, whose
    resume per commit is `test_fsdp2.py::test_fsdp2_resumes_bit_identically_after_a_kill` and
    `test_fsdp2_resumes_on_one_process`."""
    out, small = tmp_path / "retried", micro_batch_1
    sft_train = [sys.executable, "-m", "sft", "train", "--nproc-per-node", "2"]
    fsdp2 = ["--engine", "fsdp2", "--deepspeed", "none"] if engine == "fsdp2" else []
    result = subprocess.run(
        [*sft_train, *PLANNED, *fsdp2, "--per_device_train_batch_size", "auto", "--output_dir", str(out)],
        cwd=ROOT, env={**cli_env(), **OOM}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    log = result.stderr
    assert "data-parallel size 2 x micro batch 4 x accumulation 1 = global batch 8" in log
    for micro in (2, 1):
        assert f"running again with micro batch {micro} and the global batch of 8 rows kept" in log
        assert f"micro batch {micro} x accumulation {4 // micro} = global batch 8" in log
    assert log.count("Resuming from") == 2 and log.count(f"Resuming from {out}/checkpoint-2: step 2") == 2
    retries = [r["out_of_memory_retry"] for r in read_jsonl(out / "metrics.jsonl") if "out_of_memory_retry" in r]
    expected = [{"micro_batch": m, "accumulation": 4 // m, "global_batch": 8} for m in (2, 1)]
    assert retries == expected  # in metrics.jsonl (at the step each retry started from) and in sft_run.json
    manifest = json.loads((out / RUN_MANIFEST).read_text())
    assert manifest["out_of_memory_retries"] == [{"step": 2, **e} for e in expected] and manifest["finished_step"] == 8
    page = (out / "report" / "index.html").read_text()  # written at the end of the run
    assert "<th>out-of-memory retries</th><td>from step 2 at micro batch 2, from step 2 at micro batch 1</td>" in page
    assert ("FSDP2 (resharded" in log) == (engine == "fsdp2")
    a, b = (
        [r for r in read_jsonl(d / "metrics.jsonl") if "loss" in r] for d in (small, out)
    )  # fmt: skip
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    assert samples_per_step(small) == samples_per_step(out)
    for x, y in zip(a, b, strict=True):  # the same samples, summed in another order within each step
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x["step"], x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=1e-4), (x["step"], x["grad_norm"], y["grad_norm"])
    wa, wb = (safetensors.torch.load_file(d / "model.safetensors") for d in (small, out))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


def test_out_of_memory_elsewhere_says_what_to_change(tmp_path):
    """One process without a launcher (no retry there): with sft's micro batch the error names the flags of the
    rerun; with a micro batch set by hand, it is not changed and the error gives the plan's figures. Both exit 2."""
    plain = [*PLANNED, "--deepspeed", "none", "--global_batch_size", "4"]
    auto, by_hand = ([*plain, "--per_device_train_batch_size", m, "--output_dir", str(tmp_path / m)] for m in "a4")
    auto[auto.index("a")] = "auto"
    results = run_cli_side_by_side([(auto, 0), (by_hand, 0)], env=OOM)
    for result in results:
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert last.startswith("sft: error: out of memory at micro batch 4 x accumulation 1 (global batch 4)")
        assert "The memory plan for" in last and "GiB usable per GPU" in last and "ZeRO-3" in last
    auto_error, by_hand_error = (r.stderr.strip().splitlines()[-1] for r in results)
    assert "sft's choice" in auto_error
    assert "--per_device_train_batch_size 2 --global_batch_size 4 (it resumes from the newest" in auto_error
    assert "set by hand" in by_hand_error and "per_device_train_batch_size: auto" in by_hand_error
    for micro, result in zip("a4", results, strict=True):
        assert not (tmp_path / micro / "model.safetensors").exists()
        stopped = json.loads((tmp_path / micro / RUN_MANIFEST).read_text())["stopped"]
        assert stopped["reason"] == "out of memory" and stopped["step"] == 3  # the step it ran out of memory in
        assert stopped["message"] == result.stderr.strip().splitlines()[-1].removeprefix("sft: error: ")
        assert read_jsonl(tmp_path / micro / "metrics.jsonl")[-1]["stopped"] == "out of memory"


def test_under_fsdp2_a_non_finite_step_is_skipped_then_stops_the_run(tmp_path):
    """The same diverging demo under FSDP2 (`engine: fsdp2`, 2 processes): the first non-finite step is skipped (its
    gradients dropped: the weights' shards in the checkpoint after it are the bytes of the one before), the second
    stops every rank with exit code 3, no final model written."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sft", "train", "--nproc-per-node", "2", *DIVERGES, "--engine", "fsdp2",
         "--deepspeed", "none", "--output_dir", str(out)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == NONFINITE_EXIT_CODE, result.stderr[-4000:]
    lines = result.stderr.strip().splitlines()
    stopped = int(re.match(r"sft: error: step (\d+) was not finite", lines[-1]).group(1))
    skipped = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "nonfinite_skipped" in r]
    assert len(skipped) == 1 and 1 < skipped[0] < stopped and not (out / "model.safetensors").exists()
    shards = [sorted((out / f"checkpoint-{s}" / "pytorch_model_fsdp_0").glob("*.distcp")) for s in (skipped[0] - 1,
              skipped[0])]  # fmt: skip
    assert len(shards[0]) == 2 and [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]
