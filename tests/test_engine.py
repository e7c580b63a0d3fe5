"""sft.engines.deepspeed: what sft asks of DeepSpeed, tested on the real objects (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from sft.engines.deepspeed import place_optimizer_state


def stepped(**kwargs) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    param = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = torch.optim.AdamW([param], lr=1e-3, **kwargs)
    param.grad = torch.randn_like(param)
    optimizer.step()
    return param, optimizer


def as_a_universal_load_leaves_it(optimizer, param) -> None:
    """What DeepSpeed's universal loaders assign: tensors read from disk as they were written (here: float64)."""
    state = optimizer.state[param]
    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float64)
    state["exp_avg"] = state["exp_avg"].double()


def test_fused_adamw_gets_a_float32_step_on_the_parameters_device_and_steps_again():
    unplaced, refusing = stepped(fused=True)
    as_a_universal_load_leaves_it(refusing, unplaced)
    with pytest.raises(RuntimeError):  # the fused kernel refuses the state as the loader left it
        refusing.step()
    param, optimizer = stepped(fused=True)
    as_a_universal_load_leaves_it(optimizer, param)
    assert place_optimizer_state(optimizer) == 2
    state = optimizer.state[param]
    assert state["step"].dtype == torch.float32 and state["step"].device == param.device and float(state["step"]) == 1
    assert state["exp_avg"].dtype == param.dtype
    optimizer.step()
    assert float(optimizer.state[param]["step"]) == 2
    assert place_optimizer_state(optimizer) == 0  # a second call finds everything in place


def test_plain_adamw_keeps_its_step_where_torch_keeps_it():
    param, optimizer = stepped(foreach=False)
    as_a_universal_load_leaves_it(optimizer, param)
    step = optimizer.state[param]["step"]
    assert place_optimizer_state(optimizer) == 1  # exp_avg only
    assert optimizer.state[param]["step"] is step


def test_zero3_empty_groups_take_the_optimizers_defaults():
    """ZeRO-3 empties the optimizer's `params` lists between steps; the state is still keyed by the fp32 partition."""
    param, optimizer = stepped(fused=True)
    as_a_universal_load_leaves_it(optimizer, param)
    optimizer.param_groups[0]["params"] = []
    assert place_optimizer_state(optimizer) == 2
    assert optimizer.state[param]["step"].dtype == torch.float32


def test_integer_steps_are_left_alone():
    """DeepSpeed's CPU Adam counts steps in a Python int."""
    param, optimizer = stepped(fused=True)
    optimizer.state[param]["step"] = 5
    place_optimizer_state(optimizer)
    assert optimizer.state[param]["step"] == 5


def test_zero3_costs_are_the_committed_benchmarks():
    """The ratios the start-up advice quotes are those of the committed runs of sft's defaults under both stages."""
    import json

    from sft.engines.deepspeed import ZERO3_MEASURED, zero3_cost
    from tests.conftest import ROOT

    results = ROOT / "benchmarks" / "results"
    levers = json.loads((results / "zero3_levers" / "throughput.json").read_text())["runs"]
    defaults = results / "speed_sweep_h200x4" / "call2_8b_defaults" / "runs.jsonl"
    sweep = {run["name"]: run for run in map(json.loads, defaults.read_text().splitlines())}
    pairs = {
        (1, 1): (levers["1b-1gpu-zero3-sft"], levers["1b-1gpu-zero2-sft"]),
        (3, 1): (levers["3b-1gpu-zero3-sft"], levers["3b-1gpu-zero2-sft"]),
        (8, 2): (sweep["z3-default"], sweep["z2-default"]),
    }
    measured = {
        k: round(z3["tokens_per_second_per_gpu"] / z2["tokens_per_second_per_gpu"], 3) for k, (z3, z2) in pairs.items()
    }
    assert {(m.params_b, m.gpus): m.ratio for m in ZERO3_MEASURED} == measured
    assert all(z3["exit_code"] in (0, "stopped") and z2["exit_code"] in (0, "stopped") for z3, z2 in pairs.values())
    assert (zero3_cost(8_030_000_000, 2).params_b, zero3_cost(8_030_000_000, 2).gpus) == (8, 2)
    assert (zero3_cost(70_000_000_000, 8).params_b, zero3_cost(70_000_000_000, 8).gpus) == (8, 2)
    assert (zero3_cost(3_200_000_000, 1).params_b, zero3_cost(1_000_000, 1).params_b) == (3, 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepcompile_is_refused_with_what_was_measured(tmp_path, stage):
    import json

    from sft.errors import ConfigError
    from sft.plan.arguments import parse_args
    from tests.conftest import ROOT

    config = json.loads((ROOT / "ds_configs" / f"zero{stage}.json").read_text())
    config["compile"] = {"deepcompile": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    match = rf"`deepspeed`: {path} asks for DeepCompile \(compile.deepcompile\), which sft does not run: .* Remove"
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--deepspeed", str(path)])
    config["compile"] = {"deepcompile": False}
    path.write_text(json.dumps(config))
    parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--deepspeed", str(path)])


def test_fsdp2_is_written_by_sft_and_what_it_cannot_honour_is_refused(tmp_path):
    """`engine: fsdp2` writes transformers' `fsdp` / `fsdp_config` (version 2, each decoder layer a unit, resharded,
    sharded checkpoints) and builds the FSDP2 engine; a DeepSpeed config beside it, FSDP1's settings, sequence or
    expert parallelism, `fsdp` without the engine and an unknown engine are refused at parse time, naming the field."""
    from sft import engines
    from sft.errors import ConfigError
    from sft.plan.arguments import parse_args
    from tests.conftest import ROOT

    def parsed(*extra):
        return parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(tmp_path / "o"),
                           *extra])[2]  # fmt: skip

    args = parsed("--engine", "fsdp2", "--deepspeed", "none")
    assert args.fsdp is True and args.deepspeed is None and args.fsdp_plugin_args["fsdp_version"] == 2
    assert {k: args.fsdp_config[k] for k in engines.fsdp2.DEFAULTS} == engines.fsdp2.DEFAULTS
    assert args.run_engine.name == "fsdp2" and args.run_engine.sharding == engines.Sharding(3)
    kept = engines.fsdp2.prepare(None, {"reshard_after_forward": False, "cpu_offload": True})[1]
    built = engines.fsdp2.FSDP2(type("A", (), {"fsdp_config": kept, "parallel": None})())
    assert built.sharding == engines.Sharding(2, True, True)
    refusals = {
        ("--engine", "fsdp2"): "`engine: fsdp2` with `deepspeed: ds_configs/zero2.json`",
        ("--engine", "fsdp3"): "argument --engine: invalid choice: 'fsdp3'",
        ("--fsdp", "full_shard"): "set `engine: fsdp2`",
    }
    for extra, message in refusals.items():
        with pytest.raises(ConfigError, match=message.replace("`", ".").replace("(", ".").replace(")", ".")):
            parsed(*extra)
    for config, sp, ep, message in (({"backward_prefetch": "BACKWARD_PRE"}, 1, 1, "backward_prefetch is not"),
                                    ({"version": 1}, 1, 1, "version: 1"), ({}, 2, 1, "sequence_parallel_size: 2"),
                                    ({}, 1, 2, "expert_parallel_size: 2")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            engines.fsdp2.prepare(None, config, sp, ep)


def test_engine_auto_takes_fsdp2_for_zero3_where_estimated_faster_and_deepspeed_elsewhere(
    tmp_path, monkeypatch, caplog
):
    """`engine: auto` (the default): DeepSpeed, except FSDP2 in place of a ZeRO-3 config where the speed model
    estimates FSDP2's fastest setting faster, on a GPU (the GPU's name stands in for the H200 here; planned for its
    141 GB): the demo's ZeRO-3 run is rebuilt for FSDP2 with its `auto` fields still chosen by the plan, both
    estimates logged; QLoRA under ZeRO-3 goes to FSDP2 by its measurement; ZeRO-2, LoRA on 16-bit weights, no GPU and
    a DeepSpeed checkpoint keep DeepSpeed, each with its reason; an FSDP2 checkpoint is resumed by FSDP2."""
    import logging

    from sft.core.run import Resume
    from sft.plan import preflight as pre
    from sft.plan import search
    from sft.plan.arguments import parse_args
    from tests.conftest import ROOT

    def planned(*extra, resume=None):
        _, _, args, model_args = parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir",
                                             str(tmp_path / "o"), "--per_device_train_batch_size", "auto",
                                             "--plan_gpu_memory_gib", "139.8", *extra])  # fmt: skip
        assert "engine" in args.auto_settings and args.engine == "deepspeed"  # DeepSpeed's until the plan decides
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sft.plan"):
            plan = pre.preflight(args, model_args, resume)
        return plan, caplog.text

    zero3 = ("--deepspeed", "ds_configs/zero3.json")
    plan, log = planned(*zero3)
    assert plan.engine.name == "deepspeed" and "engine: auto -> deepspeed (no GPU: the engines' speeds" in log
    monkeypatch.setattr(search, "gpu_name", lambda: "NVIDIA H200")
    plan, log = planned(*zero3)
    assert plan.engine.name == "fsdp2" and plan.training_args.deepspeed is None
    assert plan.training_args.fsdp_config["version"] == 2
    assert (
        "engine: auto -> fsdp2 (PyTorch's FSDP2 in place of ZeRO-3: FSDP2 " in log
        and "against DeepSpeed ZeRO-3 " in log
    )
    assert "1.26-1.33x" in log and "Memory plan for" in log and "FSDP2 (resharded: ZeRO-3's layout)" in log
    assert plan.batch.per_device_batch_size > 1  # `per_device_train_batch_size: auto` still chosen by the plan
    lora = (*zero3, "--use_peft", "true", "--from_scratch", "false")
    plan, log = planned(*lora, "--load_in_4bit", "true")  # QLoRA: by its measurement
    assert plan.engine.name == "fsdp2" and "engine: auto -> fsdp2 (QLoRA: PyTorch's FSDP2 in place of ZeRO-3" in log
    assert "2.47x" in log and "FSDP2 (resharded: ZeRO-3's layout)" in log
    zero2 = ("--deepspeed", "ds_configs/zero2.json")
    for extra, reason in ((zero2, "ZeRO-2: FSDP2 is chosen only in place of ZeRO-3"),
                          (lora, "LoRA on 16-bit weights under FSDP2 is not measured on GPUs"),
                          ((*zero3, "--engine", "deepspeed"), None)):  # fmt: skip
        if reason is None:
            _, _, args, model_args = parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir",
                                                 str(tmp_path / "o"), *extra])  # fmt: skip
            assert "engine" not in args.auto_settings and pre.preflight(args, model_args).engine.name == "deepspeed"
            continue
        plan, log = planned(*extra)
        assert plan.engine.name == "deepspeed" and f"engine: auto -> deepspeed ({reason}" in log, log
    for folder, engine in (("pytorch_model_fsdp_0", "fsdp2"), ("global_step4", "deepspeed")):
        checkpoint = tmp_path / engine / "checkpoint-4"
        (checkpoint / folder).mkdir(parents=True)
        resume = Resume(str(checkpoint), 2, 2, 1, 4)
        plan, log = planned(*zero3, resume=resume)
        assert plan.engine.name == engine and f"was written by {'FSDP2' if engine == 'fsdp2' else 'DeepSpeed'}" in log


def test_engine_auto_runs_one_process_without_an_engine_where_estimated_faster(tmp_path, monkeypatch, caplog):
    """`engine: auto` on one process with bf16 weights and `optim: auto`: no engine (torchao's 8-bit AdamW with
    stochastic rounding steps the bf16 weights in place) where the speed model estimates it faster than the DeepSpeed
    config's setting, both estimates and what it was measured on logged, the `auto` fields still chosen by the plan;
    DeepSpeed kept where the optimizer is named (no rounding to rely on), with `engine: deepspeed`, without a GPU. A
    checkpoint one process wrote without an engine (transformers' own files) is resumed without one, not by DeepSpeed
    (which could not read it), with or without a GPU."""
    import logging

    from sft.core.run import Resume
    from sft.plan import preflight as pre
    from sft.plan import search
    from sft.plan.arguments import parse_args
    from tests.conftest import ROOT

    def planned(*extra, resume=None):
        _, _, args, model_args = parse_args(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir",
                                             str(tmp_path / "o"), "--per_device_train_batch_size", "auto",
                                             "--plan_gpu_memory_gib", "79.18", "--bf16", "true", "--dtype",
                                             "bfloat16", *extra])  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sft.plan"):
            plan = pre.preflight(args, model_args, resume)
        return plan, caplog.text

    plan, log = planned()
    assert plan.training_args.deepspeed is not None and "engine: auto -> none" not in log  # no GPU: not measured
    checkpoint = tmp_path / "alone" / "checkpoint-4"
    checkpoint.mkdir(parents=True)  # no DeepSpeed or FSDP2 folder, transformers' optimizer.pt: without an engine
    (checkpoint / "optimizer.pt").write_bytes(b"")
    plan, log = planned(resume=Resume(str(checkpoint), 1, 2, 1, 2))
    assert plan.training_args.deepspeed is None and "was written by one process without an engine" in log
    monkeypatch.setattr(search, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    plan, log = planned()
    assert plan.training_args.deepspeed is None and plan.engine.sharding.stage is None
    assert "engine: auto -> none (one process: nothing to shard" in log and "against DeepSpeed ZeRO-2: " in log
    assert "17,102 tokens/s" in log and "engine = none" in log
    assert (
        plan.training_args.optim == "adamw_torch_8bit"
        and "bf16_stochastic_round=True" in plan.training_args.optim_args
    )
    assert "Precision: bf16 weights without an fp32 master copy" in log
    assert plan.batch.per_device_batch_size > 1  # `per_device_train_batch_size: auto` still chosen by the plan
    for extra in (("--optim", "adamw_torch_fused"), ("--engine", "deepspeed")):
        plan, log = planned(*extra)
        assert plan.training_args.deepspeed is not None and "engine: auto -> none" not in log, extra
