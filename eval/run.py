"""`python eval/run.py ...` is `sft eval ...` (the code is `sft.tools.evaluation`); kept for existing scripts."""

import sys

from sft.tools.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
