"""eval/run.py (lm-eval's simple_evaluate) on sft's output directories, with the local task.

README's `sft eval` and `lm_eval` lines run as written in the README walk (`readme_walk`), on the demo it trains;
this module reads that evaluation instead of training and evaluating a demo of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from sft.tools import evaluation
from tests.conftest import ROOT, cli_env, read_jsonl
from tests.helpers import assert_ok


@pytest.fixture(scope="module")
def untrained(saved_demo_model) -> Path:
    return saved_demo_model


def evaluate(model: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**cli_env(), "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "eval/run.py", "--model", str(model), "--tasks", "sft_demo", "--batch-size", "16", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip  (no --device: the CPU is found, as in README)
    files = sorted((model / "eval").glob("results_*.json")) if (model / "eval").exists() else []
    return result, json.loads(files[-1].read_text()) if files else None


def test_eval_beats_the_untrained_model_and_logs_to_the_runs_wandb(readme_walk, tensorboard_wandb_run, untrained):
    """README's demo (its `sft eval`, from the walk) against the untrained model on all of `sft_demo`; an evaluation
    of a run that logged to wandb lands in that run (a second evaluation's files go beside the first:
    tests/test_cli.py)."""
    from concurrent.futures import ThreadPoolExecutor

    trained = readme_walk.demo
    files = sorted((trained / "eval").glob("results_*.json"))
    assert files, "the README walk's `sft eval` wrote no results (see test_readme.py)"
    results = json.loads(files[0].read_text())
    logged = tensorboard_wandb_run.out
    assert tensorboard_wandb_run.result.returncode == 0, tensorboard_wandb_run.result.stderr[-4000:]
    with ThreadPoolExecutor(max_workers=2) as pool:  # one process each: side by side on two cores
        (done, _), (_, before) = pool.map(lambda job: evaluate(*job), [(logged, "--limit", "8"), (untrained,)])
    assert done.returncode == 0, done.stderr[-4000:]
    accuracy = results["results"]["sft_demo"]["exact_match,none"]
    untrained_accuracy = before["results"]["sft_demo"]["exact_match,none"]
    print(f"sft_demo exact match: trained {accuracy:.3f}, untrained {untrained_accuracy:.3f}")
    assert accuracy >= untrained_accuracy + 0.08
    assert list((trained / "eval").glob("results_*.md"))[0].read_text().count("sft_demo") == 1
    run_id = json.loads((logged / "wandb_run.json").read_text())["id"]
    assert f"logged to wandb run {run_id}" in done.stdout
    records = list((logged / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert records and b"eval/sft_demo/exact_match" in records[0].read_bytes()  # offline: the run's record file
    assert len(list((logged / "eval").glob("results_*.json"))) == 1


def test_an_adapter_is_merged_then_evaluated(untrained, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(untrained),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))  # fmt: skip
    model.save_pretrained(adapter)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(untrained / f, adapter)
    done, results = evaluate(adapter, "--limit", "8")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (adapter / "merged" / "config.json").exists() and results["model"] == str(adapter / "merged")
    capsys.readouterr()
    code = evaluation.main(["--model", str(tmp_path / "missing"), "--tasks", "sft_demo"])  # refused: in this process
    assert code == 2 and "no such directory" in capsys.readouterr().err  # an exception would fail the test here


def test_single_process_with_tensorboard_and_wandb_offline(tensorboard_wandb_run):
    """The run of the `tensorboard_wandb_run` fixture (tests/multiproc/conftest.py; the evaluation test above logs
    into its wandb run): one process that `sft train` started without a launcher, ZeRO-2, 6 steps, logging every 2."""
    out, result = tensorboard_wandb_run.out, tensorboard_wandb_run.result
    assert_ok(result)
    assert "Parallel sizes: 1 process: data-parallel 1" in result.stderr
    assert "Starting the DeepSpeed engine (ZeRO-2)" in result.stderr and "mpi4py" not in result.stderr
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    events = list((out / "runs").rglob("events.out.tfevents.*"))
    assert events, "tensorboard wrote no event file"
    board = EventAccumulator(str(events[0].parent))
    board.Reload()
    for key in ("tokens_per_second_per_gpu", "tflops_per_gpu", "mfu", "num_flops"):
        logged = [(e.step, e.value) for e in board.Scalars(f"train/{key}")]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key
    runs = list((tensorboard_wandb_run.wandb_dir / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), "wandb wrote no offline run"
    record = next(runs[0].glob("*.wandb")).read_bytes()
    assert all(key in record for key in (b"train/mfu", b"train/tflops_per_gpu", b"train/tokens_per_second_per_gpu"))
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4
