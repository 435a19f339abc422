"""LLaMA-Factory's own inputs (its data/ folder, its examples/ YAMLs and its argument dataclasses), from its source
distribution on PyPI: fetched through pip once, unpacked into a cache every test worker shares, never copied into
this repository."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from gemmaforge.models import exclusive_lock

VERSION = "0.9.5"
WANTED = ("data/", "examples/", "src/llamafactory/hparams/")


def cache_root() -> Path:
    return Path(os.environ.get("GEMMAFORGE_TEST_CACHE") or Path(tempfile.gettempdir()) / "gemmaforge-test-cache")


def fetch_llamafactory() -> Path:
    """The unpacked llamafactory-VERSION folder (data/, examples/, src/llamafactory/hparams/). Skips the calling
    test when the sdist cannot be had, or fails it where GEMMAFORGE_REQUIRE_REFERENCES is set (CI)."""
    cache = cache_root()
    root = cache / f"llamafactory-{VERSION}"
    done = root / ".unpacked"
    if done.is_file():
        return root
    with exclusive_lock(cache / f".llamafactory-{VERSION}.lock"):  # one worker fetches, the others wait
        if done.is_file():
            return root
        download = cache / "downloads"
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               f"llamafactory=={VERSION}", "-d", str(download)], capture_output=True, text=True)
        archive = download / f"llamafactory-{VERSION}.tar.gz"
        if proc.returncode != 0 or not archive.is_file():
            reason = f"the llamafactory {VERSION} sdist could not be fetched: {proc.stderr[-300:]}"
            if os.environ.get("GEMMAFORGE_REQUIRE_REFERENCES"):  # set by .ci/run
                pytest.fail(reason)
            pytest.skip(reason)
        prefix = f"llamafactory-{VERSION}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(tuple(prefix + w for w in WANTED))]
            tar.extractall(cache, members=members, filter="data")
        done.write_text(VERSION)
    return root
