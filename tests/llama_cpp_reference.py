"""llama.cpp's own converter (`convert_hf_to_gguf.py`), the reference our GGUF writers are held to.

It comes from the llama-cpp-python sdist of the installed version (fetched through pip, from its cache when the
package was built from source)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from gemmaforge.export.gguf import write_gguf
from gemmaforge.gguf_file import GGUFFile, read_gguf


def fetch_converter(out: Path) -> Path:
    """The llama.cpp folder (converter, conversion/, gguf-py) of the installed llama-cpp-python's sdist, unpacked
    under `out`. Skips the calling test when it cannot be had, or fails it where GEMMAFORGE_REQUIRE_REFERENCES is
    set (CI must not lose these tests)."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        pytest.skip("llama-cpp-python is not installed")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                           f"llama-cpp-python=={version}", "-d", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        reason = f"the llama-cpp-python {version} sdist could not be fetched: {proc.stderr[-300:]}"
        if os.environ.get("GEMMAFORGE_REQUIRE_REFERENCES"):  # set by .ci/run
            pytest.fail(reason)
        pytest.skip(reason)
    (archive,) = out.glob("*.tar.gz")
    root = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = (root + "convert_hf_to_gguf.py", root + "convert_lora_to_gguf.py", root + "conversion/", root + "gguf-py/")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(out, members=members, filter="data")
    return out / root


MEMO_RUNNER = Path(__file__).with_name("converter_memo.py")


def run_converter(converter: Path, script: str, *args: str) -> None:
    """One of llama.cpp's converter scripts, with its own gguf-py (not the installed gguf package), its vocabulary
    readers memoized for the session by the tokenizer files' contents (tests/converter_memo.py)."""
    command = [sys.executable, str(MEMO_RUNNER), str(converter / ".vocabulary-memo"), script, *args]
    proc = subprocess.run(command, cwd=converter, capture_output=True, text=True,
                          env={"PYTHONPATH": str(converter / "gguf-py"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def convert_both(converter: Path, checkpoint: Path, tmp_path: Path, ours: Path | None = None,
                 outtype: str = "f16") -> tuple[GGUFFile, GGUFFile]:
    """(our file, or `ours` when already written; the converter's) for `checkpoint` in `outtype`."""
    reference = tmp_path / f"reference-{outtype}.gguf"
    run_converter(converter, "convert_hf_to_gguf.py", str(checkpoint), "--outtype", outtype,
                  "--outfile", str(reference))
    ours = ours or write_gguf(checkpoint, tmp_path / f"ours-{outtype}.gguf", outtype)
    return read_gguf(ours), read_gguf(reference)


def assert_same_file(ours: GGUFFile, theirs: GGUFFile, arch: str, allowed: set[str]) -> None:
    keys = set(ours.fields) | set(theirs.fields)
    differing = {k for k in keys if k not in ours.fields or k not in theirs.fields
                 or ours.fields[k].value != theirs.fields[k].value}
    assert differing <= allowed, sorted(differing - allowed)
    assert any(k.startswith(f"{arch}.") for k in set(ours.fields) - differing)  # the hyperparameters were compared
    ours_tensors = {t.name: t for t in ours.tensors}
    theirs_tensors = {t.name: t for t in theirs.tensors}
    assert set(ours_tensors) == set(theirs_tensors)
    for name, t in ours_tensors.items():
        other = theirs_tensors[name]
        assert (t.tensor_type, list(t.shape)) == (other.tensor_type, list(other.shape)), name
        assert np.array_equal(np.asarray(t.data), np.asarray(other.data)), name
