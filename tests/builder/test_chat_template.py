"""Chat templates rendered as transformers renders them: for real templates (Minimind's ChatML,
Llama-3's headers, TRL's ChatML with generation blocks) and real conversations, the tokens
equal `apply_chat_template(messages, tokenize=True)` from a local tokenizer.json, and the loss
mask equals its `return_assistant_tokens_mask` where the template has generation blocks; else
each run of masked tokens is one assistant turn and the end of turn the template writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chat_templates, dialogue
from packer.builder.chat.conversation import conversation
from packer.builder.chat.encode import encode
from packer.builder.chat.template import ChatTemplate, load_spec
from packer.builder.text import load_tokenizer
from packer.errors import SourceError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A model folder per template: the chat tokenizer's tokenizer.json and a
    tokenizer_config.json with the template and its special tokens, as a Hub model has them."""
    tok = dialogue.chat_tokenizer()
    out = {}
    for name, (template, special) in chat_templates.TEMPLATES.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "tokenizer.json").write_bytes(tok.read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **special}))
        out[name] = folder
    return out


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _ours(folder: Path):
    return ChatTemplate(load_spec(folder / "tokenizer_config.json")), load_tokenizer(folder / "tokenizer.json")


def _runs(mask) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("name", list(chat_templates.TEMPLATES))
def test_tokens_and_masks_equal_transformers(models, name):
    hf = _hf(models[name])
    template, tok = _ours(models[name])
    for messages in dialogue.dialogues(40, seed=3):
        messages = conversation({"messages": messages}).messages
        text, spans = template.render(messages)
        tokens, mask, _ = encode(tok, text, spans, "<u4")
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=template.blocks)
        assert tokens.tolist() == want["input_ids"]
        if template.blocks:
            assert mask.tolist() == want["assistant_masks"]
        assistants = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(runs) == len(assistants)
        for (a, b), content in zip(runs, assistants):
            said = tok.decode(tokens[a:b].tolist(), skip_special_tokens=False)
            end = said.strip().removeprefix(content.strip()).strip()
            assert said.strip().startswith(content.strip()) and end in ("<|im_end|>", "<|eot_id|>"), (name, said)


def test_sharegpt_turns_and_a_system_field_render_as_their_messages(models):
    template, _ = _ours(models["minimind"])
    record = {"system": "You are Prospero.", "conversations": [{"from": "human", "value": "Where am I?"},
                                                              {"from": "gpt", "value": "On an island."}]}
    text, _ = template.render(conversation(record).messages)
    assert text.startswith("<|im_start|>system\nYou are Prospero.<|im_end|>\n<|im_start|>user\nWhere am I?")


@pytest.mark.parametrize("source, words", [
    ("{{ raise_exception('no system role, please') }}", "no system role, please"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    ("{% set ns = namespace(_x=1) %}{{ ns }}", "SecurityError"),
    ("{{ messages[0].missing.deeper }}", "UndefinedError"),
    ("{% for m in messages %}{{ m.content if loop.last else 'x' }}{% endfor %}", "start differently")])
def test_a_template_that_raises_or_reaches_python_is_a_records_skip(tmp_path, source, words):
    path = tmp_path / "t.jinja"
    path.write_text(source)
    template = ChatTemplate(load_spec(path))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    with pytest.raises(SourceError, match=words):
        template.render(messages)


@pytest.mark.parametrize("record, words", [
    ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown role 'narrator'"),
    ({"messages": []}, "empty conversation"), ({"messages": [{"role": "user", "content": 3}]}, "not text"),
    ({"conversations": [{"from": "human", "value": "<image> <image> hi"}], "image": "a.jpg"}, "2 <image>"),
    ({"text": "hello"}, "no conversation")])
def test_hostile_records_are_skips_with_their_reason(record, words):
    with pytest.raises(SourceError, match=words):
        conversation(record)
