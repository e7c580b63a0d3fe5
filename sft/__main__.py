"""`python -m sft <command>` (and `torchrun --nproc_per_node N -m sft train ...`): the `sft` command."""

from sft.cli import run

run()
