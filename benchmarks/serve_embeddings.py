"""Embedding speed of `gemmaforge serve`, both engines, on a run's fine-tune: /api/embed with a batch of texts
and one text at a time, and /v1/embeddings with the batch.

    python benchmarks/serve_embeddings.py [--run runs/quickstart] [--texts 32] [--repeats 3]

The texts are the run's training answers (its data/train.jsonl, each one conversation's last answer), the
kind of passage a RAG index embeds. Reported: texts/s and tokens/s (the server's own token count over the
wall clock of the requests), the median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from serve_throughput import ROOT, free_port, start


def texts_of(run: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in (run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    return [row["messages"][-1]["content"] for row in rows][:n]


def timed(url: str, path: str, body: dict) -> tuple[float, int]:
    begin = time.perf_counter()
    response = httpx.post(url + path, json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    tokens = data["usage"]["prompt_tokens"] if "usage" in data else data["prompt_eval_count"]
    return time.perf_counter() - begin, tokens


def measure(url: str, model: str, texts: list[str], repeats: int) -> dict[str, str]:
    row = {}
    cases = {
        "/api/embed, one batch": lambda: timed(url, "/api/embed", {"model": model, "input": texts}),
        "/api/embed, one text a request": lambda: [sum(x) for x in zip(*(
            timed(url, "/api/embed", {"model": model, "input": t}) for t in texts))],
        "/v1/embeddings, one batch": lambda: timed(url, "/v1/embeddings",
                                                   {"model": model, "input": texts, "encoding_format": "float"}),
    }
    cases["/api/embed, one batch"]()  # the llama.cpp engine makes its embedding context on the first request
    for label, case in cases.items():
        results = [case() for _ in range(repeats)]
        seconds = statistics.median(r[0] for r in results)
        row[label] = f"{len(texts) / seconds:.1f} texts/s, {results[0][1] / seconds:.0f} tokens/s"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "quickstart")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from gemmaforge.runs import RunDir

    run = RunDir.open(args.run)
    texts = texts_of(run.root, args.texts)
    name = run.config().export.ollama.name or run.root.name
    serve = [sys.executable, "-m", "gemmaforge", "serve", str(run.root)]
    for label, command in (("transformers (bf16 where the CPU has it), base + adapter", serve),
                           ("llama.cpp (the deployed GGUF)", [*serve, "--engine", "llamacpp"])):
        port = free_port()
        process = start([*command, "--port", str(port)], port)
        try:
            row = measure(f"http://127.0.0.1:{port}", name, texts, args.repeats)
        finally:
            process.terminate()
            process.wait()
        print(f"{label}: {len(texts)} texts, " + "; ".join(f"{k}: {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
