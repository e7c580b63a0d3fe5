"""Bad input stops the run before any training with one clear paragraph and a non-zero exit, never a traceback.

Each case calls the training CLI function in this process (`run_cli_in_process`): every one stops before a model is
built, so no process needs to be launched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from sft.errors import ConfigError
from tests.conftest import ROOT
from tests.conftest import run_cli_in_process as run_cli
from tests.helpers import make_checkpoint

GOOD = {"role": "user", "content": "repeat: abc"}, {"role": "assistant", "content": "abc"}


def write_recipe(tmp_path: Path, **overrides) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    recipe.update(output_dir=str(tmp_path / "out"), **overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def write_jsonl(tmp_path: Path, records: list[dict], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chats(n: int = 4) -> list[dict]:
    return [{"messages": [dict(t) for t in GOOD]} for _ in range(n)]


def expect_error(result, *needles: str) -> None:
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr[-3000:]}"


def run_with_data(tmp_path: Path, records: list[dict]):
    data = write_jsonl(tmp_path, records)
    return run_cli(
        ["--config", str(write_recipe(tmp_path, datasets=[{"path": str(data)}], eval_datasets=[], eval_strategy="no"))]
    ), data


@pytest.mark.parametrize(
    ("bad_record", "needle"),
    [
        ({"msgs": [dict(t) for t in GOOD]}, "record 2: missing field `messages`"),
        ({"messages": "repeat: abc"}, "record 2: `messages` must be a list of turns, got str"),
        ({"messages": []}, "record 2: `messages` is an empty conversation"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "record 2: `messages[0].role` is 'robot'"),
        ({"messages": [{"role": "user", "content": 5}]}, "record 2: `messages[0].content` must be a string, got int"),
    ],
    ids=["missing-field", "wrong-type", "empty-conversation", "unknown-role", "non-string-content"],
)
def test_malformed_chat_record(tmp_path, bad_record, needle):
    records = chats()
    records.insert(2, bad_record)
    result, data = run_with_data(tmp_path, records)
    expect_error(result, str(data), needle, "Fix or drop that record")


def test_malformed_sharegpt_role(tmp_path):
    records = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 3
    records.append({"conversations": [{"from": "bot", "value": "hi"}]})
    result, data = run_with_data(tmp_path, records)
    expect_error(result, str(data), "record 3: `conversations[0].from` is 'bot'")


def test_invalid_json_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(chats(1)[0]) + "\n{not json\n")
    result = run_cli(
        ["--config", str(write_recipe(tmp_path, datasets=[{"path": str(data)}], eval_datasets=[], eval_strategy="no"))]
    )
    expect_error(result, "record 1 (line 2) is not valid JSON")


def test_unknown_record_format(tmp_path):
    result, data = run_with_data(tmp_path, [{"question": "q", "answer": "a"}] * 3)
    expect_error(result, "cannot tell the record format from its columns ['question', 'answer']", "Alpaca")


def test_missing_data_file(tmp_path):
    """Said first, in one line naming the recipe and the field, before any INFO line (issue #78: it came after 10)."""
    missing = tmp_path / "nope.jsonl"
    recipe = write_recipe(tmp_path, datasets=[{"path": str(missing)}])
    result = run_cli(["--config", str(recipe)])
    expect_error(result, f"{recipe}: `datasets[0].path` is {str(missing)!r}, which does not exist", "hub id")
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "INFO" not in result.stderr
    relative = write_recipe(tmp_path, eval_datasets=[{"path": "data/eval.jsonl"}])
    expect_error(run_cli(["--config", str(relative)]), "`eval_datasets[0].path` is 'data/eval.jsonl'", "read from")


def test_max_length_below_every_prompt_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """Every record's answer cut away (issue #78: every loss 0.0, exit 0): refused naming max_length, the records that
    lose every answer token and a length that keeps them, before the model is built."""
    import sft.model.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(sft.model.build, "load_model", no_model)
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--max_length", "8", "--eval_strategy", "no"])
    expect_error(result, "`max_length: 8` cuts every answer token from 6,000 of 6,000 records", "raise max_length",
                 "max_length 17 or more keeps half of them")  # fmt: skip
    assert result.returncode == 2


def test_unknown_recipe_key(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path, lerning_rate=0.1))])
    expect_error(result, "unknown key `lerning_rate`", "did you mean `learning_rate`?")


def test_missing_recipe(tmp_path):
    result = run_cli(["--config", str(tmp_path / "nope.yaml")])
    expect_error(result, "`--config`: no such file", "recipes/demo.yaml")


def test_bad_flag_value(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--learning_rate", "fast"])
    expect_error(result, "--learning_rate", "invalid float value: 'fast'")


def test_unknown_flag(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--lerning_rate", "0.1"])
    expect_error(result, "unknown flag `--lerning_rate`: did you mean `--learning_rate`")


@pytest.mark.parametrize(
    "flag,hint",
    [("--learning_rat", "`--learning_rate`"), ("--lr", "`--learning_rate`"), ("--epochs", "`--num_train_epochs`")],
)
def test_a_flag_is_never_a_prefix_and_errors_are_one_paragraph(tmp_path, flag, hint):
    """argparse would take `--learning_rat` as `--learning_rate` and answer `--lr` with its whole usage: here both are
    an unknown flag with the real one named, in a few lines."""
    result = run_cli(["--config", str(write_recipe(tmp_path)), flag, "1e-4"])
    expect_error(result, f"unknown flag `{flag}`: did you mean {hint}")
    assert "usage:" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3
    bad_value = run_cli(["--config", str(write_recipe(tmp_path)), "--learning_rate", "fast"])
    assert "usage:" not in bad_value.stderr and len(bad_value.stderr.strip().splitlines()) <= 3


def test_zero_batch_size(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--per_device_train_batch_size", "0"])
    expect_error(result, "`per_device_train_batch_size` must be >= 1, got 0")


def test_missing_ds_config(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--deepspeed", "ds_configs/zero4.json"])
    expect_error(result, "`deepspeed`: no such file 'ds_configs/zero4.json'")


def test_ds_config_contradicts_flag(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 8
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(ds))
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--deepspeed", str(ds_path)])
    expect_error(result, "contradicts the training arguments", "train_micro_batch_size_per_gpu=8", '"auto"')


def test_output_dir_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("a previous run")
    result = run_cli(["--config", str(write_recipe(tmp_path))])
    expect_error(result, "already holds model.safetensors", "does not write over a previous run")
    assert (out / "model.safetensors").read_text() == "a previous run"


def test_a_users_readme_in_output_dir_is_left_alone(tmp_path):
    """A README.md that sft did not write (TRL's model card has that name) stops the run; the file is unchanged."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_bytes(b"# my notes\n")
    (out / "metrics.jsonl").write_bytes(b'{"mine": 1}\n')
    result = run_cli(["--config", str(write_recipe(tmp_path))])
    expect_error(result, "already holds README.md, metrics.jsonl", "does not write over a previous run")
    assert result.returncode == 2 and sorted(p.name for p in out.iterdir()) == ["README.md", "metrics.jsonl"]
    assert (out / "README.md").read_bytes() == b"# my notes\n"
    assert (out / "metrics.jsonl").read_bytes() == b'{"mine": 1}\n'


def test_plan_does_not_fit(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--plan_gpu_memory_gib", "0.001"])
    expect_error(result, "The memory plan does not fit", "micro batch 2 x 512 tokens", "plan_check: false")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_unreachable_global_batch(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--global_batch_size", "7"])
    expect_error(
        result, "global batch 7 cannot be reached", "Nearest reachable: 6 (accumulation 3), 8 (accumulation 4)"
    )


def test_bad_auto_value(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--activation_checkpointing", "sometimes"])
    expect_error(result, "`activation_checkpointing` must be true, false or `auto`, got 'sometimes'")


def test_lora_on_random_weights_is_refused(tmp_path):
    result = run_cli(
        ["--config", str(write_recipe(tmp_path)), "--from_scratch", "true", "--use_peft", "--lora_r", "8"]
    )
    expect_error(result, "`from_scratch` makes random base weights")
    assert result.returncode == 2


def recipe_text(tmp_path: Path, extra: str) -> Path:
    """The demo recipe as text with `extra` lines appended (for YAML that yaml.safe_dump would not write)."""
    text = (ROOT / "recipes" / "demo.yaml").read_text()
    text = text.replace("output_dir: outputs/demo", f"output_dir: {tmp_path}/o")
    path = tmp_path / "recipe.yaml"
    path.write_text(text + extra)
    return path


def test_a_key_given_twice_is_refused(tmp_path):
    result = run_cli(["--config", str(recipe_text(tmp_path, "learning_rate: 3.0\n"))])
    expect_error(result, "key `learning_rate` is given twice (lines", "Keep one of them")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"datasets": "recipes/demo/data/train.jsonl"}, ["`datasets` must be a list of sources, got str"]),
        ({"datasets": [{"path": "recipes/demo/data/train.jsonl", "splt": "train"}]},
         ["`datasets[0]` has an unknown key `splt`", "did you mean `split`?"]),
        ({"eval_datasets": [{"split": "test"}]}, ["`eval_datasets[0]` has no `path`"]),
        ({"gradient_accumulation_steps": 2.5}, ["`gradient_accumulation_steps` must be a whole number, got 2.5"]),
        ({"learning_rate": float("nan")}, ["`learning_rate` must be a finite number, got nan"]),
        ({"max_length": "long"}, ["recipe.yaml: `max_length` must be a whole number, got 'long'"]),
        ({"plan_gpu_memory_gib": "lots"}, ["recipe.yaml: `plan_gpu_memory_gib` must be a finite number, got 'lots'"]),
        ({"dtype": "float33"}, ["`dtype` is 'float33', not a torch dtype", "bfloat16"]),
        ({"lr_scheduler_type": "cosin"}, ["`lr_scheduler_type: cosin`: cosin is not a valid SchedulerType"]),
        ({"max_steps": -5}, ["`max_steps` must be a positive number of optimizer steps, or -1", "got -5"]),
        ({"num_train_epochs": 0}, ["`num_train_epochs` must be > 0 (or set `max_steps`), got 0"]),
    ],
    ids=["sources-string", "source-key-typo", "source-no-path", "int-float", "nan", "int-string", "optional-float",
         "dtype", "enum-names-field", "max-steps-negative", "zero-epochs"],
)  # fmt: skip
def test_recipe_values_of_the_wrong_kind_are_refused(tmp_path, overrides, needles):
    result = run_cli(["--config", str(write_recipe(tmp_path, **overrides))])
    expect_error(result, *needles)
    assert result.returncode == 2 and not (tmp_path / "out").exists()


def test_a_non_finite_flag_value_is_refused(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--learning_rate", "nan"])
    expect_error(result, "`learning_rate` must be a finite number, got nan")


def run_with_source(tmp_path: Path, records: list[dict] | None = None, raw: bytes | None = None, **overrides):
    path = tmp_path / "data.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    source = {"path": str(path), **overrides.pop("source", {})}
    recipe = write_recipe(tmp_path, datasets=[source], eval_datasets=[], eval_strategy="no", **overrides)
    return run_cli(["--config", str(recipe)])


def turns(*pairs) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


@pytest.mark.parametrize(
    ("records", "raw", "overrides", "needles"),
    [
        (None, b'{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": "caf\xe9"}\n', {},
         ["data.jsonl: not UTF-8 text: byte 67 (line 2) is b'\\xe9'", "Re-save it as UTF-8"]),
        ([turns(("user", "hi"))] * 3, None, {}, ["record 0: no assistant turn, so `assistant_only_loss`"]),
        ([turns(("system", "be brief"))] * 3, None, {}, ["record 0: no assistant turn"]),
        ([turns(("user", "hi"), ("assistant", ""))] * 3, None, {},
         ["record 0: `messages[1].content` is empty (the assistant turn has no text)"]),
        ([{"text": "hello"}] * 3, None, {},
         ["`assistant_only_loss: true` trains on the assistant turns of conversations", "holds text records"]),
        ([turns(("user", "hi"), ("assistant", "yo"))] * 3, None, {"source": {"columns": ["messages", "nope"]}},
         ["`columns` names ['nope'], which the data does not have; its columns are ['messages']"]),
    ],
    ids=["not-utf8", "no-assistant-turn", "only-system-turn", "empty-content", "assistant-only-on-text",
         "missing-column"],
)  # fmt: skip
def test_bad_data_is_named_before_training(tmp_path, records, raw, overrides, needles):
    result = run_with_source(tmp_path, records, raw, **overrides)
    expect_error(result, *needles)
    assert result.returncode == 2


def test_eval_strategy_without_an_eval_set(tmp_path):
    result = run_cli(["--config", str(write_recipe(tmp_path, eval_datasets=[], eval_strategy="steps"))])
    expect_error(result, "`eval_strategy: steps` evaluates during training, but there is no eval set")


def test_a_tokenizer_without_a_chat_template_on_chat_data(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "recipes" / "demo" / "model", model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_cli(["--config", str(write_recipe(tmp_path, model_name_or_path=str(model)))])
    expect_error(result, "has no chat template, and the data is conversations", "chat_template_path")


@pytest.mark.parametrize(
    ("zero", "needle"),
    [
        ({"stage": 4}, "zero_optimization.stage in"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero_optimization.offload_param offloads to nvme in"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "zero_optimization.offload_param in"),
    ],
    ids=["stage-4", "nvme-without-path", "param-offload-below-stage-3"],
)
def test_deepspeed_values_deepspeed_would_reject_late(tmp_path, zero, needle):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto"}))
    result = run_cli(["--config", str(write_recipe(tmp_path, deepspeed=str(config)))])
    expect_error(result, f"`deepspeed`: {needle}")
    assert result.returncode == 2


def test_output_dir_that_is_a_file(tmp_path):
    target = tmp_path / "out"
    target.write_bytes(b"my file")
    result = run_cli(["--config", str(write_recipe(tmp_path))])
    expect_error(result, "is a file, not a directory")
    assert target.read_bytes() == b"my file"


def test_output_dir_that_cannot_be_written(tmp_path):
    recipe = write_recipe(tmp_path)
    result = run_cli(["--config", str(recipe), "--output_dir", "/proc/sft-out/run"])  # not even root writes there
    expect_error(result, "`output_dir` '/proc/sft-out/run' cannot be written: nothing can be created in '/proc'")
    assert result.returncode == 2


def test_an_error_one_rank_meets_alone_is_printed_by_that_rank(monkeypatch, capsys):
    """Under torchrun (no `sft train` folder for the workers' errors) rank 0 prints a configuration error, which every
    rank meets alike; an out-of-memory error (`every_rank`) is printed by the rank that met it, named, since the
    other ranks may never meet it (a rank 1 that ran out of memory alone exited 2 with no word of why)."""
    from sft.parallel.launch import ERROR_FILE_ENV, report_error

    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    report_error("the recipe names no dataset")
    report_error("out of memory at micro batch 8 x accumulation 2 (global batch 32)", every_rank=True)
    assert capsys.readouterr().err == (
        "sft: error (rank 1): out of memory at micro batch 8 x accumulation 2 (global batch 32)\n"
    )
    monkeypatch.setenv("RANK", "0")
    report_error("the recipe names no dataset")
    assert capsys.readouterr().err == "sft: error: the recipe names no dataset\n"


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_a_checkpoint_of_the_other_engine_is_refused_before_the_model(tmp_path):
    """issue #66: `--engine fsdp2 --deepspeed none` on an output directory whose newest checkpoint DeepSpeed wrote
    started, then died in the load with a traceback. Refused before the model is built, naming the checkpoint, the
    engine that wrote it and the choices; exit 2, nothing in the output directory changed. FSDP2's checkpoint under
    DeepSpeed likewise; `engine: auto` follows the checkpoint."""
    from sft.core.run import Resume
    from sft.plan.preflight import check_resume_engine

    out = tmp_path / "out"
    written = make_checkpoint(out, 6, world=1)
    before = _snapshot(out)
    result = run_cli(["--config", str(write_recipe(tmp_path)), "--engine", "fsdp2", "--deepspeed", "none"])
    expect_error(result, f"{written} was written by DeepSpeed and this run's engine is FSDP2, which cannot read it",
                 "Resume with DeepSpeed (--engine deepspeed", "start a new run in another --output_dir")  # fmt: skip
    assert result.returncode == 2 and _snapshot(out) == before
    fsdp2 = tmp_path / "fsdp2" / "checkpoint-4"
    (fsdp2 / "pytorch_model_fsdp_0").mkdir(parents=True)
    resume = Resume(str(fsdp2), 1, 2, 1, 2)
    with pytest.raises(ConfigError, match="was written by FSDP2 and this run's engine is DeepSpeed.*--engine fsdp2"):
        check_resume_engine("deepspeed", resume)
    check_resume_engine("fsdp2", resume)  # its own engine: no word
    check_resume_engine("fsdp2", Resume(str(tmp_path), 1, 2, 1, 2))  # transformers' own files: not refused here
