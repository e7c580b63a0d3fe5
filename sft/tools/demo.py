"""Build the bundled demo: a character-level tokenizer, a tiny Llama config and a synthetic chat data set.

Nothing here is downloaded. ``python -m sft.tools.demo --out recipes/demo`` writes:

- ``model/``: ``config.json`` of a 4-layer Llama (hidden 128, GQA 4/2 heads) and a character-level tokenizer with a
  chat template whose assistant turns carry ``{% generation %}`` markers (so assistant-only loss works);
- ``data/train.jsonl`` and ``data/eval.jsonl``: chat records (``messages``) of four string tasks (repeat,
  upper-case, reverse, count the letters) that the tiny model learns in a few minutes on two CPU cores. Eval records
  are held out: no eval prompt occurs in the training set.

The output is a pure function of ``--seed``, so the committed files can be checked against a fresh build.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Every printable ASCII character except the vertical whitespace ones is a token of its own.
CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
TASKS = ("repeat", "upper", "reverse", "count")


def build_tokenizer(named: dict[str, str] | None = None):
    """A character-level ``PreTrainedTokenizerFast``: one id per printable character, plus chat special tokens (and
    `named` special tokens, each an attribute of the tokenizer: `tokenizer.image_token`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=1024,
        **({"extra_special_tokens": named} if named else {}),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> dict:
    """The tiny Llama: 4 layers, hidden 128, grouped-query attention (4 query heads, 2 key/value heads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": "float32",
    }


def make_record(task: str, rng: random.Random) -> dict:
    """One chat record of ``task``: a user instruction and the assistant's exact answer."""
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    answer = {"repeat": word, "upper": word.upper(), "reverse": word[::-1], "count": str(len(word))}[task]
    prompt = f"{task}: {word}"
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def make_records(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out eval records, with no user prompt shared between the two."""
    rng = random.Random(seed)
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < n_train + n_eval:
        record = make_record(rng.choice(TASKS), rng)
        prompt = record["messages"][0]["content"]
        if prompt not in seen:
            seen.add(prompt)
            records.append(record)
    return records[n_eval:], records[:n_eval]


def write_demo(out: Path, n_train: int = 6000, n_eval: int = 200, seed: int = 0) -> None:
    tokenizer = build_tokenizer()
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir)
    config = model_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    train, held_out = make_records(n_train, n_eval, seed)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("recipes/demo"), help="Directory to write into.")
    parser.add_argument("--n-train", type=int, default=6000, help="Number of training records.")
    parser.add_argument("--n-eval", type=int, default=200, help="Number of held-out eval records.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the record generator.")
    args = parser.parse_args(argv)
    write_demo(args.out, args.n_train, args.n_eval, args.seed)
    print(f"wrote the demo tokenizer, model config and data to {args.out}")


if __name__ == "__main__":
    main()
