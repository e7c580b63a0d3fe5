"""`sft report RUN_DIR [RUN_DIR ...]`: a run's curves as PNG plots and one self-contained HTML page
(`sft.run.report` writes them; the end of training writes the same).

    sft report outputs/demo                       # outputs/demo/report/index.html and one PNG per plot
    sft report outputs/a outputs/b --out cmp/     # two runs overlaid, one legend entry each
"""

from __future__ import annotations

import sys

from sft.core import flags
from sft.errors import ConfigError
from sft.run.report import write


def main(argv: list[str] | None = None, prog: str = "python -m sft.tools.report") -> int:
    parser = flags.Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output_dir of an sft run (several: overlaid)")
    parser.add_argument("--out", help="Folder for index.html and the PNGs (default: RUN_DIR/report of the first)")
    args = parser.parse_args(argv)
    try:
        page = write(args.runs, args.out)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    print(f"Wrote {page} ({len(pngs)} plots: {', '.join(pngs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
