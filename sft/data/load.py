"""Load, check and mix the training data; TRL's SFTTrainer then tokenises and packs it.

What TRL does not do, and this module does:

- loads local files by extension and `save_to_disk` directories as well as hub ids (`trl.get_dataset` only calls
  `load_dataset`);
- turns ShareGPT and Alpaca records into `messages`, so sources of different chat formats can be mixed;
- checks every record and stops with the source, the record index and the problem (TRL fails later, deep inside
  tokenisation, or silently trains on a broken turn);
- carves the eval split with the run's seed, so every rank gets the same split.

All of it runs on the main process first while the other ranks wait (TRL's `global_then_local_main_first`, through
`sft.parallel.distributed.main_first_together`: an error on one rank stops every rank with it), and the others then
read the `datasets` cache that the main process wrote.
"""

from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path

import datasets
from trl import ScriptArguments
from trl.scripts.utils import DatasetConfig

from sft.config import DataArguments, TrainConfig
from sft.core.recipe import DATA_FILE_BUILDERS, missing_local_source
from sft.errors import DataError
from sft.parallel.distributed import main_first_together

logger = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "tool": "tool",
}
FORMATS = (
    "messages, conversations (ShareGPT from/value), instruction/output (Alpaca), prompt/completion, text, "
    "input_ids (already tokenised)"
)


def detect_format(columns: list[str], text_field: str) -> str | None:
    if "input_ids" in columns:
        return "tokenized"
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    if "instruction" in columns and "output" in columns:
        return "alpaca"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if text_field in columns:
        return "text"
    return None


def _check_turns(turns, field: str, roles: dict[str, str] | set[str], role_key: str, content_key: str) -> str | None:
    if turns is None:
        return f"missing field `{field}`"
    if not isinstance(turns, list):
        return f"`{field}` must be a list of turns, got {type(turns).__name__}"
    if not turns:
        return f"`{field}` is an empty conversation"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"`{field}[{i}]` must be an object with `{role_key}` and `{content_key}`, got {turn!r}"
        role, content = turn.get(role_key), turn.get(content_key)
        if role not in roles:
            return f"`{field}[{i}].{role_key}` is {role!r}, not one of {sorted(roles)}"
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            return (f"`{field}[{i}].{content_key}` holds an image part, and this model is not one sft trains on "
                    "images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; Gemma 3 and SmolVLM not yet): use one of those, or "
                    "drop the images from the data")  # fmt: skip
        if not isinstance(content, str):
            return f"`{field}[{i}].{content_key}` must be a string, got {type(content).__name__} ({content!r})"
        if not content.strip() and role not in ("system",):
            return f"`{field}[{i}].{content_key}` is empty (the {role} turn has no text)"
    return None


def _check_text(record: dict, field: str) -> str | None:
    value = record.get(field)
    if value is None:
        return f"missing field `{field}`"
    if not isinstance(value, str):
        return f"`{field}` must be a string, got {type(value).__name__} ({value!r})"
    if not value.strip() and field != "input":
        return f"`{field}` is empty"
    return None


def check_record(record: dict, fmt: str, text_field: str = "text") -> str | None:
    """What is wrong with one record of format ``fmt``, or None."""
    if fmt == "messages":
        return _check_turns(record.get("messages"), "messages", ROLES, "role", "content")
    if fmt == "sharegpt":
        return _check_turns(record.get("conversations"), "conversations", SHAREGPT_ROLES, "from", "value")
    if fmt == "alpaca":
        problem = _check_text(record, "instruction") or _check_text(record, "output")
        if problem is None and record.get("input") is not None and not isinstance(record["input"], str):
            problem = f"`input` must be a string, got {type(record['input']).__name__}"
        return problem
    if fmt == "tokenized":
        ids = record.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return "`input_ids` must be a non-empty list of token ids"
        return None
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            value = record.get(key)
            problem = (
                _check_turns(value, key, ROLES, "role", "content")
                if isinstance(value, list)
                else _check_text(record, key)
            )
            if problem:
                return problem
        return None
    return _check_text(record, text_field)


def to_canonical(record: dict, fmt: str, text_field: str = "text") -> dict:
    """The record in the column layout SFTTrainer reads: `messages`, `prompt`/`completion` or the text field."""
    if fmt == "messages":
        return {"messages": [{"role": t["role"], "content": t["content"]} for t in record["messages"]]}
    if fmt == "sharegpt":
        return {
            "messages": [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]
        }
    if fmt == "alpaca":
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]}
    if fmt == "prompt_completion":
        return {"prompt": record["prompt"], "completion": record["completion"]}
    if fmt == "tokenized":  # already tokenised: SFTTrainer only truncates and packs it
        return {"input_ids": record["input_ids"]}
    return {text_field: record[text_field]}


def check_utf8(path: Path, chunk: int = 1 << 24) -> None:
    """Bytes that are not UTF-8 in a text data file are a DataError naming the byte and line (pyarrow reads them
    without a word, and they fail later, deep inside tokenisation). Read in chunks: data files can be large."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                at = max(e.start - len(e.object) + len(block), 0)  # the position in this block
                line = lines + block.count(b"\n", 0, at) + 1
                raise DataError(
                    f"{path}: not UTF-8 text: byte {offset + at} (line {line}) is "
                    f"{block[at : at + 1]!r} ({e.reason}). Re-save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
                ) from None
            offset, lines = offset + len(block), lines + block.count(b"\n")


def read_utf8(path: Path) -> str:
    check_utf8(path)
    return path.read_text(encoding="utf-8")


def _scan_json_file(path: Path, text_field: str) -> None:
    """Find the first bad record of a JSON/JSONL file that pyarrow refused, and raise DataError naming it."""
    text = read_utf8(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e}).") from e
        numbered = list(enumerate(records))
    else:
        numbered = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                numbered.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: record {i} (line {i + 1}) is not valid JSON: {e}.") from e
    if not numbered:
        raise DataError(f"{path}: holds no records.")
    fmt = detect_format(list(numbered[0][1]), text_field) if isinstance(numbered[0][1], dict) else None
    for i, record in numbered:
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} must be a JSON object, got {type(record).__name__}.")
        problem = check_record(record, fmt, text_field) if fmt else None
        if problem:
            raise DataError(f"{path}: record {i}: {problem}. Fix or drop that record.")


def load_source(source: DatasetConfig, streaming: bool = False, text_field: str = "text") -> datasets.Dataset:
    """One source as a `datasets.Dataset`: a local file, a `save_to_disk` directory, or what `load_dataset` takes."""
    path = Path(source.path)
    if path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(
                f"{path}: unknown file type {path.suffix!r}. Use one of {sorted(DATA_FILE_BUILDERS)} or a "
                "`save_to_disk` directory."
            )
        if builder in ("json", "csv"):
            check_utf8(path)
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
        except Exception as e:  # pyarrow's message names neither the record nor the fix: find the record
            if builder == "json":
                _scan_json_file(path, text_field)
            raise DataError(f"{path}: could not be read as {builder}: {e}") from e
    if path.is_dir() and any((path / f).exists() for f in ("state.json", "dataset_dict.json", "dataset_info.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise DataError(f"{path}: no split {source.split!r}; it has {sorted(loaded)}. Set `split`.")
            loaded = loaded[source.split]
        return loaded
    if source.data_files is not None:
        files = source.data_files if isinstance(source.data_files, list) else [source.data_files]
        if isinstance(source.data_files, dict):
            files = list(source.data_files.values())
        missing = [f for f in files if "*" not in str(f) and "://" not in str(f) and not Path(f).exists()]
        if missing:
            raise DataError(f"dataset {source.path!r}: data file {missing[0]!r} does not exist.")
    elif missing_local_source(source.path) or path.is_dir():
        raise DataError(f"dataset path {source.path!r} does not exist (nor is it a `save_to_disk` directory).")
    try:
        return datasets.load_dataset(
            source.path,
            name=source.name,
            data_dir=source.data_dir,
            data_files=source.data_files,
            split=source.split,
            streaming=streaming,
        )
    except Exception as e:
        raise DataError(
            f"dataset {source.path!r} (split {source.split!r}) could not be loaded: {e}. If it is a local path, check "
            "that it exists; if it is a hub id, check the name and that the hub is reachable."
        ) from e


CHAT_FORMATS = ("messages", "sharegpt", "alpaca")


def prepare_source(
    source: DatasetConfig, text_field: str, streaming: bool = False, assistant_only: bool = False
) -> datasets.Dataset:
    """Load one source, check every record and convert it to the canonical layout. With `assistant_only`
    (`assistant_only_loss`), every record must be a conversation with an assistant turn to train on."""
    dataset = load_source(source, streaming, text_field)
    if source.columns is not None:
        present = list(dataset.column_names or [])
        missing = [c for c in source.columns if c not in present]
        if missing:
            raise DataError(
                f"{source.path}: `columns` names {missing}, which the data does not have; its columns are {present}."
            )
        dataset = dataset.select_columns(source.columns)
    columns = list(dataset.column_names or [])
    fmt = detect_format(columns, text_field)
    if fmt is None:
        raise DataError(
            f"{source.path}: cannot tell the record format from its columns {columns}. Expected one of: {FORMATS}."
        )
    if assistant_only and fmt not in CHAT_FORMATS:
        raise DataError(
            f"{source.path}: `assistant_only_loss: true` trains on the assistant turns of conversations, but this "
            f"source holds {fmt} records. Set assistant_only_loss: false (prompt/completion records train on the "
            "completion with completion_only_loss), or give chat records (messages, ShareGPT, Alpaca)."
        )

    def convert(record: dict, index: int) -> dict:
        problem = check_record(record, fmt, text_field)
        canonical = None if problem else to_canonical(record, fmt, text_field)
        if canonical and assistant_only and not any(t["role"] == "assistant" for t in canonical["messages"]):
            problem = "no assistant turn, so `assistant_only_loss` has nothing to train on"
        if problem:
            raise DataError(f"{source.path}: record {index}: {problem}. Fix or drop that record.")
        return canonical

    kwargs = {} if streaming else {"desc": f"Checking {source.path}"}
    return dataset.map(convert, with_indices=True, remove_columns=columns, **kwargs)


def mix(parts: list[datasets.Dataset], sources: list[DatasetConfig], seed: int) -> datasets.Dataset:
    """Concatenate sources; with `fraction`s, the same shares as `trl.get_dataset`, but a seeded random subset."""
    fractions = [s.fraction for s in sources]
    if fractions[0] is not None:
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(part) / w for part, w in zip(parts, weights, strict=True))
        parts = [
            part.shuffle(seed=seed).select(range(round(w * total))) for part, w in zip(parts, weights, strict=True)
        ]
    kinds = {tuple(sorted(part.column_names)) for part in parts}
    if len(kinds) > 1:
        names = ", ".join(f"{s.path} -> {sorted(p.column_names)}" for s, p in zip(sources, parts, strict=True))
        raise DataError(
            f"The sources cannot be mixed: they come in different layouts ({names}). Chat formats (messages, "
            "ShareGPT, Alpaca) mix with each other; prompt/completion and text sources must be used on their own."
        )
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def load_datasets(
    script_args: ScriptArguments, data_args: DataArguments, training_args: TrainConfig
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The checked training set and the eval set (None when there is none)."""
    text_field = training_args.dataset_text_field
    sources = data_args.datasets or [
        DatasetConfig(
            path=script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
        )
    ]
    eval_sources = data_args.eval_datasets
    given_split = not data_args.datasets and data_args.test_split_size is None and training_args.eval_strategy != "no"
    if not eval_sources and given_split:  # `dataset_name` with its own test split, as in TRL's sft script
        eval_sources = [
            DatasetConfig(
                path=script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_test_split
            )
        ]
    streaming = data_args.streaming or script_args.dataset_streaming
    only = bool(training_args.assistant_only_loss)
    with main_first_together():  # an error on one rank stops every rank with it
        train = mix([prepare_source(s, text_field, streaming, only) for s in sources], sources, training_args.seed)
        eval_set = None
        if eval_sources:
            parts = [prepare_source(s, text_field, streaming, only) for s in eval_sources]
            eval_set = mix(parts, eval_sources, training_args.seed)
        elif data_args.test_split_size is not None:
            split = train.train_test_split(test_size=data_args.test_split_size, seed=training_args.seed)
            train, eval_set = split["train"], split["test"]
    logger.info(
        "Training data: %s records from %d source(s); eval: %s records",
        len(train) if not streaming else "streamed",
        len(sources),
        (len(eval_set) if eval_set is not None and not streaming else eval_set and "streamed") or 0,
    )
    return train, eval_set


def check_tokenizer(train: datasets.Dataset, tokenizer, training_args) -> None:
    """Chat records need a chat template: the tokenizer's own, or `chat_template_path`."""
    chat = "messages" in (train.column_names or [])
    template = getattr(tokenizer, "chat_template", None) or getattr(training_args, "chat_template_path", None)
    if chat and not template:
        raise DataError(
            f"The tokenizer of {tokenizer.name_or_path!r} has no chat template, and the data is conversations. "
            "Set `chat_template_path` (a Jinja template file, or a tokenizer that has one), or use a chat "
            "model's tokenizer."
        )
    if chat and training_args.assistant_only_loss:
        check_assistant_mask(tokenizer, training_args)


def check_assistant_mask(tokenizer, training_args) -> None:
    """`assistant_only_loss` needs a chat template that marks the assistant's tokens (`{% generation %}`): the
    tokenizer's (or `chat_template_path`'s), or the training version TRL ships of a family's original template
    (`trl/chat_templates/*_training.jinja`, swapped in by TRL). Any other is refused here, not by TRL later."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    path = getattr(training_args, "chat_template_path", None)
    if path and Path(path).is_file() and path.endswith((".jinja", ".j2")):
        if not has_generation_markers(Path(path).read_text()):
            raise DataError(
                f"`chat_template_path: {path}` has no `{{% generation %}}` markers, so `assistant_only_loss` cannot "
                "tell the assistant's tokens apart. Use a training template (TRL ships them as "
                "trl/chat_templates/<family>_training.jinja), or set assistant_only_loss: false."
            )
        return
    if path or has_generation_markers(tokenizer.chat_template):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError as e:
        raise DataError(
            f"The chat template of {tokenizer.name_or_path!r} has no `{{% generation %}}` markers and is not one "
            "whose training version TRL ships, so `assistant_only_loss` cannot tell the assistant's tokens apart. "
            "Set `chat_template_path` to a template with the markers (TRL's trl/chat_templates/<family>"
            "_training.jinja for Llama 3, Qwen2.5/3, Gemma, Phi-3, GLM-4-MoE, gpt-oss, DeepSeek-V3), or set "
            "assistant_only_loss: false."
        ) from e
