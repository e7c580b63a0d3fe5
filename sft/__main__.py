"""`python -m sft <command>` (and `torchrun --nproc_per_node N -m sft train ...`): the `sft` command."""

import sys

from sft.cli import main

sys.exit(main())
