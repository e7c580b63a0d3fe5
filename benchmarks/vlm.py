"""Vision-language SFT on one GPU: sft's default against TRL's own VLM path, Qwen2.5-VL-7B widths (issue #55).

    python -m benchmarks.vlm --out $OUT                     # both runs on GPU 0, one after the other
    python -m benchmarks.vlm --tiny --out /tmp/vlm          # CPU smoke test: the demo's widths, a few steps

The model is Qwen2.5-VL-7B's public config (text: hidden 3584, 28 heads, 4 KV heads, MLP 18944, vocab 152064; vision:
32 blocks of hidden 1280, windows of 112 pixels, full attention in blocks 7/15/23/31) with `--layers` of its 28
decoder layers (as fit one GPU with the full fine-tuning's optimizer state), random weights made on the GPU (the
same seed for both runs), bf16 weights. The data (made here, the same files for both): chats of one image and a
question, then an answer; images of random sizes (sides 224-896 pixels: 64-1,024 image tokens each under the
processor's 1,003,520-pixel cap), questions of 20-120 and answers of 20-2,000 text tokens (log-normal, median 300;
the demo tokenizer's characters as text). Loss on the answers only (`assistant_only_loss`) in both; the vision
encoder frozen in both (sft's default; done by hand for TRL), its projector trained.

- `sft`: `python sft/train.py --config ...` with sft's defaults: image+text samples packed exactly into rows of
  `--max-length` tokens (`sft.data.vision`), the attention backend, micro batch and checkpointing from the plan,
  `global_batch_size: --rows` rows per step.
- `trl`: TRL's SFTTrainer as its docs set up a VLM (`AutoModelForImageTextToText`, a processor, `max_length: None`:
  no truncation of image tokens; TRL refuses packing and padding-free for images), tuned as a skilled user runs it
  (`--trl-setting tuned`, the default, issue #65): length-grouped batches (transformers' `train_sampling_strategy:
  group_by_length` over a `length` column of each record's image and text tokens), micro batch `--trl-batch` (10: the
  largest that fit one H100 in the issue's measurement) x `--trl-accumulation` (7: 70 samples, about sft's 8 rows), no
  checkpointing (it fits without), sdpa (its flash and efficient kernels). `--trl-setting defaults` is TRL left at
  its defaults (random order, gradient checkpointing; micro 4 x 18), what session 30's 11.1x compared against. The GPU
  image has no torchvision, so the processor is Qwen2.5-VL's with its
  video processor left out (`ImageProcessorOnly`: only the check of a video processor's class is skipped).

Both count tokens (every non-padding token, image tokens included) and FLOPs the same way (`sft.model.flops`: the
language model per token, the encoder per image patch, attention over the real lengths), so MFU is comparable; the
first `--warmup` steps are left out. Loss curves are beside each other by samples seen (`<out>/vlm.png`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import ROOT, environment, stop, torchrun, write_results

DEMO = ROOT / "recipes" / "demo-vlm" / "model"
MAX_PIXELS = 1280 * 28 * 28
TEXT_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "vocab_size": 152064, "hidden_act": "silu",
           "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                             "mrope_section": [16, 24, 24]}}  # fmt: skip
VISION_7B = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
             "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
             "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "in_channels": 3}  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyz     "


def make_model(work: Path, layers: int, tiny: bool) -> Path:
    """A model directory: the demo's tokenizer, chat template and image processor, a Qwen2.5-VL config of 7B widths
    (or the demo's own, `tiny`) with `layers` decoder layers; no weights (`from_scratch`)."""
    path = work / "model"
    path.mkdir(parents=True, exist_ok=True)
    for f in DEMO.iterdir():
        shutil.copy(f, path)
    config = json.loads((DEMO / "config.json").read_text())
    processor = json.loads((DEMO / "preprocessor_config.json").read_text())
    if not tiny:
        text = config["text_config"]
        config["text_config"] = {**text, **TEXT_7B, "num_hidden_layers": layers}
        config["vision_config"] = VISION_7B
        config["dtype"] = "bfloat16"
        processor["size"] = {"shortest_edge": 56 * 56, "longest_edge": MAX_PIXELS}
        processor.update(min_pixels=56 * 56, max_pixels=MAX_PIXELS)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def make_data(work: Path, n: int, tiny: bool, seed: int = 0) -> Path:
    """`n` records (JSON lines, images as JPEG files beside them) of one image of random size, a question and an
    answer of random text."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    data = work / "data"
    (data / "img").mkdir(parents=True, exist_ok=True)
    low, high = (28, 112) if tiny else (224, 896)
    with open(data / "train.jsonl", "w") as f:
        for i in range(n):
            w, h = rng.randint(low, high), rng.randint(low, high)
            image = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
            pen = ImageDraw.Draw(image)
            for _ in range(6):
                x, y = rng.randrange(w), rng.randrange(h)
                pen.rectangle((x, y, x + rng.randint(4, w // 2), y + rng.randint(4, h // 2)),
                              fill=tuple(rng.randrange(256) for _ in range(3)))  # fmt: skip
            image.save(data / "img" / f"{i}.jpg", quality=90)
            answer = int(min(max(rng.lognormvariate(math.log(60 if tiny else 300), 1.0), 20), 200 if tiny else 2000))
            text = lambda k: "".join(rng.choice(LETTERS) for _ in range(k)).strip() or "a"  # noqa: E731
            record = {"messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text(rng.randint(20, 120))}]},
                {"role": "assistant", "content": [{"type": "text", "text": text(answer)}]},
            ], "images": [f"img/{i}.jpg"]}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    return data / "train.jsonl"


COMMON = {"from_scratch": True, "learning_rate": 1e-5, "lr_scheduler_type": "constant", "warmup_steps": 0,
          "weight_decay": 0.0, "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none",
          "seed": 0, "assistant_only_loss": True, "dataloader_num_workers": 8}  # fmt: skip


def timed_run(cmd: list[str], log: Path, timeout: float):
    """Run `cmd` from the repository root into `log`; its exit code, or "timeout" (killed, what it wrote kept)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=f, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            return "timeout"


# `sft-master`: sft with fp32 master weights (DeepSpeed ZeRO-2's copy, torch's fused fp32 AdamW; no memory cap): the
# loss curve that sft's default without an engine (bf16 weights, 8-bit AdamW with stochastic rounding) is checked
# against (issue #65); `sft-m<N>`: sft's default at micro batch N (the memory plan checked at a second point)
MASTER = {"deepspeed": str(ROOT / "ds_configs" / "zero2.json"), "engine": "deepspeed", "optim": "adamw_torch_fused"}
# `sft-<engine>x<N>`: sft's defaults under one engine on N processes (`sft-z3x2`, `sft-fsdp2x2`): the engines measured
# side by side for image+text models (issue #65: `engine: auto` weighs FSDP2 only where it was measured)
ENGINE_ARMS = {"z2": {"engine": "deepspeed", "deepspeed": str(ROOT / "ds_configs" / "zero2.json")},
               "z3": {"engine": "deepspeed", "deepspeed": str(ROOT / "ds_configs" / "zero3.json")},
               "fsdp2": {"engine": "fsdp2", "deepspeed": "none"}}  # fmt: skip


def engine_arm(arm: str) -> tuple[dict, int]:
    """The recipe changes and process count of an `sft-<engine>x<N>` arm; ({}, 1) for any other."""
    head, _, count = arm.removeprefix("sft-").rpartition("x")
    if head in ENGINE_ARMS and count.isdigit():
        return ENGINE_ARMS[head], int(count)
    return {}, 1


def run_sft(args, work: Path, model: Path, data: Path, arm: str = "sft") -> dict:
    recipe = {**COMMON, "model_name_or_path": str(model), "datasets": [{"path": str(data)}],
              "output_dir": str(work / arm), "max_steps": args.steps, "packing": True,
              "max_length": args.max_length, "global_batch_size": args.rows}  # fmt: skip
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", peak_tflops=1.0, dataloader_num_workers=0)
    else:
        recipe.update(bf16=True, dtype="bfloat16")
    if arm == "sft-master":
        recipe.update(MASTER)
    elif args.gpu_memory:  # plan for and cap at a smaller card's memory (an H100's on an H200)
        recipe.update(plan_gpu_memory_gib=args.gpu_memory, max_gpu_memory_gib=args.gpu_memory)
    if arm.startswith("sft-m") and arm[5:].isdigit():  # `sft-m1`: the default at a micro batch set by hand
        recipe["per_device_train_batch_size"] = int(arm[5:])
    engine, nproc = engine_arm(arm)
    recipe.update(engine)
    (work / f"{arm}.yaml").write_text(yaml.safe_dump(recipe))
    log = work / "logs" / f"{arm}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.reuse_sft and log.exists():  # a run of an earlier call on this machine
        rc, start = 0, time.time() - args.reuse_sft
    else:
        launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
        rc = timed_run([*launcher, "sft/train.py", "--config", str(work / f"{arm}.yaml")], log, args.run_timeout)
    metrics = work / arm / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in steps if "loss" in r and "tokens_per_second_per_gpu" in r]
    text = log.read_text()
    plan = [x.split("sft.plan.preflight: ", 1)[1] for x in text.splitlines() if "sft.plan.preflight: " in x]
    result = {"setting": arm, "exit_code": rc, "wall_s": round(time.time() - start, 1), "plan": plan[-12:],
              "steps": [{"step": r.get("step"), "loss": r["loss"], "tokens": r["tokens_per_step"],
                         "tokens_per_second_per_gpu": r["tokens_per_second_per_gpu"], "mfu": r.get("mfu"),
                         "peak_memory_gib": r.get("peak_memory_gib")} for r in steps]}  # fmt: skip
    if rc != 0 or not steps:
        result["log_tail"] = text[-4000:]
    return result


def run_trl(args, work: Path, model: Path, data: Path) -> dict:
    """TRL's arm in a process of its own (`--trl-worker`), as a user would run it."""
    log = work / "logs" / "trl.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out = work / "trl.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.vlm", "--trl-worker", str(out), "--model", str(model), "--data",
           str(data), "--steps", str(args.steps), "--trl-batch", str(args.trl_batch), "--trl-accumulation",
           str(args.trl_accumulation), "--trl-setting", args.trl_setting,
           *(["--tiny"] if args.tiny else []),
           *(["--gpu-memory", str(args.gpu_memory)] if args.gpu_memory else [])]  # fmt: skip
    start = time.time()
    rc = timed_run(cmd, log, args.run_timeout)
    result = {"setting": "trl", "exit_code": rc, "wall_s": round(time.time() - start, 1),
              "steps": json.loads(out.read_text()) if out.exists() else []}  # fmt: skip
    if rc != 0 or not result["steps"]:
        result["log_tail"] = log.read_text()[-4000:]
    return result


def record_length(record: dict) -> int:
    """About a record's tokens: its image's (one per 28 x 28 pixels after the 2 x 2 merge, as Qwen2.5-VL's processor
    counts them) and its text's characters (the demo tokenizer's one token each)."""
    from PIL import Image

    with Image.open(record["images"][0]) as image:
        w, h = image.size
    text = sum(len(part.get("text", "")) for m in record["messages"] for part in m["content"])
    return math.ceil(w / 28) * math.ceil(h / 28) + text


def trl_worker(args) -> None:
    """TRL's SFTTrainer on the same model and data; one line per optimizer step: loss, tokens, samples, seconds,
    FLOPs (sft's count), peak memory."""
    import datasets
    import torch
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Qwen2_5_VLProcessor,  # fmt: skip
        TrainerCallback,
        set_seed,
    )
    from trl import SFTConfig, SFTTrainer

    from sft.model import architectures
    from sft.model.flops import FlopCounter

    class ImageProcessorOnly(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    processor = ImageProcessorOnly(image_processor=AutoImageProcessor.from_pretrained(args.model),
                                   tokenizer=tokenizer, video_processor=None,
                                   chat_template=tokenizer.chat_template)  # fmt: skip
    config = AutoConfig.from_pretrained(args.model)
    set_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.gpu_memory and device == "cuda":  # the cap sft's arm has (`max_gpu_memory_gib`)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory * 2**30 / total))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for _, p in architectures.vision_tower_parameters(model):  # frozen by hand, as sft freezes it by default
        p.requires_grad_(False)
    base = Path(args.data).parent
    records = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    for r in records:
        r["images"] = [str(base / x) for x in r["images"]]
    tuned = args.trl_setting == "tuned"
    if tuned:  # what length grouping sorts by: the record's image tokens and its text's (one token a character)
        for r in records:
            r["length"] = record_length(r)
    dataset = datasets.Dataset.from_list(records).cast_column("images", datasets.Sequence(datasets.Image()))
    flops, rows = FlopCounter(model), []

    class Trainer(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            flops.add(inputs)
            self._tokens = getattr(self, "_tokens", 0) + int(inputs["attention_mask"].sum())
            self._samples = getattr(self, "_samples", 0) + int(inputs["attention_mask"].shape[0])
            return super().training_step(model, inputs, *rest, **kwargs)

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not rows or "end" in rows[-1]:
                rows.append({"begin": time.perf_counter()})

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            rows[-1].update(end=time.perf_counter(), step=state.global_step, tokens=trainer._tokens,
                            samples=trainer._samples, flops=float(flops.take(torch.device("cpu"))),
                            peak_memory_gib=memory)  # fmt: skip
            trainer._tokens = trainer._samples = 0
            done = rows[-1]
            print(f"step {done['step']}: {done['end'] - done['begin']:.2f} s, {done['tokens']} tokens", flush=True)
            Path(args.trl_worker).write_text(json.dumps(finished(rows)))

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs and rows:
                rows[-1]["loss"] = logs["loss"]
                Path(args.trl_worker).write_text(json.dumps(finished(rows)))

    training_args = SFTConfig(
        output_dir=str(Path(args.trl_worker).parent / "trl"), max_steps=args.steps, max_length=None,
        per_device_train_batch_size=args.trl_batch, gradient_accumulation_steps=args.trl_accumulation,
        bf16=not args.tiny, **{k: v for k, v in COMMON.items() if k != "from_scratch"},
        # the `length` column kept for the sampler (TRL's signature columns would drop it)
        **({"train_sampling_strategy": "group_by_length", "gradient_checkpointing": False,
            "remove_unused_columns": False} if tuned else {}),  # fmt: skip
    )  # fmt: skip
    if args.tiny:
        training_args.dataloader_num_workers = 0
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, processing_class=processor,
                      callbacks=[Steps()])  # fmt: skip
    if args.profile:
        return profile_micro_batch(trainer, dataset, args.trl_batch)
    trainer.train()
    Path(args.trl_worker).write_text(json.dumps(finished(rows)))


def profile_micro_batch(trainer, dataset, batch: int) -> None:
    """Where the time of TRL's micro batch goes, on the model and collator TRL's trainer set up: `training_step`
    timed, its vision encoder's forward timed on sdpa (transformers calls it once per image and window) and on sft's
    varlen name (one call per layer), and the profiler's top operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sft.model import attention

    args = trainer.args
    if args.activation_checkpointing:  # as `Trainer.train` turns it on (TRL's default)
        kwargs = dict(args.activation_checkpointing_kwargs or {})
        trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    model = trainer._wrap_model(trainer.model_wrapped)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    inputs = trainer._prepare_inputs(trainer.data_collator([dataset[i] for i in range(batch)]))

    def timed(fn, repeat=3) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        return (time.perf_counter() - start) / repeat

    report = {"input_ids": list(inputs["input_ids"].shape), "real_tokens": int(inputs["attention_mask"].sum()),
              "patches": int(inputs["image_grid_thw"].prod(-1).sum()),
              "training_step_s": timed(lambda: trainer.training_step(model, inputs))}  # fmt: skip
    visual = trainer.model.model.visual

    def encoder():
        with torch.no_grad():
            visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])

    report["encoder_forward_sdpa_s"] = timed(encoder)
    attention.register_varlen()
    trainer.model.config.vision_config._attn_implementation = attention.VARLEN
    attention.vision_encoder_on_varlen(trainer.model)
    report["encoder_forward_sft_varlen_s"] = timed(encoder)
    trainer.model.config.vision_config._attn_implementation = "sdpa"
    print(json.dumps(report), flush=True)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        trainer.training_step(model, inputs)
        sync()
    if gpu:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


def finished(rows: list[dict]) -> list[dict]:
    """The TRL worker's steps that ended, each with its seconds."""
    return [{**r, "seconds": r["end"] - r["begin"]} for r in rows if "end" in r]


def summarise(args, runs: dict) -> dict:
    """tokens/s and MFU over the steps after the warm-up; sft's from its own metrics, TRL's from the worker's clock."""
    peak = 1.0 if args.tiny else 989.0
    for name, r in runs.items():
        timed = r["steps"][args.warmup :]
        if not timed:
            continue
        if name.startswith("sft"):
            r["tokens_per_second_per_gpu"] = float(np.mean([s["tokens_per_second_per_gpu"] for s in timed]))
            r["mfu"] = float(np.mean([s["mfu"] for s in timed])) if timed[0]["mfu"] is not None else None
        else:
            seconds = sum(s["seconds"] for s in timed)
            r["tokens_per_second_per_gpu"] = sum(s["tokens"] for s in timed) / seconds
            r["mfu"] = sum(s["flops"] for s in timed) / seconds / 1e12 / peak
        r["tokens_per_step"] = float(np.mean([s["tokens"] for s in timed]))
        r["peak_memory_gib"] = max((s.get("peak_memory_gib") or 0.0) for s in r["steps"])
    ratios = {}
    if all("tokens_per_second_per_gpu" in runs.get(k, {}) for k in ("sft", "trl")):
        sft, trl = (runs[k]["tokens_per_second_per_gpu"] for k in ("sft", "trl"))
        ratios["sft / trl tokens/s"] = sft / trl
    from benchmarks.precision_curves import compare

    curves = {arm: {"loss": [s["loss"] for s in runs.get(k, {}).get("steps", []) if "loss" in s]}
              for arm, k in (("default", "sft"), ("fp32_master", "sft-master"))}  # fmt: skip
    against = compare(curves).get("default")  # sft's default against fp32 master weights, last half of the steps
    if against:
        ratios["sft / sft-master mean |loss difference|, last half of the steps, relative"] = against[
            "relative_to_master"
        ]
    return ratios


def plot(out: Path, runs: dict) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU image has none: `--plot DIR` draws it from vlm.json afterwards
        print("no matplotlib: vlm.png not drawn")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        tokens = np.cumsum([s["tokens"] for s in r["steps"]])
        ax.plot(tokens, [s.get("loss", np.nan) for s in r["steps"]], marker=".", label=name)
    ax.set_xlabel("tokens trained (image tokens included)")
    ax.set_ylabel("training loss (answers only)")
    ax.legend()
    ax.set_title("Qwen2.5-VL-7B widths, per optimizer step")
    fig.tight_layout()
    fig.savefig(out / "vlm.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layers", type=int, default=12, help="Decoder layers of the 28 (as fit one GPU)")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=8192, help="sft's packed row length")
    parser.add_argument("--rows", type=int, default=8, help="sft's global batch in packed rows")
    parser.add_argument(
        "--trl-batch", type=int, default=10, help="TRL's micro batch (10: the largest that fit one H100)"
    )
    parser.add_argument("--trl-accumulation", type=int, default=7, help="10 x 7 = 70 samples: about sft's 8 rows")
    parser.add_argument(
        "--trl-setting",
        choices=["tuned", "defaults"],
        default="tuned",
        help="tuned: length-grouped, no checkpointing; defaults: TRL's (random order, checkpointing)",
    )
    parser.add_argument("--gpu-memory", type=float, help="GiB both arms plan for and are capped at (an H100's)")
    parser.add_argument("--run-timeout", type=float, default=400, help="Seconds before a run is stopped")
    parser.add_argument("--reuse-sft", type=float, help="Read sft's run from --work (an earlier call); its wall s")
    parser.add_argument("--work", type=Path, help="Model, data and run folders (default <out>/work)")
    parser.add_argument("--plot", type=Path, help="Draw <dir>/vlm.png from <dir>/vlm.json; run nothing")
    parser.add_argument("--only", nargs="*", default=["sft", "trl"])
    parser.add_argument("--tiny", action="store_true", help="The demo's widths on the CPU: a smoke test")
    parser.add_argument("--profile", action="store_true", help="With --trl-worker: profile one TRL micro batch")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    if args.plot:
        return plot(args.plot, json.loads((args.plot / "vlm.json").read_text())["runs"])
    args.out.mkdir(parents=True, exist_ok=True)  # the plot and the results are written there (call 7 lost them)
    work = args.work or args.out / "work"
    model = make_model(work, args.layers, args.tiny)
    started = time.time()
    data = make_data(work, args.records, args.tiny)
    print(f"data: {args.records} records in {time.time() - started:.0f} s", flush=True)
    runs = {}
    for name in args.only:
        runs[name] = (
            run_sft(args, work, model, data, name) if name.startswith("sft") else run_trl(args, work, model, data)
        )
        print(name, {k: v for k, v in runs[name].items() if k != "steps"}, flush=True)
    ratios = summarise(args, runs)
    plot(args.out, runs)
    result = {"environment": environment(), "layers": args.layers, "records": args.records, "steps": args.steps,
              "warmup": args.warmup, "max_length": args.max_length, "rows": args.rows, "trl_batch": args.trl_batch,
              "trl_accumulation": args.trl_accumulation, "trl_setting": args.trl_setting, "runs": runs,
              "ratios": ratios}  # fmt: skip
    device = result["environment"]["device"]
    lines = [f"# Vision-language SFT, Qwen2.5-VL-7B widths ({args.layers} decoder layers), {device}", "",
             "| run | exit | tokens/s/GPU | MFU | tokens/step | peak GiB |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, r in runs.items():
        if "tokens_per_second_per_gpu" in r:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            lines.append(f"| {name} | {r['exit_code']} | {r['tokens_per_second_per_gpu']:.0f} | {mfu} | "
                         f"{r['tokens_per_step']:.0f} | {r['peak_memory_gib']:.1f} |")  # fmt: skip
        else:
            lines.append(f"| {name} | {r['exit_code']} | failed | | | |")
    lines += [""] + [f"- {k} = {v:.3f}" for k, v in ratios.items()]
    write_results(args.out, "vlm", result, "\n".join(lines) + "\n")
    for log in (work / "logs").glob("*.log"):
        shutil.copy(log, args.out / f"run_{log.name}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
