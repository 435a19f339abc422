"""The data stage: read every source, convert to messages, clean, deduplicate, filter by token
length, split; write train.jsonl, val.jsonl and stats.json.

Records stream through in batches (tokenized together), so memory stays flat however large the
dataset: the split is a second pass over a temporary file. Outputs appear only when everything
succeeded: stats.json is removed first and written last, so its presence marks a complete stage.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import time
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from gemmaforge.chat.conversation import Message, Rendered, has_content
from gemmaforge.config import DataConfig, Method
from gemmaforge.console import console
from gemmaforge.data.clean import clean_messages
from gemmaforge.data.dedup import Deduplicator
from gemmaforge.data.formats import (
    default_schema,
    detect_schema,
    document_text,
    schema_with,
    to_feedback,
    to_messages,
    to_pair,
)
from gemmaforge.data.llamafactory import SourceSpec, dataset_info_sources, is_dataset_dir
from gemmaforge.data.media_files import CheckedClip, CheckedImage, ImageFinder, SoundFinder
from gemmaforge.data.sources import data_files, file_sha256, iter_records
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.runs import atomic_write_text
from gemmaforge.senses import NO_SENSES, Senses

BATCH_SIZE = 512  # conversations tokenized per call: the fast tokenizer's batching amortises its overhead
OUTPUTS = ("train.jsonl", "val.jsonl", "stats.json")
# in the output folder: media that came inside the data (data URIs, Parquet bytes, input_audio parts)
IMAGES_DIR, AUDIOS_DIR = "images", "audios"


@dataclass
class Example:
    """One conversation, and its images and clips in the order of their placeholders."""

    messages: list[Message]
    images: list[CheckedImage] = field(default_factory=list)
    audios: list[CheckedClip] = field(default_factory=list)


@dataclass
class Tally:
    """What happened to one source's records."""

    label: str
    path: str
    format: str = ""
    records: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    changed: Counter[str] = field(default_factory=Counter)


def resolve_sources(config: DataConfig) -> tuple[list[SourceSpec], list[SourceSpec]]:
    """(training sources, explicit validation sources) named by the data config."""
    base = None if config.format == "auto" else default_schema(config.format)
    if config.format == "auto" and (config.columns or config.tags):
        raise UserError("data.columns / data.tags need data.format (alpaca, sharegpt or openai)")

    def plain(path: str) -> SourceSpec:
        schema = schema_with(base, config.columns, config.tags, "data") if base else None
        return SourceSpec(Path(path), schema, Path(path).name)

    path = Path(config.path)
    if is_dataset_dir(path):
        train = dataset_info_sources(path, config.dataset)
    elif config.dataset:
        raise UserError(f"data.dataset is set but {path} is not a folder with dataset_info.json")
    else:
        train = [plain(config.path)]
    return train, [plain(config.eval_path)] if config.eval_path else []


class Preparer:
    """Turns sources into cleaned, length-checked conversations written as JSON Lines."""

    def __init__(self, config: DataConfig, tokenizer: Any, family: Family, cutoff_len: int,
                 progress: Callable[[int], None], senses: Senses, store: Path):
        self.config, self.tokenizer, self.family, self.cutoff_len = config, tokenizer, family, cutoff_len
        self.progress = progress
        self.senses = senses
        self.images = ImageFinder(store / IMAGES_DIR)
        self.sounds = SoundFinder(store / AUDIOS_DIR, senses.audio)
        self.with_images = 0  # conversations with images
        self.most_images = 0  # in one conversation: the memory planner prices that many per example
        self.with_audio = 0  # conversations with sound
        self.most_audio_tokens = 0  # in one conversation: what the planner prices for the audio tower
        self.dedup = Deduplicator(config.clean.dedup, config.clean.near_dup_threshold)
        self.lengths: array[int] = array("I")
        self.with_tools = 0  # conversations that offer tools (a run trained on them serves tools)
        self.supervised: array[int] = array("I")

    def run(self, spec: SourceSpec, out: IO[str], seed: int) -> Tally:
        tally = Tally(spec.label, str(spec.path))
        schema = spec.schema
        pending: list[Example] = []
        for where, record in self._records(spec, seed):
            if schema is None:
                schema = detect_schema(record, where)
                console.print(f"[bold]data[/]: {spec.path}: detected format {schema.describe()}")
            tally.records += 1
            example = self._convert(record, schema, where, tally, spec.media)
            if example is not None:
                pending.append(example)
            if len(pending) >= BATCH_SIZE:
                self._write_batch(pending, tally, out)
                pending = []
        self._write_batch(pending, tally, out)
        tally.format = schema.describe() if schema else ""
        return tally

    def _records(self, spec: SourceSpec, seed: int) -> Iterator[tuple[str, Any]]:
        """The source's records: its num_samples subset, then the first data.max_samples, as LLaMA-Factory
        takes them."""
        records: Iterator[tuple[str, Any]] = (item for path in data_files(spec.path)
                                              for item in iter_records(path, self.progress))
        if spec.num_samples is not None:
            # num_samples (LLaMA-Factory): a seeded random subset, or every record and then random repeats when it
            # asks for more than there are (repeats that data.clean.dedup then drops), so the source is held in memory.
            everything = list(records)
            rng = random.Random(seed)
            if spec.num_samples < len(everything):
                chosen = sorted(rng.sample(range(len(everything)), spec.num_samples))
                everything = [everything[i] for i in chosen]
            elif everything:
                everything += rng.choices(everything, k=spec.num_samples - len(everything))
            records = iter(everything)
        return itertools.islice(records, self.config.max_samples)

    def _convert(self, record: Any, schema: Any, where: str, tally: Tally, media: Path) -> Example | None:
        clean = self.config.clean
        messages = to_messages(record, schema, where, self.config.system)
        self.family.chat.check_features(messages, where)
        images, audios = self._media(record, messages, schema, where, media)
        empty = next((m for m in messages if not has_content(m)), None)
        if empty is not None:
            if not clean.drop_empty:
                raise UserError(
                    f"{where}: empty {empty['role']} turn; fix the record, or set data.clean.drop_empty=true "
                    "to drop such records (they are counted in stats.json)"
                )
            tally.dropped["empty"] += 1
            return None
        messages, changes = clean_messages(messages, clean)
        tally.changed.update(changes)
        if not all(map(has_content, messages)):
            tally.dropped["empty_after_cleaning"] += 1
            return None
        # other pictures, other clips: other questions
        pictures = "".join(f"\n[{kind} {m.sha256}]" for kind, found in (("image", images), ("audio", audios))
                           for m in found)
        verdict = self.dedup.check("\n".join(_dedup_text(m) for m in messages) + pictures)
        if verdict:
            tally.dropped[verdict] += 1
            return None
        return Example(messages, images, audios)

    def _media(self, record: Any, messages: list[Message], schema: Any, where: str,
               media: Path) -> tuple[list[CheckedImage], list[CheckedClip]]:
        """The record's images and clips, found and checked, with the family's markers in the text."""
        senses, chat = self.senses, self.family.chat
        images = self.images.in_record(record, messages, schema, where, media, (senses.vision, senses.no_vision),
                                       chat.image)
        audios = self.sounds.in_record(record, messages, schema, where, media, (senses.audio, senses.no_audio),
                                       chat.audio)
        if images:
            self.with_images += 1
            self.most_images = max(self.most_images, len(images))
        if audios:
            assert senses.audio is not None  # in_record refuses sound without it
            self.with_audio += 1
            self.most_audio_tokens = max(self.most_audio_tokens,
                                         sum(senses.audio.soft_token_count(c.samples) for c in audios))
        return images, audios

    def _render(self, example: Example, **options: Any) -> Rendered:
        """The conversation as training tokenizes it: each image's and clip's marker expanded into its tokens."""
        rendered = self.family.chat.render(example.messages, **options)
        if not example.images and not example.audios:
            return rendered
        return self.senses.expand(rendered, [(i.width, i.height) for i in example.images],
                                  [c.samples for c in example.audios])

    def _write_batch(self, batch: list[Example], tally: Tally, out: IO[str]) -> None:
        if not batch:
            return
        rendered = [self._render(example) for example in batch]
        for example, r, offsets in zip(batch, rendered, token_offsets(self.tokenizer, [r.text for r in rendered])):
            messages = example.messages
            answer_tokens = count_in_spans(offsets, r.supervised) - len(r.supervised)  # less the end markers
            view: Rendered | None = r  # what training supervises
            if answer_tokens < self.config.clean.min_answer_tokens:
                tally.dropped["too_short"] += 1
                continue
            if len(offsets) > self.cutoff_len:
                truncated = self._truncate(example) if self.config.clean.overlong == "truncate" else None
                if truncated is None:
                    tally.dropped["too_long"] += 1
                    continue
                tally.changed["truncated"] += 1
                messages, offsets = truncated
                view = None
            if view is None or self.config.train_on_prompt or self.config.mask_history:
                view = self._render(
                    Example(messages, example.images, example.audios),
                    train_on_prompt=self.config.train_on_prompt, mask_history=self.config.mask_history,
                )
            self.lengths.append(len(offsets))
            self.supervised.append(count_in_spans(offsets, view.supervised))
            line: dict[str, Any] = {"messages": messages}
            if example.images:
                line["images"] = [str(image.path) for image in example.images]
            if example.audios:
                line["audios"] = [str(clip.path) for clip in example.audios]
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            tally.kept += 1
            self.with_tools += bool(messages[0].get("tools"))

    def _truncate(self, example: Example) -> tuple[list[Message], list[tuple[int, int]]] | None:
        """Cut the last answer so the whole conversation fits cutoff_len tokens (its end-of-turn kept,
        so the model still learns to stop); None when the prompt alone leaves no room for an answer."""
        messages = example.messages
        if messages[-1].get("tool_calls") or messages[-1].get("thinking"):
            return None  # only an answer's text is cut; its calls and thinking are whole or not at all
        answer = messages[-1]["content"].strip()
        keep = len(answer)
        while keep > 0:
            candidate = [*messages[:-1], {**messages[-1], "content": answer[:keep].strip()}]
            rendered = self._render(Example(candidate, example.images, example.audios))
            (offsets,) = token_offsets(self.tokenizer, [rendered.text])
            if len(offsets) <= self.cutoff_len:
                return (candidate, offsets) if candidate[-1]["content"] else None
            answer_start = rendered.supervised[-1][0]
            over = len(offsets) - self.cutoff_len
            # Drop the answer's last `over` tokens and check again (tokens can merge across the cut).
            first_answer_token = bisect_left(offsets, (answer_start,))
            answer_token_count = len(offsets) - first_answer_token - 2  # less the end marker and newline
            if answer_token_count - over < max(1, self.config.clean.min_answer_tokens):
                return None
            cut_token = first_answer_token + answer_token_count - over
            keep = min(keep - 1, offsets[cut_token][0] - answer_start)
        return None


class TextPreparer(Preparer):
    """Continued pretraining's data: each record's text (formats.document_text), cleaned and deduplicated as
    conversations are, written as {"text": ...}. No text is too long: training cuts it into rows of cutoff_len."""

    def _convert(self, record: Any, schema: Any, where: str, tally: Tally, media: Path) -> Example | None:
        text = document_text(record, schema, where)
        if not text.strip():
            if not self.config.clean.drop_empty:
                raise UserError(f"{where}: empty text; fix the record, or set data.clean.drop_empty=true to drop "
                                "such records (they are counted in stats.json)")
            tally.dropped["empty"] += 1
            return None
        (message,), changes = clean_messages([{"role": "user", "content": text}], self.config.clean)
        tally.changed.update(changes)
        if not has_content(message):
            tally.dropped["empty_after_cleaning"] += 1
            return None
        verdict = self.dedup.check(message["content"].strip())
        if verdict:
            tally.dropped[verdict] += 1
            return None
        return Example([message])

    def _write_batch(self, batch: list[Example], tally: Tally, out: IO[str]) -> None:
        texts = [example.messages[0]["content"] for example in batch]
        for text, offsets in zip(texts, token_offsets(self.tokenizer, texts) if texts else []):
            if len(offsets) < self.config.clean.min_answer_tokens:
                tally.dropped["too_short"] += 1
                continue
            self.lengths.append(len(offsets) + 2)  # with <bos> and <eos>
            self.supervised.append(len(offsets) + 1)  # every token after <bos> is predicted
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            tally.kept += 1


@dataclass
class PairExample(Example):
    """A preference pair: `messages` is the prompt and the chosen answer, `rejected` the other answer."""

    rejected: Message = field(default_factory=lambda: {"role": "assistant", "content": ""})


class PairPreparer(Preparer):
    """Preference tuning's data (train.method: dpo, and rm's): each record's prompt and its chosen and rejected answers,
    cleaned and deduplicated as conversations are, both sides within cutoff_len; written as
    {"messages": prompt, "chosen": answer, "rejected": answer}."""

    def _convert(self, record: Any, schema: Any, where: str, tally: Tally, media: Path) -> Example | None:
        prompt, chosen, rejected = to_pair(record, schema, where, self.config.system)
        self.family.chat.check_features([*prompt, chosen], where)
        self.family.chat.check_features([*prompt, rejected], where)
        _text_only(record, schema, where, "preference pairs")
        cleaned = self._cleaned([*prompt, chosen, rejected], where, tally)
        if cleaned is None:
            return None
        *prompt, chosen, rejected = cleaned
        if chosen == rejected:
            tally.dropped["same_answers_after_cleaning"] += 1
            return None
        return PairExample([*prompt, chosen], rejected=rejected)

    def _cleaned(self, messages: list[Message], where: str, tally: Tally) -> list[Message] | None:
        """The record's turns cleaned, or None (counted) when one is empty or the record a duplicate."""
        empty = next((m for m in messages if not has_content(m)), None)
        if empty is not None:
            if not self.config.clean.drop_empty:
                raise UserError(f"{where}: empty {empty['role']} turn; fix the record, or set "
                                "data.clean.drop_empty=true to drop such records (they are counted in stats.json)")
            tally.dropped["empty"] += 1
            return None
        cleaned, changes = clean_messages(messages, self.config.clean)
        tally.changed.update(changes)
        if not all(map(has_content, cleaned)):
            tally.dropped["empty_after_cleaning"] += 1
            return None
        verdict = self.dedup.check("\n".join(map(_dedup_text, cleaned)))
        if verdict:
            tally.dropped[verdict] += 1
            return None
        return cleaned

    def _write_batch(self, batch: list[Example], tally: Tally, out: IO[str]) -> None:
        pairs = [example for example in batch if isinstance(example, PairExample)]
        sides = [self.family.chat.render(conversation, mask_history=True)
                 for pair in pairs for conversation in (pair.messages, [*pair.messages[:-1], pair.rejected])]
        offsets = token_offsets(self.tokenizer, [side.text for side in sides]) if sides else []
        for i, pair in enumerate(pairs):
            (chosen, chosen_offsets), (_, rejected_offsets) = zip(sides[2 * i:2 * i + 2], offsets[2 * i:2 * i + 2])
            if max(len(chosen_offsets), len(rejected_offsets)) > self.cutoff_len:
                tally.dropped["too_long"] += 1  # a pair is compared whole: neither side is cut
                continue
            line = {"messages": pair.messages[:-1], "chosen": pair.messages[-1], "rejected": pair.rejected}
            self._keep(line, len(chosen_offsets), count_in_spans(chosen_offsets, chosen.supervised), tally, out)

    def _keep(self, line: dict[str, Any], tokens: int, supervised: int, tally: Tally, out: IO[str]) -> None:
        """Write one prepared line, counted in the stats (its first side's tokens and supervised tokens)."""
        self.lengths.append(tokens)
        self.supervised.append(supervised)
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        tally.kept += 1
        self.with_tools += bool(line["messages"] and line["messages"][0].get("tools"))


@dataclass
class FeedbackExample(Example):
    """An answer labelled desirable or undesirable: `messages` is the prompt and the answer."""

    desirable: bool = True


class FeedbackPreparer(PairPreparer):
    """KTO's data (train.method: kto): answers labelled desirable or undesirable, cleaned and deduplicated as
    conversations are, within cutoff_len, written as {"messages": prompt, "completion": answer, "label": bool};
    preference pairs as PairPreparer writes them (training takes each side as one labelled answer, as TRL's
    KTOTrainer unpairs them)."""

    def _convert(self, record: Any, schema: Any, where: str, tally: Tally, media: Path) -> Example | None:
        if schema.ranking:
            return super()._convert(record, schema, where, tally, media)
        prompt, answer, desirable = to_feedback(record, schema, where, self.config.system)
        self.family.chat.check_features([*prompt, answer], where)
        _text_only(record, schema, where, "labelled answers")
        cleaned = self._cleaned([*prompt, answer], where, tally)
        return None if cleaned is None else FeedbackExample(cleaned, desirable=desirable)

    def _write_batch(self, batch: list[Example], tally: Tally, out: IO[str]) -> None:
        super()._write_batch(batch, tally, out)
        labelled = [example for example in batch if isinstance(example, FeedbackExample)]
        rendered = [self.family.chat.render(example.messages, mask_history=True) for example in labelled]
        offsets = token_offsets(self.tokenizer, [r.text for r in rendered]) if rendered else []
        for example, r, token_spans in zip(labelled, rendered, offsets):
            if len(token_spans) > self.cutoff_len:
                tally.dropped["too_long"] += 1  # as a pair's sides, an answer is never cut
                continue
            line = {"messages": example.messages[:-1], "completion": example.messages[-1], "label": example.desirable}
            self._keep(line, len(token_spans), count_in_spans(token_spans, r.supervised), tally, out)


def _dedup_text(message: Message) -> str:
    """A message as deduplication compares it: its text, and what else it says (calls, tools, thinking)."""
    extra = {k: message[k] for k in ("tool_calls", "tools", "thinking") if message.get(k)}
    return message["content"].strip() + (json.dumps(extra, ensure_ascii=False, sort_keys=True) if extra else "")


def token_offsets(tokenizer: Any, texts: list[str]) -> list[list[tuple[int, int]]]:
    """Character offsets of each text's tokens, as training tokenizes it (no special tokens added).
    A fast tokenizer's Rust backend is called directly: transformers' per-encoding conversion into
    Python lists would cost as much as the tokenization itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [encoding.offsets for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [[tuple(o) for o in offsets] for offsets in encoded["offset_mapping"]]


def count_in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> int:
    """How many tokens start inside the [start, end) character spans (offsets sorted by start; a
    1-tuple (x,) sorts before every (x, end), so bisect finds the first token starting at x)."""
    return sum(bisect_left(offsets, (end,)) - bisect_left(offsets, (start,)) for start, end in spans)


def _text_only(record: Any, schema: Any, where: str, what: str) -> None:
    for column in (schema.images, schema.audios):
        if column and record.get(column):
            raise UserError(f"{where}: {what} with {column} are not supported yet; give text records")


def prepare_data(
    config: DataConfig, seed: int, out_dir: Path, tokenizer: Any, family: Family, cutoff_len: int,
    senses: Senses = NO_SENSES, method: Method = "sft",
) -> dict[str, Any]:
    """Write train.jsonl, val.jsonl and stats.json into out_dir; return the stats. `senses`: Senses.of the model, for
    records with images or sound. `method`: pt prepares raw text ({"text": ...} lines), the others conversations
    ({"messages": [...]} lines)."""
    began = time.perf_counter()
    train_specs, eval_specs = resolve_sources(config)
    files = [p for spec in train_specs + eval_specs for p in data_files(spec.path)]
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    temps = {name: out_dir / f".{name}.{os.getpid()}.tmp" for name in ("all", "train", "val")}
    try:
        with _progress_bar(sum(p.stat().st_size for p in files)) as advance:
            kind = {"pt": TextPreparer, "dpo": PairPreparer, "rm": PairPreparer,
                    "kto": FeedbackPreparer}.get(method, Preparer)
            preparer = kind(config, tokenizer, family, cutoff_len, advance, senses, out_dir)
            with temps["all"].open("w", encoding="utf-8") as out:
                tallies = [preparer.run(spec, out, seed) for spec in train_specs]
            with temps["val"].open("w", encoding="utf-8") as out:
                tallies += [preparer.run(spec, out, seed) for spec in eval_specs]
        n_kept = sum(t.kept for t in tallies[: len(train_specs)])
        if n_kept == 0:
            raise UserError(f"no training example left after cleaning: {_summary(tallies)}")
        if eval_specs:
            os.replace(temps["all"], temps["train"])
            n_val = sum(t.kept for t in tallies[len(train_specs) :])
        else:
            n_val = _split(temps["all"], temps["train"], temps["val"], config.validation_size, seed, n_kept)
        hashes = {name: file_sha256(temps[name]) for name in ("train", "val")}
        stats = _stats(config, family, cutoff_len, tallies, files, preparer, hashes, n_kept, n_val, began)
        stats["method"] = method
        (out_dir / "stats.json").unlink(missing_ok=True)
        for name in ("train", "val"):
            os.replace(temps[name], out_dir / f"{name}.jsonl")
        atomic_write_text(out_dir / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
        return stats
    except BaseException:
        if created:  # leave no folder behind that was made for a failed run
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def _split(all_path: Path, train_path: Path, val_path: Path, val_size: float, seed: int, n: int) -> int:
    """Route a seeded random `val_size` (ratio < 1, or count >= 1) of the n lines to validation."""
    n_val = int(val_size) if val_size >= 1 else round(n * val_size)
    if n_val >= n:
        raise UserError(f"data.val_size={val_size} leaves no training examples out of {n}")
    val_lines = set(random.Random(seed).sample(range(n), n_val))
    with all_path.open(encoding="utf-8") as src, train_path.open("w", encoding="utf-8") as train, val_path.open(
        "w", encoding="utf-8"
    ) as val:
        for i, line in enumerate(src):
            (val if i in val_lines else train).write(line)
    return n_val


def _stats(
    config: DataConfig, family: Family, cutoff_len: int, tallies: list[Tally], files: list[Path],
    preparer: Preparer, hashes: dict[str, str], n_kept: int, n_val: int, began: float,
) -> dict[str, Any]:
    dropped = sum((t.dropped for t in tallies), Counter())
    changed = sum((t.changed for t in tallies), Counter())
    return {
        "source": str(config.path),
        "format": " + ".join(dict.fromkeys(t.format for t in tallies)),
        "sources": [
            {"label": t.label, "path": t.path, "format": t.format, "records": t.records, "kept": t.kept,
             "dropped": dict(t.dropped), "changed": dict(t.changed)}
            for t in tallies
        ],
        "files_sha256": {str(p): file_sha256(p) for p in files},
        "records": sum(t.records for t in tallies),
        "kept": sum(t.kept for t in tallies),
        "train": n_kept - (0 if config.eval_path else n_val),
        "val": n_val,
        "dropped": dict(dropped),
        "changed": dict(changed),
        "tool_conversations": preparer.with_tools,
        "images": {"conversations": preparer.with_images, "references": preparer.images.references,
                   "files": len(preparer.images.seen), "most_in_one": preparer.most_images},
        "audios": {"conversations": preparer.with_audio, "references": preparer.sounds.references,
                   "files": len(preparer.sounds.seen), "most_tokens_in_one": preparer.most_audio_tokens},
        "tokens": describe_lengths(preparer.lengths),
        "supervised_tokens": describe_lengths(preparer.supervised),
        "template": family.name,
        "cutoff_len": cutoff_len,
        "options": {
            "train_on_prompt": config.train_on_prompt,
            "mask_history": config.mask_history,
            "system": config.system,
            **config.clean.model_dump(),
        },
        "train_sha256": hashes["train"],
        "val_sha256": hashes["val"],
        "seconds": round(time.perf_counter() - began, 2),
    }


def describe_lengths(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "total": sum(ordered),
        "min": ordered[0],
        "mean": round(statistics.fmean(ordered), 1),
        "p50": ordered[len(ordered) // 2],
        "p95": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))],
        "max": ordered[-1],
    }


def summary_line(stats: dict[str, Any]) -> str:
    """'N train / M val examples (of R records; dropped: ..., changed: ...)' for the console."""
    parts = [f"{stats['records']} records"]
    for key in ("dropped", "changed"):
        if stats[key]:
            parts.append(f"{key}: " + ", ".join(f"{reason} {n}" for reason, n in sorted(stats[key].items())))
    return f"{stats['train']} train / {stats['val']} val examples ({'; '.join(parts)})"


def _summary(tallies: list[Tally]) -> str:
    records = sum(t.records for t in tallies)
    dropped = sum((t.dropped for t in tallies), Counter())
    reasons = ", ".join(f"{reason} {n}" for reason, n in dropped.most_common()) or "none"
    return f"{records} records read, dropped: {reasons}"


class _progress_bar:
    """A byte-based progress bar on stderr, advanced by the readers."""

    def __init__(self, total: int):
        self.bar = Progress(
            TextColumn("[bold]data[/]"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
            console=console, transient=True,
        )
        self.task = self.bar.add_task("prepare", total=total)
        self.pending = 0

    def __enter__(self) -> Callable[[int], None]:
        self.bar.start()
        return self.advance

    def advance(self, n: int) -> None:
        self.pending += n
        if self.pending >= 1 << 20:  # the bar's lock per JSONL line would cost more than the parsing
            self.bar.advance(self.task, self.pending)
            self.pending = 0

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def _answered_rows(path: Path) -> list[dict[str, Any]]:
    """A prepared split's lines, less KTO's undesirable answers (no conversation to learn from or score against)."""
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return [row for row in rows if row.get("label", True)]


def read_prepared(path: Path) -> list[list[Message]]:
    """The prepared conversations; of preference pairs, each prompt with its chosen answer, of labelled answers the
    desirable ones (what the eval stage asks and scores against, and what `export verify` compares)."""
    rows = _answered_rows(path)
    if rows and "messages" not in rows[0]:
        raise UserError(f"{path} holds raw text (prepared for train.method: pt), not conversations: prepare the "
                        "data again for this method")
    return [[*row["messages"], row.get("chosen") or row["completion"]] if "chosen" in row or "completion" in row
            else row["messages"] for row in rows]


def read_prepared_pairs(path: Path) -> list[tuple[list[Message], Message, Message]]:
    """The prompts and their chosen and rejected answers of a split prepared for train.method: dpo or rm (or kto,
    whose labelled answers are left out)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    if any("chosen" not in row and "label" not in row for row in rows):
        raise UserError(f"{path} holds no preference pairs: prepare the data again for train.method: dpo")
    return [(row["messages"], row["chosen"], row["rejected"]) for row in rows if "chosen" in row]


def read_prepared_feedback(path: Path) -> list[tuple[list[Message], Message, bool]]:
    """The prompts, answers and labels (True: desirable) of a split prepared for train.method: kto; each side of a
    preference pair is one answer, the chosen desirable."""
    examples: list[tuple[list[Message], Message, bool]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line else {}
        if "chosen" in row:
            examples += [(row["messages"], row["chosen"], True), (row["messages"], row["rejected"], False)]
        elif "label" in row:
            examples.append((row["messages"], row["completion"], row["label"]))
        elif row:
            raise UserError(f"{path} holds neither labelled answers nor preference pairs: prepare the data again "
                            "for train.method: kto")
    return examples


def read_prepared_images(path: Path) -> list[list[Path]]:
    """Each prepared conversation's images (absolute paths, in the order of their placeholders)."""
    return [[Path(p) for p in row.get("images", ())] for row in _answered_rows(path)]


def read_prepared_audios(path: Path) -> list[list[Path]]:
    """Each prepared conversation's clips (absolute paths, in the order of their placeholders)."""
    return [[Path(p) for p in row.get("audios", ())] for row in _answered_rows(path)]


def read_prepared_texts(path: Path) -> list[str]:
    """The texts of a split prepared for continued pretraining (train.method: pt)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    if rows and "text" not in rows[0]:
        raise UserError(f"{path} holds conversations, not raw text: prepare the data again for train.method: pt")
    return [row["text"] for row in rows]
