"""What the Launch tab shows before a run starts: the first conversations as training will see them (what
`gemmaforge data inspect` prints) and the memory plan (what `gemmaforge plan` prints), refusing, as the train
stage does, a config the planner says cannot fit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.config import RunConfig
from gemmaforge.data.inspect import encoded_conversations, media_slots, token_spans
from gemmaforge.data.prepare import resolve_sources
from gemmaforge.models import ResolvedModel, load_tokenizer, resolve_model
from gemmaforge.senses import Senses
from gemmaforge.train.memory_plan import Plan, plan_config, plan_summary


@dataclass(frozen=True)
class Preview:
    where: str  # file and line (or record) of the conversation
    tokens: int
    supervised: int  # within cutoff_len
    spans: list[tuple[str, str]]  # (text, 'prompt' | 'supervised' | 'image' | 'cut')


def base_of(config: RunConfig, home: Path) -> ResolvedModel:
    return resolve_model(config.model.name_or_path, home, config.model.revision)


def preview(config: RunConfig, base: ResolvedModel, n: int = 3) -> list[Preview]:
    """The first n conversations of the training data, rendered and masked as training renders them."""
    tokenizer = load_tokenizer(base.path)
    (source, *_), _ = resolve_sources(config.data)
    cutoff, shown = config.train.cutoff_len, list[Preview]()
    for e in encoded_conversations(source.path, source.schema, config.data.system, tokenizer, base.family,
                                   train_on_prompt=config.data.train_on_prompt, mask_history=config.data.mask_history,
                                   senses=Senses.of(base.path, base.spec, tokenizer)):
        if len(shown) == n:
            break
        supervised = sum(label != IGNORE_INDEX for label in e.labels[:cutoff])
        spans = token_spans(e.text, e.labels, e.offsets, cutoff, media_slots(tokenizer))
        shown.append(Preview(e.where, len(e.ids), supervised, spans))
    return shown


def refusal(config: RunConfig, base: ResolvedModel) -> str | None:
    """Why the train stage would refuse this config for memory (its plan says it cannot fit), or None."""
    if not config.train.check_memory:
        return None
    plan: Plan = plan_config(config, base)
    if plan.fits:
        return None
    return f"this config cannot fit: {plan_summary(plan)}\n(train.check_memory=false trains anyway)"
