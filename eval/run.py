"""`python eval/run.py ...` is `sft eval ...` (the code is `sft.evaluation`); kept for existing scripts."""

import sys

from sft.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
