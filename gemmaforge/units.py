"""Sizes written by people, in the two conventions they come in, and bytes written for people.

llama.cpp's tools count file sizes in decimal units (`--split-max-size 2G` is 2 * 10^9 bytes); memory is sold and
reported in binary units (a 24 GB card has 24 GiB). Each parser is named for its convention."""

from __future__ import annotations

import re

from gemmaforge.errors import UserError

GiB = 2**30
_DECIMAL = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_BINARY = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
           "g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_decimal_size(text: str, what: str = "split size") -> int:
    """'2G', '500M', '750K' or a byte count -> bytes, in decimal units (as llama.cpp's --split-max-size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), flags=re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise UserError(f"{what} {text!r}: expected a positive size such as 2G, 500M or 1500000")
    return int(float(match[1]) * _DECIMAL[match[2].upper()])


def parse_binary_size(text: str, source: str = "--gpu-memory") -> int:
    """'24GiB', '24G', '24GB', '16000MiB', '0.5T' -> bytes, in binary units: GB and G mean GiB here."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    size = int(float(match.group(1)) * _BINARY[unit]) if match and unit in _BINARY else 0
    if size < 2**20:  # '24' without a unit would be 24 bytes: surely not what was meant
        raise UserError(f"{source} {text!r}: expected a size with its unit, such as 24GiB, 16G or 8000MiB")
    return size


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def decimal_size(n: int) -> str:
    """Bytes in decimal units, as llama.cpp and file managers show file sizes: 292 MB, 1.07 GB."""
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"
