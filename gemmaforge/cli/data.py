"""`gemmaforge data prepare` (convert, clean, split) and `gemmaforge data inspect` (what training sees)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gemmaforge.cli.common import Parser, Verbs
from gemmaforge.config import FORMATTINGS, METHODS, DataConfig, TrainConfig, apply_override, validate_config
from gemmaforge.console import console
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.models import ResolvedModel
from gemmaforge.senses import Senses

DATA_EPILOG = """formats: alpaca (instruction/input/output, optional system, history), sharegpt (conversations of
from/value: human, gpt, system), openai (messages of role/content), in JSON, JSONL, CSV or Parquet; or a
LLaMA-Factory data folder (dataset_info.json) with --dataset NAME.

images (Gemma 3 4B+ and Gemma 4, with --model naming one): an `images` column with one <image> in the text per
picture (LLaMA-Factory), OpenAI image_url content parts (local paths or data URIs), or a folder of pictures with
a JSONL whose file_name column names each record's picture; every picture is checked here.

sound (Gemma 4 E2B and E4B): an `audios` column with one <audio> in the text per clip (LLaMA-Factory), OpenAI
input_audio content parts (base64), or a folder of clips with a file_name JSONL; every clip is decoded here
(WAV, FLAC, OGG, MP3, ...), mixed to mono and resampled to the model's rate; at most 30 s each.

examples:
  gemmaforge data prepare chats.jsonl -o prepared/chats clean.dedup=near
  gemmaforge data prepare LLaMA-Factory/data --dataset alpaca_zh_demo,identity
  gemmaforge data prepare LLaMA-Factory/data --dataset mllm_demo --model google/gemma-3-4b-it
  gemmaforge data prepare LLaMA-Factory/data --dataset mllm_audio_demo --model google/gemma-4-E2B-it
  gemmaforge data inspect prepared/chats/train.jsonl -n 2
  gemmaforge data inspect chats.jsonl --json -n 1 | jq .labels
"""


def add(verbs: Verbs) -> None:
    data = verbs.add_parser(
        "data", help="Prepare (convert, clean, split) or inspect a dataset.", epilog=DATA_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", choices=["auto", *FORMATTINGS], default="auto")
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
    p.add_argument("--method", choices=METHODS, default="sft",
                   help="the training method the data is for: sft (conversations, the default), pt (raw text "
                        "for continued pretraining: a text column, .txt lines, or each record's first prompt), dpo "
                        "(preference pairs), kto (answers labelled desirable or not, and pairs) or rm (preference "
                        "pairs, for a reward model)")
    p.add_argument("-o", "--output", type=Path, help="output folder (default: prepared/<input name>)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="data config keys, e.g. clean.dedup=near clean.overlong=truncate mask_history=true")
    p.set_defaults(handler=prepare)

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
    p.set_defaults(handler=inspect)


def prepare(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.data.prepare import prepare_data, summary_line

    raw: dict[str, object] = {"path": str(args.input), "format": args.format, "system": args.system}
    for key in ("dataset", "eval_path", "val_size"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    data = data_config_from(raw, args.overrides)
    output = args.output or Path("prepared") / (data.dataset[0] if data.dataset else args.input.stem)
    model, tokenizer = _tokenizer(args, home)
    stats = prepare_data(data, args.seed, output, tokenizer, model.family, args.cutoff_len,
                         Senses.of(model.path, model.spec, tokenizer), method=args.method)
    console.print(f"[green]data[/]: {summary_line(stats)} -> {output}")
    return 0


def inspect(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.data.inspect import inspect_file
    from gemmaforge.data.prepare import resolve_sources

    data = data_config_from({"path": str(args.file), "format": args.format, "system": args.system}, [])
    model, tokenizer = _tokenizer(args, home)
    family = FAMILIES[args.template] if args.template else model.family
    if tokenizer.convert_tokens_to_ids(family.chat.turn_start) == tokenizer.unk_token_id:
        console.print(f"[yellow]warning[/]: {family.chat.turn_start} is not one token in {args.model}'s vocabulary")
    (source,), _ = resolve_sources(data)
    inspect_file(
        source.path, tokenizer, family, schema=source.schema, system=data.system, cutoff_len=args.cutoff_len,
        train_on_prompt=args.train_on_prompt, mask_history=args.mask_history, limit=args.n, as_json=args.json,
        senses=Senses.of(model.path, model.spec, tokenizer),
    )
    return 0


def _tokenizer(args: argparse.Namespace, home: Path) -> tuple[ResolvedModel, Any]:
    """The model --model names (resolved, so its family is known) and its tokenizer."""
    from gemmaforge.models import load_tokenizer, resolve_model

    if args.cutoff_len < 8:
        raise UserError(f"--cutoff-len {args.cutoff_len}: expected at least 8 tokens")
    model = resolve_model(args.model, home)
    return model, load_tokenizer(model.path)


def data_config_from(raw: dict[str, object], overrides: list[str]) -> DataConfig:
    """A validated data section from CLI options plus `key=value` overrides (errors name the key)."""
    config = {"output_dir": "-", "data": {k: v for k, v in raw.items() if v is not None}}
    for item in overrides:
        apply_override(config, f"data.{item}")
    return validate_config(config, source="command line").data
