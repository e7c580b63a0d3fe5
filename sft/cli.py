"""`sft`: one command for sft's tools; each subcommand is the module that `python -m` runs too.

sft train --nproc-per-node 2 --config recipes/demo.yaml  # starts 2 workers (torchrun's agent); without: 1 process
sft plan --model recipes/demo/model --gpus 2 --gpu-memory 80 --suggest
sft batch --global-batch-size 128 --world-size 8 --per-device-batch-size 2
sft merge --adapter outputs/run --output outputs/run-merged
sft eval --model outputs/demo --tasks sft_demo
sft report outputs/demo [outputs/other ...]
sft data recipes/demo.yaml [--gpus 8]
sft check --config recipes/demo.yaml
"""

from __future__ import annotations

import difflib
import importlib
import sys

# subcommand -> (module, what it does); every module has `main(argv, prog)`, `sft.train` also `run(argv)`
COMMANDS = {
    "train": ("sft.train", "fine-tune a model from a recipe (the same as sft/train.py)"),
    "plan": ("sft.plan.cli", "per-GPU memory of a setting, whether it fits, the fastest that does"),
    "batch": ("sft.core.batch", "gradient accumulation steps for a global batch on a number of GPUs"),
    "merge": ("sft.tools.merge", "merge a LoRA adapter into its base model"),
    "eval": ("sft.tools.evaluation", "evaluate a model or adapter with lm-eval"),
    "report": ("sft.tools.report", "plots and an HTML page of one or more runs' curves"),
    "data": ("sft.data.stats", "a recipe's data once tokenised: lengths, truncation, packing, steps per epoch"),
    "check": ("sft.tools.check", "a recipe's packed rows against each sample alone, on its own model (no training)"),
}


def usage() -> str:
    lines = ["usage: sft <command> [options]   (sft <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:<7} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        hint = difflib.get_close_matches(name, COMMANDS, n=1)
        print(
            f"sft: unknown command {name!r}{f'; did you mean {hint[0]!r}?' if hint else ''}\n\n{usage()}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    if name == "train":
        module.run(rest)  # exits with the run's code (sft.core.leave)
    return module.main(rest, prog=f"sft {name}")


def run() -> None:
    """The `sft` command (and `python -m sft`): `main`, then leave with its code after the exit handlers, without the
    interpreter's teardown (`sft.core.leave`)."""
    from sft.core.leave import leave

    try:
        code = main()
    except SystemExit as e:  # argparse's refusals and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    leave(code)
