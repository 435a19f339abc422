"""The dashboard's reading of run directories: metrics.jsonl while it is appended to, stage status from the
recorded process, curves thinned for drawing, config differences. (A real run launched from the dashboard is
tests/integration/test_ui.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from gemmaforge.cli import main
from gemmaforge.models import default_home
from gemmaforge.runs import RunDir
from gemmaforge.ui.app import REFRESH_S
from gemmaforge.ui.dashboard import Dashboard
from gemmaforge.ui.overview import (
    MAX_POINTS,
    MetricsTail,
    config_diff,
    find_runs,
    overall_status,
    points,
    running_pid,
    stage_status,
    summarize,
)
from gemmaforge.ui.playground import conversation
from gemmaforge.ui.results import eval_report, ollama_command
from gemmaforge.units import decimal_size
from tests.helpers import run_config


def test_metrics_are_read_as_they_grow_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []
    path.write_text('{"step": 1, "loss": 3.5}\n{"step": 2, "lo', encoding="utf-8")  # the trainer mid-write
    assert tail.read() == [{"step": 1, "loss": 3.5}]
    with path.open("a", encoding="utf-8") as f:
        f.write('ss": 3.25}\nnot json\n{"step": 3, "loss": 3.0}\n')
    assert [row["step"] for row in tail.read()] == [1, 2, 3]
    # a resumed run rewrites the file up to its checkpoint: read from the start again
    path.write_text('{"step": 1, "loss": 3.5}\n', encoding="utf-8")
    assert tail.read() == [{"step": 1, "loss": 3.5}]
    path.unlink()
    assert tail.read() == []


def test_a_long_curve_is_thinned_evenly_keeping_its_ends() -> None:
    rows = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(10_000)] + [{"step": 10_000, "eval_loss": 0.5}]
    drawn = points(rows, "loss")
    assert len(drawn) == MAX_POINTS
    assert drawn[0] == (0, 1.0) and drawn[-1] == (9_999, 1.0 / 10_000)
    assert [s for s, _ in drawn] == sorted(s for s, _ in drawn)
    assert points(rows, "eval_loss") == [(10_000, 0.5)]
    assert points(rows[:10], "loss") == [(i, 1.0 / (i + 1)) for i in range(10)]


def test_a_running_stage_whose_process_died_is_interrupted() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    here = socket.gethostname()
    assert stage_status({"status": "running", "pid": os.getpid(), "host": here}) == "running"
    assert stage_status({"status": "running", "pid": ended.pid, "host": here}) == "interrupted"
    # another machine's process cannot be looked at from here: its word stands
    assert stage_status({"status": "running", "pid": ended.pid, "host": here + "-other"}) == "running"
    assert running_pid({"stages": {"data": {"status": "done"},
                                   "train": {"status": "running", "pid": os.getpid(), "host": here}}}) == os.getpid()
    assert running_pid({"stages": {"train": {"status": "running", "pid": ended.pid, "host": here}}}) is None
    # between two stages the pipeline's process is alive while every recorded stage is done
    assert running_pid({"stages": {"data": {"status": "done", "pid": os.getpid(), "host": here}}}) == os.getpid()
    assert overall_status({"data": "done"}, live=True) == "running"
    assert overall_status({"data": "done", "train": "interrupted"}) == "interrupted"
    assert overall_status({"data": "done", "train": "done"}) == "done"
    assert overall_status({}) == "new"


def test_a_stage_records_its_process_and_stopped_when_interrupted(tmp_path: Path) -> None:
    run = RunDir.create(run_config(output_dir=str(tmp_path / "run")))
    with pytest.raises(KeyboardInterrupt):
        with run.stage("train"):
            record = run.manifest()["stages"]["train"]
            assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
            raise KeyboardInterrupt
    assert run.manifest()["stages"]["train"]["status"] == "stopped"
    with pytest.raises(RuntimeError):
        with run.stage("merge"):
            raise RuntimeError("boom")
    assert run.manifest()["stages"]["merge"]["status"] == "failed"


def _run_dir(root: Path, **sections: dict) -> Path:
    root.mkdir(parents=True)
    config = {"output_dir": str(root), "model": {"name_or_path": "gemma3-270m"}, "data": {"path": "d.json"},
              **sections}
    (root / "run.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return root


def test_runs_are_listed_with_what_their_files_say(tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "a", train={"learning_rate": 1e-4})
    b = _run_dir(tmp_path / "b", train={"learning_rate": 2e-4, "max_steps": 10})
    (tmp_path / "not-a-run").mkdir()
    (a / "manifest.json").write_text(json.dumps({"stages": {
        "data": {"status": "done", "runtime_s": 1.5},
        "train": {"status": "done", "runtime_s": 10.0, "samples_per_second": 3.25}}}), encoding="utf-8")
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 2.0, "peak_memory_bytes": 1000}, {"step": 2, "eval_loss": 1.5},
        {"step": 3, "loss": 1.0, "peak_memory_bytes": 3000}, {"step": 4, "eval_loss": 1.25})), encoding="utf-8")
    os.utime(b / "run.yaml", (1, 1))  # a changed long ago: listed after a
    assert find_runs(tmp_path) == [a, b]
    assert find_runs(a) == [a]  # RUNS_DIR may be one run
    s = summarize(a, tmp_path)
    assert (s.name, s.model, s.data, s.status) == ("a", "gemma3-270m", "d.json", "done")
    assert (s.runtime_s, s.samples_per_second, s.peak_memory_bytes, s.best_eval_loss) == (11.5, 3.25, 3000, 1.25)
    assert summarize(b, tmp_path).status == "new"
    (b / "run.yaml").write_text("model: [unclosed", encoding="utf-8")
    broken = summarize(b, tmp_path)
    assert broken.status == "unreadable" and broken.error.startswith("run.yaml:")


def test_config_diff_names_the_dotted_keys_that_differ(tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "a", train={"learning_rate": 1e-4})
    b = _run_dir(tmp_path / "b", train={"learning_rate": 2e-4, "max_steps": 10})
    assert config_diff(a, b) == [
        ("output_dir", json.dumps(str(a)), json.dumps(str(b))),
        ("train.learning_rate", "0.0001", "0.0002"),
        ("train.max_steps", '"(absent)"', "10"),
    ]


def test_results_before_any_are_written_say_which_stage_writes_them(tmp_path: Path) -> None:
    root = _run_dir(tmp_path / "a")
    assert "eval/results.json" in eval_report(root)
    assert "ollama/Modelfile" in ollama_command(root)
    (root / "eval").mkdir()
    (root / "eval" / "results.json").write_text('{"cases": [{"id": "x"}]}', encoding="utf-8")
    assert eval_report(root).startswith("eval/results.json cannot be read as a report")


def test_file_sizes_are_decimal_as_llama_cpp_shows_them() -> None:
    assert [decimal_size(n) for n in (512, 1500, 291_500_000, 1_070_000_000, 150_000_000_000)] == \
        ["512 B", "1.5 kB", "292 MB", "1.07 GB", "150 GB"]


def test_ui_refuses_other_hosts_without_a_key_and_a_file_for_runs_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEMMAFORGE_API_KEY", raising=False)
    assert main(["ui", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    (tmp_path / "file.txt").write_text("x", encoding="utf-8")
    assert main(["ui", str(tmp_path / "file.txt")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_ui_without_its_extra_says_how_to_install_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` fails as it does without the ui extra
    for name in ("gemmaforge.ui.app", "gemmaforge.ui.launch_tab", "gemmaforge.ui.chat_tab"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["ui", str(tmp_path)]) == 2
    assert "gemmaforge ui needs gradio: pip install 'gemmaforge[ui]'" in capsys.readouterr().err


def test_the_chat_history_the_page_hands_back_is_read_as_text() -> None:
    history = [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "metadata": None},
               {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo."}]}]
    assert conversation(history, "Next?", "Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Next?"}]
    assert conversation([], "Next?", "  ") == [{"role": "user", "content": "Next?"}]


DASHBOARD_PAGE = (Path(__file__).parents[2] / "docs" / "dashboard.md").read_text(encoding="utf-8")


def test_the_dashboard_page_figures_are_its_own() -> None:
    """docs/dashboard.md: refreshed every 3 s, long series thinned to 2,000 points, gradio only in the ui extra."""
    section = " ".join(DASHBOARD_PAGE.split())
    assert f"refreshed every {REFRESH_S:g} s" in section
    thinned = int(section.split("thinned to ")[1].split(" points")[0].replace(",", ""))
    assert len(points([{"step": i, "loss": 1.0} for i in range(3 * thinned)], "loss")) == thinned
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(d.startswith("gradio") for d in project["optional-dependencies"]["ui"])
    assert not any(d.startswith("gradio") for d in project["dependencies"])  # the first command needs none of it


def test_the_chat_starts_with_the_run_s_deployed_system_prompt(tmp_path: Path) -> None:
    _run_dir(tmp_path / "a", data={"path": "d.json", "system": "You are a barista."})
    _run_dir(tmp_path / "b", data={"path": "d.json", "system": "trained"}, export={"ollama": {"system": "deployed"}})
    board = Dashboard(tmp_path, default_home())
    assert (board.system_prompt("a"), board.system_prompt("b"), board.system_prompt(None)) == \
        ("You are a barista.", "deployed", "")


def test_a_preference_run_draws_its_rewards(tmp_path: Path) -> None:
    """A dpo run's rewards/* rows (train and eval) are their own chart; an SFT run leaves it empty."""
    from gemmaforge.ui.dashboard import CURVES

    dpo = _run_dir(tmp_path / "dpo", train={"method": "dpo"})
    (dpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 0.69, "rewards/chosen": 0.01, "rewards/rejected": -0.01, "rewards/margins": 0.02},
        {"step": 2, "eval_loss": 0.6, "eval_rewards/margins": 0.3})), encoding="utf-8")
    sft = _run_dir(tmp_path / "sft")
    (sft / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n", encoding="utf-8")
    board = Dashboard(tmp_path, default_home())
    index = next(i for i, (title, *_) in enumerate(CURVES) if title.startswith("Preference rewards"))
    frame = board.curves(["dpo", "sft"])[index]
    assert sorted(zip(frame["series"], frame["value"])) == [
        ("dpo: eval_rewards/margins", 0.3), ("dpo: rewards/chosen", 0.01), ("dpo: rewards/margins", 0.02),
        ("dpo: rewards/rejected", -0.01)]
