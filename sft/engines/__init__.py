"""Training engines: what sft needs from the library that shards and steps the model.

`base.py` is the interface (`Engine`, `Sharding`); `deepspeed/` is the first engine, `fsdp2/` the second. Outside
this folder nothing imports deepspeed: the run's engine is built once (`build`, read through
`TrainConfig.run_engine` and the run plan), and the few pieces of an engine's library that sft uses without a run (the
tiled MLP, the memory equations, a model built outside ZeRO-3's `zero.Init`, LoRA weights from a sharded checkpoint)
are the functions below.

May import: `sft.errors`, `sft.core` (which parameters are routed experts, for AutoEP), and the libraries it wraps;
nothing else of sft.
"""

from __future__ import annotations

import contextlib

from sft.engines.base import Engine, Sharding

__all__ = ["Engine", "Sharding", "ENGINES", "prepare_config", "prepare_fsdp2", "check_agrees", "build", "tiled_mlp",
           "model_states", "bucket_elements", "outside_sharded_init", "lora_state"]  # fmt: skip


def prepare_config(config, processes: int, sp: int = 1, ep: int = 1) -> tuple[str | dict | None, dict]:
    """The engine's configuration argument checked and its `"auto"` values resolved for a run of `processes`
    processes (at parse time, `TrainConfig.__post_init__`); returns (the value for transformers, {setting: value}).
    """
    from sft.engines.deepspeed.config import prepare_config as prepare

    return prepare(config, processes, sp, ep)


def check_agrees(training_args) -> None:
    """After transformers resolved its own values: one that contradicts a training argument is an error."""
    from sft.engines.deepspeed.config import check_agrees as check

    check(training_args)


ENGINES = ("deepspeed", "fsdp2")


def prepare_fsdp2(deepspeed, fsdp_config, sp: int = 1, ep: int = 1) -> tuple[bool, dict]:
    """`engine: fsdp2`: transformers' `fsdp` and `fsdp_config` as sft writes them (`sft.engines.fsdp2.prepare`)."""
    from sft.engines.fsdp2 import prepare

    return prepare(deepspeed, fsdp_config, sp, ep)


def build(training_args) -> Engine:
    """The run's engine, from its resolved training arguments: FSDP2 where `engine: fsdp2`, else DeepSpeed (on or
    off)."""
    if training_args.engine == "fsdp2":
        from sft.engines.fsdp2 import FSDP2

        return FSDP2(training_args)
    from sft.engines.deepspeed import DeepSpeed

    return DeepSpeed(training_args)


def tiled_mlp():
    """The tiled MLP's autograd function (DeepSpeed ALST's `TiledMLP`), which runs under any engine."""
    from sft.engines.deepspeed.ulysses import tiled_mlp as function

    return function()


def model_states(
    params: float,
    largest_module: int,
    per_node: int,
    nodes: int,
    stage: int | None,
    offload_optimizer: bool,
    offload_params: bool,
) -> tuple[float, float] | None:
    """(GPU, CPU) bytes per process of the model states of `params` trainable parameters, by the engine's own
    equations (DeepSpeed's for ZeRO-2/3); None where the plan uses its own terms."""
    from sft.engines.deepspeed.zero import model_states as equations

    return equations(params, largest_module, per_node, nodes, stage, offload_optimizer, offload_params)


def bucket_elements(hidden: int, processes: int = 2, params: int | None = None) -> int:
    """Elements of one gradient-reduction bucket for a model of width `hidden` and `params` parameters on `processes`
    (the memory plan's ZeRO-2 term)."""
    from sft.engines.deepspeed.config import bucket_elements as elements

    return elements(hidden, processes=processes, params=params)


def outside_sharded_init() -> contextlib.AbstractContextManager:
    """Build a model normally (the planner's meta-device shapes) even while a ZeRO-3 config is live."""
    from sft.engines.deepspeed.zero import outside_zero_init

    return outside_zero_init()


def lora_state(checkpoint) -> dict:
    """A LoRA adapter's weights from a sharded checkpoint, keyed as PEFT saves them."""
    from sft.engines.deepspeed.checkpoints import lora_state_from_checkpoint

    return lora_state_from_checkpoint(checkpoint)
