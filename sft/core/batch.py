"""Global-batch arithmetic: a target global batch (samples, or tokens per step with packing) -> accumulation steps.

    python -m sft.core.batch --global-batch-size 528 --world-size 8 --per-device-batch-size 2
    python -m sft.core.batch --tokens-per-step 1048576 --max-length 4096 --world-size 16 --per-device-batch-size 4

global batch = data-parallel size x per-device micro batch x gradient accumulation steps (the data-parallel size
comes from `sft.core.dims`: the world size / the sequence-parallel size, whose ranks share each row). With packing
every row holds `max_length` tokens, so tokens per step = global batch x max_length. A target that the
data-parallel size and micro batch cannot reach exactly is an error that lists the nearest reachable targets and the
settings that reach the target. transformers and DeepSpeed take accumulation steps, not a global batch; this is the
one place that converts, for a fresh start (`plan_batch`) and for a resume that keeps a checkpoint's global batch on
another number of processes (`keep_global_batch`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from sft.core import flags
from sft.core.dims import ParallelDims
from sft.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    dp_size: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    max_length: int | None = None

    @property
    def global_batch_size(self) -> int:
        return self.dp_size * self.per_device_batch_size * self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.max_length is None else self.global_batch_size * self.max_length

    def steps_per_epoch(self, rows: int) -> int:
        """Optimizer steps in an epoch of `rows` rows, as transformers counts them: each data-parallel process's
        share of the rows in micro-batches, in whole accumulation windows."""
        micro_batches = math.ceil(math.ceil(rows / self.dp_size) / self.per_device_batch_size)
        return steps_per_epoch(micro_batches, self.gradient_accumulation_steps)

    def describe(self) -> str:
        text = (
            f"data-parallel size {self.dp_size} x micro batch {self.per_device_batch_size} x accumulation "
            f"{self.gradient_accumulation_steps} = global batch {self.global_batch_size}"
        )
        if self.tokens_per_step is not None:
            text += f" rows = {self.tokens_per_step:,} tokens per step at max_length {self.max_length}"
        return text


def steps_per_epoch(micro_batches: int, accumulation: int) -> int:
    """Optimizer steps in an epoch of `micro_batches` micro-batches per process (at least 1): the one place that
    counts them (`sft data`, the start's data figures, the trainer's resume checks)."""
    return max(micro_batches // accumulation, 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_batch(
    dp_size: int,
    per_device_batch_size: int,
    global_batch_size: int | None = None,
    tokens_per_step: int | None = None,
    max_length: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> BatchPlan:
    """The accumulation that reaches the target on `dp_size` replicas; ConfigError with the alternatives if none does.

    With neither target, `gradient_accumulation_steps` is kept as given.
    """
    for name, value in (("data-parallel size", dp_size), ("per_device_train_batch_size", per_device_batch_size)):
        if value < 1:
            raise ConfigError(f"`{name}` must be >= 1, got {value}.")
    if global_batch_size is not None and tokens_per_step is not None:
        raise ConfigError(
            f"Both `global_batch_size` ({global_batch_size}) and `tokens_per_step` ({tokens_per_step}) are set; "
            "give one target."
        )
    if tokens_per_step is not None:
        if not max_length:
            raise ConfigError(
                f"`tokens_per_step` ({tokens_per_step}) needs `max_length`: with packing each row holds max_length "
                "tokens, so tokens per step = rows x max_length. Set max_length, or use `global_batch_size`."
            )
        if tokens_per_step < 1 or tokens_per_step % max_length:
            lower = max(tokens_per_step // max_length, 1) * max_length
            raise ConfigError(
                f"`tokens_per_step` {tokens_per_step:,} is not a whole number of rows of max_length {max_length}; "
                f"nearest: {lower:,} ({lower // max_length} rows) or {lower + max_length:,} "
                f"({lower // max_length + 1} rows)."
            )
        global_batch_size = tokens_per_step // max_length
    if global_batch_size is None:
        return BatchPlan(dp_size, per_device_batch_size, gradient_accumulation_steps, max_length)
    if global_batch_size < 1:
        raise ConfigError(f"`global_batch_size` must be >= 1, got {global_batch_size}.")
    per_step = dp_size * per_device_batch_size
    if global_batch_size % per_step == 0:
        return BatchPlan(dp_size, per_device_batch_size, global_batch_size // per_step, max_length)
    unit = "tokens per step" if tokens_per_step is not None else "global batch"
    scale = max_length if tokens_per_step is not None else 1
    lower, upper = (global_batch_size // per_step) * per_step, (global_batch_size // per_step + 1) * per_step
    nearest = [n for n in (lower, upper) if n > 0]
    options = ", ".join(f"{n * scale:,} (accumulation {n // per_step})" for n in nearest)
    fixes = []
    if global_batch_size % dp_size == 0:
        micro = [d for d in _divisors(global_batch_size // dp_size) if d <= 16]
        pairs = ", ".join(f"{m} x {global_batch_size // dp_size // m}" for m in micro)
        fixes.append(f"per_device_train_batch_size x accumulation = {pairs}")
    else:
        sizes = [w for w in _divisors(global_batch_size) if w <= 1024][-6:]
        fixes.append(f"a data-parallel size (GPU count) that divides {global_batch_size}: {sizes}")
    raise ConfigError(
        f"{unit} {global_batch_size * scale:,} cannot be reached with data-parallel size {dp_size} x "
        f"per_device_train_batch_size {per_device_batch_size} = {per_step} rows per accumulation step. Nearest "
        f"reachable: {options}. Or keep the target with {'; or '.join(fixes)}."
    )


def micro_batches_for(global_batch: int | None, dp_size: int, candidates) -> tuple[int, ...]:
    """The `candidates` that reach `global_batch` exactly on `dp_size` replicas (all of them without a target)."""
    return tuple(m for m in candidates if not global_batch or global_batch % (dp_size * m) == 0)


def keep_global_batch(global_batch: int, dp_size: int, per_device_batch_size: int, trained_with: str) -> BatchPlan:
    """A resume: the checkpoint's global batch on `dp_size` replicas of `per_device_batch_size` rows.

    `trained_with` names the checkpoint and how it was made, for the error when the batch cannot be kept.
    """
    per_step = dp_size * per_device_batch_size
    if global_batch % per_step:
        feasible = list(micro_batches_for(global_batch, dp_size, range(1, global_batch + 1)))
        raise ConfigError(
            f"{trained_with}; data-parallel size {dp_size} x per_device_train_batch_size {per_device_batch_size} "
            f"cannot make {global_batch}. Use --per_device_train_batch_size in {feasible or 'none'} or a process "
            f"count that divides {global_batch}."
        )
    return BatchPlan(dp_size, per_device_batch_size, global_batch // per_step)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = flags.Parser(prog=prog or "python -m sft.core.batch", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--global-batch-size", type=flags.whole(1), help="Samples (packed rows) per optimizer step")
    target.add_argument(
        "--tokens-per-step", type=flags.whole(1), help="Tokens per optimizer step (packing; needs --max-length)"
    )
    parser.add_argument(
        "--world-size", type=flags.whole(1), required=True, help="Processes in all: nodes x GPUs per node"
    )
    parser.add_argument("--per-device-batch-size", type=flags.whole(1), required=True, help="Micro batch per process")
    parser.add_argument("--max-length", type=flags.whole(1), help="Tokens per packed row")
    parser.add_argument(
        "--sp", type=flags.whole(1), default=1, help="Sequence-parallel size: processes sharing each row"
    )
    args = parser.parse_args(argv)
    try:
        dims = ParallelDims.build(args.world_size, args.sp)
        plan = plan_batch(
            dims.dp, args.per_device_batch_size, args.global_batch_size, args.tokens_per_step, args.max_length
        )
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"gradient_accumulation_steps: {plan.gradient_accumulation_steps}")
    print(f"parallel sizes: {dims.describe()}")
    print(plan.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
