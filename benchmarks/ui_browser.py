"""`gemmaforge ui` in a real browser, as a new user would use it: Debian's Chromium, driven by Playwright, through
the dashboard's own page. It launches a short quickstart run on the embedded model from the Launch tab (no YAML
written), watches its loss curve grow, reads its report, chats with base and tuned side by side, and then times
the page on a run with 10,000 metric rows. Screenshots go to --out; the last line printed is JSON of what was seen.

    pip install playwright          # the Python package only: the browser is Debian's (apt install chromium)
    python benchmarks/ui_browser.py --out benchmarks/ui

It takes ~15 minutes on 2 CPU cores (the run trains, evaluates, merges and exports q8_0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 1_800_000  # the whole short run on 2 cores
STEPS = 20


class Walk:
    def __init__(self, page: Page, out: Path):
        self.page, self.out, self.shots, self.seen = page, out, [], {}

    def shot(self, name: str) -> None:
        path = self.out / f"{len(self.shots) + 1:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        self.shots.append(path.name)

    def tab(self, name: str) -> None:
        self.page.get_by_role("tab", name=name).click()

    def text(self, selector: str) -> str:
        return self.page.locator(selector).inner_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ui(runs: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    ui = subprocess.Popen([sys.executable, "-m", "gemmaforge", "ui", str(runs), "--port", str(port)], cwd=ROOT,
                          stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return ui
        except OSError:
            time.sleep(0.5)
    ui.kill()
    raise SystemExit(f"gemmaforge ui did not start: {log.read_text()}")


def drawn(page: Page, series: str) -> None:
    """Until the loss plot's legend names the series (the plot draws its legend as SVG text)."""
    page.wait_for_function(f"(document.querySelector('#curve-0')?.innerText || '').includes({json.dumps(series)})",
                           timeout=120_000)


def metric_rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_file(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(1)


def launch_and_watch(walk: Walk, runs: Path) -> None:
    page, run = walk.page, runs / "quickstart-ui"
    walk.shot("empty")  # no run yet: the page opens on Launch, the quickstart's config in the form
    field = page.locator
    field("#field-output_dir").locator("textarea, input").first.fill(str(run))
    for key, value in (("train-max_steps", STEPS), ("train-logging_steps", 2), ("train-save_steps", 10)):
        field(f"#field-{key} input").first.fill(str(value))
    page.get_by_text("eval", exact=True).first.click()  # open the eval section
    field("#field-eval-retention input[type=checkbox]").uncheck()
    field("#field-eval-max_new_tokens input").first.fill("64")
    page.get_by_role("button", name="Preview data").click()
    page.locator("#preview-0").get_by_text("咖啡师小贴士").first.wait_for(timeout=120_000)
    page.get_by_role("button", name="Plan memory").click()
    page.locator("#launch-message").get_by_text("It fits").wait_for(timeout=300_000)
    walk.seen["plan"] = walk.text("#plan")[:600]
    walk.shot("launch-form")
    page.get_by_role("button", name="Start").click()
    page.locator("#launch-message").get_by_text("Started").wait_for(timeout=300_000)
    walk.seen["start_message"] = walk.text("#launch-message")
    walk.shot("started")
    walk.tab("Curves")
    metrics = run / "metrics.jsonl"
    for rows in (2, 6):
        wait_file(lambda rows=rows: metric_rows(metrics) >= rows, 1200)
        drawn(page, "quickstart-ui: loss")
        time.sleep(2 * 3.0)  # two refreshes of the page
        walk.seen[f"curve_after_{rows}_rows"] = True
        walk.shot(f"curve-{rows}-rows")
    wait_file(lambda: json.loads((run / "manifest.json").read_text())["stages"].get("export_ollama", {})
              .get("status") == "done", 1800)
    time.sleep(4)
    walk.tab("Run")
    walk.seen["runs_table"] = walk.text("#runs-table")
    walk.shot("run-done")
    walk.tab("Results")
    page.locator("#eval-report").get_by_text("Evaluation: base vs tuned").wait_for(timeout=30_000)
    walk.seen["report_head"] = walk.text("#eval-report")[:400]
    walk.shot("results")


def chat(walk: Walk) -> None:
    page = walk.page
    walk.tab("Chat")
    page.locator("#chat-prompt textarea").fill("咖啡豆应该怎么保存？")
    page.locator("#chat-send").click()
    page.locator("#chat-status").get_by_text("served together").wait_for(timeout=600_000)
    page.wait_for_function("document.querySelector('#chat-prompt textarea').value === ''", timeout=600_000)
    time.sleep(3)
    walk.seen["chat_base"] = walk.text("#chat-base")[-400:]
    walk.seen["chat_tuned"] = walk.text("#chat-tuned")[-400:]
    walk.shot("chat")


def big_run(runs: Path, source: Path, n: int = 10_000) -> Path:
    """A copy of a finished run whose metrics.jsonl has n training rows (an eval row every 100)."""
    big = runs / "big"
    big.mkdir()
    for name in ("run.yaml", "manifest.json"):
        shutil.copy(source / name, big / name)
    with (big / "metrics.jsonl").open("w") as f:
        for step in range(1, n + 1):
            row = {"step": step, "loss": 3.0 / (1 + step / 1000), "learning_rate": 1e-3 * (1 - step / n),
                   "supervised_tokens_per_second": 900.0 + step % 50, "peak_memory_bytes": 3 * 2**30,
                   "rss_bytes": 2 * 2**30}
            f.write(json.dumps(row) + "\n")
            if step % 100 == 0:
                f.write(json.dumps({"step": step, "eval_loss": 3.1 / (1 + step / 1000)}) + "\n")
    return big


def load_time(walk: Walk, url: str) -> float:
    """Seconds from asking for the page to the big run's loss curve drawn (the big run is listed first)."""
    start = time.perf_counter()
    walk.page.goto(url)
    walk.tab("Curves")
    drawn(walk.page, "big: loss")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "ui")
    parser.add_argument("--work", type=Path, help="where the runs go (default: a new temporary folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gemmaforge-ui-"))
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ui = start_ui(runs, port, work / "ui.log")
    url = f"http://127.0.0.1:{port}/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(WAIT_MS)
            walk = Walk(page, args.out)
            page.goto(url)
            page.locator("#runs-table").wait_for()
            launch_and_watch(walk, runs)
            chat(walk)
            big_run(runs, runs / "quickstart-ui")
            walk.seen["load_s_10000_rows"] = [round(load_time(walk, url), 2) for _ in range(3)]
            walk.shot("big-run-curves")
            browser.close()
    finally:
        ui.terminate()
        ui.wait(timeout=30)
    print(json.dumps({"shots": walk.shots, **walk.seen, "ui_log": (work / "ui.log").read_text()[-2000:]},
                     ensure_ascii=False))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
