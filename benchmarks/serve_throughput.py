"""Serving speed: one client and N concurrent clients, for both engines of `gemmaforge serve`, against
llama-cpp-python's own server on the same GGUF file, llama.cpp decoding with no server at all, transformers' own
`generate` with a static cache on the merged model, and vLLM's server on the merged model where vLLM is installed.
On a GPU machine the same command compares them on that GPU (the transformers rows in bf16 there).

    python benchmarks/serve_throughput.py [--run runs/quickstart] [--clients 8] [--requests 8]
                                          [--max-tokens 128] [--quant q8_0]

Each server runs in its own process on a loopback port; the clients are threads sending OpenAI
`/v1/chat/completions` requests (the one API all three servers speak), greedy, at most --max-tokens new
tokens, questions from the run's eval suite (examples/suites/coffee.yaml for the quickstart).
- one client: --requests requests one after another, streamed: time to first token and decode tokens/s
  (tokens after the first over the time after the first);
- N clients: --requests requests each at once, not streamed: aggregate completion tokens/s (the sum of
  `usage.completion_tokens` over the wall clock).
llama-cpp-python's server needs its extras (pip install 'llama-cpp-python[server]'), vLLM its package: a row whose
software is missing is reported as skipped, not measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int) -> subprocess.Popen:
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{' '.join(command)} did not start")


def ask(url: str, model: str, question: str, max_tokens: int, stream: bool) -> tuple[int, float, float]:
    """(completion tokens, seconds to the first token, total seconds)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    begin = time.perf_counter()
    if not stream:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        return reply["usage"]["completion_tokens"], float("nan"), time.perf_counter() - begin
    first, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0].get("delta", {}).get("content"):
                tokens += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return tokens, (first or end) - begin, end - begin


def measure(name: str, url: str, model: str, questions: list[str], args: argparse.Namespace) -> dict:
    ask(url, model, questions[0], 8, stream=False)  # warm-up
    single = [ask(url, model, q, args.max_tokens, stream=True) for q in questions[: args.requests]]
    decode = [(n - 1) / (total - ttft) for n, ttft, total in single if n > 1]
    batch = [questions[i % len(questions)] for i in range(args.clients * args.requests)]
    begin = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda q: ask(url, model, q, args.max_tokens, stream=False), batch))
    wall = time.perf_counter() - begin
    return {"engine": name, "ttft_ms": 1000 * statistics.median(t for _, t, _ in single),
            "decode_tok_s": statistics.median(decode), "aggregate_tok_s": sum(n for n, _, _ in results) / wall}


def raw_llama_cpp(gguf: Path, questions: list[str], args: argparse.Namespace) -> dict:
    """llama.cpp's decode speed with nothing around it: the same prompts, generate() token by token."""
    import llama_cpp

    from gemmaforge.families import FAMILIES

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_threads=os.cpu_count(), n_gpu_layers=-1, verbose=False)
    stop = llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)[0]
    rates, ttfts = [], []
    for q in questions[: args.requests]:
        text = FAMILIES["gemma3"].chat.render([{"role": "user", "content": q}],
                                   add_generation_prompt=True).text
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        begin, first, n = time.perf_counter(), None, 0
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            n += 1
            if token in (stop, llm.token_eos()) or n >= args.max_tokens:
                break
        end = time.perf_counter()
        ttfts.append(first - begin)
        if n > 1:
            rates.append((n - 1) / (end - first))
    return {"engine": "llama.cpp, no server (generate loop)", "ttft_ms": 1000 * statistics.median(ttfts),
            "decode_tok_s": statistics.median(rates), "aggregate_tok_s": float("nan")}


def generate_static(merged: Path, questions: list[str], args: argparse.Namespace) -> dict:
    """transformers' own generate on the merged model with a static KV cache (what transformers offers for fast
    single-request decoding; on CUDA it compiles the decoding step), one request at a time, greedy: the
    reference single-client speed with no server around it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemmaforge.families import FAMILIES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).to(device).eval()
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]

    class Clock:  # generate's streamer: the time of each new token
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, _ids: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    rates, ttfts = [], []
    for i, q in enumerate([questions[0], *questions[: args.requests]]):  # the first one warms up (and compiles)
        text = FAMILIES["gemma3"].chat.render([{"role": "user", "content": q}], add_generation_prompt=True).text
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        clock = Clock()
        begin = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=stops,
                           cache_implementation="static", streamer=clock)
        generated = clock.times[1:]  # the streamer's first call is the prompt
        if i and generated:
            ttfts.append(generated[0] - begin)
            if len(generated) > 1:
                rates.append((len(generated) - 1) / (generated[-1] - generated[0]))
    return {"engine": f"transformers generate, static cache ({device}, {str(dtype).removeprefix('torch.')})",
            "ttft_ms": 1000 * statistics.median(ttfts), "decode_tok_s": statistics.median(rates),
            "aggregate_tok_s": float("nan")}


def skipped(engine: str, why: str) -> dict:
    return {"engine": f"{engine}: skipped, {why}", "ttft_ms": float("nan"), "decode_tok_s": float("nan"),
            "aggregate_tok_s": float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "quickstart")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quant", default="q8_0")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from gemmaforge.runs import RunDir

    run = RunDir.open(args.run)
    gguf = run.gguf_path(args.quant)
    if not gguf.is_file():
        sys.exit(f"{gguf} is missing: run `gemmaforge run examples/quickstart.yaml` (or export that quant) first")
    suite = ROOT / "examples" / "suites" / "coffee.yaml"
    questions = [c["prompt"] for c in yaml.safe_load(suite.read_text(encoding="utf-8"))["cases"]]
    name = run.config().export.ollama.name or run.root.name
    gemmaforge = [sys.executable, "-m", "gemmaforge", "serve", str(run.root), "--max-batch", str(args.clients)]
    servers = [
        ("gemmaforge serve, transformers (bf16 where the device has it), base + adapter", gemmaforge, name),
        (f"gemmaforge serve, llama.cpp ({args.quant} merged)", [*gemmaforge, "--engine", "llamacpp"], name),
        (f"llama-cpp-python server ({args.quant} merged)",
         [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", "4096", "--n_gpu_layers", "-1",
          "--n_threads", str(os.cpu_count())], str(gguf)),  # its default is half the cores
        ("vLLM server (merged)", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                  str(run.merged_dir), "--served-model-name", name, "--max-model-len", "4096",
                                  "--gpu-memory-utilization", "0.5"], name),
    ]
    needs = {"llama-cpp-python server": "llama_cpp.server", "vLLM": "vllm"}
    rows = []
    for label, command, model in servers:
        missing = [module for prefix, module in needs.items() if label.startswith(prefix) and not installed(module)]
        if missing:
            rows.append(skipped(label, f"{missing[0]} is not installed"))
            continue
        port = free_port()
        flag = ["--port", str(port)]
        process = start(command + flag, port)
        try:
            rows.append(measure(label, f"http://127.0.0.1:{port}", model, questions, args))
        finally:
            process.terminate()
            process.wait(timeout=30)
    rows.append(raw_llama_cpp(gguf, questions, args))
    rows.append(generate_static(run.merged_dir, questions, args) if (run.merged_dir / "config.json").is_file()
                else skipped("transformers generate", f"no merged model in {run.merged_dir}"))

    print(f"{args.requests} requests x 1 client (streamed) and {args.requests} x {args.clients} clients at once, "
          f"greedy, <= {args.max_tokens} new tokens, {os.cpu_count()} CPU cores, {device_name()}")
    print(f"| engine | first token (median ms) | decode tok/s, 1 client | aggregate tok/s, {args.clients} clients |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['ttft_ms']:.0f} | {r['decode_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} |")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def device_name() -> str:
    import torch

    return f"GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    main()
