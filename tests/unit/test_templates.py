from pathlib import Path

import pytest

from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.templates import (
    IGNORE_INDEX,
    check_roles,
    encode_for_training,
    hf_chat_template,
    ollama_template,
    render_conversation,
)

OFFICIAL_GEMMA3 = (Path(__file__).parents[1] / "fixtures" / "gemma3_official_chat_template.jinja").read_text()
GEMMA3 = FAMILIES["gemma3"]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "什么是手冲咖啡？"}, {"role": "assistant", "content": "用热水慢慢冲过咖啡粉。"}],
    "system": [
        {"role": "system", "content": "你是一位咖啡师。"},
        {"role": "user", "content": "拿铁和卡布奇诺有什么区别？"},
        {"role": "assistant", "content": "奶泡的比例不同。"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Name a coffee."},
        {"role": "assistant", "content": "Espresso."},
    ],
    "whitespace": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  \n  spaced   question \t\n"},
        {"role": "assistant", "content": "\n\n answer with\n\ninner lines  \n"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(gemma3_tokenizer):
    return gemma3_tokenizer


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_training_text_equals_official_gemma3_template(tokenizer, name: str, generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    if generation_prompt:
        messages = messages[:-1]
    ours = render_conversation(messages, GEMMA3, add_generation_prompt=generation_prompt).text
    official = tokenizer.apply_chat_template(
        messages, chat_template=OFFICIAL_GEMMA3, tokenize=False, add_generation_prompt=generation_prompt
    )
    generated = tokenizer.apply_chat_template(
        messages, chat_template=hf_chat_template(GEMMA3), tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours == official == generated
    assert ours.count("<bos>") == 1


def test_gemma3_golden_rendering() -> None:
    text = render_conversation(CONVERSATIONS["system"], GEMMA3, add_generation_prompt=False).text
    assert text == (
        "<bos><start_of_turn>user\n你是一位咖啡师。\n\n拿铁和卡布奇诺有什么区别？<end_of_turn>\n"
        "<start_of_turn>model\n奶泡的比例不同。<end_of_turn>\n"
    )


def test_gemma4_gives_system_its_own_turn() -> None:
    text = render_conversation(CONVERSATIONS["system"], FAMILIES["gemma4"], add_generation_prompt=False).text
    assert text == (
        "<bos><|turn>system\n你是一位咖啡师。<turn|>\n<|turn>user\n拿铁和卡布奇诺有什么区别？<turn|>\n"
        "<|turn>model\n奶泡的比例不同。<turn|>\n"
    )


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_labels_cover_exactly_the_answers_and_their_end_of_turn(tokenizer, name: str) -> None:
    messages = CONVERSATIONS[name]
    ids, labels = encode_for_training(messages, tokenizer, GEMMA3, cutoff_len=4096)
    text = render_conversation(messages, GEMMA3).text
    assert ids == tokenizer(text, add_special_tokens=False).input_ids  # tokenized exactly as at inference
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    supervised = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    expected = "".join(m["content"].strip() + "<end_of_turn>" for m in messages if m["role"] == "assistant")
    assert tokenizer.decode(supervised) == expected
    assert all(label in (IGNORE_INDEX, i) for i, label in zip(ids, labels))
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    answers = sum(m["role"] == "assistant" for m in messages)
    assert supervised.count(end_of_turn) == answers


def test_truncation_keeps_the_start(tokenizer) -> None:
    ids, labels = encode_for_training(CONVERSATIONS["multi-turn"], tokenizer, GEMMA3, cutoff_len=10)
    full, _ = encode_for_training(CONVERSATIONS["multi-turn"], tokenizer, GEMMA3, cutoff_len=4096)
    assert ids == full[:10] and len(labels) == 10


def test_ollama_template_has_no_bos_and_the_training_markers() -> None:
    template = ollama_template(GEMMA3)
    assert "<bos>" not in template
    assert "<start_of_turn>user\n" in template and "<start_of_turn>model\n" in template
    assert "{{ $.System }}\n\n" in template  # system folded into the first user turn, as in training
    assert "<|turn>system\n{{ .System }}<turn|>" in ollama_template(FAMILIES["gemma4"])


@pytest.mark.parametrize(
    "messages, pattern",
    [
        ([{"role": "assistant", "content": "a"}], "turn 1 has role 'assistant', expected 'user'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "turn 2 has role 'user'"),
        ([{"role": "system", "content": "a"}], "no user turn"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "role 'tool'"),
    ],
)
def test_roles_that_do_not_alternate_are_errors(messages, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern):
        check_roles(messages, "d.jsonl line 3")
