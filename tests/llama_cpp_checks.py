"""llama.cpp (llama-cpp-python) driven token by token, for the tests that hold it against transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

PROMPT = "<start_of_turn>user\nWhat does caffeine do to the body?<end_of_turn>\n<start_of_turn>model\n"


def load(path: Path, **kwargs):
    """llama.cpp on `path`; the calling test is skipped, saying so, where llama-cpp-python is not installed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False, **kwargs)


def greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def relative_error(llm, tokens: list[int], want: np.ndarray) -> float:
    llm.reset()
    llm.eval(tokens)
    got = np.asarray(llm.scores[: len(tokens)])  # (T, V)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
