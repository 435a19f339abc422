"""What the installed llama-cpp-python was built for: llama.cpp compiles its GPU backends in (GGML_CUDA for NVIDIA,
GGML_HIP for AMD ROCm), and a plain `pip install llama-cpp-python` builds the CPU backend alone."""

from __future__ import annotations

import re

# how to rebuild llama-cpp-python with a GPU backend, by the torch build of this machine
BUILD_LINES = {
    "CUDA": 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python',
    "ROCm": 'CMAKE_ARGS="-DGGML_HIP=on -DAMDGPU_TARGETS=<your gfx arch, e.g. gfx1100>" '
            'pip install --force-reinstall --no-cache-dir llama-cpp-python',
}


def llama_cpp_backends() -> list[str]:
    """The backends llama.cpp lists in its system info ("CUDA : ARCHS = 900 | ... | CPU : AVX2 = 1 | ..."), e.g.
    ["CUDA", "CPU"]; the HIP backend calls itself ROCm."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return re.findall(r"(?:^|\| )([A-Za-z][\w-]*) : ", info)


def gpu_layers() -> int:
    """llama.cpp's n_gpu_layers for a served GGUF: every layer where the build can offload to a GPU, else none."""
    import llama_cpp

    return -1 if llama_cpp.llama_supports_gpu_offload() else 0
