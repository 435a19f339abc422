"""What an adapter must be for a runtime to apply it unmerged (llama.cpp's GGUF adapters, vLLM's LoRA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError


def require_plain_lora(config: dict[str, Any], adapter_dir: Path, *, dora: str, other: str, instead: str) -> None:
    """Plain LoRA only: no DoRA, no fully trained modules, no trained token rows. `dora` and `other` end the
    sentence saying why the runtime cannot take them; `instead` is what to do."""
    if config.get("use_dora"):
        raise UserError(f"{adapter_dir} is a DoRA adapter{dora}: {instead}")
    if config.get("target_parameters"):
        raise UserError(f"{adapter_dir} adapts expert weights ({', '.join(config['target_parameters'])}){other}: "
                        f"{instead}")
    for tower in ("vision", "audio"):
        if f"{tower}_tower" in str(config.get("target_modules") or ""):
            raise UserError(f"{adapter_dir} adapts the {tower} tower (lora.freeze_{tower}_tower: false){other}: "
                            f"{instead}")
    if config.get("modules_to_save"):
        raise UserError(f"{adapter_dir} trains whole modules ({', '.join(config['modules_to_save'])}){other}: "
                        f"{instead}")
    if config.get("trainable_token_indices"):
        raise UserError(f"{adapter_dir} trains the chat-marker embedding rows (lora.train_template_tokens){other}: "
                        f"{instead}, or train with lora.train_template_tokens: false")
