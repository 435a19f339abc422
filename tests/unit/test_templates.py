from pathlib import Path

import pytest

from gemmaforge.chat.conversation import IGNORE_INDEX, check_roles
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES

FIXTURES = Path(__file__).parents[1] / "fixtures"
OFFICIAL = {
    "gemma2": (FIXTURES / "gemma2_chat_template.jinja").read_text(encoding="utf-8"),  # also Gemma 1.1's
    "gemma3": (FIXTURES / "gemma3_official_chat_template.jinja").read_text(encoding="utf-8"),
    "gemma4": (FIXTURES / "gemma4_chat_template.jinja").read_text(encoding="utf-8"),
}
GEMMA3 = FAMILIES["gemma3"]
# Gemma 4's official generation prompt opens an empty thought channel (thinking off). Our fine-tunes
# are trained with answers right after `<|turn>model\n` (the official rendering of a finished
# conversation), so every gemmaforge rendering prompts the way training saw it.
GEMMA4_EMPTY_THOUGHT = "<|channel>thought\n<channel|>"

CONVERSATIONS = {
    "single": [{"role": "user", "content": "什么是手冲咖啡？"},
               {"role": "assistant", "content": "用热水慢慢冲过咖啡粉。"}],
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
    "chinese-multi-turn-system": [
        {"role": "system", "content": "你是青禾生活馆的客服小禾。"},
        {"role": "user", "content": "我的订单 QH2026000123 到哪了？"},
        {"role": "assistant", "content": "已经从仓库发出，预计明天送达。"},
        {"role": "user", "content": "那运费呢？ "},
        {"role": "assistant", "content": "满 99 元包邮，这单免运费。\n"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(gemma3_tokenizer):
    return gemma3_tokenizer


def official_render(tokenizer, family: str, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=OFFICIAL[family], tokenize=False, add_generation_prompt=generation_prompt
    )


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_training_text_equals_the_official_template(tokenizer, family: str, name: str, generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    if generation_prompt:
        messages = messages[:-1]
    ours = FAMILIES[family].chat.render(messages, add_generation_prompt=generation_prompt).text
    official = official_render(tokenizer, family, messages, generation_prompt)
    if family == "gemma4" and generation_prompt:
        official = official.removesuffix(GEMMA4_EMPTY_THOUGHT)
    generated = tokenizer.apply_chat_template(
        messages, chat_template=FAMILIES[family].chat.jinja(), tokenize=False,
        add_generation_prompt=generation_prompt
    )
    assert ours == official == generated
    assert ours.count("<bos>") == 1


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
@pytest.mark.parametrize("name", ["single", "multi-turn", "whitespace"])
def test_gemma1_and_2_equal_the_official_template_without_system(tokenizer, family: str, name: str) -> None:
    """Their official template refuses a system message; without one it must match exactly."""
    messages = [m for m in CONVERSATIONS[name] if m["role"] != "system"]
    for generation_prompt in (False, True):
        turns = messages[:-1] if generation_prompt else messages
        ours = FAMILIES[family].chat.render(turns, add_generation_prompt=generation_prompt).text
        assert ours == official_render(tokenizer, "gemma2", turns, generation_prompt)


GOLDEN_SYSTEM = {
    # Gemma 1-3: the system text opens the first user turn, separated by a blank line.
    "gemma": "<bos><start_of_turn>user\n你是一位咖啡师。\n\n拿铁和卡布奇诺有什么区别？<end_of_turn>\n"
    "<start_of_turn>model\n奶泡的比例不同。<end_of_turn>\n",
    "gemma2": "<bos><start_of_turn>user\n你是一位咖啡师。\n\n拿铁和卡布奇诺有什么区别？<end_of_turn>\n"
    "<start_of_turn>model\n奶泡的比例不同。<end_of_turn>\n",
    "gemma3": "<bos><start_of_turn>user\n你是一位咖啡师。\n\n拿铁和卡布奇诺有什么区别？<end_of_turn>\n"
    "<start_of_turn>model\n奶泡的比例不同。<end_of_turn>\n",
    # Gemma 4: the system prompt is a turn of its own.
    "gemma4": "<bos><|turn>system\n你是一位咖啡师。<turn|>\n<|turn>user\n拿铁和卡布奇诺有什么区别？<turn|>\n"
    "<|turn>model\n奶泡的比例不同。<turn|>\n",
}


@pytest.mark.parametrize("family", list(GOLDEN_SYSTEM))
def test_golden_rendering_with_system(tokenizer, family: str) -> None:
    rendered = FAMILIES[family].chat.render(CONVERSATIONS["system"])
    assert rendered.text == GOLDEN_SYSTEM[family]
    hf = tokenizer.apply_chat_template(CONVERSATIONS["system"], chat_template=FAMILIES[family].chat.jinja(),
                                       tokenize=False)
    assert hf == rendered.text
    end = FAMILIES[family].chat.turn_end
    assert [rendered.text[s:e] for s, e in rendered.supervised] == ["奶泡的比例不同。" + end]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_labels_cover_exactly_the_answers_and_their_end_of_turn(tokenizer, name: str) -> None:
    messages = CONVERSATIONS[name]
    ids, labels = GEMMA3.chat.encode(messages, tokenizer, cutoff_len=4096)
    text = GEMMA3.chat.render(messages).text
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
    ids, labels = GEMMA3.chat.encode(CONVERSATIONS["multi-turn"], tokenizer, cutoff_len=10)
    full, _ = GEMMA3.chat.encode(CONVERSATIONS["multi-turn"], tokenizer, cutoff_len=4096)
    assert ids == full[:10] and len(labels) == 10


def test_ollama_template_has_no_bos_and_the_training_markers() -> None:
    template = GEMMA3.chat.go_template()
    assert "<bos>" not in template
    assert "<start_of_turn>user\n" in template and "<start_of_turn>model\n" in template
    assert "{{ $.System }}\n\n" in template  # system folded into the first user turn, as in training
    assert "<|turn>system\n{{ .System }}<turn|>" in FAMILIES["gemma4"].chat.go_template()


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


def supervised_text(tokenizer, messages, **options) -> str:
    ids, labels = GEMMA3.chat.encode(messages, tokenizer, cutoff_len=4096, **options)
    return tokenizer.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])


def test_mask_history_supervises_only_the_last_answer(tokenizer) -> None:
    messages = CONVERSATIONS["chinese-multi-turn-system"]
    assert supervised_text(tokenizer, messages) == ("已经从仓库发出，预计明天送达。<end_of_turn>"
                                                    "满 99 元包邮，这单免运费。<end_of_turn>")
    assert supervised_text(tokenizer, messages, mask_history=True) == "满 99 元包邮，这单免运费。<end_of_turn>"


def test_train_on_prompt_supervises_everything_after_bos(tokenizer) -> None:
    messages = CONVERSATIONS["chinese-multi-turn-system"]
    text = GEMMA3.chat.render(messages).text
    assert supervised_text(tokenizer, messages, train_on_prompt=True) == text.removeprefix("<bos>")


def test_training_conversations_must_end_with_an_answer() -> None:
    with pytest.raises(UserError, match="d.jsonl line 3: the last turn is from the user"):
        check_roles([{"role": "user", "content": "a"}], "d.jsonl line 3", require_answer=True)
    check_roles([{"role": "user", "content": "a"}], "d.jsonl line 3")  # a prompt for generation is fine


def test_trainer_examples_follow_the_loss_options(tokenizer) -> None:
    from gemmaforge.train.collate import tokenize_conversations

    messages = CONVERSATIONS["chinese-multi-turn-system"]
    (default,), _ = tokenize_conversations([messages], tokenizer, GEMMA3, 4096, "train.jsonl")
    (last,), _ = tokenize_conversations([messages], tokenizer, GEMMA3, 4096, "train.jsonl", mask_history=True)
    assert default["input_ids"] == last["input_ids"]
    supervised = [sum(label != IGNORE_INDEX for label in ex["labels"]) for ex in (default, last)]
    assert supervised[0] > supervised[1] > 0
    with pytest.raises(UserError, match="train.jsonl line 1: the last turn is from the user"):
        tokenize_conversations([messages[:-1]], tokenizer, GEMMA3, 4096, "train.jsonl")
