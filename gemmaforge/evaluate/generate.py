"""Answer many conversations: batched transformers generation (left-padded, KV cache) or llama.cpp on a
GGUF file. Both see the same prompt token ids (the training template with its generation prompt) and
stop at the family's end-of-turn marker or <eos>, as Ollama does."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gemmaforge.families import Family
from gemmaforge.templates import Message, render_conversation


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


class Generator(Protocol):
    def generate(self, conversations: list[list[Message]], sampling: Sampling) -> list[Generation]: ...


def prompt_ids(tokenizer: Any, family: Family, messages: list[Message]) -> list[int]:
    text = render_conversation(messages, family, add_generation_prompt=True).text
    return tokenizer(text, add_special_tokens=False).input_ids


def stop_token_ids(tokenizer: Any, family: Family) -> list[int]:
    return sorted({tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(family.stop))})


class TransformersGenerator:
    """Greedy or seeded sampling in batches of prompts of similar length (less padding)."""

    def __init__(self, model: Any, tokenizer: Any, family: Family, batch_size: int):
        self.model, self.tokenizer, self.family, self.batch_size = model, tokenizer, family, batch_size
        self.stops = stop_token_ids(tokenizer, family)

    def generate(self, conversations: list[list[Message]], sampling: Sampling) -> list[Generation]:
        import torch
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample,
            temperature=sampling.temperature if sampling.do_sample else None,
            top_p=sampling.top_p if sampling.do_sample else None, top_k=None,
            eos_token_id=self.stops, pad_token_id=self.tokenizer.pad_token_id,
        )
        prompts = [prompt_ids(self.tokenizer, self.family, m) for m in conversations]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        self.model.eval()
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), self.tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding: every prompt ends where generation starts
                input_ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                attention_mask[row, width - len(prompts[i]):] = 1
            if sampling.do_sample:
                torch.manual_seed(sampling.seed + start)
            with torch.no_grad():
                out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
            for row, i in enumerate(batch):
                results[i] = self._finished(out[row, width:].tolist())
        return [results[i] for i in range(len(prompts))]

    def _finished(self, ids: list[int]) -> Generation:
        end = next((k for k, t in enumerate(ids) if t in self.stops), None)
        kept = ids if end is None else ids[:end]
        return Generation(self.tokenizer.decode(kept, skip_special_tokens=True).strip(), len(kept), end is not None)


class LlamaCppGenerator:
    """One prompt at a time through llama.cpp (what Ollama runs), fed the same prompt ids."""

    def __init__(self, gguf: Path, tokenizer: Any, family: Family, n_ctx: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)
        self.tokenizer, self.family = tokenizer, family

    def generate(self, conversations: list[list[Message]], sampling: Sampling) -> list[Generation]:
        results = []
        for messages in conversations:
            out = self.llm.create_completion(
                prompt_ids(self.tokenizer, self.family, messages), max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature if sampling.do_sample else 0.0, top_p=sampling.top_p,
                top_k=0 if sampling.do_sample else 1, min_p=0.0, repeat_penalty=1.0, seed=sampling.seed,
                stop=list(self.family.stop),
            )
            choice = out["choices"][0]
            results.append(Generation(choice["text"].strip(), out["usage"]["completion_tokens"],
                                      choice["finish_reason"] == "stop"))
            self.llm.reset()
        return results
