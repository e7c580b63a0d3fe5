"""The subcommands' argument parsing: argparse whose refusals are one line naming the flag, and number types that
refuse what no run can use (`sft plan --gpus 0`, `--seq-len -5`) as argparse's own errors."""

from __future__ import annotations

import argparse
import math


class Parser(argparse.ArgumentParser):
    """argparse's parser; a refusal is `prog: error: message (prog --help lists the options)`, one line, exit 2,
    instead of the usage block above it (sft plan's is 20 lines)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def whole(minimum: int = 1):
    """An argparse type: a whole number >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
        return value

    return parse


def positive(below: float | None = None, zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with `zero`), and < `below` where given."""

    def parse(text: str) -> float:
        wanted = f"a number {'>=' if zero else '>'} 0" + (f" and < {below:g}" if below is not None else "")
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        too_big = below is not None and value >= below
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero) or too_big:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse
