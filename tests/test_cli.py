"""The command line a new user meets: `--help` and `--help-all`, `sft train`'s launcher flags, the planner offline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sft.config import HELP_GROUPS, make_parser
from sft.errors import ConfigError
from sft.model import shapes
from sft.parallel import launch
from sft.plan import cli as plan_cli
from tests.conftest import ROOT, cli_env
from tests.conftest import run_cli_in_process as run_cli
from tests.helpers import demo_args


def test_help_is_short_grouped_and_names_config():
    result = run_cli(["--help"])
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and result.stderr == ""
    assert lines[0].startswith("usage: python sft/train.py --config RECIPE.yaml")
    assert len(lines) <= 70
    fields = {action.dest for action in make_parser()._actions}
    shown = [name for group in HELP_GROUPS.values() for name in group]
    assert 30 <= len(shown) <= 45 and set(shown) <= fields  # every line is a real field
    for group, names in HELP_GROUPS.items():
        assert f"{group}:" in lines
        assert all(any(line.startswith(f"  --{name} ") for line in lines) for name in names)
    assert "--nproc-per-node" in result.stdout and "--help-all" in lines[-1]


def test_help_all_lists_every_field():
    result = run_cli(["--help-all"])
    assert result.returncode == 0
    fields = {action.dest for action in make_parser()._actions} - {"help"}
    assert all(f"--{name}" in result.stdout for name in fields) and len(fields) > 150


def test_help_from_the_script_and_the_command(capsys):
    """`python sft/train.py --help` and `sft train --help` (their entry points, in this process: the script as a
    process runs in every multi-process test) print the short help and exit 0 without starting anything."""
    import torch.distributed

    from sft import cli, train

    for entry in (lambda: train.run(["--help"]), lambda: cli.main(["train", "--help"]),
                  lambda: train.run(["--nproc-per-node", "2", "--help"])):  # fmt: skip
        with pytest.raises(SystemExit) as leaving:
            entry()
        out = capsys.readouterr().out
        assert leaving.value.code == 0 and out.startswith("usage: python sft/train.py --config"), out[:200]
        assert len(out.splitlines()) <= 70
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ  # no process group, no launch


def test_the_entry_point_reads_a_recipe_only_where_the_arguments_name_one():
    """`sft.train.run` reads the recipe before importing any library (`read_recipe_in`): none named, every field is on
    the command line and nothing is read (it was an AttributeError); a named one is read, a missing one refused."""
    from sft.core.recipe import read_recipe_in

    assert read_recipe_in(["--model_name_or_path", "recipes/demo/model", "--output_dir", "out"]) is None
    assert read_recipe_in(["--config", str(ROOT / "recipes" / "demo.yaml")])["packing"] is True
    with pytest.raises(ConfigError, match="`--config`: no such file 'nope.yaml'"):
        read_recipe_in(["--config", "nope.yaml"])


def test_launcher_flags_are_split_from_training_arguments():
    launcher, rest = launch.split_args(
        ["--nproc-per-node", "2", "--config", "r.yaml", "--nproc_per_node=4", "--max-restarts", "1", "--lr", "x"]
    )
    assert launcher == ["--nproc-per-node", "2", "--nproc-per-node", "4", "--max-restarts", "1"]
    assert rest == ["--config", "r.yaml", "--lr", "x"]
    with pytest.raises(ConfigError, match="`--nproc-per-node` needs a value"):
        launch.split_args(["--nproc-per-node", "--config", "r.yaml"])


def test_launcher_flags_inside_a_worker_are_refused():
    result = subprocess.run(
        [sys.executable, "-m", "sft", "train", "--nproc-per-node", "2", "--config", "recipes/demo.yaml"],
        cwd=ROOT, env={**cli_env(), "LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "this already is one" in result.stderr


# Published parameter counts (model cards) of the configs shipped for the planner
PUBLISHED_BILLIONS = {
    "meta-llama/Llama-3.2-1B": 1.24, "meta-llama/Llama-3.2-3B": 3.21, "meta-llama/Llama-3.1-8B": 8.03,
    "meta-llama/Llama-3.1-70B": 70.6, "Qwen/Qwen2.5-7B": 7.61, "Qwen/Qwen2.5-72B": 72.7, "Qwen/Qwen3-8B": 8.2,
    "Qwen/Qwen3-32B": 32.8, "mistralai/Mistral-7B-v0.3": 7.25, "google/gemma-2-9b": 9.24,
    "google/gemma-3-4b": 3.88, "allenai/OLMo-2-1124-7B": 7.30, "microsoft/Phi-3-mini-4k-instruct": 3.82,
    "Qwen/Qwen2.5-VL-7B": 8.29,  # its vision encoder included
}  # fmt: skip


@pytest.mark.parametrize("model", sorted(PUBLISHED_BILLIONS))
def test_shipped_configs_have_the_published_sizes(model, monkeypatch):
    monkeypatch.setattr(shapes, "_hub_reachable", lambda: pytest.fail("a shipped model must not touch the hub"))
    shape = shapes.load_shape(model)
    assert shape.n_params / 1e9 == pytest.approx(PUBLISHED_BILLIONS[model], rel=0.01)
    assert shapes.load_shape(model.upper() + "-Instruct").n_params == shape.n_params  # any case, -Instruct variants


def test_planner_offline_fails_fast_naming_what_it_knows(capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert plan_cli.main(["--model", "some-org/some-model"]) == 2
    err = capsys.readouterr().err
    assert "hub id sft has no config for" in err and "HF_HUB_OFFLINE is set" in err
    assert "meta-llama/Llama-3.1-8B" in err  # the shipped ones are named
    assert plan_cli.main(["--model", "not-a-path-or-id"]) == 2
    assert "neither a file, a directory nor a hub id" in capsys.readouterr().err


def test_an_image_text_model_is_planned_offline_and_a_text_only_entry_says_so(capsys, monkeypatch):
    """`sft plan` knows Qwen2.5-VL-7B offline (its frozen encoder counted apart) and ranks settings for it on one
    80 GB card; Gemma 3's shipped entries are its text model, which the plan says (the published checkpoints are
    image+text), where a text family's is silent."""
    monkeypatch.setattr(shapes, "_hub_reachable", lambda: pytest.fail("a shipped model must not touch the hub"))
    args = ["--gpus", "1", "--gpu-memory", "79.18", "--seq-len", "4096"]
    plan_cli.main(["--model", "Qwen/Qwen2.5-VL-7B-Instruct", *args, "--suggest"])
    out = capsys.readouterr().out
    assert out.startswith("Qwen/Qwen2.5-VL-7B-Instruct: qwen2_5_vl_text, 8.292B parameters (0.632B in the frozen")
    assert "fastest setting that fits:" in out and "| 1 | " in out and "Planned as a text model" not in out
    plan_cli.main(["--model", "google/gemma-3-12b-it", *args])
    assert "Planned as a text model: the published checkpoint is image+text" in capsys.readouterr().out
    plan_cli.main(["--model", "meta-llama/Llama-3.1-8B", *args])
    assert "Planned as a text model" not in capsys.readouterr().out
    assert "_text_only" not in shapes.shipped_config("google/gemma-3-12b")  # a note, not a config field


def test_suggest_without_a_gpu_answers_for_common_sizes(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "detected_gpu_memory", lambda: None)  # the name sft plan calls
    args = ["--model", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--zero", "3", "--seq-len", "4096"]
    assert plan_cli.main([*args, "--micro-batch", "2", "--liger", "--suggest"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2:4].strip().isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == list(plan_cli.COMMON_GPU_GIB)
    assert "does NOT fit" in rows[0] and "| 141 | fits |" in rows[-1]
    peaks = [float(row.split("|")[4]) for row in rows]
    assert all(peak <= gib * 0.9 for peak, gib in zip(peaks, plan_cli.COMMON_GPU_GIB, strict=True))
    assert plan_cli.main(args) == 0 and "add --suggest for a table" in capsys.readouterr().out


def test_harmless_library_messages_are_dropped_and_the_rest_kept(tmp_path, caplog):
    """`sft.core.logs.setup` drops the messages named in `QUIET_MESSAGES` (torch's traceback for every Liger Triton
    kernel it compiles: thousands of lines in a compiled FP8 run) and nothing else of those loggers."""
    import logging

    from sft.core import logs

    _, _, args, _ = demo_args(tmp_path)
    logs.setup(args)
    logs.setup(args)  # twice: one filter per message
    dynamo = logging.getLogger("torch._dynamo")
    assert sum(isinstance(f, logs._DropMessages) for f in dynamo.filters) == 1
    with caplog.at_level(logging.WARNING):
        dynamo.warning("Encountered an exception in identify_mutated_tensors, assuming every input is mutated")
        dynamo.warning("Encountered an exception in identify_accessed_tensors, assuming every input is mutated")
        dynamo.warning("torch._dynamo hit config.recompile_limit (8)")
        logging.getLogger("liger_kernel.backends.registry").warning("Backend impl 'x' could not be imported")
    assert [r.getMessage() for r in caplog.records] == ["torch._dynamo hit config.recompile_limit (8)"]


def test_library_warnings_a_user_cannot_act_on_are_not_shown(tmp_path):
    """TRL's SFTTrainer warns on every run with Liger on (issue #39: use the Hub kernels, which need the network), and
    torch's barrier in a one-process GPU run; each message as the library's source writes it is filtered after
    `sft.core.logs.setup`, another warning of the same kind is not."""
    import inspect
    import re
    import warnings

    import torch.distributed.distributed_c10d
    import trl.trainer.sft_trainer

    from sft.core import logs

    trl_says = re.search(r'"(`use_liger_kernel=True` is deprecated[^"]*)"', inspect.getsource(trl.trainer.sft_trainer))
    c10d = inspect.getsource(torch.distributed.distributed_c10d)
    torch_says = re.search(r'"(barrier\(\): using the device[^"]*)"', c10d)  # the first of its two literals
    assert trl_says and torch_says, "a library no longer says this: drop its filter in sft.core.logs.HARMLESS_WARNINGS"
    _, _, args, _ = demo_args(tmp_path)
    with warnings.catch_warnings(record=True) as shown:
        logs.setup(args)
        warnings.warn(trl_says.group(1), FutureWarning, stacklevel=1)
        warnings.warn(torch_says.group(1), UserWarning, stacklevel=1)
        warnings.warn("`something_else` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("barrier(): something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["`something_else` is deprecated", "barrier(): something else"]


def test_eval_batch_size_auto_is_fixed_on_the_cpu_only(tmp_path, capsys):
    """lm-eval's `auto` searches the GPU's memory; on a CPU it would only cost time. A missing model is refused before
    lm-eval is imported (exit 2, one line)."""
    from sft.tools import evaluation

    assert evaluation.batch_size("auto", "cpu") == evaluation.CPU_BATCH_SIZE == 16
    assert evaluation.batch_size("auto", "cuda") == "auto" and evaluation.batch_size("4", "cpu") == "4"
    assert evaluation.main(["--model", str(tmp_path / "none"), "--tasks", "sft_demo"], prog="sft eval") == 2
    assert capsys.readouterr().err.strip() == (
        f"sft eval: error: --model {tmp_path / 'none'}: no such directory. Give a training output_dir or a merged "
        "model."
    )


def test_a_second_evaluation_adds_files_and_never_replaces_the_first(tmp_path, monkeypatch):
    """`write_results` twice into one model's `eval/` at one timestamp (two evaluations in the same second): a second
    pair of files beside the first, which is left as it was (the README walk's evaluations write through it)."""
    import json

    from sft.tools import evaluation

    monkeypatch.setattr(evaluation.time, "strftime", lambda _: "20261203-120000")
    task = {"alias": "sft_demo", "exact_match,none": 0.3, "exact_match_stderr,none": 0.03}
    results = {"results": {"sft_demo": task}, "versions": {"sft_demo": 1}, "n-shot": {"sft_demo": 0},
               "higher_is_better": {"sft_demo": {"exact_match": True}}}  # fmt: skip
    first = evaluation.write_results(results, tmp_path, str(tmp_path))
    before = [p.read_bytes() for p in first]
    again = evaluation.write_results({**results, "results": {"sft_demo": {**task, "exact_match,none": 0.5}}},
                                     tmp_path, str(tmp_path))  # fmt: skip
    assert [p.name for p in first + again] == [
        "results_20261203-120000.json",
        "results_20261203-120000.md",
        "results_20261203-120000_1.json",
        "results_20261203-120000_1.md",
    ]
    assert [p.read_bytes() for p in first] == before
    assert json.loads(again[0].read_text())["results"]["sft_demo"]["exact_match,none"] == 0.5
    assert "|sft_demo|" in again[1].read_text() and "0.5" in again[1].read_text()


def test_a_lone_process_gets_the_variables_of_a_one_process_launch(monkeypatch):
    """`python sft/train.py` and `sft train` without `--nproc-per-node`: rank 0 of 1 on a free local port (DeepSpeed
    would otherwise look for MPI); a launcher's variables, even some of them, are never changed."""
    import socket

    import psutil
    import torch

    from sft.parallel.distributed import LAUNCH_VARIABLES, lone_process_environment

    threads = torch.get_num_threads()
    for name in (*LAUNCH_VARIABLES, "OMP_NUM_THREADS"):  # set, then removed: monkeypatch puts back what was there
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    values = lone_process_environment()
    torch.set_num_threads(threads)
    expected = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                # on a CPU, accelerate's thread count (a thread per physical core), set before it warns about it
                "OMP_NUM_THREADS": str(psutil.cpu_count(logical=False))}  # fmt: skip
    assert {k: v for k, v in values.items() if k != "MASTER_PORT"} == expected
    with socket.socket() as s:  # the port is free to take
        s.bind(("127.0.0.1", int(values["MASTER_PORT"])))
    assert all(os.environ[k] == v for k, v in values.items())
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert lone_process_environment() == {} and "RANK" not in os.environ


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--gpus", "0"], "argument --gpus: must be a whole number >= 1, got 0"),
     (["--seq-len", "-5"], "argument --seq-len: must be a whole number >= 1, got -5"),
     (["--micro-batch", "two"], "argument --micro-batch: must be a whole number >= 1, got 'two'"),
     (["--headroom", "1.5"], "argument --headroom: must be a number >= 0 and < 1, got 1.5")],
    ids=["gpus-0", "seq-len-negative", "micro-batch-word", "headroom"],
)  # fmt: skip
def test_sft_plan_refuses_numbers_no_setting_can_have_in_one_line(flags, needle, capsys):
    """Issue #78: `--gpus 0` was a ZeroDivisionError traceback, `--seq-len -5` a plan with exit 0."""
    with pytest.raises(SystemExit) as stopped:
        plan_cli.main(["--model", str(ROOT / "recipes" / "demo" / "model"), *flags], prog="sft plan")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"sft plan: error: {needle}") and "sft plan --help" in err


def test_every_command_names_itself_in_its_errors(tmp_path, capsys):
    """`sft merge`'s errors began `sft.tools.merge:` where the others say `sft <command>: error:`."""
    from sft.core import batch
    from sft.tools import merge

    assert merge.main(["--adapter", str(tmp_path / "none"), "--output", str(tmp_path / "m")], prog="sft merge") == 2
    assert capsys.readouterr().err.startswith("sft merge: error: ")
    with pytest.raises(SystemExit):
        batch.main(["--global-batch-size", "0", "--world-size", "2", "--per-device-batch-size", "1"], prog="sft batch")
    assert capsys.readouterr().err.startswith("sft batch: error: argument --global-batch-size: must be a whole number")


def test_help_shows_each_fields_own_default():
    """`--report` defaults to on; its `--no_report` twin's False was shown (issue #78)."""
    from sft.config import short_help

    lines = {line.split()[0]: line for line in short_help(make_parser()).splitlines() if line.startswith("  --")}
    assert lines["--report"].endswith("[True]") and lines["--packing"].endswith("[False]")


def test_recipe_commands_take_the_recipe_either_way(tmp_path, capsys, monkeypatch):
    """`sft data RECIPE` and `sft check --config RECIPE` (and `sft train`) each take both forms; both at once is one
    line naming the two (issue #78: `sft data --config` died in HfArgumentParser, `sft check RECIPE` was not a
    recipe)."""
    from sft.core.recipe import with_config
    from sft.tools import check

    assert with_config(["r.yaml", "--max_length", "8"], "sft check") == ["--config", "r.yaml", "--max_length", "8"]
    assert with_config(["--config", "r.yaml"], "sft check") == ["--config", "r.yaml"]
    with pytest.raises(ConfigError, match=r"the recipe is given twice, a.yaml and `--config b.yaml`"):
        with_config(["a.yaml", "--config", "b.yaml"], "sft data")
    from sft.parallel.distributed import LAUNCH_VARIABLES

    for name in LAUNCH_VARIABLES:  # `sft check` gives this process a one-process launch's; put back as they were
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert check.main([str(tmp_path / "nope.yaml")], prog="sft check") == 2
    assert capsys.readouterr().err.strip() == (
        f"sft check: error: `--config`: no such file {str(tmp_path / 'nope.yaml')!r}. Recipes live in recipes/, e.g. "
        "recipes/demo.yaml."
    )
    result = run_cli([str(tmp_path / "nope.yaml")])
    assert result.returncode == 2 and "`--config`: no such file" in result.stderr
