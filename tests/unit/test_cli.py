"""Bad input through the real command line: exit code 2, one clear message, nothing half-written."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gemmaforge.cli import main
from tests.helpers import run_cli, write_config


@pytest.mark.slow  # a process of its own: 17 s on 2 busy cores
def test_missing_data_file_is_exit_2_without_traceback(tmp_path: Path) -> None:
    config = write_config(tmp_path, "gemma3-270m")
    (tmp_path / "data.json").unlink()
    proc = run_cli("run", str(config), cwd=tmp_path)
    assert proc.returncode == 2
    assert "data.json: data file not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "data").exists()


def test_config_typo_is_exit_2_with_did_you_mean(tmp_path: Path) -> None:
    config = write_config(tmp_path, "gemma3-270m")
    proc = run_cli("run", str(config), "train.lerning_rate=1e-3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "train.lerning_rate: unknown key; did you mean 'learning_rate'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists(), "a config error must not create the run directory"


def test_malformed_json_names_the_line_and_writes_no_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "gemma3-270m")
    (tmp_path / "data.json").write_text('[{"instruction": "a", "output": "b"},\n{"instruction": "c" "output": "d"}]')
    assert main(["run", str(config)]) == 2
    assert f"{tmp_path / 'data.json'} line 2 column 21: malformed JSON (Expecting ',' delimiter)" in \
        capsys.readouterr().err
    assert not (tmp_path / "run" / "data" / "train.jsonl").exists()


def test_unwritable_output_dir_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "gemma3-270m")  # /proc refuses new folders, even to root
    assert main(["run", str(config), "output_dir=/proc/gemmaforge-test/run"]) == 2
    assert "output_dir '/proc/gemmaforge-test/run': cannot write there" in capsys.readouterr().err


def test_output_dir_that_is_a_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("not a folder")
    config = write_config(tmp_path, "gemma3-270m")
    assert main(["run", str(config), f"output_dir={tmp_path}/taken/run"]) == 2
    assert "cannot write there" in capsys.readouterr().err


def test_stage_on_a_folder_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["merge", str(tmp_path)]) == 2
    assert "not a run directory (no run.yaml)" in capsys.readouterr().err


def test_export_before_merge_names_the_missing_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     tiny_gemma3_dir: Path) -> None:
    from gemmaforge.config import load_config
    from gemmaforge.runs import RunDir

    RunDir.create(load_config(write_config(tmp_path, tiny_gemma3_dir)))
    assert main(["export", "gguf", str(tmp_path / "run")]) == 2
    assert "merged/config.json is missing: run `gemmaforge merge" in capsys.readouterr().err


def test_missing_model_and_unknown_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tmp_path / "no-such-model.gguf")
    assert main(["train", str(config)]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    assert main(["export", "gguf", str(tmp_path), "--quant", "q3_k"]) == 2
    assert "invalid choice: 'q3_k'" in capsys.readouterr().err


def test_offline_hub_id_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = write_config(tmp_path, "google/gemma-3-1b-it-not-cached")
    assert main(["train", str(config)]) == 2
    assert "the hub could not provide it" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_fp16_on_gemma3_and_gemma4_is_refused_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              text_checkpoint_of, family: str) -> None:
    """docs/training.md (Refused before loading): fp16 on Gemma 3/4, with the reason and the precisions to use instead.
    """
    config = write_config(tmp_path, text_checkpoint_of(family), precision="fp16")
    assert main(["train", str(config)]) == 2
    assert f"train.precision=fp16: {family} activations overflow in fp16 (NaN loss); use bf16 or fp32" in \
        " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "adapter").exists()


@pytest.mark.parametrize("flags", [["--quant", "q8_0"], ["--output", "x.gguf"], ["--split-max-size", "2G"],
                                   ["--split-max-tensors", "10"]])
def test_export_gguf_adapter_refuses_the_flags_it_would_ignore(tmp_path: Path, flags: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--adapter writes adapter-f16.gguf whole: a quant, an output file or a split asked for beside it would be
    dropped without a word, so the command is refused before anything loads."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.yaml").write_text(write_config(tmp_path, "gemma3-270m").read_text(encoding="utf-8"))
    assert main(["export", "gguf", str(tmp_path / "run"), "--adapter", *flags]) == 2
    assert f"--adapter writes RUN_DIR/gguf/adapter-f16.gguf, whole and in f16: {flags[0]} do not apply" in \
        " ".join(capsys.readouterr().err.split())


def test_export_gguf_adapter_of_a_checkpoint_folder_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}')
    assert main(["export", "gguf", str(tmp_path), "--adapter"]) == 2
    assert f"--adapter exports a run's LoRA adapter, and {tmp_path} is a checkpoint folder" in \
        " ".join(capsys.readouterr().err.split())


def test_serve_listens_on_loopback_at_ollamas_port_by_default() -> None:
    from gemmaforge.cli import build_parser

    args = build_parser().parse_args(["serve", "gemma3-270m"])
    assert (args.host, args.port) == ("127.0.0.1", 11434)


@pytest.mark.parametrize(("argv", "says"), [
    (["chat", "http://127.0.0.1:9", "--engine", "llamacpp"], "leave out --engine"),
    (["chat", "http://127.0.0.1:9", "--num-ctx", "8", "--dtype", "fp32"], "leave out --num-ctx, --dtype"),
    (["chat", "gemma3-270m", "--model", "x"], "--model picks one of the models a server URL serves"),
    (["chat", "gemma3-270m", "--engine", "llamacpp", "--dtype", "bf16"], "--dtype sets the transformers engine's"),
    (["serve", "gemma3-270m", "--engine", "llamacpp", "--dtype", "fp32"], "--engine llamacpp runs the GGUF file's"),
])
def test_flags_that_would_be_ignored_are_refused(argv: list[str], says: str, capsys, monkeypatch) -> None:
    """Refused before anything is loaded or served (the model loaders are not reached)."""
    import gemmaforge.serve.server as server

    monkeypatch.setattr(server, "load_registry", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(server, "serve", lambda *a, **k: pytest.fail("served"))
    assert main(argv) == 2
    assert says in " ".join(capsys.readouterr().err.split())


def test_eval_gguf_without_the_llamacpp_engine_is_refused_before_loading(tmp_path: Path, capsys) -> None:
    from gemmaforge.config import load_config
    from gemmaforge.runs import RunDir

    run = RunDir.create(load_config(write_config(tmp_path, tmp_path / "no-model-here")))
    assert main(["eval", str(run.root), "gguf=q8_0"]) == 2
    assert "eval.gguf picks the file the llamacpp engine answers from" in " ".join(capsys.readouterr().err.split())
    assert not (run.root / "eval").exists()


def test_every_verb_and_target_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """README's verb table names every verb `gemmaforge --help` lists, and each verb (and export target) has its own
    help."""
    import argparse

    from gemmaforge.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    documented = {line.split("`gemmaforge ")[1].split()[0].rstrip("`") for line in readme.splitlines()
                  if line.startswith("| `gemmaforge ")}
    assert documented == set(verbs)
    commands = [[verb] for verb in verbs if verb != "export"] + [["export", t] for t in ("gguf", "verify", "vllm",
                                                                                        "ollama")]
    commands += [["data", t] for t in ("prepare", "inspect")] + [["config", "convert"]]
    for command in [[], *commands]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*command, "--help"])
        assert exit_info.value.code == 0, command
        assert capsys.readouterr().out.startswith("usage: gemmaforge"), command


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(verb path, parser) for every command line the parser accepts: `export gguf`, `train`, ..."""
    verbs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not verbs:
        yield path, parser
        return
    for name, sub in verbs[0].choices.items():
        yield from leaf_parsers(sub, (*path, name))


def test_each_verb_parser_names_its_handler_which_lives_in_that_verbs_module() -> None:
    """The CLI is a table (docs/architecture.md): each verb's parser names the function that runs it, a handler in the
    cli/ module that built the parser."""
    from gemmaforge.cli import VERB_MODULES, build_parser
    from gemmaforge.cli.common import Parser

    owner = {}
    for module in VERB_MODULES:
        verbs = Parser().add_subparsers(parser_class=Parser)
        module.add(verbs)
        owner.update({name: module.__name__ for name in verbs.choices})
    leaves = list(leaf_parsers(build_parser()))
    assert {" ".join(path) for path, _ in leaves} >= {"run", "train", "plan", "data prepare", "data inspect", "eval",
                                                       "merge", "export gguf", "export verify", "serve", "chat",
                                                       "doctor"}
    for path, parser in leaves:
        handler = parser.get_default("handler")
        assert callable(handler), f"{' '.join(path)} names no handler"
        assert handler.__module__ == owner[path[0]], (path, handler.__module__)
