"""The Chat tab: the chosen run's base and tuned models answering the same prompt side by side (playground.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from gemmaforge.errors import UserError
from gemmaforge.ui.dashboard import Dashboard
from gemmaforge.ui.playground import Settings, side_by_side


def chat_tab(board: Dashboard, run: Any) -> Any:
    """The tab's inputs and events; `run` is the page's run picker. Returns the system prompt input (the page
    fills it when it loads)."""
    with gr.Row():
        base_chat = gr.Chatbot(label="Base", elem_id="chat-base", height=380)
        tuned_chat = gr.Chatbot(label="Tuned", elem_id="chat-tuned", height=380)
    prompt = gr.Textbox(label="Prompt (both answer it)", lines=2, elem_id="chat-prompt")
    with gr.Row():
        send = gr.Button("Send", variant="primary", elem_id="chat-send")
        clear = gr.Button("Clear")
    status = gr.Markdown(elem_id="chat-status")
    with gr.Accordion("System prompt and sampling", open=False):
        system = gr.Textbox(label="System prompt (starts as the run's deployed one)", lines=2)
        with gr.Row():
            temperature = gr.Slider(0.0, 2.0, 0.0, step=0.05, label="temperature (0: greedy)")
            top_p = gr.Slider(0.05, 1.0, 0.9, step=0.05, label="top_p")
            max_tokens = gr.Slider(16, 2048, 256, step=16, label="max new tokens")
            seed = gr.Number(None, precision=0, label="seed (empty: random)")

    async def chat(name: str | None, text: str, system_text: str, temp: float, p: float, tokens: float,
                   seed_value: float | None, base_history: list, tuned_history: list) -> AsyncIterator[tuple]:
        root = board.root(name)
        if root is None or not text.strip():
            raise gr.Error("Choose a run and write a prompt first.")
        yield base_history, tuned_history, "", "Loading the base model and the run's adapter (once per run) ..."
        settings = Settings(system_text, temp, p, int(tokens), None if seed_value is None else int(seed_value))
        try:
            url, pair = await asyncio.to_thread(board.playground.pair, root)
            async for base_now, tuned_now in side_by_side(url, pair, (base_history, tuned_history), text, settings):
                yield base_now, tuned_now, "", f"`{pair.base}` and `{pair.tuned}`, served together."
        except UserError as exc:
            raise gr.Error(str(exc)) from None

    run.change(lambda name: ([], [], board.system_prompt(name)), run, [base_chat, tuned_chat, system])
    inputs = [run, prompt, system, temperature, top_p, max_tokens, seed, base_chat, tuned_chat]
    for trigger in (send.click, prompt.submit):
        trigger(chat, inputs, [base_chat, tuned_chat, prompt, status])
    clear.click(lambda: ([], []), None, [base_chat, tuned_chat])
    return system
