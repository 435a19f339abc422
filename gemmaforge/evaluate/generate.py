"""Answer many conversations through an inference engine, as `serve` answers them: the transformers engine
(base: no adapter, tuned: the run's adapter) or the llama.cpp engine on a GGUF file. Each conversation is one
job with the same prompt token ids (the training template with its generation prompt), stopping at the
family's end-of-turn marker or <eos>, as Ollama does."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.audio import LONGEST_CLIP_SECONDS
from gemmaforge.chat.conversation import Message
from gemmaforge.errors import StageError, UserError
from gemmaforge.families import Family
from gemmaforge.inference.jobs import Delta, Engine, Failed, Job, Params
from gemmaforge.intake import decode_picture, decode_sound
from gemmaforge.media import AUDIO, IMAGE


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: int  # generated tokens, the stop token excluded
    stopped: bool  # ended on a stop token; False: ran into max_new_tokens


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 42

    def params(self, index: int) -> Params:
        """The engine's parameters for the `index`-th conversation (its own seed: answers repeat with eval.seed
        whatever the batch they share)."""
        if not self.do_sample:
            return Params(self.max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, repeat_last_n=0)
        return Params(self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=0,
                      seed=self.seed + index, repeat_last_n=0)


def prompt_ids(tokenizer: Any, family: Family, messages: list[Message]) -> list[int]:
    text = family.chat.render(messages, add_generation_prompt=True).text
    return tokenizer(text, add_special_tokens=False).input_ids


class EngineGenerator:
    """All conversations submitted at once; the engine batches them as it batches concurrent requests."""

    def __init__(self, engine: Engine, tokenizer: Any, adapter: str | None = None):
        self.engine, self.tokenizer, self.adapter = engine, tokenizer, adapter

    def generate(self, conversations: list[list[Message]], sampling: Sampling,
                 images: list[list[Path]] | None = None, audios: list[list[Path]] | None = None) -> list[Generation]:
        """`images`, `audios`: each conversation's pictures and clips, where its text has `<image>` / `<audio>` (or
        the family's markers)."""
        prompts = [self._prompt(m, images[i] if images else [], audios[i] if audios else [], i)
                   for i, m in enumerate(conversations)]
        return asyncio.run(self._answers(prompts, sampling))

    def _prompt(self, messages: list[Message], pictures: list[Path], clips: list[Path], index: int
                ) -> tuple[list[int], Any]:
        family = self.engine.family
        if not pictures and not clips:
            return prompt_ids(self.tokenizer, family, messages), None
        markers = {IMAGE.placeholder: family.chat.image, AUDIO.placeholder: family.chat.audio or AUDIO.placeholder}
        messages = [{**m, "content": _replaced(m["content"], markers)} for m in messages]
        text = family.chat.render(messages, add_generation_prompt=True).text
        try:
            rate = self.engine.audio_rate
            if clips and rate is None:
                raise ValueError(getattr(self.engine, "no_audio", "the model takes no sound"))
            sounds = [decode_sound(p.read_bytes(), str(p), rate, LONGEST_CLIP_SECONDS) for p in clips] if rate else []
            return self.engine.encode_media(text, [decode_picture(p.read_bytes(), str(p)) for p in pictures], sounds)
        except ValueError as e:
            raise UserError(f"eval: conversation {index + 1} has media: {e}") from None

    async def _answers(self, prompts: list[tuple[list[int], Any]], sampling: Sampling) -> list[Generation]:
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, sampling.params(i), self.adapter, loop, stream=False, media=media)
                for i, (ids, media) in enumerate(prompts)]
        for job in jobs:
            self.engine.submit(job)
        return [await _generation(job) for job in jobs]


async def _generation(job: Job) -> Generation:
    parts = []
    while True:
        event = await job.events.get()
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise StageError(f"eval: {event.message}")
        else:
            return Generation("".join(parts).strip(), event.completion_tokens, event.reason == "stop")


def _replaced(text: str, markers: dict[str, str]) -> str:
    for placeholder, marker in markers.items():
        text = text.replace(placeholder, marker)
    return text
