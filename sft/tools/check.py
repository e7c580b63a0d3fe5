"""`sft check --config recipe.yaml [--field value ...]`: the packing check on a recipe's own model and data, before
training it; nothing is trained and nothing of the recipe's output directory is read or written.

The run is built as `sft train` builds it (the same parsing, plan, data and model; `sft.train.build`), in one process
with no sharding engine, packed (`packing: true`, `padding_free: true`), into a temporary output directory; then the
training set's first packed rows go through the model against each of their samples alone
(`sft.run.packing_check`), in the dtype the run computes in. Exit code 0 when every sample is within the dtype's noise,
2 with the figures when packing leaks (or the recipe is refused). The model must fit one process's memory for a
forward pass (the memory plan, which is a training run's, does not stop it: `plan_check: false`).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

import torch

from sft.core.recipe import with_config
from sft.errors import SFTError

# what makes the built run a packed one-process run that the check can read without touching the recipe's outputs
OVERRIDES = ("--packing", "true", "--padding_free", "true", "--packing_check", "true", "--engine", "deepspeed",
             "--deepspeed", "none", "--sequence_parallel_size", "1", "--expert_parallel_size", "1",
             "--plan_check", "false", "--report_to", "none", "--resume_from_checkpoint", "none")  # fmt: skip
REASON = "sft check"


def usage(prog: str) -> str:
    return (f"usage: {prog} [--config] RECIPE.yaml [--field value ...]\n\n"
            f"{__doc__.split(chr(10) + chr(10))[0].split(': ', 1)[1]}\n"
            "The recipe's fields and overrides are `sft train`'s (sft train --help); exit code 0: packing is exact, "
            "2: it leaks (the figures say by how much) or the recipe is refused.")  # fmt: skip


def run_check(argv: list[str]):
    """Build the run (one process, a temporary output directory) and check its first packed rows; the Result."""
    from sft.parallel.distributed import lone_process_environment
    from sft.run import failsafe, packing_check
    from sft.train import build

    lone_process_environment()
    with tempfile.TemporaryDirectory(prefix="sft-check-") as output_dir:
        trainer, plan, _, _ = build([*argv, *OVERRIDES, "--output_dir", output_dir], failsafe.OutOfMemoryWatch())
        args, model = plan.training_args, trainer.model
        mixed = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        weights = next(model.parameters()).dtype
        autocast = (torch.autocast(args.device.type, dtype=mixed) if mixed is not None and weights != mixed
                    else contextlib.nullcontext())  # fmt: skip
        try:
            with autocast:
                return packing_check.check(model, model, trainer.train_dataset, trainer.data_collator, args, REASON)
        finally:
            trainer.end()


def main(argv: list[str] | None = None, prog: str = "sft check") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(usage(prog))
        return 0 if argv else 2
    try:
        result = run_check(with_config(argv, prog))
    except SFTError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if result is None:
        print(f"{prog}: the training set is streamed: there are no first rows to check", file=sys.stderr)
        return 2
    print(f"{prog}: packing is exact: {result.sentence()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
