"""Supervised fine-tuning: conversations rendered in the family's chat format, the loss on what the model writes,
packed rows when the data is text only."""

from __future__ import annotations

from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import read_prepared, read_prepared_audios, read_prepared_images
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel
from gemmaforge.recipe.method import Datasets, Method
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.collate import MediaBatches, RightPadCollator, tokenize_conversations
from gemmaforge.train.loss import SupervisedLossTrainer
from gemmaforge.train.memory_plan import MediaLoad
from gemmaforge.train.packing import PackedCollator, pack_examples


def encode_split(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel, name: str,
                 senses: Senses) -> tuple[list[dict], int]:
    path = run.require(run.data_dir / f"{name}.jsonl", "data")
    return tokenize_conversations(
        read_prepared(path), tokenizer, base.family, config.train.cutoff_len, f"data/{name}.jsonl",
        train_on_prompt=config.data.train_on_prompt, mask_history=config.data.mask_history,
        images=read_prepared_images(path), audios=read_prepared_audios(path), senses=senses,
    )


def sft_datasets(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel, senses: Senses) -> Datasets:
    cutoff = config.train.cutoff_len
    train_rows, dropped = encode_split(run, config, tokenizer, base, "train", senses)
    val_rows, _ = encode_split(run, config, tokenizer, base, "val", senses)
    if not train_rows:
        raise UserError(f"no training example keeps a supervised token within train.cutoff_len={cutoff}")
    if dropped:
        console.print(f"[yellow]gemmaforge[/]: {dropped} training examples dropped: "
                      f"prompt alone exceeds cutoff_len={cutoff}")
    with_media = sum("images" in row or "audios" in row for row in train_rows + val_rows)
    if with_media and config.train.packing:
        # Packed rows attend causally within each example; an image's tokens attend to each other both ways, and
        # the towers' inputs go with the padded batch's rows.
        console.print(f"[bold]train[/]: {with_media} examples hold images or sound: padded batches (train.packing "
                      "is for text-only data)")
        config = config.model_copy(deep=True)
        config.train.packing = False
    if config.train.packing:
        train_set, val_set = pack_examples(train_rows, cutoff), pack_examples(val_rows, cutoff)
        collator: Any = PackedCollator(tokenizer.pad_token_id)
        console.print(f"[bold]train[/]: {len(train_rows)} examples packed into {len(train_set)} rows "
                      f"of <= {cutoff} tokens")
    else:
        train_set, val_set, collator = train_rows, val_rows, RightPadCollator(tokenizer.pad_token_id)
        if with_media:  # data with media was refused for a model without their tower
            collator = MediaBatches(collator, senses)
    return Datasets(train_set, val_set, collator, examples=len(train_rows), dropped=dropped,
                    media=media_load(train_rows, senses, tokenizer), config=config,
                    unpackable="examples hold images or sound" if with_media else "")


SFT = Method("sft", sft_datasets, SupervisedLossTrainer)


def media_load(rows: list[dict[str, Any]], senses: Senses, tokenizer: Any) -> MediaLoad:
    """The most pictures, and the most audio tokens, one encoded training example holds."""
    audio = senses.audio.audio_token_id if senses.audio else None
    return MediaLoad(max((len(row.get("images", ())) for row in rows), default=0),
                     max((row["input_ids"].count(audio) for row in rows if "audios" in row), default=0))
