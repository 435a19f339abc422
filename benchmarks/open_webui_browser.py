"""The browser half of benchmarks/open_webui.py: Playwright drives Debian's Chromium through Open WebUI's own
pages as a person would, saves a screenshot after each step and prints what it saw as JSON on the last line.
It runs in Open WebUI's environment (where Playwright is installed); see benchmarks/open_webui.py.

Selectors are Open WebUI 0.12's (read in its compiled frontend): the sign-up form's #name/#email/#password,
the message bar's #model-selector-model-button and #chat-input, the answer's #response-content-container, and
the buttons' accessible names (Stop, Continue Response, Regenerate, Eject model).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

ANSWER = "#response-content-container"
WAIT_MS = 300_000  # an answer on a 2-core CPU, queued behind title generation, can take minutes


class Steps:
    def __init__(self, page: Page, out: Path):
        self.page, self.out, self.seen, self.shots = page, out, {}, []

    def shot(self, name: str) -> None:
        path = self.out / f"{len(self.shots) + 1:02d}-{name}.png"
        self.page.screenshot(path=str(path))
        self.shots.append(path.name)

    def answer(self) -> str:
        return self.page.locator(ANSWER).last.inner_text().strip()

    def answers(self) -> int:
        return self.page.locator(ANSWER).count()

    def wait_done(self) -> None:
        """Until the last answer is finished: its Stop button has gone and its action bar is shown."""
        self.page.locator('button[aria-label="Stop"]').wait_for(state="hidden", timeout=WAIT_MS)
        self.page.locator('button[aria-label="Regenerate"]').last.wait_for(timeout=WAIT_MS)

    def send(self, text: str) -> list[int]:
        """Send a message; the lengths of the answer's text as it streams in (more than one: it streamed)."""
        before = self.answers()
        self.page.locator("#chat-input").click()
        self.page.keyboard.type(text)
        self.page.locator("#send-message-button").click()
        self.page.wait_for_function(f"document.querySelectorAll('{ANSWER}').length > {before}", timeout=WAIT_MS)
        return self.watch()

    def watch(self) -> list[int]:
        lengths: list[int] = []
        stop = self.page.locator('button[aria-label="Stop"]')
        try:  # the answer is under way once its Stop button shows (continue starts from text already there)
            stop.wait_for(timeout=10_000)
        except PlaywrightTimeout:
            pass  # an answer so short that it ended before the button could be seen
        deadline = time.monotonic() + WAIT_MS / 1000
        while time.monotonic() < deadline:
            length = len(self.answer())
            if length and (not lengths or lengths[-1] != length):
                lengths.append(length)
            if not stop.is_visible() and length:
                break
            time.sleep(0.2)
        self.wait_done()
        return lengths


def sign_up(s: Steps, url: str) -> None:
    page = s.page
    page.goto(url + "/auth")
    page.get_by_role("button", name="Get started").click()
    page.locator("#name").fill("Barista Admin")
    page.locator("#email").fill("admin@example.com")
    page.locator("#password").fill("a local admin password")
    s.shot("sign-up")
    page.get_by_role("button", name="Create Admin Account").click()
    whats_new = page.get_by_role("button", name="Okay, Let's Go!")
    whats_new.wait_for(timeout=60_000)
    whats_new.click()
    page.locator("#chat-input").wait_for()
    s.seen["signed_up"] = page.url


def pick(s: Steps, model: str) -> None:
    page = s.page
    page.locator("#model-selector-model-button").click()
    option = page.get_by_role("option", name=f"Select {model} model")
    option.wait_for()
    s.seen["models_listed"] = page.locator("#model-selector-list [role=option]").all_inner_texts()
    s.shot("model-picker")
    option.click()
    s.seen["model_selected"] = page.locator("#model-selector-model-button").get_attribute("aria-label")


def chat(s: Steps, question: str) -> None:
    s.seen["question"] = question
    lengths = s.send(question)
    s.seen["answer"] = s.answer()
    s.seen["answer_stream_lengths"] = lengths
    s.seen["chat_url"] = s.page.url
    s.shot("answer")


def continue_response(s: Steps) -> None:
    before = s.answer()
    s.page.locator('button[aria-label="Continue Response"]').last.click()
    s.seen["continue_stream_lengths"] = s.watch()
    after = s.answer()
    s.seen["continued"] = {"before": before, "after": after}
    s.shot("continued")


def regenerate(s: Steps) -> None:
    before = s.answer()
    s.page.locator(".regenerate-response-button").last.dispatch_event("click")
    s.page.wait_for_function(f"document.querySelectorAll('{ANSWER}').length >= 1", timeout=WAIT_MS)
    time.sleep(1)
    s.watch()
    s.seen["regenerated"] = {"before": before, "after": s.answer()}
    s.shot("regenerated")


def stop_midway(s: Steps, question: str, tries: int = 3) -> None:
    """Ask for a long answer and press Stop a few words in (again, up to `tries` times, when the model finished
    before that: a sampled answer can be short)."""
    page = s.page
    stop = page.locator('button[aria-label="Stop"]')
    for _ in range(tries):
        before = s.answers()
        page.locator("#chat-input").click()
        page.keyboard.type(question)
        page.locator("#send-message-button").click()
        page.wait_for_function(f"document.querySelectorAll('{ANSWER}').length > {before}", timeout=WAIT_MS)
        deadline = time.monotonic() + WAIT_MS / 1000
        while len(s.answer()) < 20 and stop.is_visible() and time.monotonic() < deadline:
            time.sleep(0.1)
        if stop.is_visible():
            stop.click(force=True)  # it moves while the answer streams in
            stopped = s.answer()
            stop.wait_for(state="hidden", timeout=30_000)
            time.sleep(5)  # nothing more arrives once stopped
            s.seen["stopped"] = {"at_click": stopped, "five_seconds_later": s.answer()}
            s.shot("stopped")
            return
        s.wait_done()
    raise RuntimeError(f"the model finished each of {tries} answers before Stop could be pressed")


def title(s: Steps) -> None:
    chat_id = s.seen["chat_url"].rstrip("/").rsplit("/", 1)[-1]
    page = s.page
    if not page.locator('button[aria-label="Close Sidebar"]').is_visible():
        page.locator('button[aria-label="Open Sidebar"]').first.click()
    link = page.locator(f'a[href="/c/{chat_id}"]').first
    link.wait_for(timeout=WAIT_MS)
    deadline = time.monotonic() + WAIT_MS / 1000
    def shown() -> str:  # the item's first line (a second one says when the chat was updated)
        return (link.inner_text().strip().splitlines() or [""])[0]

    while shown() in ("", "New Chat") and time.monotonic() < deadline:
        time.sleep(1)
    s.seen["title"] = shown()
    s.shot("title")


def eject(s: Steps, model: str) -> None:
    page = s.page
    button = page.locator("#model-selector-model-button")
    button.hover()  # refreshes the model list (and with it, which models are loaded)
    time.sleep(2)
    button.click()
    option = page.get_by_role("option", name=f"Select {model} model")
    option.hover()
    eject_button = option.locator('button[aria-label="Eject model"]')
    eject_button.wait_for(timeout=30_000)
    s.shot("eject")
    eject_button.click()
    toast = page.get_by_text("Model unloaded successfully")
    toast.wait_for(timeout=60_000)
    s.seen["ejected"] = toast.inner_text()
    s.shot("ejected")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, Any] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        s = Steps(page, args.out)
        try:
            sign_up(s, args.url)
            pick(s, args.model)
            chat(s, "什么是冷萃咖啡？")
            regenerate(s)
            stop_midway(s, "请详细介绍手冲咖啡的步骤，越详细越好。")
            continue_response(s)  # continues the answer Stop cut short
            title(s)
            eject(s, args.model)
        except Exception as e:  # noqa: BLE001  (what failed, with the screen at that moment, is the result)
            s.seen["error"] = f"{type(e).__name__}: {e}"
            s.shot("error")
        seen = {**s.seen, "screenshots": s.shots}
        browser.close()
    print(json.dumps(seen, ensure_ascii=False))


if __name__ == "__main__":
    main()
