"""`gemmaforge export vllm`: what `vllm serve` needs, and the command, for users who outgrow one machine.

The merged folder serves as is (its tokenizer carries the training chat template and its generation
config stops at the end-of-turn marker). With --adapter, vLLM serves the base with the PEFT adapter
(several fine-tunes on one base), after checking what vLLM's LoRA support accepts.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from gemmaforge.errors import UserError
from gemmaforge.export.adapter_limits import require_plain_lora
from gemmaforge.runs import RunDir, atomic_write_text

# vLLM accepts these values of --max-lora-rank (vllm.config.lora.LoRAConfig)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_command(run: RunDir, name: str, base_reference: str, max_model_len: int, adapter: bool) -> list[str]:
    if not adapter:
        merged = run.require(run.merged_dir / "config.json", "merge").parent
        return ["vllm", "serve", str(merged.resolve()), "--served-model-name", name,
                "--max-model-len", str(max_model_len)]
    adapter_dir = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    rank = vllm_lora_rank(config, adapter_dir)
    return ["vllm", "serve", base_reference, "--served-model-name", f"{name}-base", "--max-model-len",
            str(max_model_len), "--enable-lora", "--max-lora-rank", str(rank),
            "--lora-modules", f"{name}={adapter_dir.resolve()}"]


def vllm_lora_rank(config: dict, adapter_dir: Path) -> int:
    """The --max-lora-rank that admits this adapter, or a UserError naming what vLLM cannot serve."""
    merge_instead = f"serve the merged model instead (`gemmaforge export vllm {adapter_dir.parent}` without --adapter)"
    require_plain_lora(config, adapter_dir, dora="; vLLM serves plain LoRA only",
                       other="; vLLM loads LoRA weights only", instead=merge_instead)
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    allowed = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not allowed:
        raise UserError(f"{adapter_dir}: rank {rank} is above vLLM's largest --max-lora-rank "
                        f"({VLLM_LORA_RANKS[-1]}): {merge_instead}")
    return allowed[0]


def write_vllm_script(run: RunDir, command: list[str]) -> Path:
    path = run.root / "vllm" / "serve.sh"
    atomic_write_text(path, "#!/bin/sh\n"
                      "# written by gemmaforge export vllm; needs `pip install vllm` on a GPU machine\n"
                      f"exec {shlex.join(command)} \"$@\"\n")
    path.chmod(0o755)
    return path
