"""The Ollama export: a Modelfile whose TEMPLATE renders the training format, next to the GGUF."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from gemmaforge.config import RunConfig
from gemmaforge.errors import StageError, UserError
from gemmaforge.families import Family
from gemmaforge.gguf_names import gguf_parts
from gemmaforge.runs import RunDir, atomic_write_text, ollama_model_name

GEMMA_TERMS = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


def pick_gguf(run: RunDir, config: RunConfig) -> Path:
    """The GGUF the Modelfile points at (see RunDir.deployed_quant), whole: Ollama cannot import shards."""
    quant = run.deployed_quant(config)
    parts = gguf_parts(run.gguf_path(quant))
    if len(parts) > 1:
        raise UserError(
            f"{parts[0]} is split into {len(parts)} shards and Ollama cannot import split GGUF files "
            f"(ollama/ollama#5245): export it whole for Ollama, without export.split_max_size / --split-max-size "
            f"(llama.cpp and `gemmaforge serve` load the shards as they are)"
        )
    return run.require(run.gguf_path(quant), "export gguf")


# Which Ollama imports a text GGUF plus a projector GGUF (two FROM lines) for each family: 0.11.11 runs Gemma 3's
# on its llama.cpp engine (ollama/ollama commit aba157531), Gemma 4 needs the llama.cpp of 0.30.0 (ollama#16031).
_PROJECTOR_OLLAMA = {"gemma3": "0.11.11", "gemma4": "0.30.0"}


def render_modelfile(gguf_relpath: str, family: Family, config: RunConfig, adapter_relpath: str | None = None,
                     mmproj_relpath: str | None = None, trained_with_tools: bool = False) -> str:
    o = config.export.ollama
    projector = [
        f"# Images: the second FROM is the vision projector; Ollama >= {_PROJECTOR_OLLAMA[family.name]} imports it "
        "(older versions answer text only).",
        f"# llama.cpp: llama-mtmd-cli -m {gguf_relpath} --mmproj {mmproj_relpath} --image photo.jpg -p '...'",
        f"FROM {mmproj_relpath}",
    ] if mmproj_relpath else []
    lines = [
        f"# Ollama Modelfile written by gemmaforge for {config.output_dir}",
        f"# Create the model:  ollama create {ollama_model_name(config)} -f Modelfile",
        f"FROM {gguf_relpath}",
        *projector,
        *([f"ADAPTER {adapter_relpath}"] if adapter_relpath else []),
        *family.chat.modelfile(trained_with_tools),
    ]
    system = config.deployed_system
    if system:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in family.stop]
    lines += [
        f"PARAMETER temperature {o.temperature}",
        f"PARAMETER top_p {o.top_p}",
        f"PARAMETER top_k {o.top_k}",
        f"PARAMETER num_ctx {o.num_ctx}",
        f'LICENSE """{GEMMA_TERMS}"""',
    ]
    return "\n".join(lines) + "\n"


def write_modelfile(run: RunDir, config: RunConfig, family: Family, adapter: bool = False) -> Path:
    """FROM the merged GGUF; with `adapter`, FROM the base GGUF plus ADAPTER (`export gguf --adapter`)."""
    if adapter:
        gguf = run.require(run.gguf_dir / BASE_GGUF, "export gguf --adapter")
        lora = run.require(run.gguf_dir / ADAPTER_GGUF, "export gguf --adapter")
    else:
        gguf, lora = pick_gguf(run, config), None
    path = run.ollama_dir / "Modelfile"

    def relative(file: Path) -> str:
        return (Path("..") / file.relative_to(run.root)).as_posix()

    mmproj = run.mmproj_path if run.mmproj_path.is_file() and not adapter else None
    atomic_write_text(path, render_modelfile(relative(gguf), family, config, relative(lora) if lora else None,
                                             relative(mmproj) if mmproj else None, run.trained_with_tools()))
    return path


BASE_GGUF, ADAPTER_GGUF = "base-f16.gguf", "adapter-f16.gguf"  # what `export gguf --adapter` writes


def ollama_create(modelfile: Path, name: str) -> None:
    binary = shutil.which("ollama")
    if binary is None:
        raise UserError(
            f"--create needs the `ollama` command on PATH; install Ollama, then run: "
            f"ollama create {name} -f {modelfile}"
        )
    proc = subprocess.run([binary, "create", name, "-f", str(modelfile)], cwd=modelfile.parent)
    if proc.returncode != 0:
        raise StageError(f"`ollama create {name}` failed with exit code {proc.returncode}")
