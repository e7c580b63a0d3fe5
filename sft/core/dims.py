"""Parallel dimensions: how the processes of a run split the work, computed once and read everywhere else.

Every process of a run is one GPU (or one CPU process). sft spreads work two ways: data parallelism with DeepSpeed ZeRO
(`dp` replicas, each reading its own data) and sequence parallelism (`sp` ranks sharing the tokens of one packed row,
`sft.parallel.sequence`); world size = dp x sp. A mixture-of-experts model's experts may also be split over `ep` data-
parallel ranks (`sft.engines.deepspeed.autoep`, DeepSpeed AutoEP): those ranks still read their own data, so `ep`
divides `dp` and changes no batch arithmetic, only where the experts live. Context and tensor parallelism (`cp`, `tp`)
and replicas of the sharded states (`dp_replicate`) are axes here, validated with the others, for the engines that
will run them (none does yet: a run's are 1). Everything
that needs one of these sizes — the batch arithmetic (`sft.core.batch`: global batch = data-parallel size x micro batch
x accumulation), the memory planner, the checkpoint fingerprint and the resume on another process count, tokens/s and
MFU per GPU — reads it from `ParallelDims`, so that a new dimension is a change here plus its consumers' use of it, not
a search for every `world_size` in the package. Like torchtitan's `ParallelDims`, the product of the dimensions must
equal the world size, and a rank's coordinates follow from its global rank (sequence-parallel ranks of one replica are
neighbours); unlike it, no device mesh is built here: DeepSpeed and accelerate build their own process groups from
these sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sft.errors import ConfigError

# The axes that multiply to the world size, outermost first, with their names in a plan's lines
AXES = (("dp", "data-parallel"), ("cp", "context-parallel"), ("sp", "sequence-parallel"), ("tp", "tensor-parallel"))


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of one run, every axis validated here once: `world_size` processes = `dp` (data-parallel ranks, each
    reading its own data: `dp_replicate` replicas of `dp_shard` ranks that shard the states among them) x `cp`
    (context-parallel ranks) x `sp` (Ulysses' sequence-parallel ranks) x `tp` (tensor-parallel ranks) per replica.
    `ep`: the data-parallel ranks each MoE layer's experts are split over (1: every rank has them all).
    `gpus_per_node` is the processes of one node (torchrun's LOCAL_WORLD_SIZE); `rank` this process's global rank.
    Consumers ask the properties (`*_enabled`, `non_data_parallel_size`, `seq_len_divisor`, a rank's coordinates).
    No engine runs context or tensor parallelism yet: a run's sizes have cp = tp = 1 (`sft.config` has no field for
    them)."""

    world_size: int
    dp: int
    sp: int = 1
    gpus_per_node: int | None = None
    rank: int = 0
    ep: int = 1
    cp: int = 1
    tp: int = 1
    dp_replicate: int = 1

    def __post_init__(self):
        for name in ("world_size", "dp", "sp", "ep", "cp", "tp", "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Parallel size `{name}` must be a whole number >= 1, got {value!r}.")
        if self.dp * self.non_data_parallel_size != self.world_size:
            sizes = " x ".join(f"{label} {getattr(self, name)}" for name, label in AXES
                               if name == "dp" or getattr(self, name) > 1)  # fmt: skip
            raise ConfigError(
                f"The parallel sizes do not multiply to the number of processes: {sizes} = "
                f"{self.dp * self.non_data_parallel_size}, but the run has {self.world_size} processes. Choose a "
                f"sequence-parallel size that divides {self.world_size}, or launch dp x sp processes."
            )
        for name, whole, what in (("dp_replicate", self.dp, "data-parallel processes (replicas of the sharded "
                                   "states)"), ("ep", self.dp, "data-parallel processes of this run")):  # fmt: skip
            if whole % getattr(self, name):
                key = "expert_parallel_size" if name == "ep" else name
                raise ConfigError(
                    f"`{key}` {getattr(self, name)} does not divide the {whole} {what}. "
                    f"Use one of {[d for d in range(1, whole + 1) if whole % d == 0]}."
                )

    @classmethod
    def build(
        cls, world_size: int, sp: int = 1, gpus_per_node: int | None = None, rank: int = 0, ep: int = 1, cp: int = 1,
        tp: int = 1, dp_replicate: int = 1,
    ) -> ParallelDims:  # fmt: skip
        """The dimensions of `world_size` processes with `sp` sequence-parallel ranks (and `cp`, `tp`; data
        parallelism fills the rest); a ConfigError names the values when `sp` does not divide the world size."""
        if not isinstance(sp, int) or sp < 1:
            raise ConfigError(f"`sequence_parallel_size` must be a whole number >= 1, got {sp!r}.")
        if world_size % sp:
            raise ConfigError(
                f"`sequence_parallel_size: {sp}` does not divide the {world_size} processes of this run. Use one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}, or launch a multiple of {sp} "
                "processes."
            )
        others = sp * max(cp, 1) * max(tp, 1)  # a size under 1 is named by the constructor
        return cls(world_size, max(world_size // others, 1), sp, gpus_per_node, rank, ep, cp, tp, dp_replicate)

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks one replica's states are sharded over (ZeRO's, FSDP's group)."""
        return self.dp // self.dp_replicate

    @property
    def non_data_parallel_size(self) -> int:
        """The ranks that share one data-parallel rank's rows: cp x sp x tp."""
        return self.cp * self.sp * self.tp

    @property
    def seq_len_divisor(self) -> int:
        """What a row's length must be a multiple of to split evenly: sp x tp, times 2 x cp (context parallelism's
        load balancing cuts each rank's share in two)."""
        return self.sp * self.tp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @classmethod
    def from_env(cls, sp: int = 1, ep: int = 1) -> ParallelDims:
        """The dimensions of this launch (torchrun's / the deepspeed launcher's WORLD_SIZE and LOCAL_WORLD_SIZE)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local, rank = int(os.environ.get("LOCAL_WORLD_SIZE", world)), int(os.environ.get("RANK", "0"))
        return cls.build(world, sp, local, rank, ep)

    @classmethod
    def of(cls, training_args) -> ParallelDims:
        """The dimensions of a run from its training arguments (the processes accelerate found)."""
        world, sp = training_args.world_size, getattr(training_args, "sequence_parallel_size", 1)
        local, ep = int(os.environ.get("LOCAL_WORLD_SIZE", world)), getattr(training_args, "expert_parallel_size", 1)
        return cls.build(world, sp, local, training_args.process_index, ep)

    # the axes from the outermost (ranks farthest apart) in: the tensor-parallel ranks of one sequence shard are
    # neighbours, then the sequence-parallel ranks of one replica (dp x cp x sp x tp, as torchtitan lays its mesh)
    def _coordinate(self, inner: int, size: int) -> int:
        return self.rank // inner % size

    @property
    def dp_rank(self) -> int:
        """Which data-parallel rank this process belongs to (the data shard it reads)."""
        return self.rank // self.non_data_parallel_size

    @property
    def cp_rank(self) -> int:
        return self._coordinate(self.sp * self.tp, self.cp)

    @property
    def sp_rank(self) -> int:
        """This process's place among the sequence-parallel ranks of its replica."""
        return self._coordinate(self.tp, self.sp)

    @property
    def tp_rank(self) -> int:
        return self._coordinate(1, self.tp)

    def describe(self) -> str:
        text = f"{self.world_size} process{'es' * (self.world_size > 1)}: data-parallel {self.dp}"
        if self.dp_replicate > 1:
            text += f" ({self.dp_replicate} replicas of {self.dp_shard} sharded)"
        text += "".join(f" x {label} {getattr(self, name)}" for name, label in AXES[1:] if getattr(self, name) > 1)
        return text + (f", experts split over {self.ep} of the data-parallel ranks" if self.ep > 1 else "")


def is_routed_expert(name: str) -> bool:
    """Whether parameter `name` is a routed expert's weight: a parameter of an MoE block's `experts` module
    (transformers' fused experts; shared experts are apart). What expert parallelism splits and the plan counts."""
    return name.rsplit(".", 2)[-2:-1] == ["experts"]
