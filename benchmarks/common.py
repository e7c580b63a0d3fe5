"""What the benchmark scripts share: model shapes (tests use them too), SFT-like data, model directories, the sft
command line under torchrun, starting and stopping runs, the environment a result was measured in, and the result
writer. Scripts run as modules from the repository root (`python -m benchmarks.<name>`), so they import this without
touching `sys.path`. Results go to `benchmarks/results/<script>[_<variant>].{json,md}` (or a folder of that name).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "recipes" / "demo" / "model"
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "attention_dropout": 0.0, "dtype": "bfloat16", "pad_token_id": 1, "bos_token_id": 2,
    "eos_token_id": 3,
}  # fmt: skip
# Llama 3.x shapes from their public configs (token ids of the demo tokenizer; the weights are random)
LLAMA_SHAPES = {
    "llama-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
                 "tie_word_embeddings": True},
    "llama-3b": {**_LLAMA, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                 "num_attention_heads": 24, "head_dim": 128, "tie_word_embeddings": True},
    "llama-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "head_dim": 128,
                 "tie_word_embeddings": False},
    "llama-70b": {**_LLAMA, "num_attention_heads": 64, "hidden_size": 8192, "intermediate_size": 28672,
                  "num_hidden_layers": 80, "head_dim": 128, "tie_word_embeddings": False},
}  # fmt: skip


def model_dir(path: Path, config: dict | None = None, **overrides) -> Path:
    """A model directory at `path` (made once): the demo's tokenizer files and a config.json, `config` (default: the
    demo's) with `overrides` applied. The weights are made by `from_scratch`."""
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        for f in DEMO_MODEL.iterdir():
            shutil.copy(f, path)
        base = config if config is not None else json.loads((DEMO_MODEL / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**base, **overrides}, indent=2))
    return path


def make_sft_data(path: Path, n: int, vocab: int, max_len: int) -> None:
    """`n` pre-tokenised records with an SFT-like length distribution (log-normal, median about 300 tokens, clipped to
    16..max_len: tens to thousands of tokens with a long tail), random token ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=np.log(300), sigma=1.0, size=n), 16, max_len).astype(int)
    with open(path, "w") as f:
        for length in lengths:
            f.write(json.dumps({"input_ids": rng.integers(10, vocab, size=length).tolist()}) + "\n")


def random_checkpoint(path: Path, config: dict, std: float = 0.02, seed: int = 0, storage: str = "bfloat16") -> Path:
    """A `from_pretrained` directory of random Llama weights (normal(0, std), norms 1), written one decoder layer per
    safetensors shard so that no more than a layer is ever in memory (a 70B shape needs neither a download nor 140 GB
    of RAM); made on the GPU when there is one. `storage: float8_e4m3fn` stores the matrices in 1 byte (half the disk;
    `from_pretrained(dtype=bfloat16)` casts them back, and bitsandbytes quantizes the cast values). Made once: an
    existing directory with an index is kept."""
    import torch
    from safetensors.torch import save_file

    index_file = path / "model.safetensors.index.json"
    model_dir(path, config)
    if index_file.is_file():
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0, std, generator=gen).cpu()

    shards = {"embed": {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h)}}
    if not config.get("tie_word_embeddings"):
        shards["embed"]["lm_head.weight"] = normal(vocab, h)
    weight_map = {}
    for i in range(-1, config["num_hidden_layers"]):
        if i < 0:
            name, tensors = "embed", shards.pop("embed")
        else:
            pre = f"model.layers.{i}."
            name, tensors = f"layer{i:03d}", {
                pre + "self_attn.q_proj.weight": normal(q, h), pre + "self_attn.k_proj.weight": normal(kv, h),
                pre + "self_attn.v_proj.weight": normal(kv, h), pre + "self_attn.o_proj.weight": normal(h, q),
                pre + "mlp.gate_proj.weight": normal(inter, h), pre + "mlp.up_proj.weight": normal(inter, h),
                pre + "mlp.down_proj.weight": normal(h, inter),
                pre + "input_layernorm.weight": torch.ones(h), pre + "post_attention_layernorm.weight": torch.ones(h),
            }  # fmt: skip
        low = getattr(torch, storage)
        tensors = {k: v.to(low if v.dim() == 2 else torch.bfloat16).contiguous() for k, v in tensors.items()}
        save_file(tensors, path / f"model-{name}.safetensors", metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"model-{name}.safetensors"))
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return path


def fewer_layers(source: Path, path: Path, layers: int) -> Path:
    """A model directory of `source`'s first `layers` decoder layers: its shards linked, not copied (disk)."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    index = json.loads((source / "model.safetensors.index.json").read_text())
    keep = {k: v for k, v in index["weight_map"].items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < layers}  # fmt: skip
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, path)
    for shard in set(keep.values()):
        if not (path / shard).exists():
            (path / shard).symlink_to(source / shard)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=1))
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


def torchrun(nproc: int) -> list[str]:
    """torchrun with `nproc` processes on a free rendezvous port (so runs can go side by side)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def sft_command(nproc: int, args: list[str]) -> list[str]:
    """`sft/train.py` under torchrun (of the checkout in `SFT_CODE`, default this one: an earlier commit's package side
    by side with this one's, with PYTHONPATH pointing at it)."""
    code = Path(os.environ.get("SFT_CODE", ROOT))
    return [*torchrun(nproc), str(code / "sft" / "train.py"), *args]


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
    """Like `run`, in the background and in a process group of its own: wait for it with `.wait()`, end it and every
    process it started with `stop`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "a")  # noqa: SIM115 (closed with the process)
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=f, stderr=f, start_new_session=True
    )
    proc.log, proc.started = f, time.time()
    return proc


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL a run from `start` and everything in its process group (torchrun's workers, their data loaders), and
    wait until none of them is alive: a worker that is still dying holds its GPU memory, and the next run on that GPU
    ran out of memory at its start (benchmarks/results/speed_sweep_h200x4)."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + timeout
    while _alive_in_group(proc.pid) and time.time() < deadline:
        time.sleep(0.2)


def free_gpus(gpu_ids: list[int], timeout: float = 60) -> list[str]:
    """Wait until no process computes on the GPUs `gpu_ids` (nvidia-smi), SIGKILL what is still there after `timeout`
    seconds; returns "pid (MiB)" of each process killed. Why: runs stopped by SIGKILL to their process group left a
    worker holding 120 GiB on its GPU into the next runs, which ran out of memory at their start (4 x H200,
    benchmarks/results/fsdp2_h200x4, call 2 and 3), and a machine's processes are all this sweep's."""
    import signal

    def holders() -> list[tuple[int, str]]:
        uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], text=True,
                               capture_output=True).stdout  # fmt: skip
        wanted = {u.split(",")[1].strip() for u in uuids.splitlines() if int(u.split(",")[0]) in gpu_ids}
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                              text=True, capture_output=True).stdout  # fmt: skip
        rows = [[f.strip() for f in line.split(",")] for line in apps.splitlines() if line.strip()]
        return [(int(pid), memory) for pid, uuid, memory in rows if uuid in wanted]

    deadline = time.time() + timeout
    while holders() and time.time() < deadline:
        time.sleep(1)
    killed = []
    for pid, memory in holders():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{pid} ({memory})")
    while holders() and time.time() < deadline + timeout:
        time.sleep(1)
    return killed


def _alive_in_group(group: int) -> bool:
    """Whether a process of process group `group` is alive (a zombie holds no memory: not counted)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def environment() -> dict:
    """Where and with what a result was measured: date, device, library versions."""
    import platform

    import deepspeed
    import torch
    import transformers
    import trl

    gpus = torch.cuda.device_count()
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "trl": trl.__version__, "deepspeed": deepspeed.__version__}  # fmt: skip
    for package in ("liger_kernel", "peft", "accelerate"):
        try:
            versions[package] = __import__(package).__version__
        except (ImportError, AttributeError):
            versions[package] = None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else platform.processor() or "cpu",
        "gpu": torch.cuda.get_device_name(0) if gpus else "cpu",
        "gpus_on_machine": gpus,
        "versions": versions,
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_results(out: Path, tag: str, result: dict, markdown: str) -> None:
    """`<out>/<tag>.json` (everything) and `<out>/<tag>.md` (the table a person reads)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{tag}.md").write_text(markdown.rstrip() + "\n")
