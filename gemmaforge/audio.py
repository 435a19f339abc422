"""Sound in a prompt, as Gemma 4's own processor puts it there (E2B and E4B: their Conformer audio tower).

The chat rendering writes the official template's marker for an audio part (`ChatFormat.audio`, `<|audio|>`);
`AudioPrompt.expand_rendered` turns each into `<|audio>` + n x `<|audio|>` + `<audio|>` (no margin), n the clip's
own soft-token count: its mel frames (20 ms windows every 10 ms, the first centred at 0) through the tower's two
stride-2 convolutions, at most `audio_seq_length` (Gemma4Processor's arithmetic, `_compute_audio_num_tokens`).
The features are the checkpoint's feature extractor's (`input_features`, `input_features_mask`); audio tokens are
marked 3 in `mm_token_type_ids` and attend causally, as text does.
Only the feature extractor is loaded (Gemma 4's full processor also needs torchvision for video).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gemmaforge.media import AUDIO, check_placeholders, expand_placeholders
from gemmaforge.model_spec import ModelSpec

_AUDIO_TOKEN_TYPE = 3  # ProcessorMixin.create_mm_token_type_ids: 1 image, 2 video, 3 audio
_CONV_LAYERS = 2  # Gemma4AudioSubSampleConvProjection: two Conv2d, kernel 3, stride 2, padding 1 along time
_ARCHITECTURES = {"Gemma4ForConditionalGeneration"}  # Gemma 4 12B Unified (raw waveform frames) is not here yet
_EXTRACTOR_MAX_SAMPLES = 480_000  # Gemma4AudioFeatureExtractor.__call__'s max_length: it cuts longer clips
# the longest clip Gemma 4's audio encoder takes at once (30 s at 16 kHz): where no AudioPrompt says (llama.cpp)
LONGEST_CLIP_SECONDS = 30.0
GEMMA4_AUDIO_RATE = 16_000  # Gemma4AudioFeatureExtractor's sampling_rate, and llama.cpp's for its audio encoder


class AudioPrompt:
    """A checkpoint's audio markers expanded, and its audio inputs, for one prompt."""

    def __init__(self, spec: ModelSpec, extractor: Any, tokenizer: Any, max_tokens: int, ms_per_token: int):
        assert spec.family.chat.audio is not None  # load() checks the family takes audio
        self.placeholder: str = spec.family.chat.audio
        self._extractor = extractor
        self._boa, self._eoa, self._soft = tokenizer.boa_token, tokenizer.eoa_token, tokenizer.audio_token
        self.audio_token_id: int = tokenizer.audio_token_id
        self.rate: int = extractor.sampling_rate
        self.max_tokens = max_tokens
        # the longest clip whose every frame reaches the tower: the feature extractor's call cuts at 480,000 samples
        # (30 s at 16 kHz), as many as max_tokens x ms_per_token
        self.max_seconds = min(_EXTRACTOR_MAX_SAMPLES / self.rate, max_tokens * ms_per_token / 1000)

    @classmethod
    def load(cls, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> AudioPrompt:
        """ValueError saying why when the checkpoint cannot take sound here."""
        if "audio" not in spec.towers:
            raise ValueError(f"{model_dir.name} has no audio tower (only Gemma 4 E2B and E4B hear)")
        if spec.architecture.name not in _ARCHITECTURES or spec.family.chat.audio is None:
            raise ValueError(f"audio for {spec.architecture.kind} is not supported yet")
        from transformers import AutoFeatureExtractor

        try:
            extractor = AutoFeatureExtractor.from_pretrained(model_dir)
        except (ImportError, OSError, ValueError) as e:
            raise ValueError(f"its audio feature extractor does not load here: {e}") from None
        settings = model_dir / "processor_config.json"
        found = json.loads(settings.read_text(encoding="utf-8")) if settings.is_file() else {}
        # Gemma4Processor's defaults where processor_config.json does not say
        return cls(spec, extractor, tokenizer, found.get("audio_seq_length", 750), found.get("audio_ms_per_token", 40))

    @classmethod
    def of(cls, model_dir: Path, spec: ModelSpec, tokenizer: Any) -> tuple[AudioPrompt | None, str]:
        """The checkpoint's AudioPrompt, or None and why it takes no sound here."""
        try:
            return cls.load(model_dir, spec, tokenizer), ""
        except ValueError as e:
            return None, str(e)

    def soft_token_count(self, samples: int) -> int:
        """The soft tokens of a clip of `samples` samples at `rate`: its mel frames through the tower's
        convolutions, at most max_tokens (0 for a clip shorter than one frame's half)."""
        e = self._extractor
        frames = (samples + e.frame_length // 2 - (e.frame_length + 1)) // e.hop_length + 1
        if frames <= 0:
            return 0
        for _ in range(_CONV_LAYERS):
            frames = (frames + 2 * 1 - 3) // 2 + 1
        return min(frames, self.max_tokens)

    def shortest_samples(self) -> int:
        """The fewest samples that give one soft token."""
        e = self._extractor
        return e.frame_length + 1 - e.frame_length // 2

    def features(self, clips: list[Any]) -> dict[str, Any]:
        """The feature extractor's model inputs for `clips` (float32 mono at `rate`), padded to the longest, as the
        full processor passes them on."""
        out = self._extractor(list(clips), return_tensors="pt")
        return {"input_features": out["input_features"], "input_features_mask": out["input_features_mask"]}

    def expand(self, prompt: str, clips: list[Any]) -> tuple[str, dict[str, Any]]:
        """`prompt` with each marker replaced by its clip's tokens, and the clips' model inputs (without the token
        types, which depend on the ids: see token_types). ValueError when the counts differ."""
        check_placeholders(prompt, self.placeholder, clips, AUDIO)
        text, _ = self.expand_rendered(prompt, [], [self.soft_token_count(len(clip)) for clip in clips])
        return text, self.features(clips)

    def expand_rendered(self, text: str, spans: list[tuple[int, int]], counts: list[int]
                        ) -> tuple[str, list[tuple[int, int]]]:
        """A rendering with each marker replaced by its clip's tokens (`counts` soft tokens each), and its character
        spans moved to where their text now is."""
        blocks = [f"{self._boa}{self._soft * int(count)}{self._eoa}" for count in counts]
        return expand_placeholders(text, spans, self.placeholder, blocks, AUDIO)

    def most_prompt_tokens(self, clips: int) -> int:
        """At most how many tokens `clips` clips add to a prompt: the longest clip's soft tokens and its two
        frame tokens each."""
        return clips * (self.max_tokens + 2)

    def audio_token_ids(self, tokenizer: Any) -> set[int]:
        """The ids a clip's block is made of (never supervised)."""
        return {tokenizer.convert_tokens_to_ids(t) for t in (self._boa, self._eoa, self._soft)}

    def token_types(self, ids: Any) -> dict[str, Any]:
        """The forward's token-type argument for `ids` (B, T): 3 on audio soft tokens."""
        return {"mm_token_type_ids": (ids == self.audio_token_id).long() * _AUDIO_TOKEN_TYPE}
