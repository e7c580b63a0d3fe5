"""End-to-end runs of the real CLI on the demo: one process, and torchrun with 2 gloo processes under ZeRO-2/ZeRO-3."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import DEMO, ROOT, cli_env, read_jsonl, run_cli
from tests.helpers import assert_ok, kill_after_checkpoint

STEPS, LOG_EVERY = 40, 5
DEMO_MODEL = ROOT / "recipes" / "demo" / "model"


def train_losses(out) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    """The demo model with one fixed random init, saved: ZeRO-3 initialises inside `zero.Init` with its own RNG
    order, so comparing stages needs the same starting weights."""
    path = tmp_path_factory.mktemp("init")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL)).save_pretrained(path)
    AutoTokenizer.from_pretrained(DEMO_MODEL).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, init_model):
    """The demo for STEPS steps under ZeRO-2 and ZeRO-3, 2 processes each; same weights, seed and data."""
    runs = {}
    for stage in (2, 3):
        out = tmp_path_factory.mktemp(f"zero{stage}") / "out"
        result = run_cli(
            DEMO
            + ["--model_name_or_path", str(init_model), "--from_scratch", "false"]
            + ["--output_dir", str(out), "--deepspeed", f"ds_configs/zero{stage}.json", "--max_steps", str(STEPS)]
            + ["--logging_steps", str(LOG_EVERY), "--eval_strategy", "steps", "--eval_steps", str(STEPS)]
            + ["--trace_data", "true"],
            nproc=2,
            env={"TORCH_EXTENSIONS_DIR": str(out.parent / "torch_extensions")},  # where DeepSpeed would build its ops
        )
        assert_ok(result)
        (out.parent / "console.txt").write_text(result.stdout + result.stderr)  # what the user saw (not in out/)
        runs[stage] = out
    runs["args"] = lambda stage: (
        DEMO
        + ["--model_name_or_path", str(init_model), "--from_scratch", "false"]
        + ["--output_dir", str(runs[stage]), "--deepspeed", f"ds_configs/zero{stage}.json", "--max_steps", str(STEPS)]
    )
    return runs


# What a 40-step 2-process demo run may print (stdout + stderr, torchrun's banner included). Measured after
# sft.core.logs: 26 lines (8 of them training/eval logs); before it a 60-step ZeRO-3 demo printed 8,329 lines.
CONSOLE_LINES_BOUND = 40


@pytest.mark.parametrize("stage", [2, 3])
def test_console_is_short_and_plain(zero_runs, stage):
    """Under a bound of lines, no per-call deprecation warnings, no op compiled or loaded by DeepSpeed (its CPU
    shared-memory all-reduce, which training never calls), and no progress-bar carriage returns or cursor escape
    codes in a log that is not a terminal."""
    text = (zero_runs[stage].parent / "console.txt").read_text()
    lines = text.splitlines()
    assert len(lines) <= CONSOLE_LINES_BOUND, "\n".join(lines)
    assert "FutureWarning:" not in text and "return func(" not in text
    assert "\x1b[" not in text and "\r" not in text
    assert "built successfully" not in text and "Setting accelerator to CPU" not in text
    # DeepSpeed's shared-memory all-reduce op neither built nor loaded (sft.engines.deepspeed.zero.skip_cpu_...)
    assert not (zero_runs[stage].parent / "torch_extensions").exists()
    assert sum("'loss'" in line for line in lines) == STEPS // LOG_EVERY  # each training log is one line
    assert f"Starting the DeepSpeed engine (ZeRO-{stage})" in text
    if stage == 3:
        assert "inside deepspeed.zero.Init" in text


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_demo_learns_and_logs_every_step(zero_runs, stage):
    out = zero_runs[stage]
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))  # one line per logged step
    for r in train:
        assert {"loss", "learning_rate", "grad_norm", "num_tokens", "epoch"} <= set(r)
        assert {"tokens_per_step", "tokens_per_second_per_gpu", "packing_efficiency"} <= set(r)
        assert 0.5 < r["packing_efficiency"] <= 1.0
    tokens = [r["num_tokens"] for r in train]
    assert tokens == sorted(tokens) and tokens[0] > 0
    for before, after in zip(train, train[1:], strict=False):  # real tokens of all ranks per optimizer step
        assert after["tokens_per_step"] == (after["num_tokens"] - before["num_tokens"]) / LOG_EVERY
    assert [r["step"] for r in records if "eval_loss" in r] == [STEPS]
    losses = train_losses(out)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("stage", [2, 3])
def test_each_rank_sees_different_samples(zero_runs, stage):
    trace = {rank: read_jsonl(zero_runs[stage] / "data_trace" / f"rank{rank}.jsonl") for rank in (0, 1)}
    assert [t["step"] for t in trace[0]] == [t["step"] for t in trace[1]] == list(range(STEPS))
    for a, b in zip(trace[0], trace[1], strict=True):
        assert a["sha1"] != b["sha1"], f"both ranks trained on the same batch at step {a['step']}"
    hashes = [t["sha1"] for t in trace[0] + trace[1]]
    assert len(set(hashes)) == len(hashes)  # within one epoch, no micro-batch is seen twice


@pytest.mark.parametrize("stage", [2, 3])
def test_output_loads_and_generates(zero_runs, stage):
    out = zero_runs[stage]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(p.numel() > 0 and torch.isfinite(p).all() for p in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "repeat: abc"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_zero2_and_zero3_agree(zero_runs):
    """Same seed, data and global batch: ZeRO-3 sharding changes summation order only."""
    z2, z3 = train_losses(zero_runs[2]), train_losses(zero_runs[3])
    assert len(z2) == len(z3)
    flops = [[r["num_flops"] for r in read_jsonl(zero_runs[s] / "metrics.jsonl") if "loss" in r] for s in (2, 3)]
    assert flops[0] == flops[1] and flops[0][0] > 0  # ZeRO-3's partitioned weights count as whole layers
    for a, b in zip(z2, z3, strict=True):
        assert math.isclose(a, b, rel_tol=1e-3), (z2, z3)


def test_rerun_of_a_finished_run_under_sft_train_exits_2_with_the_error_last(zero_runs):
    """`sft train --nproc-per-node 2` (torchrun's agent as a library): a configuration error in the workers is one
    paragraph, printed last, and exit code 2, not torchrun's exit 1 under its ChildFailedError report."""
    result = subprocess.run(
        [sys.executable, "-m", "sft", "train", "--nproc-per-node", "2", *zero_runs["args"](2)],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines[-1].startswith("sft: error: `output_dir`") and f"holds a finished sft run (step {STEPS}" in lines[-1]
    assert f"raise max_steps or num_train_epochs: it then resumes from checkpoint-{STEPS}" in lines[-1]
    assert sum(line.startswith("sft: error:") for line in lines) == 1
    assert len(lines) <= 4 and "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr


def test_the_run_ends_with_its_report_and_data_figures(zero_runs, tmp_path):
    """The report written at the end (`sft.run.report`): every plot a PNG that decodes and is inline in index.html,
    the plotted values those of metrics.jsonl; the data figures of the start (`sft.data.stats`) agree with the epochs
    the trainer counted; two runs overlay in one report."""
    import base64
    import json

    from matplotlib.image import imread

    out = zero_runs[2]
    pngs = sorted((out / "report").glob("*.png"))
    assert {p.stem for p in pngs} == {"loss", "learning_rate", "grad_norm", "tokens_per_second", "packing", "lengths"}
    page = (out / "report" / "index.html").read_text()
    for png in pngs:
        assert imread(png).shape[0] > 300
        assert base64.b64encode(png.read_bytes()).decode() in page  # inline: the page is one file
    plotted = json.loads((out / "report" / "plotted.json").read_text())
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert plotted["loss"]["train"] == [[r["step"] for r in train], [r["loss"] for r in train]]
    assert plotted["loss"]["eval"][1] == [r["eval_loss"] for r in records if "eval_loss" in r]
    assert plotted["grad_norm"]["out"][1] == [r["grad_norm"] for r in train]
    assert "resumed at" not in plotted["loss"]
    assert f"<td>{train[-1]['step']}</td>" in page and f"{train[-1]['num_tokens']:,.0f}" in page
    stats = json.loads((out / "data_stats.json").read_text())
    assert train[0]["epoch"] == pytest.approx(LOG_EVERY / stats["steps_per_epoch"])
    assert sum(plotted["lengths"]["out"][1]) == stats["records"]
    # two runs overlaid, named apart (both directories are called `out`)
    args = [sys.executable, "-m", "sft", "report", str(zero_runs[2]), str(zero_runs[3]), "--out", str(tmp_path)]
    both = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=cli_env())
    assert both.returncode == 0, both.stderr
    overlay = json.loads((tmp_path / "plotted.json").read_text())
    names = [f"{p.parent.name}/out" for p in (zero_runs[2], zero_runs[3])]
    assert sorted(overlay["grad_norm"]) == sorted(names)
    assert overlay["grad_norm"][names[1]][1] == [r["grad_norm"] for r in read_jsonl(zero_runs[3] / "metrics.jsonl")
                                                 if "loss" in r]  # fmt: skip


def test_a_bad_record_found_by_one_rank_stops_every_rank_with_its_paragraph(tmp_path):
    """Under torchrun with 2 processes the main process checks the data first while rank 1 waits in a barrier; a bad
    record it finds stops both ranks with exit code 2 and the one paragraph, and no rank prints a traceback (before,
    rank 1 waited until gloo's "Connection closed by peer" ended it with one;
    `sft.parallel.distributed.main_first_together`).
    """
    import json

    import yaml

    demo_data = ROOT / "recipes" / "demo" / "data" / "train.jsonl"
    records = [json.loads(line) for line in demo_data.read_text().splitlines()[:200]]
    records.insert(150, {"messages": "repeat: abc"})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    recipe.update(output_dir=str(tmp_path / "out"), datasets=[{"path": str(data)}], eval_datasets=[])
    recipe["eval_strategy"] = "no"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_cli(["--config", str(path)], nproc=2, tmp_path=tmp_path, timeout=300, fresh=True)  # torchrun's report
    assert result.returncode != 0
    assert f"sft: error: {data}: record 150: `messages` must be a list of turns, got str" in result.stderr
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr, result.stderr
    # torchrun's summary: each rank exited 2, but one whose exit the agent had not seen before the other's is stopped
    # by its SIGTERM (-15; both ranks had the paragraph by then), which one depends on the cores' timing
    codes = re.findall(r"exitcode  : (-?\d+) ", result.stderr)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, result.stderr[-3000:]


DECIDED_ONCE_PROBE = r"""
import atexit, json, sys
from sft.engines.deepspeed import config as ds_config
from sft.model import architectures

calls = {"architectures.of": 0}
real_of = architectures.of
def counted_of(*args, **kwargs):
    calls["architectures.of"] += 1
    return real_of(*args, **kwargs)
architectures.of = counted_of
def report():
    calls["json_parsed"] = ds_config._parse_file.cache_info().misses
    print("DECIDED " + json.dumps(calls), flush=True)
atexit.register(report)
sys.argv = ["sft/train.py", *sys.argv[1:]]
from sft.train import run
run()
"""


def test_a_run_decides_once(tmp_path):
    """One process, ZeRO-2, the demo for 2 steps: the model's Architecture is worked out once (`architectures.of`,
    in the plan; the model build, the fingerprint, the FLOP count and sequence parallelism's checks read the plan's),
    and the DeepSpeed JSON is parsed once (`sft.engines.deepspeed.config._parse_file`); the run trains."""
    out = tmp_path / "out"
    args = [*DEMO, "--output_dir", str(out), "--max_steps", "2", "--eval_strategy", "no", "--logging_steps", "1"]
    result = subprocess.run([sys.executable, "-c", DECIDED_ONCE_PROBE, *args], cwd=ROOT, env=cli_env(tmp_path),
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert_ok(result)
    counts = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("DECIDED "))[8:])
    assert counts == {"architectures.of": 1, "json_parsed": 1}, counts
    assert len(train_losses(out)) == 2


def test_eight_bit_adam_keeps_its_moments_in_8_bit_under_zero2_and_resumes_exactly(tmp_path, init_model):
    """`optim: adamw_torch_8bit` (torchao's AdamW8bit) under ZeRO-2 on 2 processes, 4 steps: the plan counts Adam's
    moments at 2 + 8/256 bytes a parameter, and each rank's checkpoint holds them as torchao's 8-bit blocks for ZeRO's
    flat partition of the weights (the small partition of norms stays fp32, as torchao does below 4,096 elements).
    SIGKILLed after checkpoint-2 and run again, the run's losses and final weights equal the uninterrupted run's
    (the 8-bit states load as they were saved)."""
    args = [
        "--config", str(ROOT / "recipes" / "demo.yaml"), "--from_scratch", "false", "--model_name_or_path",
        str(init_model), "--max_steps", "4", "--max_length", "256", "--per_device_train_batch_size", "1",
        "--global_batch_size", "4", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "steps",
        "--save_steps", "2", "--optim", "adamw_torch_8bit", "--report", "false", "--plan_gpu_memory_gib", "80",
    ]  # fmt: skip
    out, again = tmp_path / "out", tmp_path / "again"
    result = run_cli([*args, "--output_dir", str(out)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "full, 8-bit Adam moments" in result.stderr
    assert "optimizer: fp32 master + Adam moments (8-bit)" in result.stderr
    for states in sorted((out / "checkpoint-2").glob("*/*optim_states.pt")):
        saved = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        flat = [p.numel() for p in saved["single_partition_of_fp32_groups"]]
        moments = saved["base_optimizer_state"]["state"]
        kinds = {i: type(moments[i]["exp_avg"]).__name__ for i in range(len(flat))}
        assert kinds == {i: "OptimState8bit" if n >= 4096 else "Tensor" for i, n in enumerate(flat)}
        assert "OptimState8bit" in kinds.values()
    kill_after_checkpoint([*args, "--output_dir", str(again)], again, step=2)
    resumed = run_cli([*args, "--output_dir", str(again)], nproc=2)
    assert resumed.returncode == 0 and "Resuming from" in resumed.stderr, resumed.stderr[-3000:]
    ref, res = ([(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(o / "metrics.jsonl") if "loss" in r]
                for o in (out, again))  # fmt: skip
    assert [s for s, _, _ in ref] == [1, 2, 3, 4] and all(math.isfinite(x) for _, x, _ in ref)
    assert res == ref
    a, b = (safetensors.torch.load_file(o / "model.safetensors") for o in (out, again))
    assert all(torch.equal(a[k], b[k]) for k in a)
