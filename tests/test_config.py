"""Every recipe parses, every DeepSpeed config loads, and settings that must agree are checked against each other."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from sft.engines.deepspeed import BUCKET_FLOOR, fill_buckets, prepare_config, unresolved_config
from sft.errors import ConfigError
from sft.plan.arguments import parse_args
from sft.plan.preflight import preflight
from tests.conftest import ROOT

RECIPES = sorted(ROOT.glob("recipes/**/*.yaml"))
DS_CONFIGS = sorted(ROOT.glob("ds_configs/*.json"))
# Keys whose value TrainingArguments owns: in our DeepSpeed configs they must all be "auto".
TRAINER_OWNED = [
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("bf16", "enabled"),
    ("fp16", "enabled"),
    ("zero_optimization", "reduce_bucket_size"),
]


def test_there_are_recipes_and_ds_configs():
    assert ROOT / "recipes" / "demo.yaml" in RECIPES
    assert {p.stem for p in DS_CONFIGS} >= {"zero2", "zero3", "zero2_offload", "zero3_offload"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_parses(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["--config", str(recipe), "--output_dir", str(tmp_path)]
    sp = yaml.safe_load(recipe.read_text()).get("sequence_parallel_size", 1)
    if sp != 1 and sp != "auto":  # a recipe for a launch of several processes: this test is one
        with pytest.raises(ConfigError, match=f"`sequence_parallel_size: {sp}` does not divide the 1 processes"):
            parse_args(args)
        args += ["--sequence_parallel_size", "1"]
    _, data_args, training_args, model_args = parse_args(args)
    assert model_args.model_name_or_path
    assert data_args.datasets, "a recipe names its data"
    if isinstance(training_args.deepspeed, str):  # a config with sft's "auto" values arrives resolved, as a dict
        assert (ROOT / training_args.deepspeed).is_file()


def test_cli_overrides_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    _, _, args, _ = parse_args(
        [
            "--config",
            "recipes/demo.yaml",
            "--output_dir",
            str(tmp_path),
            "--learning_rate",
            "0.5",
            "--deepspeed",
            "none",
        ]
    )
    assert args.learning_rate == 0.5
    assert args.deepspeed is None
    assert args.packing and args.assistant_only_loss  # recipe values the CLI did not touch survive


@pytest.mark.parametrize("ds_path", DS_CONFIGS, ids=lambda p: p.name)
def test_ds_config(ds_path):
    config = json.loads(ds_path.read_text())
    for keys in TRAINER_OWNED:
        node = config
        for key in keys[:-1]:
            node = node.get(key, {})
        if keys[-1] in node:
            assert node[keys[-1]] == "auto", f'{ds_path.name}: {".".join(keys)} must be "auto"'
    for section in ("optimizer", "scheduler"):
        for key, value in config.get(section, {}).get("params", {}).items():
            assert value == "auto", f'{ds_path.name}: {section}.params.{key} must be "auto"'
    zero = config["zero_optimization"]
    assert zero["stage"] == (3 if "zero3" in ds_path.name else 2)
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # final output is a from_pretrained dir
    # *_offload.json offload to the CPU; zero3.json leaves it to the memory plan ("auto"), zero2.json has none
    device = {"zero2": None, "zero3": "auto"}.get(ds_path.stem, "cpu")
    assert zero.get("offload_optimizer", {}).get("device") == device
    assert zero.get("offload_param", {}).get("device") == (device if zero["stage"] == 3 else None)
    # transformers' own DeepSpeed config reader accepts it and finds the ZeRO stage
    assert HfTrainerDeepSpeedConfig(str(ds_path)).get_value("zero_optimization.stage") == zero["stage"]


def test_overlap_comm_auto_is_off_on_one_process_and_on_with_several(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--config", "recipes/demo.yaml", "--output_dir", str(tmp_path), "--deepspeed", "ds_configs/zero2.json"]
    _, _, training_args, _ = parse_args(args)
    assert training_args.resolved_ds_settings == {"zero_optimization.overlap_comm": False}
    # what transformers and accelerate hand to DeepSpeed
    assert training_args.hf_deepspeed_config.config["zero_optimization"]["overlap_comm"] is False
    assert training_args.deepspeed_plugin.deepspeed_config["zero_optimization"]["overlap_comm"] is False
    config, chosen = prepare_config("ds_configs/zero2.json", processes=2)
    assert config["zero_optimization"]["overlap_comm"] is True and chosen == {"zero_optimization.overlap_comm": True}
    assert json.loads((ROOT / "ds_configs" / "zero2.json").read_text())["zero_optimization"]["overlap_comm"] == "auto"
    # an explicit value is the user's, on any number of processes: the path is passed on untouched
    explicit = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    explicit["zero_optimization"]["overlap_comm"] = True
    (tmp_path / "explicit.json").write_text(json.dumps(explicit))
    assert prepare_config(str(tmp_path / "explicit.json"), processes=1) == (str(tmp_path / "explicit.json"), {})
    explicit["zero_optimization"]["overlap_comm"] = "yes"
    (tmp_path / "bad.json").write_text(json.dumps(explicit))
    with pytest.raises(ConfigError, match=r'overlap_comm in .*bad.json must be true, false or "auto", got \'yes\''):
        parse_args([*args[:-1], str(tmp_path / "bad.json")])


def test_auto_bucket_sizes_of_a_narrow_model_get_the_floor(tmp_path, monkeypatch):
    """`reduce_bucket_size` (and ZeRO-3's `stage3_prefetch_bucket_size`) `auto` are at least 2^20 elements: the demo's
    width of 128 would give transformers' hidden^2 = 16,384. Wider models, explicit values and ZeRO-3's persistence
    threshold are left to transformers and the user; the shipped files are not changed; preflight hands the values on
    to what transformers gives DeepSpeed."""
    monkeypatch.chdir(ROOT)
    assert BUCKET_FLOOR == 2**20
    config, chosen = fill_buckets("ds_configs/zero2.json", hidden=128)
    assert chosen == {"zero_optimization.reduce_bucket_size": 2**20}
    assert config["zero_optimization"]["reduce_bucket_size"] == 2**20
    config, chosen = fill_buckets("ds_configs/zero3.json", hidden=128)
    assert chosen == {f"zero_optimization.{k}": 2**20 for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size")}
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == "auto"
    assert fill_buckets("ds_configs/zero3.json", hidden=1024) == ("ds_configs/zero3.json", {})  # hidden^2 = 2^20
    assert fill_buckets(None, hidden=128) == (None, {})
    explicit = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    explicit["zero_optimization"]["reduce_bucket_size"] = 5e8
    (tmp_path / "explicit.json").write_text(json.dumps(explicit))
    assert fill_buckets(str(tmp_path / "explicit.json"), hidden=128) == (str(tmp_path / "explicit.json"), {})
    shipped = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    assert shipped["zero_optimization"]["reduce_bucket_size"] == "auto"
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--config", "recipes/demo.yaml", "--output_dir", str(tmp_path / "out"), "--deepspeed"]
    _, _, training_args, model_args = parse_args([*args, "ds_configs/zero3.json"])
    planned = preflight(training_args, model_args).training_args
    zero = planned.hf_deepspeed_config.config["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == 2**20


def test_overlap_comm_is_off_under_sequence_parallelism_on_zero_1_and_2(tmp_path, monkeypatch):
    """DeepSpeed's overlapped ZeRO-1/2 reduction gives wrong gradients under Ulysses on GPUs
    (benchmarks/results/sp_gradients): `auto` turns it off there, an explicit `true` is refused; ZeRO-3 is not
    touched. With `sequence_parallel_size: auto` the plan's choice of sp resolves it again."""
    monkeypatch.chdir(ROOT)
    config, chosen = prepare_config("ds_configs/zero2.json", processes=2, sp=2)
    assert config["zero_optimization"]["overlap_comm"] is False and chosen == {"zero_optimization.overlap_comm": False}
    assert prepare_config("ds_configs/zero2.json", processes=4, sp=1)[0]["zero_optimization"]["overlap_comm"] is True
    assert prepare_config("ds_configs/zero3.json", processes=2, sp=2) == ("ds_configs/zero3.json", {})
    explicit = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    explicit["zero_optimization"]["overlap_comm"] = True
    (tmp_path / "overlap.json").write_text(json.dumps(explicit))
    with pytest.raises(ConfigError, match=r"overlap_comm: true in .*overlap.json with sequence_parallel_size 2.*wrong "
                       r'gradients.*Set it to "auto" or false'):  # fmt: skip
        prepare_config(str(tmp_path / "overlap.json"), processes=2, sp=2)
    # what preflight hands back when `sequence_parallel_size: auto` becomes 2: sft's choices are "auto" again
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--config", "recipes/demo.yaml", "--output_dir", str(tmp_path), "--deepspeed", "ds_configs/zero2.json"]
    _, _, training_args, _ = parse_args(args)
    again = unresolved_config(training_args)
    assert again["zero_optimization"]["overlap_comm"] == "auto"
    assert training_args.deepspeed["zero_optimization"]["overlap_comm"] is False  # the run's own config untouched
    assert prepare_config(again, processes=2, sp=2)[0]["zero_optimization"]["overlap_comm"] is False
    assert prepare_config(again, processes=2, sp=1)[0]["zero_optimization"]["overlap_comm"] is True


def test_fraction_on_some_sources_only(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    (tmp_path / "a.jsonl").touch(), (tmp_path / "b.jsonl").touch()  # sources that exist: the check is the fractions'
    recipe.write_text(
        "model_name_or_path: recipes/demo/model\noutput_dir: " + str(tmp_path / "o") + "\n"
        f"datasets:\n  - {{path: {tmp_path}/a.jsonl, fraction: 0.5}}\n  - {{path: {tmp_path}/b.jsonl}}\n"
    )
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=r"`fraction` is set on some entries"):
        parse_args(["--config", str(recipe)])


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci_command
    assert ci_command in (ROOT / "README.md").read_text()


def test_liger_defaults_to_the_hardware_and_an_explicit_request_without_a_gpu_is_refused_loudly(caplog):
    """Unset: on with a CUDA GPU and liger-kernel, off here (no GPU) without a warning; `true` here: a warning."""
    demo = ["--config", str(ROOT / "recipes" / "demo.yaml")]
    with caplog.at_level("WARNING", logger="sft.config"):
        assert parse_args(demo)[2].use_liger_kernel is False
    assert "use_liger_kernel" not in caplog.text
    with caplog.at_level("WARNING", logger="sft.config"):
        assert parse_args([*demo, "--use_liger_kernel", "true"])[2].use_liger_kernel is False
    assert "`use_liger_kernel` needs a CUDA GPU" in caplog.text


def test_peak_tflops_must_be_positive():
    with pytest.raises(ConfigError, match=r"`peak_tflops` must be > 0 \(or unset\), got -1"):
        parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--peak_tflops", "-1"])
