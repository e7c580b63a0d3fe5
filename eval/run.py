"""`python eval/run.py ...` is `sft eval ...` (the code is `sft.evaluate`); kept for existing scripts."""

import sys

from sft.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
