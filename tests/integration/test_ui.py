"""The dashboard on real runs: started from it as their own `gemmaforge run` processes on a tiny Gemma 3, stopped
and resumed, read back into its tables, curves and reports, and its page served over HTTP (with the key rule).
The page in a browser is benchmarks/ui_browser.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gemmaforge.cli import main
from gemmaforge.config import load_config
from gemmaforge.data.formats import detect_schema, to_messages
from gemmaforge.errors import UserError
from gemmaforge.models import default_home
from gemmaforge.serve.server import app_in_background
from gemmaforge.ui.app import create_app
from gemmaforge.ui.config_form import check, form_fields, values_from_file
from gemmaforge.ui.dashboard import CURVES, Dashboard
from gemmaforge.ui.launch_checks import base_of, preview
from gemmaforge.ui.overview import read_json
from gemmaforge.ui.playground import Settings, side_by_side
from gemmaforge.ui.results import eval_report, ollama_command, verify_rows
from tests.helpers import reference_answer, write_config

pytestmark = pytest.mark.integration
SUITE = Path(__file__).parents[2] / "examples" / "suites" / "coffee.yaml"  # cases with checks: a pass rate
WAIT_S = 600


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


FIELDS = form_fields()


def launch(board: Dashboard, config_file: Path, changes: dict[str, Any]) -> str:
    """What the Launch tab does: the file loaded into the form, fields changed, checked, started."""
    values = values_from_file(FIELDS, str(config_file))
    keys = [f.key for f in FIELDS]
    for key, value in changes.items():
        values[keys.index(key)] = value
    config, problems = check(FIELDS, values)
    assert not problems, problems
    return board.launch(config)


def status_of(board: Dashboard, name: str) -> str:
    table = board.table()
    return str(table.loc[table["run"] == name, "status"].iloc[0]) if name in set(table["run"]) else "absent"


@dataclass
class Stopped:
    """What the run looked like once stopped, before its resume."""
    train_status: str
    status: str
    at_step: int
    refusals: tuple[str, ...]  # start again, resume, stop: while running, then stop once stopped


Finished = tuple[Dashboard, Path, Stopped]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Finished:
    """A run started from the dashboard, stopped in training after its first checkpoint, resumed from it and left to
    finish, then verified from the command line. One run for all the tests here (each costs a minute on 2 cores)."""
    tmp = tmp_path_factory.mktemp("ui")
    runs, steps = tmp / "runs", 20
    config = write_config(tmp, tiny_gemma3_dir, max_steps=steps, save_steps=5)
    board = Dashboard(runs, default_home())
    changes = {"output_dir": str(runs / "first"), "eval.retention": False, "eval.max_new_tokens": 8,
               "eval.suite": str(SUITE)}
    message = launch(board, config, changes)
    assert message.startswith("Started"), message
    metrics = runs / "first" / "metrics.jsonl"
    # steps 1-5, the evaluation at 5, step 6: checkpoint-5 is complete (saved after the evaluation)
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 7, "a checkpoint")
    refusals = (launch(board, config, changes), board.resume("first"))
    assert board.stop("first").startswith("Stopping")
    wait_for(lambda: not board.launcher.busy(runs / "first"), "the stop")
    stopped = Stopped(read_json(runs / "first" / "manifest.json")["stages"]["train"]["status"],
                      status_of(board, "first"), max(json.loads(line)["step"] for line in metrics.open()),
                      (*refusals, board.stop("first")))
    assert board.resume("first").startswith("Resumed")
    wait_for(lambda: status_of(board, "first") not in ("stopped", "running"), "the resumed run to end")
    assert status_of(board, "first") == "done", board.console("first")
    assert main(["export", "verify", str(runs / "first")]) == 0
    return board, runs / "first", stopped


def test_a_run_is_stopped_and_resumed_from_its_checkpoint(finished: Finished) -> None:
    board, root, stopped = finished
    assert (stopped.train_status, stopped.status) == ("stopped", "stopped"), board.console("first")
    again, resume, stop = stopped.refusals
    assert again.startswith("**Not started.**") and "running already" in again
    assert resume.startswith("**Not resumed.**")
    assert stop.endswith("is not running on this machine.")
    train = read_json(root / "manifest.json")["stages"]["train"]
    assert train["steps"] == 20 and 0 < train["resumed_from_step"] <= stopped.at_step < 20
    steps = [json.loads(line)["step"] for line in (root / "metrics.jsonl").open() if '"loss"' in line]
    assert steps == list(range(1, 21))  # none lost, none logged twice across the resume


def test_a_run_started_from_the_dashboard_is_listed_with_its_figures(finished: Finished) -> None:
    board, root, _ = finished
    row = board.table().set_index("run").loc["first"]
    manifest = read_json(root / "manifest.json")
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert row["stages"] == f"{len(manifest['stages'])}/{len(manifest['stages'])}"
    assert row["samples/s"] == round(manifest["stages"]["train"]["samples_per_second"], 2)
    assert row["best eval loss"] == round(min(r["eval_loss"] for r in metrics if "eval_loss" in r), 4)
    results = read_json(root / "eval" / "results.json")
    assert row["pass rate base -> tuned"] == f"{results['base']['suite_pass_rate']} -> " \
                                             f"{results['tuned']['suite_pass_rate']}"
    stages = board.stages("first")
    assert list(stages["stage"][:6]) == ["data", "train", "eval", "merge", "export_gguf", "export_ollama"]
    assert set(stages["status"]) == {"done"}
    assert "export ollama" in board.console("first")  # run.log: the child's console output
    assert board.config_text("first") == (root / "run.yaml").read_text(encoding="utf-8")


def test_its_curves_are_its_metrics_rows(finished: Finished) -> None:
    board, root, _ = finished
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    frames = dict(zip((title for title, *_ in CURVES), board.curves(["first"])))
    loss = frames["Loss"]
    assert list(loss.loc[loss["series"] == "first: loss", "step"]) == [r["step"] for r in metrics if "loss" in r]
    assert list(loss.loc[loss["series"] == "first: eval_loss", "value"]) == \
        [r["eval_loss"] for r in metrics if "eval_loss" in r]
    assert len(frames["Learning rate"]) == sum("learning_rate" in r for r in metrics) > 0
    memory = frames["Memory (GiB)"]
    peak = [r["peak_memory_bytes"] / 2**30 for r in metrics if "peak_memory_bytes" in r]
    assert list(memory.loc[memory["series"] == "first: peak_memory_bytes", "value"]) == pytest.approx(peak)


def test_its_results_report_failing_cases_first_and_its_exports(finished: Finished) -> None:
    board, root, _ = finished
    report = eval_report(root)
    results = read_json(root / "eval" / "results.json")
    assert report.startswith("# Evaluation: base vs tuned")
    listed = [line.split(" | ")[0].lstrip("| ") for line in report.split("## Cases")[1].splitlines()
              if line.startswith("| ") and not line.startswith("| case |")]
    order = {False: 0, None: 1, True: 2}
    by_id = {case["id"]: case for case in results["cases"]}
    assert sorted(listed) == sorted(by_id)
    assert [order[by_id[i]["tuned"]["passed"]] for i in listed] == sorted(order[c["tuned"]["passed"]]
                                                                           for c in results["cases"])
    verify = read_json(root / "gguf" / "verify.json")["files"]
    assert verify_rows(root) == [[q, Path(r["file"]).name, r["shards"], r["top1_agreement"], r["mean_kl"]]
                                 for q, r in verify.items()]
    assert ollama_command(root) == f"ollama create tiny-coffee -f {root / 'ollama' / 'Modelfile'}"
    files = dict(board.files("first").values.tolist())
    assert {"gguf/model-f16.gguf", "gguf/model-q8_0.gguf", "ollama/Modelfile",
            "adapter/adapter_model.safetensors"} <= set(files)


def test_the_page_is_served_and_a_key_guards_it(tmp_path: Path) -> None:
    board = Dashboard(tmp_path, default_home())
    with app_in_background(create_app(board, api_key=None)) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(url + "/config").status_code == 200
    with app_in_background(create_app(board, api_key="sesame")) as url:
        assert httpx.get(url + "/config").status_code == 401
        with httpx.Client(base_url=url) as client:
            assert client.post("/login", data={"username": "me", "password": "wrong"}).status_code == 400
            assert client.post("/login", data={"username": "me", "password": "sesame"}).status_code == 200
            assert client.get("/config").status_code == 200


def test_chat_streams_base_and_tuned_side_by_side_as_serve_answers(finished: Finished) -> None:
    board, root, _ = finished
    url, pair = board.playground.pair(root)
    assert board.playground.pair(root) == (url, pair)  # loaded once
    registry = board.playground._registry
    assert registry.get(pair.base).engine is registry.get(pair.tuned).engine  # one base in memory
    assert (pair.tuned, pair.base) == ("first:latest", "first-base:latest")  # named for the run's folder
    assert registry.get(pair.tuned).adapter and registry.get(pair.base).adapter is None
    settings = Settings(system="Answer briefly.", temperature=0.0, top_p=1.0, max_tokens=12, seed=None)
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]

    async def collect() -> list[tuple[list, ...]]:
        return [tuple([dict(m) for m in h] for h in shown)
                async for shown in side_by_side(url, pair, (earlier, []), "How do I store beans?", settings,
                                                      every_s=0.001)]

    frames = asyncio.run(collect())
    base, tuned = frames[-1]
    assert base[:2] == earlier and [m["role"] for m in base] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in tuned] == ["user", "assistant"]
    asked = [{"role": "system", "content": "Answer briefly."}, *earlier,
             {"role": "user", "content": "How do I store beans?"}]
    assert base[-1]["content"] == reference_answer(registry, pair.base, asked, 12)
    assert tuned[-1]["content"] == reference_answer(registry, pair.tuned, asked[:1] + asked[-1:], 12)
    assert len({len(f[1][-1]["content"]) for f in frames}) > 1  # seen growing: it streamed


def test_chat_on_a_run_that_has_not_trained_is_a_message(tmp_path: Path, finished: Finished) -> None:
    board, root, _ = finished
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "run.yaml").write_text((root / "run.yaml").read_text(), encoding="utf-8")
    with pytest.raises(UserError, match="names no base model yet"):
        board.playground.pair(fresh)
    (fresh / "manifest.json").write_text((root / "manifest.json").read_text(), encoding="utf-8")
    with pytest.raises(UserError, match="adapter_config.json is missing: run `gemmaforge train"):
        board.playground.pair(fresh)


def test_launch_previews_the_training_text_and_refuses_what_cannot_fit(tmp_path: Path, tiny_gemma3_dir: Path) -> None:
    board = Dashboard(tmp_path / "runs", default_home())
    config = load_config(write_config(tmp_path, tiny_gemma3_dir, cutoff_len=64))
    base = base_of(config, board.home)
    shown = preview(config, base, 2)
    records = json.loads((tmp_path / "data.json").read_text(encoding="utf-8"))
    rendered = base.family.chat.render(to_messages(records[0], detect_schema(records[0], "r"), "r", None))
    first = shown[0]
    assert len(shown) == 2 and "".join(text for text, _ in first.spans) == rendered.text
    # the answer is supervised up to cutoff_len (64 tokens) and cut after it
    supervised = "".join(text for text, kind in first.spans if kind == "supervised")
    cut = "".join(text for text, kind in first.spans if kind == "cut")
    assert first.tokens > 64 and 0 < first.supervised < 64
    assert records[0]["output"].startswith(supervised) and cut and records[0]["output"].endswith(cut.split("<")[0])
    assert [kind for _, kind in first.spans] == ["prompt", "supervised", "cut"]

    huge = config.model_copy(update={"output_dir": str(tmp_path / "runs" / "huge"), "train": config.train.model_copy(
        update={"per_device_train_batch_size": 1_000_000, "cutoff_len": 4096})})
    assert board.launch(huge).startswith("**Not started:** this config cannot fit")
    assert not (tmp_path / "runs" / "huge").exists()
