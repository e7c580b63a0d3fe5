"""What a run needs from the engine that shards and steps the model: the interface every engine implements.

sft decides a run once (`sft.plan.memory.run.RunPlan`, which holds its engine) and the rest of the package asks the
engine, never the library behind it: outside `sft/engines/` nothing imports deepspeed (tests/test_layout.py checks it).
A second engine (FSDP2) is a sibling of `sft/engines/deepspeed/` implementing this class.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sharding:
    """How an engine splits the training state: the ZeRO stage (None: not sharded, one replica per process) and what
    is offloaded to the CPU."""

    stage: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_ratio: float = 1.0  # optimizer offload: the share of the states on the CPU


class Engine(abc.ABC):
    """One run's engine, built once from its resolved configuration (`sft.engines.build`)."""

    name: str

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

    # --- the plan's decisions written into the configuration (`sft.plan.memory.preflight`) ---
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
