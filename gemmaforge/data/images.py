"""A dataset's images, found and checked once, at prepare time.

Prepared records reference their images by absolute path; nothing is copied into the JSON Lines. An image that
comes inside the data (a data URI, the bytes of a Parquet image) is written once into the data folder's `images/`,
named by its hash. Remote URLs are refused: nothing is downloaded. Each image is opened and decoded here (by the
intake serve and eval use too: gemmaforge/intake.py), so a training run never meets a missing, unreadable or
oversized picture hours in.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from gemmaforge.chat.conversation import Message
from gemmaforge.data.formats import IMAGE_PLACEHOLDER, Schema, record_images
from gemmaforge.errors import UserError
from gemmaforge.intake import check_picture, data_uri_bytes
from gemmaforge.vision import ImagePrompt


@dataclass(frozen=True)
class CheckedImage:
    path: Path
    sha256: str  # of the file's bytes: records that ask the same question of other pictures are not duplicates
    width: int
    height: int


class ImageFinder:
    """Finds each image a record names, relative to its dataset's folder (then the working directory), checks that
    it is a picture training can read, and remembers what it found."""

    def __init__(self, store: Path):
        self.store = store  # where embedded images are written
        self.seen: dict[str, CheckedImage] = {}  # by resolved path
        self.references = 0

    def find(self, ref: Any, folder: Path, where: str) -> CheckedImage:
        self.references += 1
        if isinstance(ref, dict):  # a Parquet / datasets Image: {"bytes": ..., "path": ...}
            if ref.get("bytes"):
                return self._embedded(bytes(ref["bytes"]), where)
            ref = ref.get("path")
        if not isinstance(ref, str) or not ref.strip():
            raise UserError(f"{where}: an image entry must be a path or data URI, got {ref!r}")
        if ref.startswith("data:"):
            return self._embedded(data_uri_bytes(ref, where), where)
        scheme = urlparse(ref).scheme
        if scheme in ("http", "https", "ftp", "s3", "gs"):
            raise UserError(f"{where}: {ref}: remote images are not downloaded; download them once and name the "
                            "local files")
        path = Path(unquote(urlparse(ref).path)) if scheme == "file" else Path(ref).expanduser()
        candidates = [path] if path.is_absolute() else [folder / path, Path.cwd() / path]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            tried = " or ".join(str(p) for p in dict.fromkeys(candidates))
            raise UserError(f"{where}: image {ref} not found (looked for {tried})")
        found = found.resolve()
        if str(found) not in self.seen:
            self.seen[str(found)] = _checked(found, found.read_bytes(), where)
        return self.seen[str(found)]

    def in_record(self, record: Any, messages: list[Message], schema: Schema, where: str, folder: Path,
                  vision: tuple[ImagePrompt | None, str], marker: str) -> list[CheckedImage]:
        """The record's images, found and checked, and the model's own image `marker` put where its messages hold
        the dataset placeholder (in place). `vision` is the model's ImagePrompt, or None and why it takes none."""
        refs = record_images(record, messages, schema, where)
        if not refs:
            return []
        prompt, reason = vision
        if prompt is None:
            raise UserError(f"{where}: the record has images, but the model takes none ({reason})")
        images = [self.find(ref, folder, f"{where}: image {i + 1}") for i, ref in enumerate(refs)]
        for message in messages:
            if marker in message["content"]:
                raise UserError(f"{where}: the text holds {marker}, the model's own image marker; write "
                                f"{IMAGE_PLACEHOLDER} where an image goes")
            message["content"] = message["content"].replace(IMAGE_PLACEHOLDER, marker)
        return images

    def _embedded(self, data: bytes, where: str) -> CheckedImage:
        digest = hashlib.sha256(data).hexdigest()
        checked = _checked(Path(), data, where)
        path = self.store / f"{digest}.{_suffix(data)}"
        if not path.is_file():
            self.store.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self.seen[str(path)] = CheckedImage(path, digest, checked.width, checked.height)
        return self.seen[str(path)]


def _checked(path: Path, data: bytes, where: str) -> CheckedImage:
    width, height = check_picture(data, f"{where}: {f'image {path}' if path.parts else 'the embedded image'}")
    return CheckedImage(path, hashlib.sha256(data).hexdigest(), width, height)


def _suffix(data: bytes) -> str:
    from PIL import Image

    return (Image.open(io.BytesIO(data)).format or "img").lower()
