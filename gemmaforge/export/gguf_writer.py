"""gguf's GGUFWriter, with metadata arrays packed in one call: its own writer packs them one element at a time
through Python, which for a Gemma vocabulary (262,144 token texts, scores and types) is most of an export's time
on a small model. The bytes are the same."""

from __future__ import annotations

import struct
from typing import Any

import gguf
from gguf import GGUFValueType


class GGUFWriter(gguf.GGUFWriter):
    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if vtype != GGUFValueType.ARRAY or isinstance(val, bytes) or not val:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        item_type = sub_type if sub_type is not None else GGUFValueType.get_type(val[0])
        order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
        if item_type == GGUFValueType.STRING and set(map(type, val)) == {str}:
            encoded = [item.encode("utf-8") for item in val]
            body = b"".join(struct.pack(f"{order}Q", len(item)) + item for item in encoded)
        elif item_type in (GGUFValueType.FLOAT32, GGUFValueType.INT32, GGUFValueType.UINT32) and _one_type(val):
            body = struct.pack(f"{order}{len(val)}{self._simple_value_packing[item_type]}", *val)
        else:  # anything else as gguf packs it
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack(f"{order}I", vtype) if add_vtype else b""
        return head + struct.pack(f"{order}IQ", item_type, len(val)) + body


def _one_type(val: list[Any]) -> bool:
    """Whether every item has the first one's GGUF type: for plain floats or plain ints (a vocabulary's scores and
    token types) by their Python types, in C; anything else item by item, as gguf types them."""
    kinds = set(map(type, val))
    if len(kinds) == 1 and kinds <= {float, int}:
        return True
    first = GGUFValueType.get_type(val[0])
    return all(GGUFValueType.get_type(item) == first for item in val)
