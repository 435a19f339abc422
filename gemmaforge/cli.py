"""Command line: verbs -> stage functions. Argument parsing and exit codes only, no logic.

Exit codes: 0 success, 1 failure inside a stage, 2 bad input (config, data, arguments).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from gemmaforge import __version__, pipeline
from gemmaforge.config import (
    GGUF_QUANTS,
    DataConfig,
    ExportConfig,
    RunConfig,
    Split,
    TrainConfig,
    apply_override,
    load_config,
    validate_config,
)
from gemmaforge.console import console, escape
from gemmaforge.distributed import init_if_launched
from gemmaforge.errors import StageError, UserError
from gemmaforge.families import FAMILIES
from gemmaforge.models import default_home
from gemmaforge.runs import RunDir
from gemmaforge.serve.server import ServeOptions
from gemmaforge.units import parse_decimal_size

EPILOG = """examples:
  gemmaforge run examples/quickstart.yaml                  # data -> train -> eval -> merge -> GGUF -> Modelfile
  gemmaforge run my.yaml train.learning_rate=1e-4          # any config key can be overridden
  gemmaforge eval runs/quickstart --suite suite.yaml        # base vs tuned: checks, BLEU/ROUGE-L, retention
  gemmaforge merge runs/quickstart                         # a stage alone, on an existing run dir
  gemmaforge export gguf runs/quickstart --quant f16 --quant q4_k_m
  gemmaforge export verify runs/quickstart                 # every GGUF against the merged model
  gemmaforge export ollama runs/quickstart --create
  gemmaforge serve runs/quickstart                         # Ollama + OpenAI APIs on 127.0.0.1:11434
  gemmaforge chat runs/quickstart                          # talk to it in the terminal
  gemmaforge doctor                                        # can this machine train? (ROCm, CUDA, CPU)
  gemmaforge plan examples/quickstart.yaml --gpu-memory 24GiB   # will it fit?
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 as well; keep its usage line
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gemmaforge",
        description="From an instruction dataset to a LoRA-tuned Gemma answering in Ollama.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gemmaforge {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=_Parser)

    def config_verb(name: str, help_text: str) -> None:
        p = verbs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", type=Path,
                       help="YAML config (sections: output_dir, model, data, lora, train, eval, export)")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                       help="override config keys, e.g. train.max_steps=10")

    config_verb("run", "Run the whole pipeline: data, train, eval, merge, export gguf, export ollama.")
    config_verb("train", "Prepare the data and train the LoRA adapter (resumes from the run's last checkpoint).")

    add_data_verbs(verbs)

    add_eval_verb(verbs)
    add_serve_verbs(verbs)
    add_system_verbs(verbs)

    p = verbs.add_parser("merge", help="Merge the run's adapter into the base model (RUN_DIR/merged).")
    p.add_argument("run_dir", type=Path)

    export = verbs.add_parser("export", help="Export a merged run: GGUF files or an Ollama Modelfile.")
    targets = export.add_subparsers(dest="target", required=True, metavar="TARGET", parser_class=_Parser)
    p = targets.add_parser(
        "gguf", help="Write RUN_DIR/gguf/model-<quant>.gguf from RUN_DIR/merged, or convert any HF Gemma checkpoint.",
        description="Write RUN_DIR/gguf/model-<quant>.gguf from RUN_DIR/merged, or convert any Hugging Face Gemma "
        "checkpoint folder (default output: CHECKPOINT/<folder>-<quant>.gguf). K-quants go through llama.cpp's "
        "quantizer (llama-cpp-python).",
    )
    p.add_argument("run_dir", type=Path, metavar="PATH", help="a run directory, or an HF Gemma checkpoint folder")
    p.add_argument("--quant", action="append", choices=GGUF_QUANTS,
                   help="repeatable; default: the run config's export.gguf (f16 for a checkpoint)")
    p.add_argument("--output", type=Path, metavar="FILE", help="the GGUF file to write (one --quant only)")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="split into shards of at most SIZE (2G, 500M) named NAME-00001-of-0000N.gguf, as llama.cpp's "
                   "gguf-split; llama.cpp loads the first shard (Ollama cannot import split files); default: the run "
                   "config's export.split_max_size")
    p.add_argument("--split-max-tensors", type=_positive_int, metavar="N",
                   help="split into shards of at most N tensors")
    p.add_argument("--adapter", action="store_true",
                   help="write the LoRA adapter alone as RUN_DIR/gguf/adapter-f16.gguf (for llama.cpp --lora and "
                   "Ollama's ADAPTER on top of the base GGUF) instead of the merged model")
    p = targets.add_parser(
        "verify", help="Read every RUN_DIR/gguf file back, run it in llama.cpp, compare with the merged model.",
        description="Read every gguf/model-<quant>.gguf back (every key and tensor), load it in llama.cpp and "
        "compare its next-token distributions with the merged model's on val conversations: top-1 agreement "
        "and mean KL per file, into gguf/verify.json. Fails when f16 agrees on fewer than 99% of positions.",
    )
    p.add_argument("run_dir", type=Path)
    p = targets.add_parser(
        "vllm", help="Write RUN_DIR/vllm/serve.sh: `vllm serve` on the merged model (or base + adapter).",
        description="Write RUN_DIR/vllm/serve.sh with the `vllm serve` command for the merged model, or with "
        "--adapter for the base model plus the PEFT adapter (checked against vLLM's LoRA limits: rank, no DoRA, "
        "no modules_to_save, no trained token rows).",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--adapter", action="store_true",
                   help="serve base + LoRA adapter (--enable-lora) instead of merged/")
    p = targets.add_parser("ollama", help="Write RUN_DIR/ollama/Modelfile pointing at the run's GGUF.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--create", action="store_true", help="also run `ollama create NAME -f Modelfile`")
    p.add_argument("--adapter", action="store_true",
                   help="FROM the base GGUF plus ADAPTER (after `export gguf --adapter`) instead of the merged GGUF")
    return parser


EVAL_EPILOG = """suite file (YAML, or JSONL with one case per line):
  cases:
    - prompt: "手冲咖啡的水温应该是多少？"
      system: "你是咖啡师。"            # optional (default: the system prompt the model is deployed with)
      reference: "90到96摄氏度。"        # optional: scored by BLEU and ROUGE-L
      checks: [{starts_with: "咖啡师小贴士"}, {contains: "摄氏度"}, {max_chars: 200}]
checks: starts_with, ends_with, contains, not_contains, regex, json_valid, max_chars, min_chars

writes RUN_DIR/eval/results.json, report.md and report.html (base vs tuned).

examples:
  gemmaforge eval runs/quickstart
  gemmaforge eval runs/quickstart --suite examples/suites/coffee.yaml --fail-under 0.8
  gemmaforge eval runs/quickstart --engine llamacpp max_new_tokens=64   # the exported GGUF itself
"""


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


def add_serve_verbs(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "serve", help="Serve runs and models over the Ollama and OpenAI HTTP APIs (many LoRA adapters on one base).",
        description="Serve runs and models over Ollama's API (/api/chat, /api/generate, /api/tags, ...) and "
        "OpenAI's (/v1/chat/completions, /v1/completions, /v1/models), with adapters loaded and unloaded at "
        "runtime (/v1/load_lora_adapter, /v1/unload_lora_adapter). Concurrent requests on the transformers "
        "engine are batched at every decoding step.",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("models", nargs="+", metavar="[NAME=]MODEL")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback); any other needs --api-key")
    p.add_argument("--port", type=int, default=11434, help="default 11434, Ollama's")
    add_engine_options(p)
    p.add_argument("--api-key", help="require Authorization: Bearer KEY (default: $GEMMAFORGE_API_KEY)")
    p.add_argument("--max-batch", type=_positive_int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-queue", type=_positive_int, default=64,
                   help="requests waiting beyond the batch before 503 + Retry-After (default 64)")
    p.add_argument("--max-tokens", type=_positive_int, default=4096, help="the longest answer (default 4096)")
    p.add_argument("--timeout", type=_positive_int, default=600, help="seconds one request may generate (default 600)")

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


PLAN_EPILOG = """The plan counts weights, trainable parameters with AdamW's state, the activations autograd keeps
(traced on a probe with two layers of each kind at the real width), the backward pass, the loss's logits and the
runtime, for full rows of cutoff_len tokens; `gemmaforge train` makes the same plan first and refuses a
config that cannot fit (train.check_memory=false trains anyway).

examples:
  gemmaforge plan examples/quickstart.yaml
  gemmaforge plan my.yaml --gpu-memory 24GiB                # for an RX 7900 XTX, from any machine
  gemmaforge plan my.yaml train.per_device_train_batch_size=16 train.gradient_checkpointing=true --json
"""


def add_system_verbs(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "doctor", help="Check this machine: torch build, GPUs, ROCm access and arch, bf16, attention kernels, tools.",
        description="Check whether this machine can train, export and serve: OS and Python, the torch build, "
        "every GPU (torch, the driver's real arch, rocm-smi/amd-smi/nvidia-smi readings), /dev/kfd access and "
        "groups, the arch in torch's kernels, HSA_OVERRIDE_GFX_VERSION, the bf16 decision, a fused-attention probe, "
        "flash-attn, bitsandbytes, conflicting packages, free disk, the HF token, llama.cpp and ollama. Each "
        "check says PASS, WARN, FAIL or SKIP with a one-line fix; exit 1 when one fails.",
    )
    p.add_argument("--json", action="store_true", help='the report as JSON (schema "gemmaforge-doctor/1", see README)')
    p = verbs.add_parser(
        "plan", help="Predict a config's peak training memory, the largest batch and cutoff that fit, and fixes.",
        description="Predict the peak memory of training CONFIG on this device (or on a GPU of --gpu-memory), "
        "part by part, with the largest batch and cutoff_len that fit and what to change when it does not fit.",
        epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--gpu-memory", metavar="SIZE", help="plan for a GPU with this much memory (24GiB, 16G, 80GB)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")


def run_plan(args: argparse.Namespace, home: Path) -> bool:
    """Print the plan; True when it fits."""
    from gemmaforge.models import load_tokenizer, resolve_model
    from gemmaforge.train.memory_plan import Planner, plan_json, plan_summary, this_device
    from gemmaforge.train.precision import resolve_precision
    from gemmaforge.units import parse_binary_size

    config = load_config(args.config, args.overrides)
    gpu_memory = parse_binary_size(args.gpu_memory) if args.gpu_memory is not None else None
    base = resolve_model(config.model.name_or_path, home, config.model.revision)
    requested = config.train.precision
    # for another machine's GPU, auto means bf16 (every GPU gemmaforge targets has it but RDNA1/2)
    precision = "bf16" if gpu_memory is not None and requested == "auto" else resolve_precision(requested, base.family)
    load_tokenizer(base.path)  # resident as it will be in training, for the CPU's runtime part
    plan = Planner(config, base, precision, this_device(gpu_memory)).plan()
    print(plan_json(plan) if args.json else plan_summary(plan))
    return plan.fits


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("transformers", "llamacpp"), default="transformers",
                   help="for run directories: transformers (base + adapter, batched) or llamacpp (the run's GGUF)")
    p.add_argument("--num-ctx", type=_positive_int, default=4096, help="context window in tokens (default 4096)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="transformers engine weights: auto picks bf16 where the hardware has it (default)")


def serve_options(args: argparse.Namespace) -> ServeOptions:
    from gemmaforge.serve.server import api_key_from_env

    extra = {k: getattr(args, k) for k in ("host", "port", "max_batch", "max_queue", "max_tokens") if hasattr(args, k)}
    return ServeOptions(engine=args.engine, num_ctx=args.num_ctx, dtype=args.dtype,
                        api_key=api_key_from_env(args.api_key), timeout_s=float(getattr(args, "timeout", 600)), **extra)


def run_chat(args: argparse.Namespace, home: Path) -> None:
    from gemmaforge.serve.chat import chat_loop, pick_model
    from gemmaforge.serve.server import background_server, load_registry

    options = serve_options(args)
    sampling = {} if args.temperature is None else {"temperature": args.temperature}
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    if args.target.startswith(("http://", "https://")):
        url = args.target.rstrip("/")
        chat_loop(url, pick_model(url, args.model, headers), system=args.system, options=sampling, headers=headers)
        return
    registry = load_registry([args.target], options, home)
    try:
        with background_server(registry, options) as url:
            name = next(iter(registry.models))
            chat_loop(url, name, system=args.system, options=sampling, headers=headers)
    finally:
        registry.close()


def add_eval_verb(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "eval", help="Evaluate base vs tuned: loss, a generation suite with checks, BLEU/ROUGE-L, retention.",
        description="Evaluate the run's base and tuned models on the same val loss, generation suite (checks, "
        "BLEU/ROUGE-L against references) and knowledge-retention probes.",
        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--suite", help="YAML or JSONL suite (default: a sample of the run's val prompts)")
    p.add_argument("--engine", choices=["transformers", "llamacpp"],
                   help="llamacpp: the tuned answers come from the exported GGUF")
    p.add_argument("--fail-under", type=float, metavar="X",
                   help="exit 1 when the tuned suite pass rate is below X (0-1)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="eval config keys, e.g. max_new_tokens=64 num_samples=32 do_sample=true retention=false")


DATA_EPILOG = """formats: alpaca (instruction/input/output, optional system, history), sharegpt (conversations of
from/value: human, gpt, system), openai (messages of role/content), in JSON, JSONL, CSV or Parquet; or a
LLaMA-Factory data folder (dataset_info.json) with --dataset NAME.

examples:
  gemmaforge data prepare chats.jsonl -o prepared/chats clean.dedup=near
  gemmaforge data prepare LLaMA-Factory/data --dataset alpaca_zh_demo,identity
  gemmaforge data inspect prepared/chats/train.jsonl -n 2
  gemmaforge data inspect chats.jsonl --json -n 1 | jq .labels
"""


def add_data_verbs(verbs: argparse._SubParsersAction) -> None:
    data = verbs.add_parser(
        "data", help="Prepare (convert, clean, split) or inspect a dataset.", epilog=DATA_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", choices=["auto", "alpaca", "sharegpt", "openai"], default="auto")
        p.add_argument("--system", help="system prompt for records without one")
        p.add_argument("--model", default="gemma3-270m",
                       help="tokenizer and template family (default: the embedded gemma3-270m)")
        p.add_argument("--cutoff-len", type=int, default=TrainConfig.model_fields["cutoff_len"].default, metavar="N",
                       help="token limit, as train.cutoff_len (default: %(default)s)")

    p = actions.add_parser(
        "prepare", help="Convert, clean and split INPUT into train.jsonl, val.jsonl and stats.json.",
        description="Convert, clean and split INPUT into train.jsonl, val.jsonl and stats.json (written only "
        "when everything succeeded). Every dropped or changed record is counted by reason in stats.json.",
        epilog=DATA_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", type=Path, help="dataset file or folder, or a LLaMA-Factory data folder")
    common(p)
    p.add_argument("--dataset", help="LLaMA-Factory dataset name(s), comma-separated")
    p.add_argument("--eval", dest="eval_path", help="explicit validation file (instead of a split)")
    p.add_argument("--val-size", type=float, help="ratio in [0, 1) or a count >= 1 (default 0.1)")
    p.add_argument("--seed", type=int, default=TrainConfig.model_fields["seed"].default)
    p.add_argument("-o", "--output", type=Path, help="output folder (default: prepared/<input name>)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="data config keys, e.g. clean.dedup=near clean.overlong=truncate mask_history=true")

    p = actions.add_parser(
        "inspect", help="Show rendered conversations, the tokens that carry loss, and token lengths.",
        description="Show rendered conversations with the supervised tokens highlighted and a length summary; "
        'with --json, one {"text", "input_ids", "labels"} object per conversation (labels -100 where not trained).',
    )
    p.add_argument("file", type=Path, help="a prepared train.jsonl/val.jsonl, or any dataset file")
    common(p)
    p.add_argument("--template", choices=sorted(FAMILIES), help="template family (default: the model's)")
    p.add_argument("--json", action="store_true", help="JSON Lines on stdout")
    p.add_argument("-n", type=int, metavar="N", help="conversations to show (default: 3; with --json: all)")
    p.add_argument("--train-on-prompt", action="store_true")
    p.add_argument("--mask-history", action="store_true")


def main(argv: list[str] | None = None) -> int:
    # transformers warns about its own deprecated API whenever PEFT wraps a model: noise to users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        code = dispatch(parse_args(build_parser(), argv))
    except UserError as exc:
        console.print(f"[red]gemmaforge: error:[/] {escape(str(exc))}")
        return 2
    except StageError as exc:
        console.print(f"[red]gemmaforge: failed:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        console.print("gemmaforge: interrupted")
        return 130
    return code


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse stops filling a `key=value ...` positional at the first option; collect overrides that
    come after options too, so `data prepare IN -o OUT clean.dedup=near` works as written."""
    args, extras = parser.parse_known_args(argv)
    if extras and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extras):
        args.overrides = [*args.overrides, *extras]
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def dispatch(args: argparse.Namespace) -> int:
    """Run the verb; its exit code (a verb that reports, such as doctor, can fail without an exception)."""
    home = default_home()
    if args.verb == "run":
        run = pipeline.run_all(load_config(args.config, args.overrides), home)
        console.print(f"[green]done[/]: {run.root}")
    elif args.verb == "data":
        run_data_action(args, home)
    elif args.verb == "train":
        init_if_launched()
        config = load_config(args.config, args.overrides)
        run = RunDir.create(config)
        base = pipeline.base_model(run, config, home)
        pipeline.stage_data(run, config, base)
        pipeline.stage_train(run, config, base)
    elif args.verb == "serve":
        from gemmaforge.serve.server import serve

        serve(args.models, serve_options(args), home)
    elif args.verb == "chat":
        run_chat(args, home)
    elif args.verb == "doctor":
        from gemmaforge.doctor import doctor

        return doctor(args.json)
    elif args.verb == "plan":
        return 0 if run_plan(args, home) else 1
    elif args.verb == "export" and args.target == "gguf" and (ignored := ignored_gguf_flags(args)):
        raise UserError(ignored)
    elif args.verb == "export" and args.target == "gguf" and is_checkpoint(args.run_dir):
        split = split_from(ExportConfig(), args)
        pipeline.export_checkpoint_gguf(args.run_dir, args.quant or ["f16"], args.output, split)
    else:
        run = RunDir.open(args.run_dir)
        config: RunConfig = run.config()
        base = pipeline.base_model(run, config, home)
        if args.verb == "eval":
            pipeline.stage_eval(run, eval_config_from(config, args), base)
        elif args.verb == "merge":
            pipeline.stage_merge(run, base)
        elif args.target == "gguf" and args.adapter:
            pipeline.stage_export_adapter(run, base)
        elif args.target == "gguf":
            pipeline.stage_export_gguf(run, config, base, args.quant or list(config.export.gguf), args.output,
                                       split_from(config.export, args))
        elif args.target == "verify":
            pipeline.stage_export_verify(run, base)
        elif args.target == "vllm":
            pipeline.stage_export_vllm(run, config, base, adapter=args.adapter)
        else:
            pipeline.stage_export_ollama(run, config, base, create=args.create, adapter=args.adapter)
    return 0


def ignored_gguf_flags(args: argparse.Namespace) -> str:
    """Why `export gguf` cannot honour these flags together ('' when it can): --adapter writes the adapter alone,
    from a run directory's adapter/."""
    if not args.adapter:
        return ""
    if is_checkpoint(args.run_dir):
        return (f"--adapter exports a run's LoRA adapter, and {args.run_dir} is a checkpoint folder, not a run "
                "directory: leave out --adapter to convert the checkpoint")
    given = [flag for flag, value in (("--quant", args.quant), ("--output", args.output),
                                      ("--split-max-size", args.split_max_size),
                                      ("--split-max-tensors", args.split_max_tensors)) if value is not None]
    if given:
        return (f"--adapter writes RUN_DIR/gguf/adapter-f16.gguf, whole and in f16: {', '.join(given)} "
                "do not apply to it (they are for the merged model: leave out --adapter)")
    return ""


def split_from(export: ExportConfig, args: argparse.Namespace) -> Split:
    """The config's GGUF split, with --split-max-size / --split-max-tensors taking precedence."""
    split = export.split()
    size = parse_decimal_size(args.split_max_size, "--split-max-size") if args.split_max_size else split.max_bytes
    return Split(size, split.max_tensors if args.split_max_tensors is None else args.split_max_tensors)


def is_checkpoint(path: Path) -> bool:
    """A model folder rather than a run directory (which has run.yaml)."""
    return (path / "config.json").is_file() and not (path / "run.yaml").is_file()


def run_data_action(args: argparse.Namespace, home: Path) -> None:
    from gemmaforge.models import load_tokenizer, resolve_model

    if args.action == "prepare":
        raw: dict[str, object] = {"path": str(args.input), "format": args.format, "system": args.system}
        for key in ("dataset", "eval_path", "val_size"):
            if getattr(args, key) is not None:
                raw[key] = getattr(args, key)
        data = data_config_from(raw, args.overrides)
        output = args.output or Path("prepared") / (data.dataset[0] if data.dataset else args.input.stem)
    else:
        data = data_config_from({"path": str(args.file), "format": args.format, "system": args.system}, [])
    if args.cutoff_len < 8:
        raise UserError(f"--cutoff-len {args.cutoff_len}: expected at least 8 tokens")
    model = resolve_model(args.model, home)
    tokenizer = load_tokenizer(model.path)
    if args.action == "prepare":
        from gemmaforge.data.prepare import prepare_data, summary_line

        stats = prepare_data(data, args.seed, output, tokenizer, model.family, args.cutoff_len)
        console.print(f"[green]data[/]: {summary_line(stats)} -> {output}")
        return
    from gemmaforge.data.inspect import inspect_file
    from gemmaforge.data.prepare import resolve_sources

    family = FAMILIES[args.template] if args.template else model.family
    if tokenizer.convert_tokens_to_ids(family.chat.turn_start) == tokenizer.unk_token_id:
        console.print(f"[yellow]warning[/]: {family.chat.turn_start} is not one token in {args.model}'s vocabulary")
    (source,), _ = resolve_sources(data)
    inspect_file(
        source.path, tokenizer, family, schema=source.schema, system=data.system, cutoff_len=args.cutoff_len,
        train_on_prompt=args.train_on_prompt, mask_history=args.mask_history, limit=args.n, as_json=args.json,
    )


def eval_config_from(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The run's config with the eval section changed by the command line (errors name the key)."""
    raw = config.model_dump(mode="json")
    for item in args.overrides:
        apply_override(raw, f"eval.{item}")
    for key in ("suite", "engine", "fail_under"):
        if getattr(args, key) is not None:
            raw["eval"][key] = getattr(args, key)
    return validate_config(raw, source="command line")


def data_config_from(raw: dict[str, object], overrides: list[str]) -> DataConfig:
    """A validated data section from CLI options plus `key=value` overrides (errors name the key)."""
    config = {"output_dir": "-", "data": {k: v for k, v in raw.items() if v is not None}}
    for item in overrides:
        apply_override(config, f"data.{item}")
    return validate_config(config, source="command line").data


if __name__ == "__main__":
    sys.exit(main())
