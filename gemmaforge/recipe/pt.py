"""Continued pretraining (`train.method: pt`): raw text, the loss on every token. Each text is `<bos>` + its tokens +
`<eos>`, cut into pieces of at most cutoff_len tokens (as LLaMA-Factory's pretraining stage cuts its token
stream into blocks); the pieces are packed into rows with attention kept within each (`train.packing`), or padded.
The chat template plays no part: the model learns the text itself."""

from __future__ import annotations

from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import read_prepared_texts
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel
from gemmaforge.recipe.method import Datasets, Method
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.collate import RightPadCollator
from gemmaforge.train.loss import SupervisedLossTrainer
from gemmaforge.train.memory_plan import NO_MEDIA
from gemmaforge.train.packing import PackedCollator, pack_examples

MIN_PIECE = 2  # a piece of one token predicts nothing


def encode_texts(texts: list[str], tokenizer: Any, cutoff_len: int) -> list[dict[str, list[int]]]:
    """Each text as `<bos>` tokens `<eos>`, cut into pieces of at most cutoff_len tokens, every token a label."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    pieces = []
    for ids in encoded:
        whole = [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
        for start in range(0, len(whole), cutoff_len):
            piece = whole[start:start + cutoff_len]
            if len(piece) >= MIN_PIECE:
                pieces.append({"input_ids": piece, "labels": list(piece)})
    return pieces


def pt_datasets(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel,
                senses: Senses) -> Datasets:
    cutoff = config.train.cutoff_len
    splits = {name: read_prepared_texts(run.require(run.data_dir / f"{name}.jsonl", "data"))
              for name in ("train", "val")}
    train_rows, val_rows = (encode_texts(splits[name], tokenizer, cutoff) for name in ("train", "val"))
    if not train_rows:
        raise UserError(f"{run.data_dir / 'train.jsonl'}: no text of two tokens or more to train on")
    if config.train.packing:
        train_set, val_set = pack_examples(train_rows, cutoff), pack_examples(val_rows, cutoff)
        collator: Any = PackedCollator(tokenizer.pad_token_id)
    else:
        train_set, val_set, collator = train_rows, val_rows, RightPadCollator(tokenizer.pad_token_id)
    console.print(f"[bold]train[/]: {len(splits['train'])} texts in {len(train_rows)} pieces of <= {cutoff} tokens"
                  + (f", packed into {len(train_set)} rows" if config.train.packing else ""))
    return Datasets(train_set, val_set, collator, examples=len(train_rows), dropped=0, media=NO_MEDIA, config=config)


PT = Method("pt", pt_datasets, SupervisedLossTrainer)
