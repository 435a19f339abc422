"""Open WebUI, unmodified, in front of `gemmaforge serve`, used in a real browser.

    python benchmarks/open_webui.py [--run runs/quickstart] [--venv ~/.cache/gemmaforge/open-webui]
                                    [--version 0.12.4] [--out benchmarks/open_webui] [--chromium /usr/bin/chromium]

Needs Debian's Chromium and CJK fonts (`apt install chromium fonts-noto-cjk`); no browser is downloaded.
Open WebUI and Playwright are installed from PyPI into their own environment (--venv, made on first use:
several minutes and a few GB, torch included, at this environment's torch version so that pip takes the
build already in its cache). Then:
1. `gemmaforge serve RUN` on a loopback port (its log in OUT/serve.log);
2. `open-webui serve` on another, offline (no model downloads, no OpenAI connection, no update check), with a
   fresh data folder and OLLAMA_BASE_URL at gemmaforge (its log in OUT/open-webui.log);
3. benchmarks/open_webui_browser.py in headless Chromium: sign-up of the first local admin, the fine-tune in
   the model picker, a streamed chat answer (the barista persona's), continue response, regenerate, stop
   mid-answer, the chat's generated title, eject. A screenshot after each step, in OUT.
What was seen goes to OUT/seen.json, and the checks to standard output: the server's log must show the
stopped request cancelled (the client went away) and /api/ps must list no loaded model after the eject.
Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import httpx
from serve_throughput import ROOT, free_port


def environment(venv: Path, version: str) -> Path:
    """Open WebUI's own virtual environment, made once; its python."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "open-webui").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch = metadata.version("torch").split("+")[0]
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch}"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"open-webui=={version}", "playwright"],
                       check=True)
    return python


def open_webui_env(data: Path, ollama: str) -> dict[str, str]:
    """Offline and self-contained (read in Open WebUI's env.py and config.py)."""
    return {
        **os.environ,
        "DATA_DIR": str(data),  # otherwise its database goes into site-packages
        "WEBUI_SECRET_KEY": "gemmaforge-open-webui-check",  # otherwise it writes one into the working folder
        "OLLAMA_BASE_URL": ollama,
        "ENABLE_OPENAI_API": "false",  # otherwise listing models asks api.openai.com
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "false",
        "RAG_EMBEDDING_ENGINE": "ollama",  # skips loading a sentence-transformers model at start
        "ENABLE_FOLLOW_UP_GENERATION": "false", "ENABLE_TAGS_GENERATION": "false",  # keep to chat and title
        # Open WebUI 0.12 offers its built-in tools to every model; a Gemma 1-3 chat template has no tool format,
        # and Ollama refuses tools for such a model with a 400, as gemmaforge does: off, as a user turns them off
        "DEFAULT_MODEL_METADATA": json.dumps({"capabilities": {"builtin_tools": False}}),
    }


def wait_for(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} did not answer within {seconds:.0f} s")


def checks(seen: dict, serve_log: str, loaded: list[str]) -> list[tuple[str, bool]]:
    cont, regen, stopped = seen.get("continued", {}), seen.get("regenerated", {}), seen.get("stopped", {})
    return [
        ("no step failed", "error" not in seen),
        ("the model is in the picker", bool(seen.get("model_selected"))),
        ("the answer streamed in (several partial lengths)", len(seen.get("answer_stream_lengths", [])) > 1),
        ("continue response extended the answer", bool(cont) and cont["after"].startswith(cont["before"][:20])
         and len(cont["after"]) > len(cont["before"])),
        ("regenerate gave a new answer", bool(regen) and regen["after"] != regen["before"]),
        ("stop froze the answer", bool(stopped) and stopped["at_click"] == stopped["five_seconds_later"]),
        ("the server cancelled the stopped request", "cancelled: the client went away" in serve_log),
        ("the chat got a title", seen.get("title", "New Chat") not in ("", "New Chat")),
        ("eject unloaded the model (/api/ps lists none)", "ejected" in seen and not loaded),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "quickstart")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "gemmaforge" / "open-webui")
    parser.add_argument("--version", default="0.12.4", help="the Open WebUI release (its selectors are 0.12's)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "open_webui")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).is_file():
        sys.exit(f"{args.chromium} is missing: apt install chromium fonts-noto-cjk")
    sys.path.insert(0, str(ROOT))
    from gemmaforge.runs import RunDir

    model = RunDir.open(args.run).config().export.ollama.name or args.run.name
    python = environment(args.venv, args.version)
    args.out.mkdir(parents=True, exist_ok=True)
    serve_port, webui_port = free_port(), free_port()
    ollama = f"http://127.0.0.1:{serve_port}"
    with open(args.out / "serve.log", "w") as serve_log, tempfile.TemporaryDirectory() as data, \
            open(args.out / "open-webui.log", "w") as webui_log:
        serve = subprocess.Popen([sys.executable, "-m", "gemmaforge", "serve", str(args.run), "--port",
                                  str(serve_port)], cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT)
        webui = subprocess.Popen([str(args.venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port",
                                  str(webui_port)], cwd=data, env=open_webui_env(Path(data), ollama),
                                 stdout=webui_log, stderr=subprocess.STDOUT)
        try:
            wait_for(ollama + "/api/version", 300)
            wait_for(f"http://127.0.0.1:{webui_port}/health", 900)
            browser = subprocess.run([str(python), str(ROOT / "benchmarks" / "open_webui_browser.py"), "--url",
                                      f"http://127.0.0.1:{webui_port}", "--model", f"{model}:latest", "--out",
                                      str(args.out), "--chromium", args.chromium],
                                     capture_output=True, text=True, timeout=3600)
            if browser.returncode != 0:
                sys.exit(f"the browser script failed:\n{browser.stderr[-3000:]}")
            seen = json.loads(browser.stdout.strip().splitlines()[-1])
            deadline = time.monotonic() + 10  # an unload waits for the requests in flight, checked twice a second
            while (loaded := [m["name"] for m in httpx.get(ollama + "/api/ps", timeout=10).json()["models"]]) \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            for process in (webui, serve):
                process.terminate()
                process.wait(timeout=60)
    (args.out / "seen.json").write_text(json.dumps(seen, ensure_ascii=False, indent=1), encoding="utf-8")
    log = (args.out / "serve.log").read_text(encoding="utf-8")
    results = checks(seen, log, loaded)
    for name, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print("requests seen by gemmaforge:", len(re.findall(r"^serve: (POST|GET) ", log, re.M)))
    if seen.get("title") == seen.get("question"):  # Open WebUI's fallback when the answer holds no {"title": ...}
        print("the title is the first message: the model's answer to the title task was not the JSON asked for")
    if not all(ok for _, ok in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
