"""K-quants (q4_k_m, q5_k_m, q6_k) through llama.cpp's own quantizer, in process via llama-cpp-python.

Their mixes (which tensors get more bits) are llama.cpp's, the ones Ollama's own files use; writing them
in numpy would mean re-implementing both the block formats and those rules.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from gemmaforge.errors import StageError, UserError
from gemmaforge.export.gguf_shards import staged_output

K_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
            "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def quantizer(quant: str) -> ModuleType:
    """llama-cpp-python, or a UserError saying how to get it (checked before any file is written)."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            f"GGUF quant {quant} is made by llama.cpp's quantizer: pip install llama-cpp-python "
            "(or pip install 'gemmaforge[all]'); f32, f16, bf16, q8_0, q4_0 and q5_0 need nothing more"
        ) from None
    return llama_cpp


def llama_cpp_quantize(source: Path, out_path: Path, quant: str) -> Path:
    """Quantize the GGUF `source` to `quant` at `out_path` (appearing only once complete)."""
    llama_cpp = quantizer(quant)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, K_QUANTS[quant])
    params.nthread = os.cpu_count() or 1
    with staged_output(out_path) as staged, _captured_stderr() as log:  # C logs a line per tensor: shown on failure
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(staged).encode(), ctypes.byref(params))
        if code != 0 or not staged.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            raise StageError(f"llama.cpp's quantizer failed (code {code}) turning {source} into {quant}:\n{tail}")
    return out_path


@contextmanager
def _captured_stderr() -> Iterator[Path]:
    """Point file descriptor 2 (where C code writes) at a temporary file for the duration."""
    with tempfile.NamedTemporaryFile(prefix="gemmaforge-quantize-", suffix=".log") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield Path(log.name)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
