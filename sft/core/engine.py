"""What an engine declares about itself, and how it splits a run's training state: the plan, the model build and the
trainer read these, never an engine's name or its library's settings (issue #66). Each engine folder of
`sft/engines/` exports one spec holding its `Traits` (`sft.engines.SPECS`, the registry)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def gathers_weights_per_layer(self) -> bool:
        """Whether each pass gathers each layer's weights and frees them after (ZeRO-3's layout, FSDP2 resharded)."""
        return self.stage == 3
