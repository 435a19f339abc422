"""One intake for the media a prompt or a record carries, with the same rules wherever it arrives: a dataset at
prepare time, a training batch, an evaluation case, a request to the server.

Media travel as files or as base64 (a data URI `data:<type>;base64,<payload>`, or Ollama's bare base64); line breaks
inside base64 are skipped (as Go's decoder does), anything else that is not base64 is refused.

Pictures: any format PIL reads, at most MAX_PIXELS (one picture, and a request's pictures together), checked from
the header before any pixel is decoded; pixel modes the processors' RGB conversion keeps faithfully (32-bit integer
and float images would be clipped to 8 bits without a word); turned upright by their EXIF orientation, as a camera
or phone meant them to be seen (and as transformers' `load_image` does); transparency laid on white, as the
processors' `convert_to_rgb` does. A picture's size is its upright size: Gemma 4's token count follows from it.

Sound: any file libsndfile decodes (WAV, FLAC, OGG, MP3, ...), mixed down to one channel (the mean of the channels, as
transformers' `load_audio` and librosa do) and resampled by libsoxr to the rate the model's feature extractor reads;
an empty clip, or one longer than the model takes (its feature extractor would cut it without a word), is refused.
A clip's length in samples at that rate is its size: Gemma 4's token count follows from it.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaforge.errors import UserError

if TYPE_CHECKING:
    import numpy as np

MAX_PIXELS = 64_000_000  # an 8000x8000 photo; PIL's own decompression-bomb check is at 89M
PICTURE_MODES = {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"}
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def base64_bytes(text: Any, where: str, kind: str = "image") -> bytes:
    """The bytes of base64 `text`, bare or as a data URI."""
    if not isinstance(text, str):
        raise UserError(f"{where}: expected a base64-encoded {kind}")
    if text.startswith("data:"):
        return data_uri_bytes(text, where)
    return _decoded(text, where)


def data_uri_bytes(uri: str, where: str) -> bytes:
    """The payload of a base64 data URI (`data:image/png;base64,...`)."""
    head, comma, payload = uri.partition(",")
    if not (comma and head.startswith("data:") and head.endswith(";base64")):
        raise UserError(f"{where}: expected a base64 data URI (data:image/png;base64,...)")
    return _decoded(payload, where)


def _decoded(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.replace("\r", "").replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}: not valid base64") from None


def _opened(data: bytes, where: str, max_pixels: int) -> Any:
    """The picture's header read and checked: readable, within `max_pixels`, a faithful pixel mode."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # the header only: the size is known before any pixel is decoded
    except UnidentifiedImageError:
        raise UserError(f"{where}: not a picture PIL can read (no image format it knows)") from None
    except Exception as e:  # noqa: BLE001  (PIL raises many kinds for many formats)
        raise UserError(f"{where}: not a picture PIL can read ({e})") from None
    if image.width * image.height > max_pixels:
        whole = f" (what is left of the {MAX_PIXELS:,} a request's pictures may hold together)" \
            if max_pixels < MAX_PIXELS else ""
        raise UserError(f"{where}: the picture is {image.width}x{image.height} pixels, more than the {max_pixels:,} "
                        f"accepted{whole}; scale it down (the processors resize every picture to under a megapixel)")
    if image.mode not in PICTURE_MODES:
        raise UserError(f"{where}: the picture has pixel mode {image.mode}, which the image processors would clip "
                        "to 8-bit RGB; save it as RGB (or grayscale L)")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{where}: the picture does not decode ({e})") from None
    return image


def upright_size(image: Any) -> tuple[int, int]:
    """(width, height) of a PIL image once turned by its EXIF orientation (from the header alone)."""
    orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    return (image.height, image.width) if orientation in _TRANSPOSED else (image.width, image.height)


def check_picture(data: bytes, where: str) -> tuple[int, int]:
    """The upright (width, height) of the picture in `data`, decoded once to prove it reads."""
    return upright_size(_opened(data, where, MAX_PIXELS))


def decode_picture(data: bytes, where: str, max_pixels: int = MAX_PIXELS) -> Any:
    """The picture in `data` as an upright RGB PIL image, transparency laid on white."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(_opened(data, where, max_pixels))
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def picture_sizes(paths: list[Path] | list[str]) -> list[tuple[int, int]]:
    """The upright (width, height) of each picture file, from its header."""
    from PIL import Image

    sizes = []
    for path in paths:
        with Image.open(path) as image:
            sizes.append(upright_size(image))
    return sizes


def decode_sound(data: bytes, where: str, rate: int, max_seconds: float) -> np.ndarray:
    """The clip in `data` as float32 mono samples at `rate` Hz: at least one sample, at most `max_seconds`."""
    import numpy as np
    import soundfile

    try:
        samples, source_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001  (libsndfile's errors and soundfile's own for unknown formats)
        # soundfile says "Error opening <the BytesIO's repr>: <libsndfile's reason>": the reason alone
        reason = str(e).strip().rpartition(">: ")[2] or type(e).__name__
        raise UserError(f"{where}: not a sound libsndfile can read ({reason})") from None
    if not samples.size:
        raise UserError(f"{where}: the clip is empty (no samples)")
    seconds = len(samples) / source_rate
    if seconds > max_seconds:
        raise UserError(f"{where}: the clip lasts {seconds:.1f} s, more than the {max_seconds:g} s the model's audio "
                        "encoder takes in one clip; cut it into shorter clips")
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if source_rate != rate:
        import soxr

        mono = soxr.resample(mono, source_rate, rate, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)
