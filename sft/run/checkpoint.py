"""Exact, crash-safe resume: which checkpoint to resume, whether it is complete, and whether it belongs to this run.

transformers and DeepSpeed already save and load the model, ZeRO shards, optimizer, LR scheduler, per-rank RNG and
trainer state; data order is a function of (seed, epoch) through accelerate's seeded sampler, and the trainer skips
the batches already trained. What none of them does, and this module does:

- completion markers: a checkpoint counts only once every rank has written and synced its files and the main
  process has written `sft_complete.json` last; `resume_from_checkpoint: auto` picks the newest complete one and
  moves incomplete ones aside (a job killed mid-save never crashes the next start);
- rotation (`save_total_limit`) that runs after the marker, over complete checkpoints only, and never deletes the
  newest complete checkpoint or the one the run resumed from;
- a fingerprint of what must match to resume exactly (seed, data, packing, tokenizer, global batch, model), checked
  before the model is built, and the counters TRL does not save (tokens seen);
- writing: `save_complete` wraps transformers' checkpoint save with the state file, the marker and the rotation, and
  `PreemptionCallback` turns SIGTERM/SIGUSR1 on any rank into one complete checkpoint and a stop.

A different number of processes is `sft.plan.preflight`'s (the global batch, by `sft.core.batch`) and the DeepSpeed
engine's (`ds_to_universal`). Every file written here is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import zipfile
from pathlib import Path

from transformers import TrainerCallback

from sft.core.outputs import RUN_MANIFEST, read_manifest  # sft's claim on an output_dir (written here)
from sft.core.run import GEOMETRY_FIELDS
from sft.errors import ConfigError

logger = logging.getLogger(__name__)

MARKER = "sft_complete.json"
STATE = "sft_state.json"
INCOMPLETE_DIR = "incomplete"
# Files sft writes into output_dir besides checkpoints (README.md is the model card TRL writes at each save;
# wandb_run.json the metrics log's; eval/ and merged/ are `sft eval`'s results and merged adapter; report/ is
# `sft report`'s)
SFT_ARTIFACTS = {
    "README.md", "metrics.jsonl", "metrics.discarded.jsonl", "data_trace", "runs", INCOMPLETE_DIR, RUN_MANIFEST,
    "wandb_run.json", "eval", "merged", "report", "data_stats.json",
}  # fmt: skip
# Fingerprint keys reconciled on a resume (`sft.plan.preflight`: the global batch is kept by recomputing accumulation):
# the batch geometry (`sft.core.run.GEOMETRY_FIELDS`) and the parallel sizes
GEOMETRY_KEYS = {*GEOMETRY_FIELDS, "parallel"}
VERSION_KEY = "versions"
# Test hook: the main process SIGKILLs itself in the save of this step, after every file but the marker is written.
KILL_DURING_SAVE_ENV = "SFT_TEST_KILL_DURING_SAVE"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-N` directories of output_dir, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_complete(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / MARKER).is_file()


def _file_damage(path: Path) -> str | None:
    """Why a checkpoint file cannot be read whole, from its structure alone (no tensor is loaded): empty, a torch
    zip archive without its central directory (truncated), a safetensors file shorter than its header says."""
    size = path.stat().st_size
    if size == 0:
        return "is empty"
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, OSError) as e:
            return f"is not a whole torch file ({e})"
    elif path.suffix == ".safetensors":
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            try:
                header = json.loads(f.read(length)) if 0 < length < size else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                header = None
        if header is None:
            return "has no readable safetensors header"
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + length + end != size:
            return f"is {size:,} bytes where its header says {8 + length + end:,} (truncated)"
    elif path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"is not valid JSON ({e})"
    return None


def _sharded_folder(path: Path) -> bool:
    """A torch.distributed.checkpoint folder, as transformers names FSDP's (`pytorch_model_fsdp_0`, `optimizer_0`) or
    by what it holds."""
    names = ("pytorch_model_fsdp_", "optimizer_")
    return path.is_dir() and (path.name.startswith(names) or (path / ".metadata").is_file()
                              or any(path.glob("*.distcp")))  # fmt: skip


def _sharded_damage(folder: Path) -> str | None:
    """What makes a torch.distributed.checkpoint folder (FSDP2's model or optimizer shards) unreadable: its
    `.metadata` missing or not readable, or a shard it names missing or shorter than the bytes it records."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / ".metadata").is_file():
        return ".metadata is missing (torch.distributed.checkpoint's index of the shards)"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 (any unpickling failure: the index is unreadable)
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            return f"{name} is missing (one process's shard)"
        if shard.stat().st_size < size:
            return f"{name} is cut short ({shard.stat().st_size} of {size} bytes)"
    return None


def damage(checkpoint: str | Path) -> str | None:
    """What makes a complete checkpoint unusable, naming the file, or None. Checks what transformers and the engine
    will read: sft's state, the trainer state, each rank's RNG state, DeepSpeed's `latest` tag and its shards (one
    per rank where there is one per rank), FSDP2's torch.distributed.checkpoint folders (their index and every shard
    it names), and every weight, optimizer and state file's structure."""
    ckpt = Path(checkpoint)
    try:
        state = read_state(ckpt)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        return f"{STATE} is not valid JSON ({e})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{STATE} has no global_step"
    fp = state.get("fingerprint")
    if not isinstance(fp, dict) or not all(isinstance(fp.get(k), int) and fp[k] >= 1 for k in GEOMETRY_FIELDS):
        return f"{STATE} has no fingerprint of the run's geometry ({', '.join(GEOMETRY_FIELDS)}: whole numbers)"
    if not (ckpt / "trainer_state.json").is_file():
        return "trainer_state.json is missing"
    world = int((state.get("fingerprint") or {}).get("world_size", 1))
    rng = ["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]
    missing = [name for name in rng if not (ckpt / name).is_file()]
    if missing and not (world == 1 and (ckpt / "rng_state_0.pth").is_file()):
        return f"{missing[0]} is missing (a run of {world} process(es) saves one RNG state per process)"
    latest = ckpt / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag:
            return "`latest` is empty (it names the folder of DeepSpeed's shards)"
        shards = ckpt / tag
        if not shards.is_dir():
            return f"`latest` names {tag!r}, which is not in the checkpoint"
        names = [f.name for f in shards.iterdir()]
        ranks = {}
        for kind in ("optim_states", "model_states"):
            ranks[kind] = sorted(
                int(m.group(1)) for name in names if (m := re.search(rf"zero_pp_rank_(\d+)_mp_rank_00_{kind}", name))
            )
            if ranks[kind] and ranks[kind] != list(range(world)):
                gone = sorted(set(range(world)) - set(ranks[kind]))
                return (f"{tag}/ lacks the {kind.replace('_', ' ')} of rank(s) {gone} ({len(ranks[kind])} of {world} "
                        "present)")  # fmt: skip
        # DeepSpeed reads the model and engine state first: one file under ZeRO-0/1/2, one per rank under ZeRO-3
        # (which also always writes each rank's optimizer shard)
        if not ranks["model_states"] and "mp_rank_00_model_states.pt" not in names:
            return f"{tag}/mp_rank_00_model_states.pt is missing (DeepSpeed's model and engine state)"
        if ranks["model_states"] and not ranks["optim_states"]:
            return f"{tag}/ has no optimizer shard (zero_pp_rank_<rank>_mp_rank_00_optim_states.pt) of any rank"
    for folder in sorted(p for p in ckpt.iterdir() if _sharded_folder(p)):
        problem = _sharded_damage(folder)
        if problem:
            return f"{folder.name}/{problem}"
    for path in sorted(ckpt.rglob("*")):
        if path.is_file() and path.suffix in (".pt", ".pth", ".bin", ".safetensors", ".json"):
            problem = _file_damage(path)
            if problem:
                return f"{path.relative_to(ckpt)} {problem}"
    return None


def write_json_synced(path: Path, payload: dict) -> None:
    """Write JSON and fsync the file and its directory, so that it is on disk before anything that follows."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_state(checkpoint: str | Path) -> dict | None:
    path = Path(checkpoint) / STATE
    return json.loads(path.read_text()) if path.is_file() else None


def fingerprint(script_args, data_args, plan, model_args, tokenizer, n_train: int) -> dict:
    """What must match (or, for the batch geometry, be reconciled) for a resume to continue the same run (`plan`:
    the run's `sft.core.run.RunPlan`)."""
    import torch
    import transformers
    import trl

    sources = [dataclasses.asdict(s) for s in data_args.datasets] or [
        {
            "path": script_args.dataset_name,
            "name": script_args.dataset_config,
            "split": script_args.dataset_train_split,
        }
    ]
    training_args, dims = plan.training_args, plan.dims
    return {
        "model": model_args.model_name_or_path,
        "architecture": plan.arch.identity(),
        "lora": json.loads(json.dumps({n: getattr(model_args, n, None) for n in LORA_FIELDS}))
        if model_args.use_peft
        else None,  # as the checkpoint's JSON will hold it (lists, not tuples)
        "from_scratch": model_args.from_scratch,
        "seed": training_args.seed,
        "data": {"sources": sources, "train_records": n_train, "test_split_size": data_args.test_split_size},
        "packing": {
            "packing": training_args.packing,
            "packing_strategy": training_args.packing_strategy,
            "padding_free": training_args.padding_free,
            "max_length": training_args.max_length,
            "assistant_only_loss": training_args.assistant_only_loss,
            "completion_only_loss": training_args.completion_only_loss,
        },
        "tokenizer": {
            "vocab": len(tokenizer),
            "chat_template": tokenizer.chat_template,
        },
        "world_size": dims.world_size,
        "parallel": {"dp": dims.dp, "sp": dims.sp, "ep": dims.ep, "autoep": plan.engine.experts is not None},
        "fp8": training_args.fp8_recipe if training_args.fp8 else False,
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),  # its states must load
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "global_batch": plan.batch.global_batch_size,
        VERSION_KEY: {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            **plan.engine.versions(),
        },
    }


# TRL's ModelConfig fields that shape or quantise what a LoRA/QLoRA checkpoint holds
LORA_FIELDS = (
    "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_rslora", "use_dora",
    "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "lora_target_parameters",
)  # fmt: skip
# Fingerprint keys added later, with the value a checkpoint written before them implies
ADDED_KEYS = {"fp8": False}
# ... and those a checkpoint written before them says nothing about (compared only when the checkpoint has them)
UNKNOWN_BEFORE = {"architecture", "lora", "optim"}


def _differences(key: str, saved, current) -> list[str]:
    """`key: checkpoint X vs now Y` for a differing entry; for two mappings, one such line per differing field."""
    if isinstance(saved, dict) and isinstance(current, dict):
        fields = [f for f in sorted(set(saved) | set(current)) if saved.get(f) != current.get(f)]
        return [line for f in fields for line in _differences(f"{key}.{f}", saved.get(f), current.get(f))]
    return [f"{key}: checkpoint {saved!r} vs now {current!r}"]


def compare_fingerprints(saved: dict, current: dict, where: str) -> None:
    """Refuse a checkpoint of another run; warn when only library versions differ."""
    saved = {**ADDED_KEYS, **saved}
    differ = [k for k in sorted(set(saved) | set(current)) if k not in GEOMETRY_KEYS | {VERSION_KEY}]
    differ = [k for k in differ if saved.get(k) != current.get(k) and (k in saved or k not in UNKNOWN_BEFORE)]
    if differ:
        details = "; ".join(line for k in differ for line in _differences(k, saved.get(k), current.get(k)))
        raise ConfigError(
            f"{where} belongs to a different run ({details}). Resuming it would not continue the same training: use "
            "a new --output_dir, restore the original settings, or pass --resume_from_checkpoint none with a new "
            "output_dir to start over."
        )
    if saved.get(VERSION_KEY) != current.get(VERSION_KEY):
        logger.warning(
            "Library versions differ from the checkpoint's (%s vs %s); the run continues, but bit-exactness is not "
            "guaranteed.",
            saved.get(VERSION_KEY),
            current.get(VERSION_KEY),
        )


def _foreign_entries(out: Path) -> list[str]:
    """What in output_dir is not this sft run's: everything, if sft never claimed the directory."""
    manifest = read_manifest(out)
    ours = manifest is not None or bool(checkpoints(out))
    if not ours:
        return sorted(p.name for p in out.iterdir() if not p.name.startswith(WRITE_PROBE))
    final = set((manifest or {}).get("files", []))
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name not in SFT_ARTIFACTS
        and p.name not in final
        and not CHECKPOINT_RE.match(p.name)
        and not p.name.startswith(WRITE_PROBE)  # another rank's probe of _check_writable
    )


WRITE_PROBE = ".sft-write-probe-"


def _check_writable(out: Path) -> None:
    """output_dir must be a directory (or not exist yet) that this process can create entries in: tried with an
    empty directory made and removed at once (permission bits alone do not tell for root, read-only mounts, /proc)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"`output_dir` {str(out)!r} is a file, not a directory: choose a directory path.")
    existing = next(p for p in (out, *out.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=WRITE_PROBE, dir=existing))
    except OSError as e:
        raise ConfigError(
            f"`output_dir` {str(out)!r} cannot be written: nothing can be created in {str(existing)!r} "
            f"({e.strerror or e}). Choose a directory you can write to."
        ) from None


def claim_output_dir(output_dir: str) -> None:
    """Write the run manifest into a new or empty output_dir (main process, before anything else is written)."""
    out = Path(output_dir)
    if read_manifest(out) is not None:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json_synced(out / RUN_MANIFEST, {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "finished_step": None})


def update_manifest(output_dir: str | Path, **entries) -> None:
    """Set `entries` in the run manifest (sft_run.json), the rest kept: its one read-modify-write (main process)."""
    out = Path(output_dir)
    manifest = read_manifest(out) or {}
    manifest.update(entries)
    write_json_synced(out / RUN_MANIFEST, manifest)


def record_settings(output_dir: str, fingerprint: dict) -> None:
    """The run's fingerprint (its settings: model, data, batch, packing, parallel sizes) in the run manifest, for
    `sft report`'s header."""
    update_manifest(output_dir, fingerprint=fingerprint)


def mark_finished(output_dir: str, step: int, max_steps: int, num_train_epochs: float, before: set[str]) -> None:
    """Record the finished step, the targets it was run with and the final model's files (those new since `before`)."""
    out = Path(output_dir)
    earlier = (read_manifest(out) or {}).get("files", [])
    files = sorted(set(earlier) | {p.name for p in out.iterdir()} - before - SFT_ARTIFACTS)
    files = [f for f in files if not CHECKPOINT_RE.match(f)]
    update_manifest(out, finished_step=step, max_steps=max_steps, num_train_epochs=num_train_epochs, files=files)


def _refuse_finished_run(out: Path, training_args, complete: list[Path]) -> None:
    """A finished run, rerun with the same targets, is finished: say so and how to train further."""
    manifest = read_manifest(out) or {}
    step = manifest.get("finished_step")
    if step is None:
        return
    raised = training_args.max_steps > max(manifest.get("max_steps", -1), 0) or (
        training_args.max_steps <= 0 and training_args.num_train_epochs > manifest.get("num_train_epochs", 0)
    )
    if raised and complete:
        logger.info("%s finished at step %d; continuing it to the raised target from %s", out, step, complete[-1].name)
        return
    how = (
        "it has no complete checkpoint to continue from, so train further in a new output_dir"
        if not complete
        else f"to train further raise max_steps or num_train_epochs: it then resumes from {complete[-1].name}"
    )
    raise ConfigError(
        f"`output_dir` {str(out)!r} holds a finished sft run (step {step}; the final model is saved there). Nothing "
        f"is left to train: {how}; or choose a new --output_dir for a new run."
    )


def resolve_resume(training_args) -> str | None:
    """The checkpoint to resume from (`auto`: newest complete one in output_dir; a path; `none`), or None.

    Refuses to start in an output_dir that holds anything but this run's own artifacts, so nothing a user made is
    written over. Runs on every rank before anything is written; the answer is the same on all of them.
    """
    value = training_args.resume_from_checkpoint
    out = Path(training_args.output_dir)
    if value is not None and str(value).lower() not in ("auto", "none", "false", "true"):
        path = Path(value)
        if not path.is_dir():
            raise ConfigError(f"`resume_from_checkpoint`: no such directory {value!r}.")
        if not is_complete(path):
            raise ConfigError(
                f"`resume_from_checkpoint`: {value} has no {MARKER}, so it may be half-written (a job killed while "
                "saving). Pick a complete checkpoint, or use `auto` to take the newest complete one."
            )
        problem = damage(path)
        if problem:
            raise ConfigError(f"`resume_from_checkpoint`: {value} is damaged: {problem}. Pick another checkpoint.")
        return str(path)
    auto = value is not None and str(value).lower() in ("auto", "true")
    _check_writable(out)
    if not out.is_dir() or not any(out.iterdir()):
        return None
    foreign = _foreign_entries(out)
    complete = _usable(out, [c for c in checkpoints(out) if is_complete(c)]) if not foreign else []
    if not auto or foreign:
        what = foreign or [p.name for p in sorted(out.iterdir())]
        raise ConfigError(
            f"`output_dir` {str(out)!r} already holds {', '.join(what[:4])}{', ...' if len(what) > 4 else ''}. sft "
            "does not write over a previous run: choose a new --output_dir or move that one away yourself"
            + (", or resume it with --resume_from_checkpoint auto." if complete and not auto else ".")
        )
    _refuse_finished_run(out, training_args, complete)
    newest = complete[-1] if complete else None
    for c in checkpoints(out):
        if is_complete(c) or (newest is not None and _step(c) < _step(newest)):
            continue
        logger.warning("Ignoring %s: it has no %s (its save did not finish).", c, MARKER)
    if newest is None:
        logger.warning("No complete checkpoint in %s: starting from step 0.", out)
    return str(newest) if newest else None


def _usable(out: Path, complete: list[Path]) -> list[Path]:
    """The complete checkpoints up to the newest undamaged one; the damaged ones after it are named (and moved aside
    by `set_aside_incomplete`). None usable while some are complete is an error."""
    for i in range(len(complete) - 1, -1, -1):
        problem = damage(complete[i])
        if problem is None:
            return complete[: i + 1]
        logger.warning(
            "%s is damaged: %s. It will be moved to %s/ and %s used instead.",
            complete[i], problem, INCOMPLETE_DIR, complete[i - 1].name if i else "no checkpoint",
        )  # fmt: skip
        last_problem = f"{complete[i].name}: {problem}"
    if complete:
        raise ConfigError(
            f"`output_dir` {str(out)!r}: no checkpoint can be resumed, every complete one is damaged (the oldest, "
            f"{last_problem}). Move the output_dir away and start again, or restore the files."
        )
    return complete


def _step(checkpoint: Path) -> int:
    return int(CHECKPOINT_RE.match(checkpoint.name).group(1))


def set_aside_incomplete(output_dir: str, resume_from: str | None) -> None:
    """Move checkpoints newer than the resume point that have no marker or are damaged into `incomplete/` (main
    process): never deleted."""
    start = read_state(resume_from)["global_step"] if resume_from else -1
    for c in checkpoints(output_dir):
        if _step(c) > start and (not is_complete(c) or damage(c)):
            target = Path(output_dir) / INCOMPLETE_DIR / f"{c.name}.{int(time.time())}"
            target.parent.mkdir(exist_ok=True)
            os.replace(c, target)
            logger.warning("Moved the incomplete or damaged %s to %s.", c, target)


def rotate(output_dir: str, limit: int | None, keep: set[str]) -> None:
    """Delete the oldest complete checkpoints beyond `limit`, never the newest one nor any in `keep`."""
    if not limit:
        return
    complete = [c for c in checkpoints(output_dir) if is_complete(c)]
    excess = len(complete) - max(limit, 1)
    for c in complete[:-1]:
        if excess <= 0:
            break
        if str(c.resolve()) in keep:
            continue
        logger.info("Deleting %s (save_total_limit=%d)", c, limit)
        shutil.rmtree(c)
        excess -= 1


class PreemptionCallback(TrainerCallback):
    """SIGTERM/SIGUSR1 on any rank: all ranks agree (one all-reduce per step), save a checkpoint and stop."""

    def __init__(self):
        self.requested = False
        self.preempted = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        logger.warning(
            "Received %s: will save a checkpoint and stop after this optimizer step", signal.Signals(signum).name
        )

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        flag = torch.tensor(float(self.requested), device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() > 0:
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
        return control


def save_complete(trainer, save, folder: Path, state: dict, keep: set[str]) -> None:
    """Run transformers' checkpoint save (`save()`), then write `state` to sft_state.json, wait for every rank's files
    to be on disk, write the marker last, and rotate (`save_total_limit`, never the checkpoints in `keep`)."""
    args = trainer.args
    limit = args.save_total_limit
    args.save_total_limit = None  # rotate only after the new checkpoint is marked complete
    try:
        save()
    finally:
        args.save_total_limit = limit
    if args.should_save:
        write_json_synced(folder / STATE, state)
    os.sync()  # every rank's files on disk ...
    trainer.accelerator.wait_for_everyone()  # ... on every rank, before the marker
    if os.environ.get(KILL_DURING_SAVE_ENV) == str(state["global_step"]) and args.process_index == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.should_save:
        write_json_synced(folder / MARKER, {"step": state["global_step"], "world_size": args.parallel.world_size})
        rotate(args.output_dir, limit, keep)
