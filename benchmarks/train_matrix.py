"""Train the same random-initialised model under several settings, side by side in one run; JSON + markdown out.

    python benchmarks/train_matrix.py --matrix liger --nproc 2 --out benchmarks/results

(Throughput against TRL, MFU and scaling: `benchmarks/throughput.py`, which reuses `make_data` and `LLAMA_1B` from
here.)

Data: pre-tokenised records with an SFT-like length distribution (log-normal, median about 300 tokens, clipped to
16..4096, so tens to thousands of tokens with a long tail), random token ids. Model: Llama-3.2-1B shape (hidden 2048,
16 layers, 32/8 heads, vocab 128256, tied embeddings), built from its config; `--tiny` swaps in the demo shape for a
CPU smoke test. Every setting runs the real CLI (`sft/train.py`) and is read back from its metrics.jsonl.

Matrix:
- liger (issue 3b): Liger off vs on, under ZeRO-2 and ZeRO-3, 20 steps; per-step loss difference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_dropout": 0.0, "dtype": "bfloat16",
    "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3,
}  # fmt: skip
COMMON = {"bf16": True, "dtype": "bfloat16", "learning_rate": 1e-4, "lr_scheduler_type": "constant",
          "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "seed": 0,
          "dataloader_num_workers": 2, "from_scratch": True}  # fmt: skip
LIGER = {
    f"{stage}_liger_{'on' if on else 'off'}": {"packing": True, "attn_implementation": "auto", "use_liger_kernel": on,
                                               "deepspeed": f"ds_configs/{stage}.json",
                                               "per_device_train_batch_size": 2}
    for stage in ("zero2", "zero3") for on in (False, True)
}  # fmt: skip


def make_data(path: Path, n: int, vocab: int, max_len: int) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=np.log(300), sigma=1.0, size=n), 16, max_len).astype(int)
    with open(path, "w") as f:
        for length in lengths:
            f.write(json.dumps({"input_ids": rng.integers(10, vocab, size=length).tolist()}) + "\n")


def run(name: str, settings: dict, args, work: Path, model: Path, data: Path) -> dict:
    recipe = {**COMMON, **settings, "model_name_or_path": str(model), "datasets": [{"path": str(data)}]}
    recipe.update(output_dir=str(work / name), max_steps=args.steps, max_length=args.max_length)
    recipe.setdefault("deepspeed", args.deepspeed)
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", use_liger_kernel=False)
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd += [str(ROOT / "sft" / "train.py"), "--config", str(work / f"{name}.yaml")]
    start = time.time()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=os.environ, stdout=log, stderr=log).returncode
    result = {"exit_code": rc, "wall_s": round(time.time() - start, 1), "settings": settings}
    metrics = work / name / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        result["log_tail"] = (work / f"{name}.log").read_text()[-3000:]
        return result
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    timed = steps[args.warmup :]
    result.update(
        losses=[r["loss"] for r in steps],
        tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
        tokens_per_step=float(np.mean([r["tokens_per_step"] for r in timed])),
        peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in steps),
        packing_efficiency=float(np.mean([r["packing_efficiency"] for r in timed]))
        if "packing_efficiency" in timed[0]
        else None,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", choices=["liger"], required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--deepspeed", default="none", help="DeepSpeed config for settings that name none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="Logged steps left out of the timing")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--tiny", action="store_true", help="Demo-sized model in fp32: a CPU smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp())
    model = work / "model"
    model.mkdir()
    for f in (ROOT / "recipes" / "demo" / "model").iterdir():
        if f.name != "config.json":
            shutil.copy(f, model)
    config = json.loads((ROOT / "recipes" / "demo" / "model" / "config.json").read_text()) if args.tiny else LLAMA_1B
    (model / "config.json").write_text(json.dumps(config, indent=2))
    data = work / "data.jsonl"
    make_data(data, args.records, config["vocab_size"], args.max_length)
    matrix = LIGER
    results = {name: run(name, settings, args, work, model, data) for name, settings in matrix.items()}
    report = {
        "matrix": args.matrix,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "nproc": args.nproc,
        "model": "demo (tiny)" if args.tiny else "Llama-3.2-1B shape, random init",
        "max_length": args.max_length,
        "steps": args.steps,
        "timed_steps": f"steps {args.warmup + 1}..{args.steps}",
        "versions": {"torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.matrix}_{args.nproc}gpu" + ("_tiny" if args.tiny else "")
    (args.out / f"{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# {args.matrix}: {report['model']}, {report['device']} x {args.nproc}, seq {args.max_length}", ""]
    lines += [
        "| setting | exit | tokens/s/GPU | tokens/step | peak GiB | packing eff. | final loss |",
        "|" + " --- |" * 7,
    ]
    for name, r in results.items():
        if r["exit_code"] != 0:
            lines.append(f"| {name} | {r['exit_code']} | failed | | | | |")
            continue
        eff = f"{r['packing_efficiency']:.3f}" if r["packing_efficiency"] is not None else "-"
        lines.append(
            f"| {name} | 0 | {r['tokens_per_second_per_gpu']:.0f} | {r['tokens_per_step']:.0f} | "
            f"{r['peak_memory_gib']:.1f} | {eff} | {r['losses'][-1]:.4f} |"
        )
    if args.matrix == "liger":
        for stage in ("zero2", "zero3"):
            off, on = results[f"{stage}_liger_off"], results[f"{stage}_liger_on"]
            if off["exit_code"] == on["exit_code"] == 0:
                diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"], strict=True))
                report[f"{stage}_max_abs_loss_diff"] = diff
                lines.append(f"\n{stage}: max |loss(Liger on) - loss(off)| over {args.steps} steps = {diff:.4g}")
        (args.out / f"{tag}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
