"""The Launch tab: the config form (one input per key, generated from the schema), the data preview, the memory
plan and Start. Problems are shown on the fields they are about (as each input's info line)."""

from __future__ import annotations

from typing import Any, TypedDict

import gradio as gr

from gemmaforge.config import RunConfig
from gemmaforge.errors import UserError
from gemmaforge.train.memory_plan import plan_config, plan_summary
from gemmaforge.ui.config_form import FormField, as_text, check, field_of, form_fields, values_from_file
from gemmaforge.ui.dashboard import Dashboard
from gemmaforge.ui.launch_checks import base_of, preview

PREVIEWS = 3
INTRO = ("Starts `gemmaforge run` on this form's config in its own process: closing this page does not stop it. "
         "Every key of the config has its input, checked as the command line checks it; load a config file or a "
         "run's run.yaml to start from it.")


def initial_values(fields: list[FormField], config_file: str) -> list[Any]:
    """The form as the given config file fills it, or the schema's defaults when it cannot be read."""
    try:
        return values_from_file(fields, config_file)
    except UserError:
        return [f.default for f in fields]


def form_inputs(fields: list[FormField], values: list[Any]) -> list[Any]:
    """One input per config key, in an accordion per section (the top-level output_dir first)."""
    made: dict[str, Any] = {}
    for section in dict.fromkeys(f.key.split(".")[0] for f in fields):
        members = [(f, v) for f, v in zip(fields, values) if f.key.split(".")[0] == section]
        if len(members) == 1 and "." not in members[0][0].key:
            made[section] = _input(*members[0])
            continue
        with gr.Accordion(section, open=section in ("model", "data", "train")):
            for start in range(0, len(members), 3):
                with gr.Row():
                    for field, value in members[start:start + 3]:
                        made[field.key] = _input(field, value)
    return [made[f.key] for f in fields]


class _Common(TypedDict):
    """The keywords every input shares, typed key by key so mypy matches each to gradio's parameter of that name."""

    label: str
    info: str
    elem_id: str


def _input(field: FormField, value: Any) -> Any:
    common: _Common = {"label": field.key, "info": field.description, "elem_id": "field-" + field.key.replace(".", "-")}
    if field.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if field.kind in ("integer", "number") and not as_text(field):
        return gr.Number(value=value, precision=0 if field.kind == "integer" else None, **common)
    if field.kind in ("choice", "choices"):
        choices = [*([""] if field.optional and field.kind == "choice" else []), *field.choices]
        return gr.Dropdown(choices, value=value, multiselect=field.kind == "choices", **common)
    return gr.Textbox(value=value, **common)


def launch_tab(board: Dashboard, default_config: str) -> None:
    fields = form_fields()
    gr.Markdown(INTRO)
    with gr.Row():
        config_path = gr.Textbox(default_config, label="Config file", scale=4)
        load = gr.Button("Load", scale=1)
    inputs = form_inputs(fields, initial_values(fields, default_config))
    with gr.Row():
        check_button = gr.Button("Check")
        preview_button = gr.Button("Preview data")
        plan_button = gr.Button("Plan memory")
        start = gr.Button("Start", variant="primary", elem_id="start")
    message = gr.Markdown(elem_id="launch-message")
    colours = {"supervised": "green", "cut": "red", "image": "magenta", "audio": "cyan"}
    previews = [gr.HighlightedText(label=f"conversation {i + 1}", color_map=colours,
                                   combine_adjacent=True, show_legend=True, elem_id=f"preview-{i}")
                for i in range(PREVIEWS)]
    plan_text = gr.Code(label="Memory plan (as `gemmaforge plan` prints it)", language=None, elem_id="plan")

    def checked(values: tuple[Any, ...]) -> tuple[RunConfig | None, list[Any], str]:
        """The form's config, each input's info line (its problem, or its description) and a summary."""
        config, problems = check(fields, list(values))
        marked: dict[str, str] = {}
        for key, problem in problems.items():
            field = field_of(fields, key)
            if field is not None:
                marked[field.key] = f"{marked[field.key]}; {problem}" if field.key in marked else problem
        infos = [gr.update(info=f"⚠ {marked[f.key]}" if f.key in marked else f.description) for f in fields]
        summary = "; ".join(f"`{key}`: {problem}" for key, problem in problems.items())
        return config, infos, (f"**Not valid.** {summary}" if problems else "")

    def check_form(*values: Any) -> list[Any]:
        _, infos, summary = checked(values)
        return [*infos, summary or "The config is valid."]

    def start_form(*values: Any) -> list[Any]:
        config, infos, summary = checked(values)
        return [*infos, board.launch(config) if config is not None else summary]

    def preview_form(*values: Any) -> list[Any]:
        config, infos, summary = checked(values)
        boxes = [gr.update(value=None, label=f"conversation {i + 1}") for i in range(PREVIEWS)]
        if config is None:
            return [*infos, summary, *boxes]
        try:
            shown = preview(config, base_of(config, board.home), PREVIEWS)
        except UserError as exc:
            return [*infos, f"**No preview.** {exc}", *boxes]
        for i, p in enumerate(shown):
            boxes[i] = gr.update(value=[(text, None if kind == "prompt" else kind) for text, kind in p.spans],
                                 label=f"{p.where}: {p.tokens} tokens, {p.supervised} supervised")
        return [*infos, "Green: supervised tokens (the loss is computed on them); red: past train.cutoff_len.",
                *boxes]

    def plan_form(*values: Any) -> list[Any]:
        config, infos, summary = checked(values)
        if config is None:
            return [*infos, summary, ""]
        try:
            planned = plan_config(config, base_of(config, board.home))
        except UserError as exc:
            return [*infos, f"**No plan.** {exc}", ""]
        verdict = "It fits." if planned.fits else \
            "**It does not fit**: Start refuses it (train.check_memory=false trains anyway)."
        return [*infos, verdict, plan_summary(planned)]

    def load_form(path: str) -> list[Any]:
        try:
            values = values_from_file(fields, path)
        except UserError as exc:
            return [*(gr.update() for _ in fields), f"**Not loaded.** {exc}"]
        return [*values, f"Loaded `{path.strip()}`: change what you like, then Check or Start."]

    check_button.click(check_form, inputs, [*inputs, message])
    start.click(start_form, inputs, [*inputs, message])
    preview_button.click(preview_form, inputs, [*inputs, message, *previews])
    plan_button.click(plan_form, inputs, [*inputs, message, plan_text])
    load.click(load_form, config_path, [*inputs, message])
