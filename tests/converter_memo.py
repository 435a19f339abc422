"""Runs one of llama.cpp's converter scripts with its vocabulary readers memoized on disk:
`python converter_memo.py MEMO_DIR SCRIPT ARGS...`, in the converter's folder (tests/llama_cpp_reference.py).

Reading Gemma's 262k-token vocabulary is most of a text conversion's time (12 of 28 s for a tiny Gemma 4), and the
conformance tests convert checkpoints that share a tokenizer again and again. The readers memoized here are pure
functions of the checkpoint's tokenizer files and config.json (`TextModel.get_vocab_base`, `gguf.LlamaHfVocab`'s
tokens, `gguf.SpecialVocab`), kept by the contents of the files each reads: the first conversion of a tokenizer runs the
converter's own code, the later ones get the values it computed, and everything else (what the converter writes from
them, the hyperparameters, the tensors) runs as it is."""

from __future__ import annotations

import hashlib
import pickle
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template")


def memoized(memo: Path, what: str, folder: Path, compute: Callable[[], Any], config: bool = True) -> Any:
    """`compute()`, a reader of `folder`'s tokenizer files (and of its config.json where `config`), once for their
    contents."""
    digest = hashlib.sha256(what.encode())
    read = (*TOKENIZER_FILES, "config.json") if config else TOKENIZER_FILES
    for file in sorted(f for f in Path(folder).iterdir() if f.is_file() and f.name.startswith(read)):
        digest.update(f"\0{file.name}\0".encode() + file.read_bytes())
    path = memo / f"{digest.hexdigest()}.pickle"
    if path.is_file():
        return pickle.loads(path.read_bytes())
    value = compute()
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(value))
    partial.replace(path)
    return value


class MemoizedHfVocab:
    """What the converter reads of `gguf.LlamaHfVocab`: its tokens and their number."""

    def __init__(self, tokens: list[tuple[bytes, float, Any]], vocab_size: int) -> None:
        self.tokens, self.vocab_size = tokens, vocab_size

    def all_tokens(self) -> list[tuple[bytes, float, Any]]:
        return self.tokens


def main() -> None:
    memo, script, *args = sys.argv[1:]
    memo_dir = Path(memo)
    memo_dir.mkdir(parents=True, exist_ok=True)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path.cwd()))
    import gguf
    from conversion.base import TextModel

    vocab_base, hf_vocab, special_vocab = TextModel.get_vocab_base, gguf.LlamaHfVocab, gguf.SpecialVocab

    def get_vocab_base(self: Any) -> Any:
        return memoized(memo_dir, "get_vocab_base", self.dir_model, lambda: vocab_base(self))

    def llama_hf_vocab(folder: Path) -> MemoizedHfVocab:
        def read() -> tuple[list, int]:
            vocab = hf_vocab(folder)
            return list(vocab.all_tokens()), vocab.vocab_size
        # it reads the tokenizer alone, and config.json only where tokenizer_config.json does not name its class
        named = '"tokenizer_class"' in (Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8")
        return MemoizedHfVocab(*memoized(memo_dir, "LlamaHfVocab", folder, read, config=not named))

    def special(folder: Path, load_merges: bool = False, special_token_types: Any = None,
                n_vocab: int | None = None) -> Any:
        what = f"SpecialVocab {load_merges} {special_token_types} {n_vocab}"
        return memoized(memo_dir, what, folder,
                        lambda: special_vocab(folder, load_merges, special_token_types, n_vocab))

    TextModel.get_vocab_base = get_vocab_base
    gguf.LlamaHfVocab, gguf.SpecialVocab = llama_hf_vocab, special
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
