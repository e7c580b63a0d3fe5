"""Training engines: what sft needs from the library that shards and steps the model.

`base.py` is the interface (`Spec`: an engine's declared `Traits` and how it enters a run; `Engine`: one run's engine);
each engine folder exports its `SPEC` (`deepspeed/` the first engine, `fsdp2/` the second) and this module is the
registry (`SPECS`, `spec`, `written_by`): outside this folder nothing branches on an engine's name; it reads traits.
Nothing else imports deepspeed: the run's engine is built once (`build`, read through `RunArguments.run_engine` and the
run plan), and the few pieces of an engine's library that sft uses without a run (the
tiled MLP, the memory equations, a model built outside ZeRO-3's `zero.Init`, LoRA weights from a sharded checkpoint)
are the functions below.

May import: `sft.errors`, `sft.core` (an engine's declared traits and sharding; which parameters are routed experts,
for AutoEP), and the libraries it wraps; nothing else of sft.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from sft.engines import deepspeed, fsdp2
from sft.engines.base import Engine, Sharding, Spec, Traits
from sft.errors import ConfigError

__all__ = ["Engine", "Sharding", "Spec", "Traits", "SPECS", "NAMES", "spec", "written_by", "build", "tiled_mlp",
           "model_states", "bucket_elements", "outside_sharded_init", "lora_state"]  # fmt: skip

# The registry: every engine sft can run, by the `engine` field's value; the first is the default
SPECS: dict[str, Spec] = {s.name: s for s in (deepspeed.SPEC, fsdp2.SPEC)}
NAMES = tuple(SPECS)


def spec(name: str) -> Spec:
    """The registered engine called `name` (the `engine` field's value), else a ConfigError naming the choices."""
    if name not in SPECS:
        raise ConfigError(f"`engine` must be one of {', '.join(NAMES)} or auto, got {name!r}.")
    return SPECS[name]


def written_by(checkpoint) -> Spec | None:
    """The engine whose state a checkpoint folder holds, else None (transformers' own files: one process without a
    sharding engine)."""
    return next((s for s in SPECS.values() if s.wrote(Path(checkpoint))), None)


def build(training_args) -> Engine:
    """The run's engine, from its resolved training arguments (`engine`'s spec)."""
    return spec(training_args.engine).build(training_args)


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
