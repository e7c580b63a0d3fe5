"""README.md's commands and those of the docs/ pages its table lists, as a plan (what runs, in order), and how one
runs: used by the README walk, a session fixture (tests/multiproc/conftest.py) whose demo other tests reuse, and
checked by tests/multiproc/test_readme.py.

Every fenced `bash` block runs, command by command, unless its first line says what it needs that this machine
lacks (`# needs: ...`: GPUs, several nodes, the hub). The two set-up commands at the top run without their install
steps (the suite runs inside the environment they make), and the test command is the suite itself: it is checked
against `.ci/run` instead. A `python` block runs too, and the `text` block that follows it is what it must print.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, cli_env

README = ROOT / "README.md"
INSTALL = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate|pip install)")
TEST_COMMAND = "python -m pytest -q"


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comment lines dropped, install steps removed."""
    joined = re.sub(r"\\\n\s*", "", body)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        steps = [step for step in line.split(" && ") if not INSTALL.match(step.strip())]
        if steps:
            out.append(" && ".join(steps))
    return out


def pages() -> list[Path]:
    """README.md, then the pages of its Documentation table (`| [docs/x.md](docs/x.md) | ... |`), in its order."""
    table = re.findall(r"^\| \[docs/([\w.-]+\.md)\]", README.read_text(), re.M)
    return [README, *(ROOT / "docs" / name for name in table)]


def plan() -> list[tuple[str, str, str | None]]:
    """(kind, what to run, expected output or None) for README and its pages, in order; kind is bash, python or
    skip."""
    found = [block for page in pages() for block in blocks(page.read_text())]
    steps = []
    for i, (language, body) in enumerate(found):
        if language == "bash":
            first = body.splitlines()[0]
            if first.startswith("# needs:"):
                steps.append(("skip", first, None))
                continue
            steps += [("bash", command, None) for command in commands(body)]
        elif language == "python":
            follows = found[i + 1] if i + 1 < len(found) else ("", "")
            steps.append(("python", body, follows[1].strip() if follows[0] == "text" else None))
    return steps


def copy_repository(root: Path) -> Path:
    """A copy of the repository's tracked files at `root`: README's commands write outputs/ there, not into the
    checkout."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    return root


def run(sandbox: Path, kind: str, what: str) -> subprocess.CompletedProcess:
    env = cli_env(sandbox)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # python, sft, torchrun, lm_eval
    cmd = [sys.executable, "-c", what] if kind == "python" else ["bash", "-c", what]
    return subprocess.run(cmd, cwd=sandbox, env=env, capture_output=True, text=True, timeout=1200)


def expected_code(what: str) -> int:
    """0, or the exit code README says a command is meant to end with (`# exits N`)."""
    said = re.search(r"# exits (\d+)", what)
    return int(said.group(1)) if said else 0
