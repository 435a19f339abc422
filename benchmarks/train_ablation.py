"""Each training speed technique measured on its own: forward + backward of the same examples.

    python benchmarks/train_ablation.py [--examples 96] [--variants padded,packed,...]

Same model, data and LoRA as benchmarks/train_throughput.py (embedded Gemma 3 270M, coffee split, r=8,
alpha 32, dropout 0.1 on q/k/v/o, chat-marker rows trained, cutoff 512, fp32 on this CPU). A seeded
subset of --examples training examples goes through forward and backward in micro-batches of 4 (4
examples, or 4 packed rows), with each variant in its own process so its peak RSS is its own. The first
micro-batch is a warm-up and is not timed; no optimizer step is taken (it is the same for all variants).

Variants, each adding one technique to the one before:

* padded: one example per row, right-padded to the batch's longest; loss at supervised positions only,
  through autograd with the output layer's logits recomputed in backward (chunks of 1024);
* packed: examples packed into rows of 512 with per-example position ids (block-diagonal SDPA mask);
* fused_ce: + the output layer's cross-entropy with its gradient computed in the forward (chunks of 128);
* per_example_attention: + each packed example through SDPA alone (gemmaforge_packed);
* byte_mask_dropout: + LoRA dropout masks kept as bool instead of fp32;
* recomputed_gelu: + the gated MLP keeping gate and up only, gelu(gate) recomputed in backward: the default;
* checkpointing: the default + gradient checkpointing (memory for compute).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import CUTOFF, DEFAULT_DATA, LORA, MODEL, ROOT, SEED, TARGETS, log, peak_rss_bytes, prepare_split

VARIANTS = ("padded", "packed", "fused_ce", "per_example_attention", "byte_mask_dropout", "recomputed_gelu",
            "checkpointing")
MICRO_BATCH = 4


def child(variant: str, work: Path, n_examples: int) -> dict[str, Any]:
    """Measure one variant in this process."""
    from gemmaforge.chat.conversation import IGNORE_INDEX
    from gemmaforge.config import validate_config
    from gemmaforge.data.prepare import read_prepared
    from gemmaforge.models import default_home, load_tokenizer, resolve_model
    from gemmaforge.train import loss, wrapping
    from gemmaforge.train.collate import RightPadCollator, tokenize_conversations
    from gemmaforge.train.packing import PackedCollator, pack_examples

    step = VARIANTS.index(variant)
    packing, fused, per_example = step >= 1, step >= 2, step >= 3
    if step < 4:
        wrapping.use_byte_mask_dropout = lambda model: 0  # PEFT's nn.Dropout stays
    if step < 5:
        wrapping.use_recomputed_gelu = lambda model: 0
    train = {"cutoff_len": CUTOFF, "packing": packing, "logits_chunk_size": 128 if fused else 1024,
             "gradient_checkpointing": variant == "checkpointing"}
    config = validate_config({"output_dir": str(work / "unused"), "model": {"name_or_path": MODEL},
                              "data": {"path": "unused"}, "lora": {**LORA, "target_modules": TARGETS},
                              "train": train}, "train_ablation")
    if not fused:
        loss.linear_cross_entropy = lambda *args: None  # the autograd path (chunked, recomputed in backward)
    base = resolve_model(MODEL, default_home())
    tokenizer = load_tokenizer(base.path)
    tokenizer.chat_template = base.family.chat.jinja()
    rows, _ = tokenize_conversations(read_prepared(work / "data" / "train.jsonl"), tokenizer, base.family, CUTOFF,
                                     "train.jsonl")
    rows = random.Random(SEED).sample(rows, min(n_examples, len(rows)))
    if packing:
        batches, collate = pack_examples(rows, CUTOFF), PackedCollator(tokenizer.pad_token_id)
    else:
        batches, collate = rows, RightPadCollator(tokenizer.pad_token_id)
    model = wrapping.build_peft_model(config, base, tokenizer, "fp32")
    if packing and not per_example:
        model.get_base_model().set_attn_implementation("sdpa")  # the block-diagonal mask
    if config.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    timed_examples = timed_tokens = timed_supervised = 0
    seconds = 0.0
    for i in range(0, len(batches), MICRO_BATCH):
        batch = collate(batches[i:i + MICRO_BATCH])
        examples = batch.pop("counts").examples
        if packing and not per_example:  # transformers' mask from the positions, not the collator's segments
            batch["segments"] = None
        start = time.perf_counter()
        model(**batch).loss.backward()
        if i:  # the first micro-batch warms up
            seconds += time.perf_counter() - start
            timed_examples += examples
            timed_tokens += batch["input_ids"].numel()
            timed_supervised += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return {"variant": variant, "examples": timed_examples, "tokens_processed": timed_tokens,
            "supervised_tokens": timed_supervised, "seconds": round(seconds, 2),
            "samples_per_second": round(timed_examples / seconds, 3),
            "supervised_tokens_per_second": round(timed_supervised / seconds, 1),
            "peak_memory_mib": round(peak_rss_bytes() / 2**20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=96, help="training examples measured (default 96)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of %(default)s")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-train-ablation")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work.resolve()
    if args.child:
        print(json.dumps(child(args.child, work, args.examples)))
        return
    prepare_split(work, DEFAULT_DATA)
    results = []
    for variant in args.variants.split(","):
        log(f"{variant} ...")
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--work", str(work),
                              "--examples", str(args.examples)], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| variant | examples timed | s | samples/s | supervised tok/s | processed tok/s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['examples']} | {r['seconds']} | {r['samples_per_second']} | "
              f"{r['supervised_tokens_per_second']} | {r['tokens_processed'] / r['seconds']:.1f} | "
              f"{r['peak_memory_mib']} |")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
