"""What a run needs from the engine that shards and steps the model: the interface every engine implements.

sft decides a run once (`sft.core.run.RunPlan`, which holds its engine) and the rest of the package asks the
engine, never the library behind it: outside `sft/engines/` nothing imports deepspeed (tests/test_layout.py checks it).
A second engine (FSDP2) is a sibling of `sft/engines/deepspeed/` implementing this class.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sft.core.engine import Sharding, Traits
from sft.errors import ConfigError

__all__ = ["Engine", "Sharding", "Spec", "Traits"]


@dataclass(frozen=True)
class Spec:
    """An engine as the registry holds it (`sft.engines.SPECS`): its declared traits and how it enters a run, without
    building it. Each engine folder exports one (`SPEC`); adding an engine is a folder and its line in the registry."""

    traits: Traits
    # at parse time: the training arguments' engine fields checked and written for a launch of `dims`
    # (`prepare(training_args, dims)`: DeepSpeed's config resolved, FSDP2's `fsdp` and `fsdp_config` written)
    prepare: Callable
    # after transformers resolved its own values: a value of the engine's configuration that contradicts a training
    # argument refused (`check_agrees(training_args)`)
    check_agrees: Callable
    build: Callable  # `build(training_args) -> Engine`, once per run, from the resolved arguments
    wrote: Callable  # `wrote(checkpoint: Path) -> bool`: whether that checkpoint folder holds this engine's state
    # the training-argument values that select this engine with its own default configuration (`engine: auto`'s
    # choice), and those that run it without sharding anything (None: it always shards)
    selected: dict = field(default_factory=dict)
    unsharded: dict | None = None

    @property
    def name(self) -> str:
        return self.traits.name


class Engine(abc.ABC):
    """One run's engine, built once from its resolved configuration (`sft.engines.build`)."""

    traits: Traits  # the engine's declared traits (its spec's)

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def drops_nonfinite_steps(self) -> bool:
        """Whether this run's optimizer skips a step whose gradients are not finite by itself (the step guard then
        leaves the gradients alone)."""
        return self.traits.drops_nonfinite_steps and self.on

    @property
    def on(self) -> bool:
        """Whether the engine runs at all (DeepSpeed without a config is off: plain data parallelism, one process)."""
        return self.config is not None

    @property
    def shards_weights(self) -> bool:
        """Whether the weights are split over the processes (where a model loaded whole must be partitioned): ZeRO-3's
        layout, or an engine that shards them in every layout (`Traits.shards_weights_always`)."""
        return self.sharding.stage == 3 or self.traits.shards_weights_always

    def starting(self) -> str | None:
        """The line the trainer logs as the engine starts (None: nothing to say)."""
        return None

    # --- its configuration, resolved once ---
    @property
    @abc.abstractmethod
    def config(self) -> dict | None:
        """The engine's resolved configuration as the library takes it (None: the engine is off)."""

    @property
    @abc.abstractmethod
    def sharding(self) -> Sharding:
        """The stage and offloading of the resolved configuration (the memory plan and the model build read it)."""

    @property
    def experts(self):
        """The engine's expert-parallel component (AutoEP's under DeepSpeed) when the run's MoE layers are split by it,
        else None."""
        return None

    @abc.abstractmethod
    def versions(self) -> dict[str, str]:
        """{library: version} recorded in every checkpoint's fingerprint."""

    # --- the plan's decisions written into the configuration (`sft.plan.preflight`) ---
    @abc.abstractmethod
    def offload_auto(self) -> tuple[bool, bool]:
        """Whether the optimizer states / the weights are offloaded only if the memory plan needs it (`"auto"`)."""

    @abc.abstractmethod
    def written(
        self,
        config,
        *,
        offload: tuple[bool, bool, float] | None = None,
        hidden: int | None = None,
        processes: int = 2,
        params: int | None = None,
        universal: bool = False,
        keep_experts: bool = False,
    ) -> tuple[dict | str | None, list[str]]:
        """`config` (the training argument's value) with the plan's decisions written in: the offload levers
        (optimizer, weights, the optimizer's share), collective sizes for a model of width `hidden` (and `params`) on
        `processes`, a checkpoint of another process count loaded, the experts' layout of an expert-parallel
        checkpoint kept; returns (config, the lines that say what changed)."""

    @abc.abstractmethod
    def unresolved(self, training_args) -> dict | str | None:
        """The configuration with sft's own resolved values set back to be resolved again (the sp size changed)."""

    @abc.abstractmethod
    def check_experts(self, ep: int, sp: int, family: str, is_moe: bool, lora: bool, resume=None) -> None:
        """Refuse an expert-parallel setting the engine cannot run (or a resume that would change the experts'
        layout), before the model loads."""

    def sharded_cost(self, params: int, gpus: int):
        """What fully sharding the weights cost against sharding only the optimizer and gradients in the engine's
        nearest measured setting (`describe()`, `ratio`), or None where nothing was measured."""
        return None

    # --- the model and the optimizer ---
    def accelerator_ready(self, trainer) -> None:
        """After transformers made the trainer's accelerator: anything the engine needs of it before the model is
        prepared (nothing by default)."""
        return None

    def optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """After transformers made the optimizer, before the engine wraps it: anything the engine's step needs of its
        parameter groups (nothing by default)."""
        return None

    def model_state_to_save(self, trainer) -> dict | None:
        """The whole model's weights for the final save where the library's `save_model` would not write them (a
        collective: every process calls it), else None (transformers saves as it does)."""
        return None

    @abc.abstractmethod
    def prepare_model_build(self) -> bool:
        """Before the model is built: start what the build needs; returns whether the model is built partitioned."""

    @abc.abstractmethod
    def partition_loaded(self, model: torch.nn.Module) -> None:
        """A model loaded whole in host memory (QLoRA under sharding) partitioned now, one weight at a time."""

    @abc.abstractmethod
    def compiled_layers_ready(self, layers) -> int:
        """After the engine wrapped the model: its hooks inside compiled decoder layers made to run eagerly; the
        number of hooks changed."""

    @abc.abstractmethod
    def gradient_divisor(self) -> int:
        """What the engine divides the sum of all ranks' gradients by (sequence parallelism scales the loss by it)."""

    def sequence_parallel_config(self, dims, attn_implementation: str):
        """accelerate's `ParallelismConfig` for sequence parallelism over `dims` (the trainer sets it on the training
        arguments before it is built); refused by an engine without sequence parallelism (`Traits.sequence_parallel`).
        """
        raise ConfigError(f"sequence parallelism is not {self.traits.label}'s: set `engine: deepspeed` (Ulysses).")

    @abc.abstractmethod
    def sequence_parallel_loader(self, loader):
        """The training loader wrapped so that each sequence-parallel rank gets its slice of every row."""

    # --- checkpoints ---
    @abc.abstractmethod
    def convert_for_resume(self, training_args, checkpoint: str) -> None:
        """Before the model is built: convert `checkpoint` if this run loads it in another layout (process count)."""

    @abc.abstractmethod
    def loading_checkpoint(self) -> contextlib.AbstractContextManager:
        """Around the library's checkpoint load."""

    @abc.abstractmethod
    def after_load(self, wrapped_model) -> int:
        """After a checkpoint load: the optimizer state placed where the optimizer expects it (logged); the tensors
        moved."""
