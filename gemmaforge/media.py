"""The kinds of media a conversation can carry beside its text, and the one rule that puts a medium's tokens where
its placeholder stands.

A dataset marks where each medium goes with LLaMA-Factory's placeholders (`<image>`, `<audio>`) and lists the media in
a column of the same name (`images`, `audios`), in the order of their placeholders. The chat renderings write the
model's own marker instead (what the official template writes for that content part); vision.py and audio.py turn
each marker into the medium's tokens as the checkpoint's processor writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MediaKind:
    name: str  # how errors name one ("image", "audio")
    placeholder: str  # the dataset's marker for one in a record's text (LLaMA-Factory's)
    column: str  # the record's list of them, and the prepared JSON Lines' key (LLaMA-Factory's column)


IMAGE = MediaKind("image", "<image>", "images")
AUDIO = MediaKind("audio", "<audio>", "audios")
KINDS = (IMAGE, AUDIO)


def check_placeholders(prompt: str, marker: str, media: list[Any], kind: MediaKind) -> None:
    """ValueError unless `prompt` holds one `marker` for each medium (either engine)."""
    found = prompt.count(marker)
    if found != len(media):
        raise ValueError(f"the prompt has {found} {kind.name} placeholder(s) ({marker}) for {len(media)} "
                         f"{kind.name}(s)")


def expand_placeholders(text: str, spans: list[tuple[int, int]], marker: str, blocks: list[str], kind: MediaKind
                        ) -> tuple[str, list[tuple[int, int]]]:
    """`text` with its i-th `marker` replaced by blocks[i], and its character `spans` moved to where their text now
    is. ValueError when the markers and the blocks differ in number."""
    parts = text.split(marker)
    if len(parts) - 1 != len(blocks):
        raise ValueError(f"the prompt has {len(parts) - 1} {kind.name} placeholder(s) ({marker}) for {len(blocks)} "
                         f"{kind.name}(s)")
    out, moves, at = parts[0], [], len(parts[0])  # moves: (original position, shift after it)
    for block, rest in zip(blocks, parts[1:]):
        moves.append((at, len(block) - len(marker)))
        out += block + rest
        at += len(marker) + len(rest)

    def moved(position: int) -> int:
        return position + sum(shift for where, shift in moves if where < position)

    return out, [(moved(start), moved(end)) for start, end in spans]


def merged_token_types(*parts: dict[str, Any]) -> dict[str, Any]:
    """Token-type arguments of several media for one forward: where two name the same argument (Gemma 4's
    `mm_token_type_ids`, 1 on image tokens and 3 on audio tokens), their marks are added (they never overlap)."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out[key] + value if key in out else value
    return out
