"""Images in a prompt, as Gemma's own processors put them there.

The chat renderings write one placeholder per image where the image goes (`ChatFormat.image`: what the
official chat template writes for an image part); `ImagePrompt.expand` turns each placeholder into the image's
soft tokens and computes the model's image inputs with the checkpoint's image processor:
- Gemma 3 (Gemma3Processor): `<start_of_image>` -> "\\n\\n<start_of_image>" + image_seq_length x
  `<image_soft_token>` + "<end_of_image>\\n\\n"; `token_type_ids` 1 on the soft tokens (attended bidirectionally).
- Gemma 4 (Gemma4Processor) and Gemma 4 12B Unified (Gemma4UnifiedProcessor): `<|image|>` -> `<|image>` + n x
  `<|image|>` + `<image|>`, n the image's own soft-token count (its aspect ratio and max_soft_tokens);
  `mm_token_type_ids` 1 on the soft tokens.
Only the image processor is loaded (Gemma 4's full processor also needs torchvision for video); Unified's, which
has only a torchvision backend, is computed by gemmaforge/vision_unified.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.media import IMAGE, check_placeholders, expand_placeholders
from gemmaforge.model_spec import ModelSpec
from gemmaforge.vision_unified import UnifiedImageProcessor


@dataclass(frozen=True)
class _Expansion:
    token_types: str  # the forward's argument that marks image tokens
    per_image: str | None  # the image processor's output with each image's soft-token count; None: fixed
    settings: tuple[tuple[str, Any], ...] = ()  # what the full processor passes its image processor


_EXPANSIONS = {  # by architecture
    "Gemma3ForConditionalGeneration": _Expansion("token_type_ids", None, (("do_pan_and_scan", False),)),
    "Gemma4ForConditionalGeneration": _Expansion("mm_token_type_ids", "num_soft_tokens_per_image"),
    "Gemma4UnifiedForConditionalGeneration": _Expansion("mm_token_type_ids", "num_soft_tokens_per_image"),
}


class ImagePrompt:
    """A multimodal checkpoint's image placeholders expanded, and its image inputs, for one prompt."""

    def __init__(self, spec: ModelSpec, processor: Any, tokenizer: Any, fixed_count: int):
        self.placeholder, self._margin = spec.family.chat.image, spec.family.chat.image_margin
        self._expansion = _EXPANSIONS[spec.architecture.name]
        self._processor, self._fixed_count = processor, fixed_count
        self._boi, self._eoi, self._soft = tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token
        self.image_token_id = tokenizer.image_token_id

    @classmethod
    def load(cls, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> ImagePrompt:
        """ValueError saying why when the checkpoint cannot take images here."""
        if "vision" not in spec.towers:
            raise ValueError(f"{model_dir.name} has no vision tower (a text-only checkpoint)")
        if spec.architecture.name not in _EXPANSIONS:
            raise ValueError(f"images for {spec.architecture.kind} are not supported yet")
        from transformers import AutoImageProcessor

        try:
            processor = UnifiedImageProcessor.load(model_dir) \
                if spec.architecture.name == "Gemma4UnifiedForConditionalGeneration" \
                else AutoImageProcessor.from_pretrained(model_dir)
        except (ImportError, OSError, ValueError) as e:
            raise ValueError(f"its image processor does not load here: {e}") from None
        settings = model_dir / "processor_config.json"
        count = json.loads(settings.read_text(encoding="utf-8")).get("image_seq_length", 256) \
            if settings.is_file() else 256  # Gemma3Processor's default
        return cls(spec, processor, tokenizer, count)

    @classmethod
    def of(cls, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> tuple[ImagePrompt | None, str]:
        """The checkpoint's ImagePrompt, or None and why it takes no images here."""
        try:
            return cls.load(model_dir, spec, tokenizer), ""
        except ValueError as e:
            return None, str(e)

    def expand(self, prompt: str, images: list[Any]) -> tuple[str, dict[str, Any]]:
        """`prompt` with each placeholder replaced by its image's tokens, and the images' model inputs (without
        the token types, which depend on the ids: see token_types). ValueError when the counts differ."""
        check_placeholders(prompt, self.placeholder, images, IMAGE)
        inputs = self.pixel_inputs(images)
        text, _ = self.expand_rendered(prompt, [], self.soft_token_counts([im.size for im in images]))
        return text, inputs

    def pixel_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The image processor's model inputs for `images` (PIL, RGB), as the full processor passes them on."""
        e = self._expansion
        inputs = dict(self._processor(images=images, return_tensors="pt", **dict(e.settings)))
        if e.per_image:
            inputs.pop(e.per_image)
        inputs.pop("num_crops", None)  # Gemma 3's pan-and-scan crops: off, as Gemma3Processor sets it
        return inputs

    def soft_token_counts(self, sizes: list[tuple[int, int]]) -> list[int]:
        """Each image's soft-token count from its (width, height), as the image processor counts them: Gemma 3 a
        fixed image_seq_length; Gemma 4 the patches of the aspect-preserving resize within max_soft_tokens,
        pooled (its image processor's own size function)."""
        if not self._expansion.per_image:
            return [self._fixed_count] * len(sizes)
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        p, k = self._processor.patch_size, self._processor.pooling_kernel_size
        counts = []
        for width, height in sizes:
            h, w = get_aspect_ratio_preserving_size(height, width, p, self._processor.max_soft_tokens * k * k, k) \
                if getattr(self._processor, "do_resize", True) else (height, width)
            counts.append((h // p) * (w // p) // (k * k))
        return counts

    def expand_rendered(self, text: str, spans: list[tuple[int, int]], counts: list[int]
                        ) -> tuple[str, list[tuple[int, int]]]:
        """A rendering with each placeholder replaced by its image's tokens (`counts` soft tokens each), and its
        character spans moved to where their text now is."""
        if self._soft != self.placeholder and self._soft in text:  # its features would not line up with them
            raise ValueError(f"the prompt holds image tokens ({self._soft}) of its own")
        blocks = [f"{self._margin}{self._boi}{self._soft * int(count)}{self._eoi}{self._margin}" for count in counts]
        return expand_placeholders(text, spans, self.placeholder, blocks, IMAGE)

    def prompt_tokens(self, sizes: list[tuple[int, int]], tokenizer: Any) -> int:
        """At most how many tokens images of these (width, height) add to a prompt: their soft tokens, and each
        one's frame (begin, end and margins) tokenized alone; beside text a margin can merge with a newline."""
        frame = f"{self._margin}{self._boi}{self._eoi}{self._margin}"
        return sum(self.soft_token_counts(sizes)) + len(sizes) * len(tokenizer.encode(frame, add_special_tokens=False))

    def image_token_ids(self, tokenizer: Any) -> set[int]:
        """The ids an image's block is made of (never supervised)."""
        return {tokenizer.convert_tokens_to_ids(t) for t in (self._boi, self._eoi, self._soft)}

    def token_types(self, ids: Any) -> dict[str, Any]:
        """The forward's token-type argument for `ids` (B, T): 1 on image soft tokens."""
        return {self._expansion.token_types: (ids == self.image_token_id).long()}
