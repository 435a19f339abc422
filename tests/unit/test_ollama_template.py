"""The Modelfile TEMPLATE, executed by Go's text/template as Ollama executes it, renders the same
prompt as training (less the leading <bos>, which the runtime adds)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gemmaforge.chat.conversation import BOS, Message
from gemmaforge.families import FAMILIES

GO_RENDERER = Path(__file__).parents[1] / "fixtures" / "gotemplate" / "main.go"

CHATS: dict[str, list[Message]] = {
    "single": [{"role": "user", "content": "什么是手冲咖啡？"}],
    "system": [{"role": "system", "content": "你是一位咖啡师。"}, {"role": "user", "content": "拿铁是什么？"}],
    "history": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Name a coffee."},
    ],
    "multiline": [{"role": "user", "content": "Line one\n\nline two:\n- a\n- b"}],
}


@pytest.fixture(scope="module")
def go_renderer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("go") is None:
        pytest.skip("Go toolchain not installed (.ci/run installs golang-go)")
    binary = tmp_path_factory.mktemp("go") / "render"
    subprocess.run(["go", "build", "-o", str(binary), str(GO_RENDERER)], check=True)
    return binary


def go_render(binary: Path, template: str, messages: list[Message]) -> str:
    request = json.dumps({"template": template, "messages": messages})
    return subprocess.run([binary], input=request, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("chat", list(CHATS))
def test_ollama_renders_the_training_prompt(go_renderer: Path, family: str, chat: str) -> None:
    messages = CHATS[chat]
    expected = FAMILIES[family].chat.render(messages, add_generation_prompt=True).text
    assert go_render(go_renderer, FAMILIES[family].chat.go_template(), messages) == expected.removeprefix("<bos>")


# what clients send beyond alternating turns (Open WebUI's "continue response" ends with the assistant's message)
REQUESTS: dict[str, list[Message]] = {
    **CHATS,
    "continue": [{"role": "user", "content": "Name a coffee."}, {"role": "assistant", "content": "Sure: the "}],
    "continue-with-system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More?"},
                             {"role": "assistant", "content": "Yes,"}],
    "same-role": [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."},
                  {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"},
                  {"role": "user", "content": "Three."}],
    "empty": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}],
    "systems-anywhere": [{"role": "system", "content": "S1"}, {"role": "user", "content": "u1"},
                         {"role": "system", "content": "S2"}, {"role": "assistant", "content": "a1"},
                         {"role": "user", "content": "u2"}],
    "system-last": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Answer in French."}],
    "assistant-first": [{"role": "assistant", "content": "Welcome."}, {"role": "user", "content": "Hi"}],
    "padded": [{"role": "user", "content": "  spaced  \n"}],
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_serve_prompts_are_what_ollama_renders(go_renderer: Path, gemma3_tokenizer, family: str,
                                               request_name: str) -> None:
    """Gemma 1-3: the Modelfile TEMPLATE through Go's text/template. Gemma 4: Ollama renders it with its built-in
    renderer whatever the TEMPLATE, a port of Google's official template (checked against it by Ollama's own
    reference tests): the official template itself is the reference."""
    messages = REQUESTS[request_name]
    prompt = FAMILIES[family].chat.request_prompt(messages)
    assert prompt.startswith(BOS)
    if family == "gemma4":
        official = gemma3_tokenizer.apply_chat_template(messages, chat_template=FAMILIES[family].chat.jinja(),
                                                        tokenize=False, add_generation_prompt=True)
        assert prompt == official
    else:
        assert prompt.removeprefix(BOS) == go_render(go_renderer, FAMILIES[family].chat.go_template(), messages)
    if request_name in CHATS:  # alternating turns of trimmed text: the training prompt itself
        assert prompt == FAMILIES[family].chat.render(messages, add_generation_prompt=True).text
