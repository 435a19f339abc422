"""Generated sound for the audio tests: a pure tone and its bytes in a container libsndfile writes."""

from __future__ import annotations

import io

import numpy as np

RATE = 16_000  # Gemma 4's feature extractor rate


def tone(seconds: float, hz: float = 440.0, rate: int = RATE, channels: int = 1, loudness: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (loudness * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def encoded(samples: np.ndarray, rate: int = RATE, fmt: str = "WAV") -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt)
    return out.getvalue()
