"""Evaluate a trained model with lm-eval: `simple_evaluate`, results next to the model, logged to the run's wandb.

    sft eval --model outputs/demo --tasks sft_demo                     # or: python eval/run.py ...
    sft eval --model outputs/demo-lora --tasks sft_demo                # an adapter: merged first (sft.tools.merge)
    sft eval --model outputs/llama-3.1-8b-sft --tasks gsm8k,ifeval --batch-size 8

`--model` is a `from_pretrained` directory or an adapter directory (merged into `<adapter>/merged` first). Tasks are
lm-eval's (where their data can be had) plus the local tasks under eval/tasks/ (`sft_demo`: the demo's held-out
records). The backend is vLLM when it is installed and a GPU is present, else transformers (`--backend` to choose).
The tokenizer's chat template is applied when it has one. Results go to `<model>/eval/results_<time>.json` and
`.md` (never over an earlier file); when the training run logged to wandb (`<model>/wandb_run.json`), the metrics are
added to that run as `eval/<task>/<metric>`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from sft.core import flags, logs
from sft.errors import ConfigError, SFTError

ROOT = Path(__file__).resolve().parents[2]  # the repository (sft/tools/evaluation.py)

logger = logging.getLogger("sft.eval")
TASKS_DIR = ROOT / "eval" / "tasks"


def resolve_model(model: str) -> Path:
    """The directory to evaluate: the model itself, or the merge of an adapter into its base."""
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"--model {model}: no such directory. Give a training output_dir or a merged model.")
    if (path / "adapter_config.json").is_file():
        merged = path / "merged"
        if not (merged / "config.json").is_file():
            from sft.tools.merge import merge

            logger.info("%s is a LoRA adapter: merging it into its base model first -> %s", path, merged)
            merge(str(path), str(merged))
        return merged
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {model}: neither a model (config.json) nor an adapter (adapter_config.json).")
    return path


def pick_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    import importlib.util

    import torch

    return "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "hf"


# `--batch-size auto` on a CPU: lm-eval's auto runs the model at decreasing batch sizes until one fits the memory,
# which on a CPU is time spent for nothing (the demo's sft_demo: 46 s with auto, 24 s with 16, 30 s with 1; 2 cores)
CPU_BATCH_SIZE = 16


def batch_size(requested: str, device: str) -> str | int:
    """lm-eval's batch size: as given, except `auto` on a CPU (nothing to probe there), which is CPU_BATCH_SIZE."""
    if requested == "auto" and device == "cpu":
        logger.info("--batch-size auto on the CPU: %d (lm-eval's search is for GPU memory)", CPU_BATCH_SIZE)
        return CPU_BATCH_SIZE
    return requested


def evaluate(args) -> dict:
    model_dir = resolve_model(args.model)  # bad input is refused before lm-eval (seconds to import) is loaded

    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=[str(TASKS_DIR), *args.include_path])
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"--tasks: unknown task(s) {unknown}. Local tasks: {sorted(p.stem for p in TASKS_DIR.rglob('*.yaml'))}; "
            "see `lm_eval ls tasks` for lm-eval's own."
        )
    chat = args.chat_template and AutoTokenizer.from_pretrained(str(model_dir)).chat_template is not None
    backend = pick_backend(args.backend)
    model_args = f"pretrained={model_dir},dtype={args.dtype}"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # lm-eval's default is cuda
    logger.info("Evaluating %s on %s with %s (chat template %s)", model_dir, tasks, backend, "on" if chat else "off")
    return lm_eval.simple_evaluate(
        model=backend,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=args.num_fewshot,
        batch_size=batch_size(args.batch_size, device),
        device=device,
        limit=args.limit,
        apply_chat_template=chat,
        log_samples=False,
    ), model_dir


def write_results(results: dict, model_dir: Path, model_arg: str) -> tuple[Path, Path]:
    from lm_eval.utils import make_table

    out = Path(model_arg) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path, md_path = out / f"results_{stamp}.json", out / f"results_{stamp}.md"
    n = 1
    while json_path.exists() or md_path.exists():  # never over an earlier evaluation
        json_path, md_path = out / f"results_{stamp}_{n}.json", out / f"results_{stamp}_{n}.md"
        n += 1
    keep = {k: results[k] for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples") if k in results}
    keep["model"] = str(model_dir)
    json_path.write_text(json.dumps(keep, indent=2, default=str) + "\n")
    md_path.write_text(f"# lm-eval results for {model_dir}\n\n" + make_table(results) + "\n")
    return json_path, md_path


def log_to_wandb(results: dict, model_arg: str) -> str | None:
    """Add the metrics to the training run's wandb run, if the run wrote wandb_run.json."""
    record = Path(model_arg) / "wandb_run.json"
    if not record.is_file():
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("%s names a wandb run but wandb is not installed; not logged there.", record)
        return None
    run_info = json.loads(record.read_text())
    metrics = {
        f"eval/{task}/{name.split(',')[0]}": value
        for task, values in results["results"].items()
        for name, value in values.items()
        if isinstance(value, int | float) and "stderr" not in name and name != "alias"
    }
    try:
        run = wandb.init(id=run_info["id"], project=run_info.get("project"), entity=run_info.get("entity"),
                         resume="allow", dir=str(Path(model_arg)))  # fmt: skip
    except Exception as e:  # wandb raises its own error types for login, network and permission problems
        logger.warning("Could not reach wandb run %s (%s); the results are in the files only.", run_info["id"], e)
        return None
    run.summary.update(metrics)
    run.log(metrics)
    run.finish()
    return run_info["id"]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = flags.Parser(prog=prog or "python eval/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Model or adapter directory")
    parser.add_argument("--tasks", required=True, help="Comma-separated lm-eval tasks, e.g. sft_demo or gsm8k,ifeval")
    parser.add_argument("--include-path", action="append", default=[], help="More directories of task YAMLs")
    parser.add_argument("--backend", default="auto", choices=["auto", "hf", "vllm"])
    parser.add_argument("--dtype", default="auto", help="Weights dtype for the backend (auto, bfloat16, float32)")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if there is a GPU, else cpu)")
    parser.add_argument(
        "--batch-size", default="auto", help=f"An integer or auto (a search on GPUs, {CPU_BATCH_SIZE} on a CPU)"
    )
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="Examples per task (or a fraction)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    args = parser.parse_args(argv)
    logs.quiet_accelerator_detection()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        results, model_dir = evaluate(args)
    except SFTError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    json_path, md_path = write_results(results, model_dir, args.model)
    run_id = log_to_wandb(results, args.model)
    print(make_table(results))
    print(f"results: {json_path} and {md_path}" + (f"; logged to wandb run {run_id}" if run_id else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
