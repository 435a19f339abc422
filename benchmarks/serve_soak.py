"""A bounded soak of `gemmaforge serve`: concurrent clients on loopback for a fixed time, each looping over a mix
of what Ollama and OpenAI clients send, some of them walking away mid-stream.

    python benchmarks/serve_soak.py [--run runs/quickstart] [--clients 32] [--seconds 60]
                                    [--engine transformers|llamacpp] [--max-tokens 48]

The server runs in its own process (`gemmaforge serve RUN --engine ENGINE`); after one warm-up request of each
kind, every client sends, in turn from its own starting point: an Ollama chat (streamed), an Ollama generate
(whole), a JSON-mode chat held to a schema (whole; the answer must parse), /api/embed with four texts, an
OpenAI chat completion (streamed, with usage), and a streamed chat it disconnects from after three chunks.
Reported: requests and their status codes by kind, latency p50/p99 by kind, completion tokens/s over the
run, and the server's resident memory (mean of the first and of the last 10 s). The run fails (exit 1) on
any 5xx, a failed request, a JSON answer that does not parse, or memory growth of 10% or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serve_throughput import ROOT, free_port, start

QUESTIONS = ["What is a flat white?", "冷萃咖啡和冰咖啡有什么区别？", "How fine should I grind for a moka pot?",
             "Why does espresso have crema?", "推荐一款适合初学者的手冲咖啡豆。", "How do I store coffee beans?"]
ORDER = {"type": "object", "properties": {"drink": {"enum": ["latte", "flat white", "espresso"]},
                                          "cups": {"type": "integer"}, "iced": {"type": "boolean"}},
         "required": ["drink", "cups", "iced"], "additionalProperties": False}


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    failures: list[str] = field(default_factory=list)
    tokens: int = 0


async def ollama_chat(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": q}], "options": {"num_predict": n}}
    async with client.stream("POST", "/api/chat", json=body) as response:
        lines = [json.loads(line) async for line in response.aiter_lines() if line]
    return response.status_code, lines[-1].get("eval_count", 0) if response.status_code == 200 else 0


async def ollama_generate(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    response = await client.post("/api/generate", json={"model": model, "prompt": q, "stream": False,
                                                         "options": {"num_predict": n}})
    return response.status_code, response.json().get("eval_count", 0) if response.status_code == 200 else 0


async def json_mode(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": f"Order for: {q}"}], "format": ORDER,
            "stream": False, "options": {"num_predict": 4 * n}}
    response = await client.post("/api/chat", json=body)
    if response.status_code != 200:
        return response.status_code, 0
    data = response.json()
    if data["done_reason"] == "stop":
        json.loads(data["message"]["content"])  # must parse (ValueError is counted as a failure)
    return 200, data.get("eval_count", 0)


async def embed(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    response = await client.post("/api/embed", json={"model": model, "input": [q, *QUESTIONS[:3]]})
    return response.status_code, 0


async def openai_stream(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": n, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return response.status_code, tokens


async def walk_away(client: httpx.AsyncClient, model: str, q: str, n: int) -> tuple[int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": q}], "options": {"num_predict": 4 * n}}
    async with client.stream("POST", "/api/chat", json=body) as response:
        chunks = 0
        async for line in response.aiter_lines():
            chunks += bool(line)
            if chunks == 3:
                break  # leaving the block closes the connection mid-stream
    return response.status_code, 0


KINDS = {"ollama chat, streamed": ollama_chat, "ollama generate": ollama_generate, "JSON schema chat": json_mode,
         "embed (4 texts)": embed, "openai chat, streamed": openai_stream, "disconnect mid-stream": walk_away}


async def client_loop(index: int, url: str, model: str, args: argparse.Namespace, deadline: float,
                      tally: Tally) -> None:
    kinds = list(KINDS.items())
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        i = index
        while time.monotonic() < deadline:
            label, kind = kinds[i % len(kinds)]
            q = QUESTIONS[i % len(QUESTIONS)]
            i += 1
            begin = time.perf_counter()
            try:
                status, tokens = await kind(client, model, q, args.max_tokens)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                tally.failures.append(f"{label}: {type(e).__name__}: {e}")
                continue
            tally.latencies[label].append(time.perf_counter() - begin)
            tally.statuses[label][status] += 1
            tally.tokens += tokens


async def sample_rss(pid: int, deadline: float, samples: list[tuple[float, int]]) -> None:
    start_time = time.monotonic()
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
        samples.append((time.monotonic() - start_time, kib * 1024))
        await asyncio.sleep(1)


async def soak(url: str, model: str, pid: int, args: argparse.Namespace) -> tuple[Tally, list[tuple[float, int]],
                                                                                float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for kind in KINDS.values():  # the first JSON request makes the grammar tables: not part of the soak
            await kind(client, model, QUESTIONS[0], 8)
    tally, samples = Tally(), []
    begin = time.monotonic()
    deadline = begin + args.seconds
    await asyncio.gather(sample_rss(pid, deadline, samples),
                         *(client_loop(i, url, model, args, deadline, tally) for i in range(args.clients)))
    return tally, samples, time.monotonic() - begin


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "quickstart")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--engine", choices=["transformers", "llamacpp"], default="transformers")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from gemmaforge.runs import RunDir

    run = RunDir.open(args.run)
    model = run.config().export.ollama.name or run.root.name
    port = free_port()
    process = start([sys.executable, "-m", "gemmaforge", "serve", str(run.root), "--engine", args.engine,
                     "--port", str(port)], port)
    try:
        tally, samples, wall = asyncio.run(soak(f"http://127.0.0.1:{port}", model, process.pid, args))
    finally:
        process.terminate()
        process.wait(timeout=30)

    first = statistics.mean(rss for t, rss in samples if t < 10)
    last = statistics.mean(rss for t, rss in samples if t >= samples[-1][0] - 10)
    growth = last / first - 1
    fives = sum(n for codes in tally.statuses.values() for code, n in codes.items() if code >= 500)
    print(f"{args.clients} clients x {wall:.0f} s, engine {args.engine}, <= {args.max_tokens} new tokens "
          f"(JSON and disconnect {4 * args.max_tokens}), {os.cpu_count()} CPU cores")
    print("| request | done | status codes | p50 (s) | p99 (s) |")
    print("| --- | ---: | --- | ---: | ---: |")
    for label in KINDS:
        times = tally.latencies.get(label, [])
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(tally.statuses[label].items()))
        p50, p99 = (f"{percentile(times, 50):.2f}", f"{percentile(times, 99):.2f}") if times else ("-", "-")
        print(f"| {label} | {len(times)} | {codes} | {p50} | {p99} |")
    print(f"completion tokens/s: {tally.tokens / wall:.1f}; 5xx: {fives}; failed requests: {len(tally.failures)}")
    print(f"server RSS: {first / 2**20:.0f} MiB (first 10 s) -> {last / 2**20:.0f} MiB (last 10 s), "
          f"{growth:+.1%}")
    for failure in tally.failures[:10]:
        print("  failed:", failure)
    if fives or tally.failures or growth >= 0.10:
        sys.exit(1)


if __name__ == "__main__":
    main()
