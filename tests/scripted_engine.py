"""A serve engine whose answers are written by the test: the stand-in for a Gemma that has learned to think and
call tools, which a tiny random model cannot be. Everything else is the real thing: the model's real tokenizer
(its special tokens), the engines' own Answer and TextStream (end-of-turn and stop handling, streaming), and the
marker decoding the real engines use. It records the prompt each request sent, decoded."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gemmaforge.families import Family
from gemmaforge.inference.jobs import Answer, Job, TextStream, decode_with_markers, marker_ids
from gemmaforge.serve.registry import Registry, Served


class ScriptedEngine:
    kind = "transformers"
    device = "cpu"
    vision = None
    audio_rate = None  # a scripted model hears nothing

    def __init__(self, tokenizer: Any, family: Family):
        self.tokenizer, self.family = tokenizer, family
        self.stops = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(family.stop))}
        self.markers = marker_ids(tokenizer, family)
        self.end = tokenizer.convert_tokens_to_ids(family.stop[0])
        self.scripts: list[str] = []  # the next answers, in order: the text the "model" writes
        self.prompts: list[str] = []  # the prompts received, decoded with their special tokens

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def compile_grammar(self, spec: str) -> None:
        raise ValueError("a scripted engine writes its script")

    def submit(self, job: Job) -> None:
        self.prompts.append(self.tokenizer.decode(job.prompt_ids))
        script = self.scripts.pop(0)
        threading.Thread(target=self._run, args=(job, script), daemon=True).start()

    def _run(self, job: Job, script: str) -> None:
        answer = Answer(job, TextStream(self._decode, job.params.stop), 4096)
        for token in [*self.encode(script), self.end]:  # what follows the script is the end of the turn
            if answer.accept(token, self.stops):
                return

    def _decode(self, ids: list[int]) -> str:
        return decode_with_markers(ids, self.markers, lambda run: self.tokenizer.decode(run, skip_special_tokens=True))

    def running(self) -> int:
        return 0

    def embed(self, texts: list[str], adapter: str | None) -> tuple[list[list[float]], int]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def parameter_count(self) -> int:
        return 0

    def quantization_level(self) -> str:
        return "F32"

    def weight_files(self) -> list[Path]:
        return []


def serve_scripted(registry: Registry, name: str, tokenizer: Any, family: Family, source: Path,
                   trained_with_tools: bool = False) -> ScriptedEngine:
    engine = ScriptedEngine(tokenizer, family)
    registry.models[f"{name}:latest"] = Served(f"{name}:latest", engine, None, family, source,
                                               details={"family": family.name, "format": "safetensors"},
                                               trained_with_tools=trained_with_tools,
                                               modified_at=datetime.now(UTC).isoformat())
    return engine
