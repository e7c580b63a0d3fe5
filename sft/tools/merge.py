"""Merge a LoRA adapter into its base model and write a `from_pretrained` directory.

    python -m sft.tools.merge --adapter outputs/run --output outputs/run-merged
    python -m sft.tools.merge --adapter outputs/run/checkpoint-500 --output merged [--base /path/to/base] [--dtype
    bfloat16]

`--adapter` is a directory that PEFT saved (the run's output_dir or a checkpoint: `adapter_config.json` and
`adapter_model.safetensors`), or a DeepSpeed checkpoint without them (ZeRO-3 with
`stage3_gather_16bit_weights_on_model_save: false`), whose LoRA weights are rebuilt with DeepSpeed's `zero_to_fp32`.
The base model is the adapter's `base_model_name_or_path` unless `--base` names another. PEFT's `merge_and_unload`
does the merge; the tokenizer is copied from the adapter directory (else the base).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from sft import engines
from sft.core import flags, logs
from sft.errors import ConfigError, SFTError

logger = logging.getLogger("sft.tools.merge")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def merge(adapter: str, output: str, base: str | None = None, dtype: str = "bfloat16") -> Path:
    import torch
    from peft import PeftConfig, PeftModel, set_peft_model_state_dict
    from transformers import AutoConfig, AutoTokenizer

    from sft.model import architectures

    adapter_dir, out = Path(adapter), Path(output)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ConfigError(
            f"--adapter {adapter}: no adapter_config.json there. Give the output_dir of a run with `use_peft: true` "
            "or one of its checkpoint-* directories."
        )
    if out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"--output {output} exists and is not empty; sft.tools.merge does not write over it. Pick a new one."
        )
    config = PeftConfig.from_pretrained(str(adapter_dir))
    base = base or config.base_model_name_or_path
    if not base:
        raise ConfigError(f"{adapter_dir}/adapter_config.json names no base model; pass --base.")
    torch_dtype = getattr(torch, dtype)
    try:
        base_config = AutoConfig.from_pretrained(base)
        model = architectures.model_class(base_config).from_pretrained(base, dtype=torch_dtype)
    except OSError as e:
        raise ConfigError(f"--base {base!r}: cannot load the base model ({e}).") from e
    has_weights = any((adapter_dir / f).is_file() for f in ADAPTER_FILES)
    if has_weights:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    else:
        if not (adapter_dir / "latest").is_file():
            raise ConfigError(
                f"--adapter {adapter}: neither adapter weights ({', '.join(ADAPTER_FILES)}) nor a DeepSpeed "
                "checkpoint."
            )
        from peft import get_peft_model

        model = get_peft_model(model, config)
        result = set_peft_model_state_dict(model, engines.lora_state(adapter_dir))
        if getattr(result, "unexpected_keys", None):
            raise ConfigError(f"--adapter {adapter}: LoRA keys that do not fit {base}: {result.unexpected_keys[:3]}")
    merged = model.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(out)
    if architectures.is_vision(base_config) or (Path(base) / "preprocessor_config.json").is_file():  # Gemma 3 too
        # the merged directory loads and generates on its own
        from sft.data import vision

        vision.save_image_processor(base, str(out))
    (out / "sft_merge.json").write_text(json.dumps({"adapter": str(adapter_dir), "base": base, "dtype": dtype}) + "\n")
    logger.info("Merged %s into %s -> %s", adapter_dir, base, out)
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = flags.Parser(prog=prog or "python -m sft.tools.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="Run output_dir or checkpoint with a LoRA adapter")
    parser.add_argument("--output", required=True, help="New directory for the merged model")
    parser.add_argument("--base", help="Base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    logs.quiet_accelerator_detection()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        out = merge(args.adapter, args.output, args.base, args.dtype)
    except SFTError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
