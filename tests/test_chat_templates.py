"""`assistant_only_loss` with each family's real chat template (TRL's training versions, with `{% generation %}`
markers, shipped in trl/chat_templates/ and usable offline): on a conversation with a system turn, two assistant turns,
a reasoning block and a tool call, the trained tokens are exactly the assistant's. Rendered with the demo's
character-level tokenizer, so every character of the template decodes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from transformers import AutoTokenizer

from sft.data.load import check_assistant_mask
from sft.errors import DataError
from tests.conftest import ROOT

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
USER_TEXT = ("be brief", "count: abc", "weather in paris")
CONVERSATION = [
    {"role": "system", "content": USER_TEXT[0]},
    {"role": "user", "content": USER_TEXT[1]},
    {"role": "assistant", "content": "3", "reasoning_content": "three letters"},
    {"role": "user", "content": USER_TEXT[2]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
]  # fmt: skip
# family -> TRL's template name (Gemma 2 uses Gemma's, which has no system turn)
FAMILIES = {"llama": "llama3", "qwen2": "qwen2_5", "qwen3": "qwen3", "gemma2": "gemma", "gemma3": "gemma3",
            "phi3": "phi3", "glm4_moe": "glm4moe", "gpt_oss": "gptoss", "deepseek_v3": "deepseekv3",
            "qwen3_5-think": "qwen3_5_think", "qwen3_5-nothink": "qwen3_5_nothink", "qwen3_6": "qwen3_6"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "recipes" / "demo" / "model")


def runs(mask: list[int]) -> int:
    """Contiguous stretches of trained tokens."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trained_tokens_are_the_assistants(tokenizer, family):
    template = (TEMPLATES / f"{FAMILIES[family]}_training.jinja").read_text()
    conversation = CONVERSATION if family != "gemma2" else CONVERSATION[1:]
    out = tokenizer.apply_chat_template(
        conversation, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    rendered = tokenizer.decode(ids)
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    untrained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert runs(mask) == 2  # the two assistant turns, nothing else
    assert "3" in trained
    for text in USER_TEXT[1:] if family == "gemma2" else USER_TEXT:
        assert text in untrained and text not in trained
    for assistant_only in ("three letters", "get_weather", 'paris"'):  # reasoning, the tool call, its arguments
        if assistant_only in rendered:  # where the template renders it at all
            assert assistant_only not in untrained, assistant_only
    # sft's check at start accepts the training template, and the original one that TRL swaps for it
    tokenizer.chat_template = template
    check_assistant_mask(tokenizer, None)
    original = TEMPLATES / f"{FAMILIES[family]}.jinja"
    if original.is_file():
        tokenizer.chat_template = original.read_text()
        check_assistant_mask(tokenizer, None)


def test_a_template_without_markers_is_refused_at_start(tokenizer, tmp_path):
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DataError, match=r"no `\{% generation %\}` markers .*`chat_template_path`.*_training.jinja"):
        check_assistant_mask(tokenizer, None)
    path = tmp_path / "plain.jinja"
    path.write_text(tokenizer.chat_template)
    args = type("Args", (), {"chat_template_path": str(path)})()
    with pytest.raises(DataError, match=f"`chat_template_path: {path}` has no"):
        check_assistant_mask(tokenizer, args)
    path.write_text((TEMPLATES / "qwen3_training.jinja").read_text())
    check_assistant_mask(tokenizer, args)
