"""The memory planner per rank for the real large Gemma checkpoints: which GPUs, how many, and which strategy.

    python benchmarks/distributed_plan.py [--cutoff 2048] [--batch 1] [--only "Gemma 3 27B"]

Each checkpoint is its real config.json (sizes below, from the sources named in tests/checkpoint_kinds.py) written
beside the embedded model's tokenizer; nothing is downloaded and no weight is allocated: the planner builds the
model on the meta device and traces its activations on a two-layer probe at the real width. The config is LoRA
r 16 on the default targets with the chat markers' rows, bf16, gradient checkpointing on, `--batch` rows of
`--cutoff` tokens per rank. For each card the table gives the peak per rank for each strategy at 1, 2, 4 and 8
ranks (`gemmaforge plan CONFIG --gpu-memory SIZE --nproc N --strategy S` prints the same figures).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CARDS = {"24 GiB (RX 7900 XTX, RTX 4090)": 24 * 2**30, "80 GiB (MI250X die, A100/H100 80G)": 80 * 2**30}
RANKS = (1, 2, 4, 8)


def gemma3_27b():
    """google/gemma-3-27b-it: text 5376 wide, intermediate 21504, 62 layers, 32 heads / 16 KV heads of 128,
    query_pre_attn_scalar 168, vocab 262208; SigLIP 1152 wide, 27 layers, patch 14, image 896."""
    from transformers import Gemma3Config

    return Gemma3Config(
        architectures=["Gemma3ForConditionalGeneration"], boi_token_index=255999, eoi_token_index=256000,
        eos_token_id=[1, 106], image_token_index=262144, mm_tokens_per_image=256,
        text_config=dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                         num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}, rope_theta=1_000_000.0,
                         rope_local_base_freq=10_000.0, sliding_window=1024, vocab_size=262208),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14,
                           vision_use_head=False),
    )


def _gemma4(text: dict):
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(vocab_size=262144, vocab_size_per_layer_input=262144, head_dim=256, global_head_dim=512,
                            sliding_window=1024, final_logit_softcapping=30.0, tie_word_embeddings=True,
                            use_bidirectional_attention="vision", hidden_size_per_layer_input=0,
                            num_kv_shared_layers=0, use_double_wide_mlp=False, max_position_embeddings=262144,
                            attention_k_eq_v=True, pad_token_id=0, bos_token_id=2, eos_token_id=1, **text)
    vision = Gemma4VisionConfig(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, head_dim=72,
                                patch_size=16, pooling_kernel_size=3, standardize=True)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, eos_token_id=[1, 106],
                        image_token_id=258880, boi_token_id=255999, eoi_token_id=258882, tie_word_embeddings=True)


def gemma4_31b():
    """google/gemma-4-31B-it: 5376 wide, intermediate 21504, 60 layers (5 sliding : 1 full), 32 heads / 16 KV
    heads, 4 global KV heads; vision large."""
    layers = (["sliding_attention"] * 5 + ["full_attention"]) * 10
    return _gemma4(dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, layer_types=layers,
                        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                        enable_moe_block=False))


def gemma4_26b_a4b():
    """google/gemma-4-26B-A4B-it: 2816 wide, dense MLP 2112 beside 128 experts of 704 (top 8), 30 layers (5:1),
    16 heads / 8 KV heads, 2 global KV heads; vision large. LoRA on the attention and dense MLP (not the experts)."""
    layers = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    return _gemma4(dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, layer_types=layers,
                        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704))


CHECKPOINTS = {"Gemma 3 27B": gemma3_27b, "Gemma 4 31B": gemma4_31b, "Gemma 4 26B-A4B": gemma4_26b_a4b}


def write_checkpoint(name: str, target: Path, tokenizer_dir: Path) -> Path:
    target.mkdir(parents=True)
    CHECKPOINTS[name]().save_pretrained(target)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, target / file)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--only", choices=CHECKPOINTS, action="append", help="these checkpoints only")
    args = parser.parse_args()

    from gemmaforge.config import RunConfig
    from gemmaforge.models import EMBEDDED_NAME, default_home, resolve_model
    from gemmaforge.train.memory_plan import Planner, this_device
    from gemmaforge.train.sharding import STRATEGIES
    from gemmaforge.units import gib

    tokenizer_dir = resolve_model(EMBEDDED_NAME, default_home()).path
    print(f"LoRA r 16, bf16, gradient checkpointing, {args.batch} x {args.cutoff} tokens per rank; peak per rank\n")
    with tempfile.TemporaryDirectory() as work:
        for name in args.only or CHECKPOINTS:
            folder = write_checkpoint(name, Path(work) / name.replace(" ", "-"), tokenizer_dir)
            base = resolve_model(str(folder), Path(work) / "home")
            config = RunConfig.model_validate({
                "output_dir": str(Path(work) / "run"), "model": {"name_or_path": str(folder)},
                "data": {"path": "unused.json"},
                "lora": {"r": 16, "lora_alpha": 32},
                "train": {"per_device_train_batch_size": args.batch, "cutoff_len": args.cutoff,
                          "gradient_checkpointing": True, "precision": "bf16"},
            })
            planner = Planner(config, base, "bf16", this_device(max(CARDS.values())))  # cards differ in size only
            peaks = {(strategy, ranks): sum(planner.parts(args.batch, args.cutoff, True, ranks, strategy).values())
                     for strategy in STRATEGIES for ranks in RANKS}
            for card, size in CARDS.items():
                print(f"### {name} on {card}\n")
                print("| strategy | " + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in RANKS) + " |")
                print("|---|" + "---|" * len(RANKS))
                for strategy in STRATEGIES:
                    cells = [f"{gib(peaks[strategy, n])}{' fits' if peaks[strategy, n] <= size else ''}" for n in RANKS]
                    print(f"| {strategy} | " + " | ".join(cells) + " |")
                print()
            del planner


if __name__ == "__main__":
    main()
