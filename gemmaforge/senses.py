"""What media a checkpoint takes, and how: its ImagePrompt and AudioPrompt, or why it takes none of a kind; and a
rendered conversation with every picture's and clip's tokens in place, as the checkpoint's processor writes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.audio import AudioPrompt
from gemmaforge.chat.conversation import Rendered
from gemmaforge.model_spec import ModelSpec
from gemmaforge.vision import ImagePrompt


@dataclass(frozen=True)
class Senses:
    vision: ImagePrompt | None = None
    no_vision: str = "no image processor was given"  # why vision is None
    audio: AudioPrompt | None = None
    no_audio: str = "no audio feature extractor was given"

    @classmethod
    def of(cls, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> Senses:
        return cls(*ImagePrompt.of(model_dir, spec, tokenizer), *AudioPrompt.of(model_dir, spec, tokenizer))

    def expand(self, rendered: Rendered, picture_sizes: list[tuple[int, int]], clip_samples: list[int]) -> Rendered:
        """`rendered` with each picture's marker replaced by its tokens ((width, height) each), then each clip's
        (its length in samples at the feature extractor's rate); the supervised spans moved with the text."""
        text, spans = rendered.text, rendered.supervised
        if picture_sizes:
            assert self.vision is not None  # the intake refuses pictures for a model without an ImagePrompt
            text, spans = self.vision.expand_rendered(text, spans, self.vision.soft_token_counts(picture_sizes))
        if clip_samples:
            assert self.audio is not None
            counts = [self.audio.soft_token_count(n) for n in clip_samples]
            text, spans = self.audio.expand_rendered(text, spans, counts)
        return Rendered(text, spans)

    def media_token_ids(self, tokenizer: Any) -> set[int]:
        """The ids a picture's or a clip's block is made of (never supervised)."""
        return ((self.vision.image_token_ids(tokenizer) if self.vision else set())
                | (self.audio.audio_token_ids(tokenizer) if self.audio else set()))


NO_SENSES = Senses()  # text only
