"""Our GGUFWriter packs metadata arrays in one call: the bytes must be gguf's own, element by element."""

import gguf
import pytest
from gguf import GGUFValueType

from gemmaforge.export.gguf_writer import GGUFWriter


@pytest.mark.parametrize("values", [
    ["<pad>", "▁hello", "日本語", "", "<start_of_turn>"],
    [0.0, -1.5, 3.25e-3, -1000.0],
    [1, 3, 2, 6, 0],
    [-1, 5, -7],
    [True, False],
    [[1, 2], [3]],
], ids=["strings", "floats", "types", "signed", "bools", "nested"])
@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_arrays_pack_to_ggufs_bytes(values: list, endianess: gguf.GGUFEndian, tmp_path) -> None:
    ours = GGUFWriter(tmp_path / "ours.gguf", "gemma3", endianess=endianess)
    theirs = gguf.GGUFWriter(tmp_path / "theirs.gguf", "gemma3", endianess=endianess)
    for add_vtype in (True, False):
        assert ours._pack_val(values, GGUFValueType.ARRAY, add_vtype) == \
            theirs._pack_val(values, GGUFValueType.ARRAY, add_vtype)
    if isinstance(values[0], int) and not isinstance(values[0], bool):  # the vocabulary's types as gguf adds them
        assert ours._pack_val(values, GGUFValueType.ARRAY, True, GGUFValueType.INT32) == \
            theirs._pack_val(values, GGUFValueType.ARRAY, True, GGUFValueType.INT32)


@pytest.mark.parametrize("values", [[0.5, 2, 3.0], [1, True, 2], ["a", 1]], ids=["float-int", "int-bool", "str-int"])
def test_mixed_arrays_are_refused_as_gguf_refuses_them(values: list, tmp_path) -> None:
    """The one-call packing reads item types in bulk; a list whose items differ in GGUF type still goes to gguf."""
    for writer in (GGUFWriter, gguf.GGUFWriter):
        with pytest.raises(ValueError, match="same type"):
            writer(tmp_path / "f.gguf", "gemma3")._pack_val(values, GGUFValueType.ARRAY, True)
