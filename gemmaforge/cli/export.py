"""`gemmaforge merge` and `gemmaforge export gguf|verify|vllm|ollama`: the stages after training, on a run
directory (and `export gguf` on any Hugging Face checkpoint folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmaforge import pipeline
from gemmaforge.cli.common import Parser, Verbs, positive_int, refuse_unless
from gemmaforge.compat.llamafactory import check_template, merge_request
from gemmaforge.config import GGUF_QUANTS, ExportConfig, RunConfig, Split, read_yaml
from gemmaforge.console import console, escape
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel, resolve_model
from gemmaforge.runs import RunDir, refuse_reward_model
from gemmaforge.units import parse_decimal_size


def add(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "merge", help="Merge the run's adapter into the base model (RUN_DIR/merged).",
        description="Merge the run's adapter into the base model (RUN_DIR/merged). Given an LLaMA-Factory export "
        "YAML (examples/merge_lora/*.yaml) instead, merge its adapter_name_or_path (the run directory its training "
        "config's output_dir named) into its export_dir.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR|EXPORT.yaml")
    p.set_defaults(handler=merge)

    export = verbs.add_parser("export", help="Export a merged run: GGUF files or an Ollama Modelfile.")
    targets = export.add_subparsers(dest="target", required=True, metavar="TARGET", parser_class=Parser)
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
    p.add_argument("--split-max-tensors", type=positive_int, metavar="N",
                   help="split into shards of at most N tensors")
    p.add_argument("--adapter", action="store_true",
                   help="write the LoRA adapter alone as RUN_DIR/gguf/adapter-f16.gguf (for llama.cpp --lora and "
                   "Ollama's ADAPTER on top of the base GGUF) instead of the merged model")
    p.set_defaults(handler=export_gguf)
    p = targets.add_parser(
        "verify", help="Read every RUN_DIR/gguf file back, run it in llama.cpp, compare with the merged model.",
        description="Read every gguf/model-<quant>.gguf back (every key and tensor), load it in llama.cpp and "
        "compare its next-token distributions with the merged model's on val conversations: top-1 agreement "
        "and mean KL per file, into gguf/verify.json. Fails when f16 agrees on fewer than 99% of positions.",
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(handler=export_verify)
    p = targets.add_parser(
        "vllm", help="Write RUN_DIR/vllm/serve.sh: `vllm serve` on the merged model (or base + adapter).",
        description="Write RUN_DIR/vllm/serve.sh with the `vllm serve` command for the merged model, or with "
        "--adapter for the base model plus the PEFT adapter (checked against vLLM's LoRA limits: rank, no DoRA, "
        "no modules_to_save, no trained token rows).",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--adapter", action="store_true",
                   help="serve base + LoRA adapter (--enable-lora) instead of merged/")
    p.set_defaults(handler=export_vllm)
    p = targets.add_parser("ollama", help="Write RUN_DIR/ollama/Modelfile pointing at the run's GGUF.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--create", action="store_true", help="also run `ollama create NAME -f Modelfile`")
    p.add_argument("--adapter", action="store_true",
                   help="FROM the base GGUF plus ADAPTER (after `export gguf --adapter`) instead of the merged GGUF")
    p.set_defaults(handler=export_ollama)


def merge(args: argparse.Namespace, home: Path) -> int:
    if args.run_dir.suffix not in (".yaml", ".yml"):
        run, _, base = _open(args.run_dir, home)
        pipeline.stage_merge(run, base)
        return 0
    source = str(args.run_dir)
    request = merge_request(read_yaml(args.run_dir), source)
    console.print(escape(request.report), end="")
    if is_adapter_folder(request.run_dir):  # an adapter LLaMA-Factory (or PEFT) trained: its base is named
        if request.model is None:
            raise UserError(f"{source}: model_name_or_path: required to merge {request.run_dir}, an adapter "
                            "folder rather than a gemmaforge run")
        base = resolve_model(request.model, home)
        check_template(request.template, base.family.name, request.model, source)
        pipeline.merge_adapter_folder(request.run_dir, base, request.export_dir)
    else:
        run, config, base = _open(request.run_dir, home)
        if request.model is not None and request.model != config.model.name_or_path and \
                Path(request.model).expanduser().resolve() != base.path:
            raise UserError(f"{source}: model_name_or_path: {request.model}, but {run.root} was trained on "
                            f"{config.model.name_or_path}")
        check_template(request.template, base.family.name, config.model.name_or_path, source)
        pipeline.stage_merge(run, base, request.export_dir)
    console.print(f"next: gemmaforge export gguf {request.export_dir} --quant q8_0")
    return 0


def is_adapter_folder(path: Path) -> bool:
    """A PEFT adapter's own folder rather than a run directory (which has run.yaml)."""
    return (path / "adapter_config.json").is_file() and not (path / "run.yaml").is_file()


def export_gguf(args: argparse.Namespace, home: Path) -> int:
    checkpoint = is_checkpoint(args.run_dir)
    if args.adapter and checkpoint:
        raise UserError(f"--adapter exports a run's LoRA adapter, and {args.run_dir} is a checkpoint folder, not a "
                        "run directory: leave out --adapter to convert the checkpoint")
    refuse_unless(not args.adapter, {"--quant": args.quant, "--output": args.output,
                                     "--split-max-size": args.split_max_size,
                                     "--split-max-tensors": args.split_max_tensors},
                  "--adapter writes RUN_DIR/gguf/adapter-f16.gguf, whole and in f16: {flags} do not apply to it "
                  "(they are for the merged model: leave out --adapter)")
    if checkpoint:
        pipeline.export_checkpoint_gguf(args.run_dir, args.quant or ["f16"], args.output,
                                        split_from(ExportConfig(), args))
        return 0
    run, config, base = _open(args.run_dir, home, "export gguf")
    if args.adapter:
        pipeline.stage_export_adapter(run, base)
    else:
        pipeline.stage_export_gguf(run, config, base, args.quant or list(config.export.gguf), args.output,
                                   split_from(config.export, args))
    return 0


def export_verify(args: argparse.Namespace, home: Path) -> int:
    run, _, base = _open(args.run_dir, home, "export verify")
    pipeline.stage_export_verify(run, base)
    return 0


def export_vllm(args: argparse.Namespace, home: Path) -> int:
    run, config, base = _open(args.run_dir, home, "export vllm")
    pipeline.stage_export_vllm(run, config, base, adapter=args.adapter)
    return 0


def export_ollama(args: argparse.Namespace, home: Path) -> int:
    run, config, base = _open(args.run_dir, home, "export ollama")
    pipeline.stage_export_ollama(run, config, base, create=args.create, adapter=args.adapter)
    return 0


def split_from(export: ExportConfig, args: argparse.Namespace) -> Split:
    """The config's GGUF split, with --split-max-size / --split-max-tensors taking precedence."""
    split = export.split()
    size = parse_decimal_size(args.split_max_size, "--split-max-size") if args.split_max_size else split.max_bytes
    return Split(size, split.max_tensors if args.split_max_tensors is None else args.split_max_tensors)


def is_checkpoint(path: Path) -> bool:
    """A model folder rather than a run directory (which has run.yaml)."""
    return (path / "config.json").is_file() and not (path / "run.yaml").is_file()


def _open(run_dir: Path, home: Path, verb: str | None = None) -> tuple[RunDir, RunConfig, ResolvedModel]:
    """The run, its config and base; for `verb`, an export of a model that writes text (never a reward model)."""
    run = RunDir.open(run_dir)
    config = run.config()
    if verb is not None:
        refuse_reward_model(run, config, f"`{verb}`")
    return run, config, pipeline.base_model(run, config, home)
