"""`python -m sft.plan`: the `sft plan` command (`sft.plan.cli`)."""

import sys

from sft.plan.cli import main

sys.exit(main())
