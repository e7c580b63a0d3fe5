"""What the benchmark scripts share: the sft command line under torchrun, model directories, the environment a
result was measured in, and the result writer. Scripts run as modules from the repository root
(`python -m benchmarks.<name>`), so they import this without touching `sys.path`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "recipes" / "demo" / "model"


def model_dir(path: Path, **config) -> Path:
    """A model directory at `path`: the demo's tokenizer and config.json with `config` applied (random weights are
    made by `from_scratch`)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in DEMO_MODEL.iterdir():
        shutil.copy(f, path)
    merged = {**json.loads((path / "config.json").read_text()), **config}
    (path / "config.json").write_text(json.dumps(merged, indent=2))
    return path


def llama_shape(hidden: int, layers: int, head_dim: int = 64, **extra) -> dict:
    """A Llama-style config of `hidden` width: 8/3 x hidden MLP (a multiple of 64), 4 query heads per KV head."""
    heads = hidden // head_dim
    return {
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 8 / 3) // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "head_dim": head_dim,
        **extra,
    }


def sft_command(nproc: int, args: list[str]) -> list[str]:
    """`sft/train.py` under torchrun (a free rendezvous port, so commands can run side by side)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(ROOT / "sft" / "train.py"), *args]


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float]:
    """Run `cmd` from the repository root, appending its output to `log`; (exit code, seconds)."""
    start = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=f, stderr=f).returncode
    return rc, time.time() - start


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Like `run`, in the background: wait for it with `.wait()`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "a")  # noqa: SIM115 (closed with the process)
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=f, stderr=f)


def environment() -> dict:
    """Where and with what a result was measured: date, device, library versions."""
    import platform

    import deepspeed
    import torch
    import transformers
    import trl

    gpus = torch.cuda.device_count()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "deepspeed": deepspeed.__version__,
        },
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_results(out: Path, tag: str, result: dict, markdown: str) -> None:
    """`<out>/<tag>.json` (everything) and `<out>/<tag>.md` (the table a person reads)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{tag}.md").write_text(markdown.rstrip() + "\n")
