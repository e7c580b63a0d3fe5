"""Data sources, formats and mixtures load into the layout SFTTrainer reads, with the checks of sft.data.load."""

from __future__ import annotations

import json
import sys

import datasets
import pytest
from trl import ScriptArguments
from trl.scripts.utils import DatasetConfig

from sft.config import DataArguments, TrainConfig
from sft.data.load import load_datasets
from sft.errors import DataError

CHAT = [{"role": "user", "content": "upper: ab"}, {"role": "assistant", "content": "AB"}]
FORMATS = {
    "messages": {"messages": CHAT},
    "sharegpt": {"conversations": [{"from": "human", "value": "upper: ab"}, {"from": "gpt", "value": "AB"}]},
    "alpaca": {"instruction": "upper:", "input": "ab", "output": "AB"},
    "prompt_completion": {"prompt": "upper: ab", "completion": "AB"},
    "text": {"text": "upper: ab AB"},
    "tokenized": {"input_ids": [5, 17, 20]},
}
EXPECTED = {
    "messages": {"messages": CHAT},
    "sharegpt": {"messages": CHAT},
    "alpaca": {"messages": [{"role": "user", "content": "upper:\n\nab"}, {"role": "assistant", "content": "AB"}]},
    "prompt_completion": {"prompt": "upper: ab", "completion": "AB"},
    "text": {"text": "upper: ab AB"},
    "tokenized": {"input_ids": [5, 17, 20]},
}


def load(tmp_path, sources, eval_sources=(), test_split_size=None, seed=0):
    args = TrainConfig(output_dir=str(tmp_path / "out"), seed=seed, report_to="none")
    data_args = DataArguments(
        datasets=list(sources), eval_datasets=list(eval_sources), test_split_size=test_split_size
    )
    return load_datasets(ScriptArguments(), data_args, args)


def write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        dataset = datasets.Dataset.from_list(rows)
        if name.endswith(".parquet"):
            dataset.to_parquet(path)
        elif name.endswith(".csv"):
            dataset.to_csv(path, index=False)
        else:
            dataset.save_to_disk(path)
    return str(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_becomes_the_trainer_layout(tmp_path, fmt):
    path = write(tmp_path, "d.jsonl", [FORMATS[fmt]] * 3)
    train, eval_set = load(tmp_path, [DatasetConfig(path=path)])
    assert eval_set is None
    assert train.to_list() == [EXPECTED[fmt]] * 3


@pytest.mark.parametrize("name", ["d.json", "d.parquet", "d.csv", "d_saved"])
def test_every_source_kind(tmp_path, name):
    fmt = "prompt_completion" if name.endswith(".csv") else "alpaca"  # csv holds flat columns only
    path = write(tmp_path, name, [FORMATS[fmt]] * 4)
    train, _ = load(tmp_path, [DatasetConfig(path=path)])
    assert train.to_list() == [EXPECTED[fmt]] * 4


def test_chat_formats_mix_with_fractions(tmp_path):
    a = write(tmp_path, "a.jsonl", [FORMATS["messages"]] * 30)
    b = write(tmp_path, "b.jsonl", [FORMATS["sharegpt"]] * 10)
    # shares 0.75/0.25, capped so that b (10 rows) is not oversampled: 30 + 10 rows
    train, _ = load(tmp_path, [DatasetConfig(path=a, fraction=3), DatasetConfig(path=b, fraction=1)])
    assert len(train) == 40
    train, _ = load(tmp_path, [DatasetConfig(path=a, fraction=1), DatasetConfig(path=b, fraction=1)])
    assert len(train) == 20  # equal shares: 10 + 10


def test_text_and_chat_do_not_mix(tmp_path):
    a = write(tmp_path, "a.jsonl", [FORMATS["messages"]] * 3)
    b = write(tmp_path, "b.jsonl", [FORMATS["text"]] * 3)
    with pytest.raises(DataError, match="cannot be mixed"):
        load(tmp_path, [DatasetConfig(path=a), DatasetConfig(path=b)])


def test_eval_split_is_carved_the_same_way_every_time(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"repeat: {i}"}, CHAT[1]]} for i in range(50)]
    path = write(tmp_path, "d.jsonl", rows)
    train, eval_set = load(tmp_path, [DatasetConfig(path=path)], test_split_size=0.2, seed=3)
    again_train, again_eval = load(tmp_path, [DatasetConfig(path=path)], test_split_size=0.2, seed=3)
    assert len(eval_set) == 10 and len(train) == 40
    assert eval_set.to_list() == again_eval.to_list() and train.to_list() == again_train.to_list()
    prompts = {r["messages"][0]["content"] for r in train}
    assert prompts.isdisjoint(r["messages"][0]["content"] for r in eval_set)


def test_given_eval_set(tmp_path):
    train_path = write(tmp_path, "t.jsonl", [FORMATS["messages"]] * 5)
    eval_path = write(tmp_path, "e.jsonl", [FORMATS["alpaca"]] * 2)
    train, eval_set = load(tmp_path, [DatasetConfig(path=train_path)], [DatasetConfig(path=eval_path)])
    assert len(train) == 5 and eval_set.to_list() == [EXPECTED["alpaca"]] * 2


def test_bad_record_in_parquet_names_source_and_index(tmp_path):
    rows = [FORMATS["alpaca"]] * 3 + [{"instruction": None, "input": "x", "output": "y"}]
    path = write(tmp_path, "d.parquet", rows)
    with pytest.raises(DataError, match=r"d\.parquet: record 3: missing field `instruction`"):
        load(tmp_path, [DatasetConfig(path=path)])


@pytest.mark.parametrize("deadlock_prone", [True, False])
def test_forked_workers_on_a_python_that_can_deadlock_them_are_warned_about(monkeypatch, deadlock_prone):
    from types import SimpleNamespace

    from sft.run import trainer

    version = sys.version_info
    assert trainer._FORK_DEADLOCK is ((3, 10) <= version < (3, 10, 15) or (3, 11) <= version < (3, 11, 10))
    monkeypatch.setattr(trainer, "_FORK_DEADLOCK", deadlock_prone)
    for workers, context in ((2, None), (2, "fork"), (2, "spawn"), (0, None)):
        said = trainer.fork_warning(
            SimpleNamespace(dataloader_num_workers=workers, dataloader_multiprocessing_context=context)
        )
        if deadlock_prone and workers and context != "spawn":
            assert "python/cpython#112275" in said and "dataloader_multiprocessing_context: spawn" in said
        else:
            assert said is None


def test_image_chats_for_a_text_model_are_named_with_the_families_that_take_them(tmp_path):
    """A chat with image parts reaches the text loader only for a model sft does not train on images (Gemma 3's
    image records did and got "must be a string"): the record is named with what to do."""
    image_chat = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
                               {"role": "assistant", "content": "a cat"}], "images": ["a.png"]}  # fmt: skip
    path = write(tmp_path, "d.jsonl", [FORMATS["messages"], image_chat])
    with pytest.raises(DataError, match=r"d\.jsonl: record 1: `messages\[0\]\.content` holds an image part") as e:
        load(tmp_path, [DatasetConfig(path=path)])
    assert "Qwen2.5-VL" in str(e.value) and "Gemma 3" in str(e.value)
