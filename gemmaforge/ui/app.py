"""The dashboard's page (Gradio Blocks) and the server it runs in.

Gradio, as LLaMA-Factory's LlamaBoard uses: its tables, line plots and timers are maintained widgets, and the
page is mounted on a FastAPI app like `gemmaforge serve`'s. The page polls every REFRESH_S seconds while it is
open; a run goes on whether or not a page watches it.
"""

from __future__ import annotations

from typing import Any

import gradio as gr
import uvicorn
from fastapi import FastAPI

from gemmaforge.ui.chat_tab import chat_tab
from gemmaforge.ui.dashboard import CURVES, Dashboard
from gemmaforge.ui.launch_tab import launch_tab
from gemmaforge.ui.results import eval_report, ollama_command, verify_rows

REFRESH_S = 3.0
_THEME = gr.themes.Default(font=["Noto Sans", "Noto Sans CJK SC", "sans-serif"],  # no web fonts: works offline
                           font_mono=["Noto Sans Mono", "monospace"])


def build(board: Dashboard, default_config: str = "examples/quickstart.yaml") -> gr.Blocks:
    with gr.Blocks(title="gemmaforge") as page:
        gr.Markdown(f"## gemmaforge · runs in `{board.runs_dir}`")
        timer = gr.Timer(REFRESH_S)
        gr.Dataframe(board.table, label="Runs", interactive=False, every=timer, elem_id="runs-table")
        names = board.names()
        with gr.Row():
            run = gr.Dropdown(names, value=names[0] if names else None, label="Run", elem_id="run-picker",
                              scale=3, allow_custom_value=False)
            stop = gr.Button("Stop", variant="stop", scale=1)
            resume = gr.Button("Resume", scale=1)
        message = gr.Markdown(elem_id="message")

        # a new user's first step is Launch; with runs to look at, their Run tab
        with gr.Tabs(selected="run" if names else "launch"):
            with gr.Tab("Run", id="run"):
                with gr.Row():
                    stages = gr.Dataframe(label="Stages", interactive=False)
                    files = gr.Dataframe(label="Files for deployment", interactive=False)
                console = gr.Code(label="Console (run.log, runs started here)", language=None, lines=12)
                config = gr.Code(label="run.yaml", language="yaml")
            with gr.Tab("Curves", id="curves"):
                compare = gr.Dropdown(names, value=names[:1], multiselect=True, label="Runs drawn together",
                                      elem_id="curve-runs")
                plots = [gr.LinePlot(x="step", y="value", color="series", title=title, y_title=y_title,
                                     x_title="step", height=260, elem_id=f"curve-{i}")
                         for i, (title, y_title, _, _) in enumerate(CURVES)]
            with gr.Tab("Results", id="results"):
                ollama = gr.Code(label="Hand it to Ollama", language="shell", lines=1)
                verify = gr.Dataframe(headers=["quant", "file", "shards", "top-1 agreement", "mean KL"],
                                      label="export verify (gguf/verify.json)", interactive=False)
                report = gr.Markdown(elem_id="eval-report")
            with gr.Tab("Chat", id="chat"):
                system = chat_tab(board, run)
            with gr.Tab("Compare configs", id="compare"):
                with gr.Row():
                    first = gr.Dropdown(names, label="First run")
                    second = gr.Dropdown(names, label="Second run")
                diff = gr.Dataframe(label="run.yaml keys that differ", interactive=False)
            with gr.Tab("Launch", id="launch"):
                launch_tab(board, default_config)

        def details(name: str | None) -> tuple[Any, ...]:
            root = board.root(name)
            return (board.stages(name), board.files(name), board.console(name), board.config_text(name),
                    ollama_command(root) if root else "", verify_rows(root) if root else [],
                    eval_report(root) if root else "")

        def curves(drawn: list[str] | None) -> list[Any]:
            # no frame for a curve without points: a visible plot drawn once from an empty frame stays empty
            return [frame if len(frame) else None for frame in board.curves(drawn)]

        def refresh(name: str | None, drawn: list[str] | None) -> tuple[Any, ...]:
            names = board.names()
            kept = [n for n in drawn or [] if n in names] or ([name] if name in names else [])
            return (gr.update(choices=names, value=name if name in names else (names[0] if names else None)),
                    gr.update(choices=names, value=kept), *details(name), *curves(kept))

        detail_outputs = [stages, files, console, config, ollama, verify, report]
        run.change(details, run, detail_outputs)
        page.load(lambda name: board.system_prompt(name), run, system)
        compare.change(curves, compare, plots)
        timer.tick(refresh, [run, compare], [run, compare, *detail_outputs, *plots], show_progress="hidden")
        page.load(refresh, [run, compare], [run, compare, *detail_outputs, *plots])
        stop.click(board.stop, run, message)
        resume.click(board.resume, run, message)
        for picker in (first, second):
            picker.change(board.diff, [first, second], diff)
    return page


def create_app(board: Dashboard, api_key: str | None, default_config: str = "examples/quickstart.yaml") -> FastAPI:
    """The page mounted at / on a FastAPI app; with an API key, the page asks for it (any user name)."""
    auth = (lambda _user, password: password == api_key) if api_key else None
    return gr.mount_gradio_app(FastAPI(title="gemmaforge ui"), build(board, default_config), path="/", auth=auth,
                               auth_message="The API key this dashboard was started with (any user name).",
                               theme=_THEME, footer_links=[], ssr_mode=False)


def run_server(board: Dashboard, host: str, port: int, api_key: str | None, default_config: str) -> None:
    app = create_app(board, api_key, default_config)
    print(f"gemmaforge ui: http://{host}:{port}/  (runs in {board.runs_dir}; Ctrl-C stops the page, not the runs)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
