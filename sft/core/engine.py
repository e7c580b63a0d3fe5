"""What an engine declares about itself, and how it splits a run's training state: the plan, the model build and the
trainer read these, never an engine's name or its library's settings (issue #66). Each engine folder of
`sft/engines/` exports one spec holding its `Traits` (`sft.engines.SPECS`, the registry)."""

from __future__ import annotations

from dataclasses import dataclass

from sft.errors import ConfigError


@dataclass(frozen=True)
class Traits:
    """One engine's declared traits."""

    name: str  # the `engine` field's value
    label: str  # its name in logs and errors
    resume_flags: str  # the command-line flags that resume a checkpoint it wrote
    config_field: str  # the training argument that holds its configuration (`deepspeed`, `fsdp_config`)
    reshards_checkpoints: bool  # a run of another process count reads its checkpoints as they are (else converted)
    # each decoder layer a unit of whole parameters sharded as tensors (FSDP2's DTensors: torchao's own float8 layers,
    # fp32 master weights under mixed precision), gathered and its gradients reduce-scattered inside the passes;
    # else the gradients reduced in whole-model buckets after the backward (DeepSpeed)
    layer_units: bool
    host_hooks: bool  # sharded weights fetched and released by per-layer host hooks each pass (ZeRO-3)
    shards_weights_always: bool  # its weights are sharded at rest in every layout it runs (FSDP2), not by stage only
    float8_all_gather: bool  # FP8 layers' weights gathered in float8 (else a 16-bit copy is gathered)
    sequence_parallel: bool  # Ulysses sequence parallelism runs under it
    expert_parallel: bool  # AutoEP expert parallelism runs under it
    offload: bool  # its configuration offloads the optimizer states (a share) and the weights to the CPU
    eight_bit_moments: bool  # 8-bit AdamW moments measured under it (`optim: auto`'s 8-bit option)
    drops_nonfinite_steps: bool  # its optimizer skips a step whose gradients are not finite by itself
    in_place_of: int | None = None  # `engine: auto` weighs it against another's layout of this stage (None: never)


@dataclass(frozen=True)
class Sharding:
    """How an engine splits the training state, as a ZeRO-like layout (the memory plan's terms): `stage` None is not
    sharded (one replica per process), 1 the optimizer states, 2 the gradients too, 3 the weights too; and what is
    offloaded to the CPU."""

    stage: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_ratio: float = 1.0  # optimizer offload: the share of the states on the CPU

    def __post_init__(self):
        if self.stage not in (None, 0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}.")

    @property
    def engine(self) -> bool:
        """Whether an engine holds the training state (sharded or not: ZeRO-0 reduces the gradients in its buckets)."""
        return self.stage is not None

    @property
    def optimizer(self) -> bool:
        """Whether the optimizer states are sharded over the processes."""
        return (self.stage or 0) >= 1

    @property
    def gradients(self) -> bool:
        """Whether the gradients are sharded too (reduce-scattered, each process keeping its partition)."""
        return (self.stage or 0) >= 2

    @property
    def weights(self) -> bool:
        """Whether the weights are sharded too: each pass gathers each layer's and frees them after (ZeRO-3's layout,
        FSDP2 resharded)."""
        return (self.stage or 0) >= 3

    @property
    def label(self) -> str:
        """The layout in logs and plans."""
        return "no DeepSpeed" if self.stage is None else f"ZeRO-{self.stage}"
