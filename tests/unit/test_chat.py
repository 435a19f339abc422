"""`gemmaforge chat`'s terminal loop, without a server."""

from __future__ import annotations

from io import StringIO

import pytest

from gemmaforge.serve.chat import chat_loop


def test_ctrl_d_leaves_the_chat() -> None:
    """End of input (Ctrl-D) at the prompt ends the chat at once: nothing is sent, no prompt is shown again."""
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        if len(prompts) > 1:
            pytest.fail("the chat asked for input again after Ctrl-D")
        raise EOFError

    out = StringIO()
    chat_loop("http://127.0.0.1:9", "coffee", read=read, out=out)  # nothing listens there: nothing may be sent
    assert prompts == [">>> "]
    assert out.getvalue().endswith("/exit)\n\n")  # the greeting, then a newline after the ^D
