"""`gemmaforge serve` (the Ollama, OpenAI and Anthropic APIs over HTTP) and `gemmaforge chat` (the terminal)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaforge.cli.common import Verbs, positive_int, refuse_unless

if TYPE_CHECKING:  # the server and its engines' job types load only when a model is served (--help stays quick)
    from gemmaforge.serve.server import ServeOptions

SERVE_EPILOG = """MODEL is a run directory (its adapter on its base model; runs on one base share it), a Hugging Face
model folder, a .gguf file, or gemma3-270m; NAME=MODEL serves it under another name (default: the run's
export.ollama.name, else the folder or file name).

examples:
  gemmaforge serve runs/quickstart                       # Ollama clients: OLLAMA_HOST=127.0.0.1:11434
  gemmaforge serve runs/support runs/faq --port 8000     # one base in memory, two adapters beside it
  gemmaforge serve runs/quickstart --engine llamacpp     # the run's exported GGUF through llama.cpp
  gemmaforge serve runs/quickstart --host 0.0.0.0 --api-key "$KEY"
  curl http://127.0.0.1:11434/api/chat -d '{"model": "coffee-gemma", "messages": [{"role": "user", "content": "hi"}]}'
"""
# the engine options' defaults; None on the command line means "not given", so flags that do not apply are refused
ENGINE_DEFAULTS: dict[str, Any] = {"engine": "transformers", "num_ctx": 4096, "dtype": "auto"}


def add(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "serve", help="Serve runs and models over the Ollama, OpenAI and Anthropic HTTP APIs (many LoRA adapters on "
        "one base).",
        description="Serve runs and models over Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, ...), "
        "OpenAI's (/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/models, "
        "/v1/audio/transcriptions) and "
        "Anthropic's Messages API (/v1/messages), with pictures and sound for the checkpoints that take them, "
        "log-probabilities on request, adapters loaded "
        "and unloaded at runtime (/v1/load_lora_adapter, /v1/unload_lora_adapter). Concurrent requests on the "
        "transformers engine are batched at every decoding step, requests on different LoRA adapters in one "
        "forward.",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("models", nargs="+", metavar="[NAME=]MODEL")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback); any other needs --api-key")
    p.add_argument("--port", type=int, default=11434, help="default 11434, Ollama's")
    add_engine_options(p)
    p.add_argument("--api-key",
                   help="require Authorization: Bearer KEY or x-api-key: KEY (default: $GEMMAFORGE_API_KEY)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests waiting beyond the batch before 503 + Retry-After (default 64)")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="the longest answer (default 4096)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds one request may generate (default 600)")
    p.add_argument("--keep-alive", type=duration, default=-1.0, metavar="DURATION",
                   help="how long a model stays loaded after its last request, as Ollama's keep_alive (5m, 1h, 30s, "
                   "seconds; 0: unload after each request; negative: until the server stops, the default); an "
                   "unloaded model stays listed and loads again on its next request")
    p.set_defaults(handler=serve)

    p = verbs.add_parser(
        "chat", help="Chat in the terminal with a run or model (served in-process) or an Ollama-compatible URL.",
        description="An interactive chat: answers stream as they are generated; /system TEXT sets the system "
        "prompt, /reset forgets the conversation, /exit (or Ctrl-D) leaves. TARGET is a run directory, model "
        "folder, .gguf file or gemma3-270m (served for the session), or the URL of a running server "
        "(gemmaforge serve or Ollama itself).",
    )
    p.add_argument("target", metavar="RUN_DIR|MODEL|URL")
    p.add_argument("--model", help="with a URL: which served model (default: the only one)")
    p.add_argument("--system", help="the system prompt (default: the one the run was trained with)")
    p.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    add_engine_options(p)
    p.add_argument("--api-key", help="with a URL: sent as Authorization: Bearer KEY (default: $GEMMAFORGE_API_KEY)")
    p.set_defaults(handler=chat)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("transformers", "llamacpp"),
                   help="for run directories: transformers (base + adapter, batched; the default) or llamacpp "
                   "(the run's GGUF)")
    p.add_argument("--num-ctx", type=positive_int, help="context window in tokens (default 4096)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"),
                   help="transformers engine weights: auto picks bf16 where the hardware has it (default)")


def duration(text: str) -> float:
    """--keep-alive: seconds, or a duration as Ollama's keep_alive takes it (5m, 1h30m, -1s)."""
    from gemmaforge.serve.protocol import parse_duration

    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The server's options; --dtype is refused with --engine llamacpp, which runs the GGUF's own types."""
    from gemmaforge.serve.server import ServeOptions, api_key_from_env

    refuse_unless(args.engine != "llamacpp", {"--dtype": args.dtype},
                  "{flags} sets the transformers engine's weights; --engine llamacpp runs the GGUF file's own types")
    engine = {key: ENGINE_DEFAULTS[key] if getattr(args, key) is None else getattr(args, key)
              for key in ENGINE_DEFAULTS}
    extra = {k: getattr(args, k) for k in ("host", "port", "max_batch", "max_queue", "max_tokens", "keep_alive")
             if hasattr(args, k)}
    return ServeOptions(**engine, api_key=api_key_from_env(args.api_key),
                        timeout_s=float(getattr(args, "timeout", 600)), **extra)


def serve(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.serve.server import serve as serve_models

    serve_models(args.models, serve_options(args), home)
    return 0


def chat(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.serve.chat import chat_loop, pick_model
    from gemmaforge.serve.server import background_server, load_registry

    url = args.target.startswith(("http://", "https://"))
    refuse_unless(not url, {"--engine": args.engine, "--num-ctx": args.num_ctx, "--dtype": args.dtype},
                  "with a URL, chat does not serve the model itself (the server there does): leave out {flags}")
    refuse_unless(url, {"--model": args.model},
                  "{flags} picks one of the models a server URL serves; for a run or model folder leave it out")
    options = serve_options(args)
    sampling = {} if args.temperature is None else {"temperature": args.temperature}
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    if url:
        base = args.target.rstrip("/")
        chat_loop(base, pick_model(base, args.model, headers), system=args.system, options=sampling, headers=headers)
        return 0
    registry = load_registry([args.target], options, home)
    try:
        with background_server(registry, options) as served_at:
            name = next(iter(registry.models))
            chat_loop(served_at, name, system=args.system, options=sampling, headers=headers)
    finally:
        registry.close()
    return 0
