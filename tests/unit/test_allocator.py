import sys

import pytest

from gemmaforge.train import allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_threshold_is_set_on_glibc() -> None:
    assert allocator.serve_large_blocks_with_mmap() is True


def test_a_users_own_threshold_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.serve_large_blocks_with_mmap() is False
