"""A run's training arguments: the parsed fields (`sft.config.TrainConfig`) with the engine entered.

`sft.config` parses and checks fields and knows no engine; here the engine registry (`sft.engines.SPECS`) writes the
chosen engine's configuration for the launch before transformers reads it (DeepSpeed's config resolved, FSDP2's
`fsdp` and `fsdp_config`), refuses a value of that configuration that contradicts a training argument once
transformers has resolved its own, and builds the run's engine once. `engine: auto` holds the registry's first engine
until the plan decides (`sft.plan.preflight`); the plan emits the final arguments through `with_values`, which keeps
this class.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from sft import engines
from sft.config import ENGINE_HELP, DataArguments, ModelArguments, ScriptArguments, TrainConfig
from sft.config import parse_args as parse_fields
from sft.core.dims import ParallelDims

__all__ = ["RunArguments", "parse_args"]


@dataclass
class RunArguments(TrainConfig):
    """`TrainConfig` whose engine is one of the registry's, its configuration written for the launch."""

    engine: str = field(
        default="auto",
        metadata={
            "help": ENGINE_HELP,
            "choices": [*engines.NAMES, "auto"],
        },
    )

    def _enter_engine(self, launch: ParallelDims) -> None:
        if self.engine == "auto":  # the registry's first engine until the plan decides
            self.engine = engines.NAMES[0]
        engines.spec(self.engine).prepare(self, launch)

    def __post_init__(self):
        super().__post_init__()
        engines.spec(self.engine).check_agrees(self)

    @functools.cached_property
    def run_engine(self) -> engines.Engine:
        """The run's engine (`sft.engines`: the `engine` field's), built once from these arguments' resolved
        configuration."""
        return engines.build(self)


def parse_args(
    args: list[str] | None = None,
) -> tuple[ScriptArguments, DataArguments, RunArguments, ModelArguments]:
    """A recipe plus command-line overrides parsed and checked (`sft.config.parse_args`) into a run's arguments, the
    engine entered; ConfigError on anything invalid."""
    return parse_fields(args, train=RunArguments)
