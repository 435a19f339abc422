"""The tokenizer files of a Google Gemma 3 release: a SentencePiece `tokenizer.model` with the real vocabulary,
and tokenizer_config.json in the form those releases have (written by transformers 4: add_bos_token,
add_eos_token and every added token in added_tokens_decoder; transformers 5 keeps them in tokenizer.json).

The pieces, scores and kinds are those of Google's own Gemma 3 GGUF (the embedded model), made from the
release's tokenizer files; what that conversion changed is undone: <unk> is SentencePiece's UNKNOWN piece
(CONTROL in the GGUF, because tokenizer_config marks it special), and user-defined pieces are spelled with
"▁" again (the GGUF writes their spaces as spaces). The trainer and normalizer settings are those of Gemma's
tokenizer.model: BPE with byte fallback, no dummy prefix, whitespace kept as it is."""

from __future__ import annotations

import json
from pathlib import Path

from gemmaforge.gguf_file import read_gguf

SPIECE_SPACE = "\u2581"
# sentencepiece_model.proto ModelProto.SentencePiece.Type, the numbering gguf.TokenType shares
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def add_google_tokenizer_files(checkpoint: Path, gguf_file: Path) -> None:
    """Write tokenizer.model into `checkpoint` and its tokenizer_config.json in the release's form."""
    write_tokenizer_model(gguf_file, checkpoint / "tokenizer.model")
    added = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config_file = checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.update(add_bos_token=True, add_eos_token=False,
                  added_tokens_decoder={str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added})
    config_file.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def write_tokenizer_model(gguf_file: Path, target: Path) -> Path:
    from sentencepiece import sentencepiece_model_pb2

    reader = read_gguf(gguf_file)
    tokens = reader.fields["tokenizer.ggml.tokens"].value
    scores = reader.fields["tokenizer.ggml.scores"].value
    kinds = reader.fields["tokenizer.ggml.token_type"].value
    unk = reader.fields["tokenizer.ggml.unknown_token_id"].value
    proto = sentencepiece_model_pb2.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, kinds)):
        if kind == USER_DEFINED:
            piece = piece.replace(" ", SPIECE_SPACE)
        proto.pieces.add(piece=piece, score=score, type=UNKNOWN if i == unk else kind)
    spec = proto.trainer_spec
    spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = spec.split_digits = spec.allow_whitespace_only_pieces = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk, 2, 1, 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    target.write_bytes(proto.SerializeToString())
    return target
