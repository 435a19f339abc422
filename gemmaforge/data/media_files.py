"""A dataset's media (pictures, sound), found and checked once, at prepare time.

Prepared records reference their media by absolute path; nothing is copied into the JSON Lines. A medium that comes
inside the data (a data URI, the bytes of a Parquet image, an OpenAI `input_audio` part) is written once into the
data folder's `images/` or `audios/`, named by its hash. Remote URLs are refused: nothing is downloaded. Each file is
opened and decoded here (by the intake serve and eval use too: gemmaforge/intake.py), so a training run never meets
a missing, unreadable or oversized picture, or a clip that does not decode or is too long, hours in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlparse

from gemmaforge.audio import GEMMA4_AUDIO_RATE, LONGEST_CLIP_SECONDS, AudioPrompt
from gemmaforge.chat.conversation import Message
from gemmaforge.data.formats import Schema, record_media
from gemmaforge.errors import UserError
from gemmaforge.intake import check_picture, data_uri_bytes, decode_sound
from gemmaforge.media import AUDIO, IMAGE, MediaKind


@dataclass(frozen=True)
class CheckedImage:
    path: Path
    sha256: str  # of the file's bytes: records that ask the same question of other pictures are not duplicates
    width: int
    height: int


@dataclass(frozen=True)
class CheckedClip:
    path: Path
    sha256: str
    samples: int  # at the model's audio rate, once decoded, mixed down and resampled


Checked = TypeVar("Checked", CheckedImage, CheckedClip)


class MediaFinder(Generic[Checked]):
    """Finds each medium of one kind a record names, relative to its dataset's folder (then the working directory),
    checks that training can read it, and remembers what it found."""

    kind: MediaKind

    def __init__(self, store: Path):
        self.store = store  # where embedded media are written
        self.seen: dict[str, Checked] = {}  # by resolved path
        self.references = 0

    def check(self, data: bytes, where: str) -> Checked:
        """The medium in `data` checked (its path left empty)."""
        raise NotImplementedError

    def suffix(self, data: bytes) -> str:
        """The file suffix an embedded medium is written with."""
        raise NotImplementedError

    def find(self, ref: Any, folder: Path, where: str) -> Checked:
        self.references += 1
        name = self.kind.name
        if isinstance(ref, dict):  # a Parquet / datasets Image or Audio: {"bytes": ..., "path": ...}
            if ref.get("bytes"):
                return self._embedded(bytes(ref["bytes"]), where)
            ref = ref.get("path")
        if not isinstance(ref, str) or not ref.strip():
            raise UserError(f"{where}: an {name} entry must be a path or data URI, got {ref!r}")
        if ref.startswith("data:"):
            return self._embedded(data_uri_bytes(ref, where), where)
        scheme = urlparse(ref).scheme
        if scheme in ("http", "https", "ftp", "s3", "gs"):
            raise UserError(f"{where}: {ref}: remote {self.kind.column} are not downloaded; download them once and "
                            "name the local files")
        path = Path(unquote(urlparse(ref).path)) if scheme == "file" else Path(ref).expanduser()
        candidates = [path] if path.is_absolute() else [folder / path, Path.cwd() / path]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            tried = " or ".join(str(p) for p in dict.fromkeys(candidates))
            raise UserError(f"{where}: {name} {ref} not found (looked for {tried})")
        found = found.resolve()
        if str(found) not in self.seen:
            self.seen[str(found)] = dataclasses.replace(self.check(found.read_bytes(), f"{where}: {name} {found}"),
                                                        path=found)
        return self.seen[str(found)]

    def in_record(self, record: Any, messages: list[Message], schema: Schema, where: str, folder: Path,
                  prompt: tuple[Any, str], marker: str | None) -> list[Checked]:
        """The record's media of this kind, found and checked, and the model's own `marker` put where its messages
        hold the dataset placeholder (in place). `prompt` is the model's ImagePrompt or AudioPrompt, or None and why
        it takes none of this kind."""
        kind = self.kind
        refs = record_media(record, messages, schema, where, kind)
        if not refs:
            return []
        if prompt[0] is None or marker is None:
            raise UserError(f"{where}: the record has {kind.column}, but the model takes none ({prompt[1]})")
        found = [self.find(ref, folder, f"{where}: {kind.name} {i + 1}") for i, ref in enumerate(refs)]
        for message in messages:
            if marker in message["content"]:
                raise UserError(f"{where}: the text holds {marker}, the model's own {kind.name} marker; write "
                                f"{kind.placeholder} where {'an' if kind.name[0] in 'aeiou' else 'a'} {kind.name} goes")
            message["content"] = message["content"].replace(kind.placeholder, marker)
        return found

    def _embedded(self, data: bytes, where: str) -> Checked:
        digest = hashlib.sha256(data).hexdigest()
        checked = self.check(data, f"{where}: the embedded {self.kind.name}")
        path = self.store / f"{digest}.{self.suffix(data)}"
        if not path.is_file():
            self.store.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self.seen[str(path)] = dataclasses.replace(checked, path=path)
        return self.seen[str(path)]


class ImageFinder(MediaFinder[CheckedImage]):
    kind = IMAGE

    def check(self, data: bytes, where: str) -> CheckedImage:
        width, height = check_picture(data, where)
        return CheckedImage(Path(), hashlib.sha256(data).hexdigest(), width, height)

    def suffix(self, data: bytes) -> str:
        from PIL import Image

        return (Image.open(io.BytesIO(data)).format or "img").lower()


class SoundFinder(MediaFinder[CheckedClip]):
    """Clips decoded at the rate of the model's feature extractor (`audio`), within its longest clip; without one
    (an eval suite, read before any model), at Gemma 4's rate within the longest clip its encoder takes."""

    kind = AUDIO

    def __init__(self, store: Path, audio: AudioPrompt | None):
        super().__init__(store)
        self.audio = audio

    def check(self, data: bytes, where: str) -> CheckedClip:
        if self.audio is None:
            samples = len(decode_sound(data, where, GEMMA4_AUDIO_RATE, LONGEST_CLIP_SECONDS))
        else:
            samples = len(decode_sound(data, where, self.audio.rate, self.audio.max_seconds))
        if self.audio is not None and self.audio.soft_token_count(samples) == 0:
            raise UserError(f"{where}: the clip lasts {samples / self.audio.rate * 1000:.1f} ms, too short for one "
                            f"audio token (at least {self.audio.shortest_samples() / self.audio.rate * 1000:g} ms)")
        return CheckedClip(Path(), hashlib.sha256(data).hexdigest(), samples)

    def suffix(self, data: bytes) -> str:
        import soundfile

        return soundfile.info(io.BytesIO(data)).format.lower()
