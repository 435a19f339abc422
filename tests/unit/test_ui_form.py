"""The Launch tab's form: one field per config key from the schema, filled from a config file, checked by the
command line's validation with each problem given to its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gemmaforge.config import dump_config, load_config
from gemmaforge.errors import UserError
from gemmaforge.ui.config_form import check, field_of, form_fields, values_from_file
from gemmaforge.ui.overview import flatten

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
FIELDS = form_fields()
KEYS = [f.key for f in FIELDS]


def changed(values: list[Any], **changes: Any) -> list[Any]:
    """values with fields replaced (keyword names use __ for the dots)."""
    values = list(values)
    for name, value in changes.items():
        values[KEYS.index(name.replace("__", "."))] = value
    return values


def test_every_config_key_has_one_field_with_its_kind_and_description() -> None:
    config = load_config(QUICKSTART)
    assert sorted(KEYS) == sorted(flatten(config.model_dump(mode="json"))) and len(set(KEYS)) == len(KEYS)
    kinds = {f.key: f.kind for f in FIELDS}
    assert (kinds["train.learning_rate"], kinds["train.max_steps"], kinds["train.packing"]) == \
        ("number", "integer", "bool")
    assert (kinds["data.format"], kinds["export.gguf"], kinds["lora.target_modules"]) == ("choice", "choices", "yaml")
    by_key = {f.key: f for f in FIELDS}
    assert by_key["model.revision"].optional and by_key["model.revision"].kind == "text"
    assert "q4_k_m" in by_key["export.gguf"].choices
    assert by_key["data.clean.unicode_normalization"].choices == ("NFC", "NFKC")
    assert by_key["train.eval_steps"].description == "default: save_steps"
    assert by_key["train.learning_rate"].default == 2e-4
    # an optional number is a text input, empty for None (a number input would show 0, which eval_steps refuses)
    assert by_key["train.eval_steps"].default == "" and by_key["data.val_size"].default == ""


def test_the_quickstart_loads_into_the_form_and_checks_back_to_the_same_config(tmp_path: Path) -> None:
    values = values_from_file(FIELDS, str(QUICKSTART))
    assert values[KEYS.index("lora.target_modules")] == \
        "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
    assert values[KEYS.index("export.gguf")] == ["f16", "q8_0"]
    config, problems = check(FIELDS, values)
    assert problems == {}
    assert dump_config(config) == dump_config(load_config(QUICKSTART))
    assert values[KEYS.index("train.eval_steps")] == "" and values[KEYS.index("data.val_size")] == "0.1"
    edited, _ = check(FIELDS, changed(values, train__max_steps=10.0, lora__target_modules="all-linear",
                                      model__revision="", export__gguf=["q4_k_m"], train__eval_steps="5",
                                      eval__fail_under="1e-05"))
    assert (edited.train.max_steps, edited.lora.target_modules, edited.model.revision, edited.export.gguf) == \
        (10, "all-linear", None, ["q4_k_m"])
    assert (edited.train.eval_steps, edited.eval.fail_under) == (5, 1e-05)
    # what a run writes (run.yaml) loads back into the same form values
    saved = tmp_path / "run.yaml"
    saved.write_text(dump_config(edited), encoding="utf-8")
    again = values_from_file(FIELDS, str(saved))
    assert again[KEYS.index("lora.target_modules")] == "all-linear" and again[KEYS.index("train.eval_steps")] == "5"
    assert dump_config(check(FIELDS, again)[0]) == dump_config(edited)


def test_each_problem_is_given_to_its_field() -> None:
    values = values_from_file(FIELDS, str(QUICKSTART))
    config, problems = check(FIELDS, changed(values, train__max_steps=2.5, output_dir="", export__gguf=["f16", "q3"],
                                             train__learning_rate=-1.0))
    assert config is None
    assert problems["output_dir"] == "required key is missing"
    assert "valid integer" in problems["train.max_steps"] and "2.5" in problems["train.max_steps"]
    assert "greater than 0" in problems["train.learning_rate"]
    assert field_of(FIELDS, next(k for k in problems if k.startswith("export.gguf"))).key == "export.gguf"
    _, problems = check(FIELDS, changed(values, lora__target_modules="[q_proj"))
    assert list(problems) == ["lora.target_modules"]
    assert problems["lora.target_modules"].startswith("not valid YAML")
    # a rule across keys is the section's problem, said as the command line says it
    _, problems = check(FIELDS, changed(values, train__load_best_model_at_end=True, train__eval_strategy="no"))
    assert "load_best_model_at_end needs evaluation" in problems["train"] and field_of(FIELDS, "train") is None


def test_a_config_file_the_command_line_refuses_is_refused_with_its_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: x\ndata: {path: d.json}\ntrain: {learning_rat: 1e-4}\n", encoding="utf-8")
    with pytest.raises(UserError, match="train.learning_rat: unknown key; did you mean 'learning_rate'"):
        values_from_file(FIELDS, str(bad))
    with pytest.raises(UserError, match="config file not found"):
        values_from_file(FIELDS, str(tmp_path / "missing.yaml"))
