"""A LoRA fleet served at once: N requests, each on an adapter of its own, decoded in shared steps (the engine's
AdapterMix) and taking turns (one forward per adapter at each step, as the engine did before, and still does for
adapters the mix cannot take), against the same N requests on one adapter and on the base model.

    python benchmarks/serve_fleet.py [--model gemma3-270m] [--adapters 4] [--max-tokens 64] [--repeats 3]

`gemmaforge serve`'s transformers engine, loaded by its own Registry, on the GPU where there is one, in the dtype
`serve` chooses (bf16 where the hardware has it). The adapters are made here, of `gemmaforge train`'s default
shape (LoRA r 8, alpha 16 on the q/k/v/o projections, the chat markers' rows trained), with random non-zero B so
that each computes its own answers. Each request asks one of the coffee suite's questions, greedy, at most
--max-tokens tokens. Reported: completion tokens/s over the wall clock, the best of --repeats rounds (each round runs
every case once, so that a slower moment of the machine weighs on all of them), and the most adapters one forward
served (the engine's own count). Turn-taking is the same engine with its mix's slots emptied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_adapters(base: Any, marker_ids: list[int], count: int, folder: Path) -> list[Path]:
    """`count` adapters of `base` (a ResolvedModel) as `gemmaforge train` shapes them by default."""
    import torch
    from peft import LoraConfig, get_peft_model

    from gemmaforge.models import load_causal_lm

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = load_causal_lm(base.path, base.spec, torch.float32)
        peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                     "o_proj"],
                                                init_lora_weights=False, trainable_token_indices=marker_ids))
        paths.append(folder / f"adapter-{i}")
        peft.save_pretrained(paths[-1])
    return paths


def measure(engine: Any, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    from gemmaforge.inference.jobs import Delta, Job, Params

    async def answer(prompt: list[int], adapter: str | None) -> int:
        job = Job(prompt, Params(max_tokens=max_tokens, temperature=0), adapter, asyncio.get_running_loop(),
                  stream=False)
        engine.submit(job)
        while isinstance(event := await job.events.get(), Delta):
            pass
        return event.completion_tokens  # type: ignore[union-attr]  # the Finished that ended the loop

    async def together() -> int:
        return sum(await asyncio.gather(*(answer(prompts[i % len(prompts)], adapter)
                                          for i, adapter in enumerate(adapters))))

    begin = time.perf_counter()
    tokens = asyncio.run(together())
    return tokens / (time.perf_counter() - begin)


def fleet(model: str, count: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Every case's tokens/s on `model` (a name serve knows or a folder) with `count` requests and adapters."""
    import torch
    import yaml

    from gemmaforge.models import default_home, resolve_model
    from gemmaforge.serve.registry import Registry
    from gemmaforge.train.wrapping import template_token_ids

    home = default_home()
    registry = Registry(home, max_batch=max(16, count))
    base = registry.add(f"base={model}")
    engine = base.engine
    suite = yaml.safe_load((ROOT / "examples" / "suites" / "coffee.yaml").read_text(encoding="utf-8"))
    prompts = [engine.encode(base.family.chat.render([{"role": "user", "content": case["prompt"]}],
                                                     add_generation_prompt=True).text) for case in suite["cases"]]
    markers = template_token_ids(engine.tokenizer, base.family)
    rows: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for i, path in enumerate(make_adapters(resolve_model(model, home), markers, count, Path(folder))):
                registry.add_adapter(f"fleet-{i}", path)
            names = [registry.get(f"fleet-{i}").adapter for i in range(count)]  # type: ignore[union-attr]
            cases = {"base model": [None] * count, "one adapter": [names[0]] * count,
                     f"{count} adapters, shared steps": names, f"{count} adapters, turns": names}
            measure(engine, prompts, [names[0]], 8)  # warm-up
            mixed = dict(engine.mix.slots)
            for _ in range(repeats):
                for case, adapters in cases.items():
                    engine.mix.slots = {} if case.endswith("turns") else mixed  # between requests: no row holds one
                    rows[case] = max(rows.get(case, 0.0), round(measure(engine, prompts, adapters, max_tokens), 1))
    finally:
        registry.close()
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "threads": torch.get_num_threads(), "model": model, "requests": count, "max_tokens": max_tokens,
            "tok_s": rows, "most_adapters_in_a_forward": engine.most_adapters_in_a_forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="the base model: a name serve knows or a folder")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(fleet(args.model, args.adapters, args.max_tokens, args.repeats), indent=1))


if __name__ == "__main__":
    main()
