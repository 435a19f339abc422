"""Gemma's SentencePiece vocabulary as GGUF wants it (`tokenizer.ggml.model = "llama"`).

llama.cpp's SentencePiece tokenizer merges the pair whose result has the highest score, so the
scores must exist even when only a tokenizer.json is at hand. Two sources:

- `tokenizer.model` (SentencePiece): pieces, scores and kinds read as they are.
- `tokenizer.json` (BPE, what transformers writes for Gemma and rebuilds from a GGUF file): no
  scores. SentencePiece's BPE trainer scores its normal pieces -0, -1, -2, ... in id order, and
  transformers derives the merge order from that same order, so they are rebuilt as such. Checked
  against the official Gemma 3 GGUF: equal, except that its single characters (never the result of
  a merge, so never compared by llama.cpp) come after a gap of 31.

Added tokens then override both, as llama.cpp's converter does: special ones become CONTROL, the
others USER_DEFINED with "▁" written back as a space.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import TokenType

from gemmaforge.errors import UserError
from gemmaforge.model_spec import SPECIAL_TOKEN_NAMES
from gemmaforge.models import load_tokenizer

SPIECE_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
ADDED_TOKEN_SCORE = -1000.0  # what llama.cpp's converter gives added (control / user-defined) tokens
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# sentencepiece_model.proto ModelProto.SentencePiece.Type -> GGUF token type (same numbering)
_SPM_KINDS = {
    1: TokenType.NORMAL,
    2: TokenType.UNKNOWN,
    3: TokenType.CONTROL,
    4: TokenType.USER_DEFINED,
    5: TokenType.UNUSED,
    6: TokenType.BYTE,
}


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType values
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad", "mask" -> token id (those present)
    add_bos: bool
    add_eos: bool
    chat_template: str | list[dict[str, str]] | None  # the tokenizer's own, if it has one


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja")


def load_vocab(model_dir: Path, n_vocab: int, config_ids: dict[str, int]) -> Vocab:
    """The vocabulary of `model_dir`, padded to `n_vocab` entries (the embedding's rows); `config_ids` are the
    special-token ids config.json gives (ModelSpec.special_token_ids), used where the tokenizer names none.
    Read once per version of the tokenizer's files: an export of several quantizations reads it once."""
    paths = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    files = tuple((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in paths)
    return _load_vocab(model_dir.resolve(), files, n_vocab, tuple(sorted(config_ids.items())))


@functools.lru_cache(maxsize=2)
def _load_vocab(model_dir: Path, files: tuple[tuple[str, int, int], ...], n_vocab: int,
                config_ids: tuple[tuple[str, int], ...]) -> Vocab:
    """load_vocab's work; `files` (name, size, modification time) only tells a changed tokenizer apart."""
    tok_json = _read_json(model_dir / "tokenizer.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json") or {}
    added = list((tok_json or {}).get("added_tokens", []))
    added += [dict(t, id=int(i)) for i, t in tok_config.get("added_tokens_decoder", {}).items()]
    spm_path = model_dir / "tokenizer.model"
    if spm_path.is_file():
        tokens, scores, types = _from_sentencepiece(spm_path)
    elif tok_json is not None:
        tokens, scores, types = _from_tokenizer_json(tok_json, {int(t["id"]) for t in added})
    else:
        raise UserError(f"no tokenizer in {model_dir}: expected tokenizer.json or tokenizer.model")
    for entry in added:
        _apply_added_token(tokens, scores, types, entry)
    for i, kind in enumerate(types):
        if kind == TokenType.USER_DEFINED:  # llama.cpp matches user-defined text as typed
            tokens[i] = tokens[i].replace(SPIECE_SPACE, " ")

    if len(tokens) > n_vocab:
        raise UserError(
            f"the tokenizer in {model_dir} has {len(tokens)} tokens but the model's embedding has only {n_vocab} rows"
        )
    for i in range(len(tokens), n_vocab):  # rows the tokenizer never produces
        tokens.append(f"[PAD{i}]")
        scores.append(ADDED_TOKEN_SCORE)
        types.append(TokenType.UNUSED)

    return Vocab(
        tokens=tokens,
        scores=scores,
        types=[int(t) for t in types],
        special_ids=_special_ids(tok_config, tokens, dict(config_ids)),
        add_bos=bool(tok_config.get("add_bos_token", True)),  # Gemma needs BOS; transformers 5 omits the flag
        add_eos=bool(tok_config.get("add_eos_token", False)),
        chat_template=_chat_template(model_dir, tok_config),
    )


def _from_sentencepiece(path: Path) -> tuple[list[str], list[float], list[TokenType]]:
    from sentencepiece import sentencepiece_model_pb2  # only needed for this input

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated by protoc, no stubs
    proto.ParseFromString(path.read_bytes())
    tokens = [p.piece for p in proto.pieces]
    scores = [float(p.score) for p in proto.pieces]
    types = [_SPM_KINDS.get(p.type, TokenType.NORMAL) for p in proto.pieces]
    return tokens, scores, types


def _from_tokenizer_json(
    tok_json: dict[str, Any],
    added_ids: set[int],
) -> tuple[list[str], list[float], list[TokenType]]:
    model = tok_json["model"]
    if model["type"] != "BPE":
        raise UserError(f"tokenizer.json: model type {model['type']!r} is not Gemma's (BPE)")
    pieces = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    if sorted(model["vocab"].values()) != list(range(len(pieces))):
        raise UserError("tokenizer.json: BPE vocabulary ids are not contiguous from 0")

    byte_fallback = bool(model.get("byte_fallback"))
    unk = model.get("unk_token")
    tokens: list[str] = []
    scores: list[float] = []
    types: list[TokenType] = []
    n_normal = 0
    for token_id, piece in enumerate(pieces):
        if token_id in added_ids:  # typed and scored by _apply_added_token
            kind, score = TokenType.CONTROL, ADDED_TOKEN_SCORE
        elif byte_fallback and _BYTE_PIECE.match(piece):
            kind, score = TokenType.BYTE, 0.0
        elif piece == unk:
            kind, score = TokenType.UNKNOWN, 0.0
        elif len(piece) > 1 and piece == SPIECE_SPACE * len(piece):
            # Gemma's runs of spaces are user-defined pieces; transformers' GGUF import respells
            # them with "▁" and leaves them out of added_tokens, so restore what the original had.
            kind, score = TokenType.USER_DEFINED, ADDED_TOKEN_SCORE
        else:
            kind, score = TokenType.NORMAL, -float(n_normal)
            n_normal += 1
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    return tokens, scores, types


def _apply_added_token(tokens: list[str], scores: list[float], types: list[TokenType], entry: dict[str, Any]) -> None:
    token_id, content = int(entry["id"]), str(entry["content"])
    while len(tokens) <= token_id:  # added beyond the base vocabulary
        tokens.append(f"[PAD{len(tokens)}]")
        scores.append(ADDED_TOKEN_SCORE)
        types.append(TokenType.UNUSED)
    types[token_id] = TokenType.CONTROL if entry.get("special") else TokenType.USER_DEFINED
    tokens[token_id] = content
    scores[token_id] = ADDED_TOKEN_SCORE


def _special_ids(tok_config: dict[str, Any], tokens: list[str], config_ids: dict[str, int]) -> dict[str, int]:
    """Ids of bos/eos/unk/pad/mask: by the text tokenizer_config names, else config.json's ids."""
    index = {t: i for i, t in enumerate(tokens)}
    ids: dict[str, int] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = tok_config.get(f"{name}_token")
        if isinstance(text, dict):  # older tokenizer_config spells an AddedToken as a dict
            text = text.get("content")
        if isinstance(text, str) and text in index:
            ids[name] = index[text]
        elif name in config_ids:
            ids[name] = config_ids[name]
    return ids


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | list[dict[str, str]] | None:
    template = tok_config.get("chat_template")
    jinja = model_dir / "chat_template.jinja"  # where transformers >= 4.43 saves it
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from e


def bpe_tokens(model_dir: Path) -> Iterator[tuple[str, TokenType]]:
    """(text, kind) of every token of a BPE tokenizer.json in id order, as the gguf package's `LlamaHfVocab`
    (through which llama.cpp's converter writes Gemma 4) gives them: the base vocabulary, byte pieces BYTE and
    special tokens CONTROL, then the added tokens past it. Its vocabulary is read once here; `LlamaHfVocab`
    rebuilds it for every special token, a third of a Gemma 4 export's time."""
    tokenizer = load_tokenizer(model_dir)
    vocab: dict[str, int] = tokenizer.get_vocab()
    base = tokenizer.vocab_size
    added = sorted((token_id, text) for text, token_id in tokenizer.get_added_vocab().items() if token_id >= base)
    added_ids = {token_id for token_id, _ in added}
    special_ids = set(tokenizer.all_special_ids)
    by_id = {token_id: text for text, token_id in vocab.items()}
    for token_id in range(base):
        if token_id not in added_ids:
            text = by_id[token_id]
            yield text, (TokenType.BYTE if _BYTE_PIECE.match(text) else
                         TokenType.CONTROL if token_id in special_ids else TokenType.NORMAL)
    for token_id, text in added:
        yield text, TokenType.CONTROL if token_id in special_ids else TokenType.USER_DEFINED


def bpe_merges(model_dir: Path) -> list[str]:
    """The merges of a BPE tokenizer.json as the gguf package's `SpecialVocab(load_merges=True)` gives them ("a b",
    a space inside a part written as U+0120), without its per-character rebuild of every pair (2.5 s of Gemma 4's
    514k merges)."""
    path = model_dir / "tokenizer.json"
    merges = (_read_json(path) or {}).get("model", {}).get("merges") or []
    if all(isinstance(merge, str) for merge in merges):
        return merges
    if not all(type(pair) is list and len(pair) == 2 and type(pair[0]) is str and type(pair[1]) is str
               for pair in merges):
        raise UserError(f"{path}: model.merges holds neither 'a b' strings nor [a, b] pairs")
    space = chr(ord(" ") + 256)
    return [f"{a.replace(' ', space)} {b.replace(' ', space)}" for a, b in merges]
