"""What `gemmaforge serve` serves: each model name mapped to an engine (and an adapter inside it).

A reference is a run directory (its adapter on its base model; or, with the llama.cpp engine, its
exported GGUF), a Hugging Face model folder, a `.gguf` file, or the embedded `gemma3-270m`; `NAME=REF`
names it. Runs on the same base share one transformers engine: the base is loaded once and every run's
adapter sits beside it. Only safetensors and GGUF files are ever loaded (no pickle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES, Family
from gemmaforge.inference.jobs import Engine
from gemmaforge.inference.llamacpp_images import projector_beside
from gemmaforge.models import EMBEDDED_NAME, ResolvedModel, resolve_model
from gemmaforge.pipeline import resolve_base
from gemmaforge.senses import Senses

if TYPE_CHECKING:
    from gemmaforge.inference.transformers_engine import TransformersEngine

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(/[A-Za-z0-9][A-Za-z0-9._-]{0,63})?(:[A-Za-z0-9._-]{1,64})?$")


@dataclass
class Served:
    name: str  # as listed: "coffee:latest"
    engine: Engine
    adapter: str | None
    family: Family
    source: Path  # the run dir, model folder or GGUF file
    system: str | None = None  # the system prompt the model was trained and deployed with
    options: dict[str, Any] = field(default_factory=dict)  # Modelfile-style defaults: temperature, top_p, ...
    details: dict[str, Any] = field(default_factory=dict)
    size: int = 0
    modified_at: str = ""
    parent: str | None = None  # the base model's name, for adapters
    adapter_dir: Path | None = None  # where the adapter is loaded from (again, after an unload)
    engine_key: Path | None = None  # the registry's key of its engine (a base model folder or GGUF file)
    loaded: bool = True  # False once keep_alive ran out: listed, loaded again by its next request
    expires_at: datetime | None = None  # when keep_alive runs out; None: loaded until the server stops
    keep_alive: float | None = None  # the latest request's keep_alive (None: the server's --keep-alive)
    trained_with_tools: bool = False  # a run whose training data offered tools (see `tools`)

    @property
    def tools(self) -> bool:
        """Whether requests may offer tools: Gemma 4's template has them; Gemma 1-3's official ones do not, so only
        runs trained on tool conversations (in LLaMA-Factory's format, as their training rendered them) take them."""
        return self.family.chat.native_tools or self.trained_with_tools

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.name}:{self.source.resolve()}".encode()).hexdigest()


def check_name(name: str, what: str = "model name") -> str:
    """Names appear in URLs and logs and are never used as paths: a strict pattern, no '..'."""
    if not _NAME.match(name) or ".." in name:
        raise UserError(f"{what} {name!r}: use letters, digits, '.', '_', '-', an optional 'namespace/' and ':tag'")
    return name if ":" in name else f"{name}:latest"


class Registry:
    """Served models by name; engines by what they hold (a base model folder or a GGUF file)."""

    def __init__(self, home: Path, *, num_ctx: int = 4096, max_batch: int = 16, max_queue: int = 64,
                 dtype: str = "auto", keep_alive: float = -1):
        self.home, self.num_ctx, self.max_batch, self.max_queue = home, num_ctx, max_batch, max_queue
        self.dtype = dtype  # auto (bf16 where the hardware has it), bf16 or fp32
        self.keep_alive = keep_alive  # seconds a model stays loaded after a request; < 0: until the server stops
        self.models: dict[str, Served] = {}
        self.engines: dict[Path, Engine] = {}
        self._loaders: dict[Path, Callable[[], Engine]] = {}  # each engine's maker, kept to load it again
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        threading.Thread(target=self._expire, name="gemmaforge-keep-alive", daemon=True).start()

    # ------------------------------------------------------------------ lookup

    def get(self, name: str) -> Served | None:
        return self.models.get(name if ":" in name else f"{name}:latest")

    # ------------------------------------------------------------------ adding

    def add(self, spec: str, engine: str = "transformers") -> Served:
        """`[NAME=]REF` (see the module docstring)."""
        with self._adding():
            return self._add(spec, engine)

    def add_adapter(self, name: str, adapter_dir: Path) -> Served:
        """A PEFT adapter (or a run directory's) loaded beside the base it was trained on, at runtime."""
        with self._adding():
            return self._add_adapter(name, adapter_dir)

    @contextmanager
    def _adding(self) -> Iterator[None]:
        """One change at a time; an engine loaded for an add that then fails is closed again."""
        with self._lock:
            before = set(self.engines)
            try:
                yield
            except BaseException:
                for key in set(self.engines) - before:
                    self.engines.pop(key).close()
                raise

    def _add(self, spec: str, engine: str) -> Served:
        name, sep, ref = spec.partition("=")
        if not sep:
            name, ref = "", spec
        path = Path(ref).expanduser()
        if (path / "run.yaml").is_file():
            served = self._add_run(path, engine, name or None)
        elif ref.endswith(".gguf"):
            served = self._add_gguf(path, name or path.stem)
        elif ref == EMBEDDED_NAME or (path / "config.json").is_file():
            served = self._add_base(ref, name or (EMBEDDED_NAME if ref == EMBEDDED_NAME else path.resolve().name))
        else:
            raise UserError(f"{ref}: expected a run directory (run.yaml), a Hugging Face model folder (config.json), "
                            f"a .gguf file or '{EMBEDDED_NAME}'")
        return served

    def _add_adapter(self, name: str, adapter_dir: Path) -> Served:
        from gemmaforge.runs import RunDir

        if (adapter_dir / "run.yaml").is_file():
            run = RunDir.open(adapter_dir)
            return self._add_run(adapter_dir, "transformers", name, adapter_dir=run.adapter_dir)
        engines = [e for e in self.engines.values() if e.kind == "transformers"]
        base = _adapter_base(adapter_dir)
        matching = [e for e in engines if base and Path(base).expanduser().resolve() == e.base_path] or engines
        if len(matching) != 1:
            raise UserError(f"{adapter_dir}: cannot tell which loaded base model it belongs to "
                            f"(base_model_name_or_path {base!r}); serve its run directory instead")
        engine = matching[0]
        _require_safetensors(adapter_dir, "adapter_model.safetensors")
        return self._register(Served(self._free(check_name(name)), engine, None, engine.family, adapter_dir,
                                     parent=engine.base_name), adapter_dir=adapter_dir)

    def _add_run(self, root: Path, engine: str, name: str | None, adapter_dir: Path | None = None) -> Served:
        from gemmaforge.runs import RunDir, ollama_model_name, refuse_reward_model

        run = RunDir.open(root)
        config = run.config()
        refuse_reward_model(run, config, "serving it")
        name = self._free(check_name(name or ollama_model_name(config)))
        o = config.export.ollama
        options = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "num_ctx": o.num_ctx}
        system = config.deployed_system
        if engine == "llamacpp":
            files = run.model_ggufs()
            if not files:
                raise UserError(f"{run.gguf_dir} has no model-<quant>.gguf: run `gemmaforge export gguf {root}` first")
            parts = files[run.deployed_quant(config)]
            served = self._add_gguf(parts[0], name, source=root)
            served.system, served.options = system, options
            served.trained_with_tools = run.trained_with_tools()
            return served
        adapter_dir = adapter_dir or run.require(run.adapter_dir / "adapter_config.json", "train").parent
        _require_safetensors(adapter_dir, "adapter_model.safetensors")
        base = resolve_base(config, self.home)  # with model.adapter: the model the run's adapter trained on
        transformers = self._transformers_engine(base, base.reference)
        served = Served(name, transformers, None, base.family, root, system=system, options=options,
                        parent=transformers.base_name, trained_with_tools=run.trained_with_tools())
        return self._register(served, adapter_dir=adapter_dir)

    def _add_base(self, ref: str, name: str) -> Served:
        name = self._free(check_name(name))
        base = resolve_model(ref, self.home)
        _require_safetensors(base.path)
        engine = self._transformers_engine(base, ref)
        return self._register(Served(name, engine, None, base.family, base.path))

    def _add_gguf(self, path: Path, name: str, source: Path | None = None) -> Served:
        from gemmaforge.gguf_names import shard_set
        from gemmaforge.inference.llamacpp_engine import LlamaCppEngine

        name = self._free(check_name(name))
        if not path.is_file():
            raise UserError(f"{path}: GGUF file not found")
        family = _gguf_family(path)
        mmproj, several = projector_beside(path)  # as `export gguf` writes it beside a multimodal model
        engine = self._engine(path.resolve(), lambda: LlamaCppEngine(
            path, family, num_ctx=self.num_ctx, max_queue=self.max_queue, files=shard_set(path),
            mmproj=mmproj, no_vision=several))
        return self._register(Served(name, engine, None, family, source or path))

    def _transformers_engine(self, base: ResolvedModel, reference: str) -> Engine:
        return self._engine(base.path.resolve(), lambda: _load_transformers(base, reference, self))

    def _engine(self, key: Path, load: Callable[[], Engine]) -> Engine:
        """The engine holding `key` (a base model folder or a GGUF file): loaded once, and again after an unload."""
        self._loaders.setdefault(key, load)
        engine = self.engines.get(key)
        if engine is None:
            engine = self.engines[key] = self._loaders[key]()
        return engine

    def _free(self, name: str) -> str:
        if name in self.models:
            raise UserError(f"model name {name!r} is already served (from {self.models[name].source}); "
                            "give another with NAME=PATH")
        return name

    def _register(self, served: Served, adapter_dir: Path | None = None) -> Served:
        served.engine_key = next(k for k, e in self.engines.items() if e is served.engine)
        served.adapter_dir, served.expires_at = adapter_dir, self._expiry(self.keep_alive)
        if adapter_dir is not None:
            served.adapter = served.name
            served.engine.load_adapter(served.name, adapter_dir)
        served.details = _details(served)
        weights = [adapter_dir / "adapter_model.safetensors"] if adapter_dir else served.engine.weight_files()
        served.size = sum(p.stat().st_size for p in weights)
        served.modified_at = datetime.fromtimestamp(served.source.stat().st_mtime, UTC).isoformat()
        self.models[served.name] = served
        return served

    def copy(self, source: str, destination: str) -> Served:
        """Another name for a served model (Ollama's /api/copy): the same engine and adapter, listed twice."""
        with self._lock:
            served = self.get(source)
            if served is None:
                raise KeyError(source)
            copy = dataclasses.replace(served, name=self._free(check_name(destination, "destination")))
            self.models[copy.name] = copy
            return copy

    # ------------------------------------------------------------------ removing and keep_alive

    def remove(self, name: str) -> Served | None:
        """Stop serving `name` (None when it is not served, e.g. removed by a concurrent request). An adapter's
        base stays loaded for adapters loaded later; any other engine closes with its last model."""
        with self._lock:
            served = self.models.pop(name, None)
            if served is not None and served.loaded:
                self._release(served, close_base=served.adapter is None)
            return served

    def ensure_loaded(self, name: str, keep_alive: float | None) -> Served:
        """`name` for a request whose keep_alive is `keep_alive` (None: the server's): loaded again if keep_alive
        had unloaded it, and held until keep() sets its expiry after the request (KeyError when it is no longer
        served). As in Ollama, the latest request's keep_alive is the one that counts once the requests in flight
        end: an eject (keep_alive 0) during another request unloads the model after it."""
        with self._lock:
            served = self.models[name]
            served.expires_at, served.keep_alive = None, keep_alive
            if not served.loaded:
                engine = self._engine(cast(Path, served.engine_key), self._loaders[cast(Path, served.engine_key)])
                if served.adapter is not None and served.adapter not in engine.adapters:
                    engine.load_adapter(served.adapter, cast(Path, served.adapter_dir))
                served.engine, served.loaded = engine, True
            return served

    def keep(self, name: str) -> None:
        """After a request: keep `name` loaded for the latest request's keep_alive (0: unload now; < 0: until
        the server stops)."""
        with self._lock:
            served = self.models.get(name)
            if served is None or not served.loaded:
                return
            seconds = self.keep_alive if served.keep_alive is None else served.keep_alive
            served.expires_at = self._expiry(seconds)
            if seconds == 0 and served.engine.running() == 0:  # else once the requests in flight end (_expire)
                self.unload(name)

    def unload(self, name: str) -> None:
        """Free what only `name` holds (its adapter, its engine when no loaded model shares it); it stays listed."""
        with self._lock:
            served = self.models.get(name)
            if served is not None and served.loaded:
                served.loaded, served.expires_at = False, None
                self._release(served, close_base=True)

    def _release(self, served: Served, close_base: bool) -> None:
        """Unload what no other loaded name still uses (a copy shares its model's engine and adapter)."""
        users = [m for m in self.models.values() if m.loaded and m.engine is served.engine and m is not served]
        if served.adapter is not None and not any(m.adapter == served.adapter for m in users):
            served.engine.unload_adapter(served.adapter)
        if not users and close_base and served.engine_key in self.engines:
            self.engines.pop(served.engine_key).close()

    @staticmethod
    def _expiry(seconds: float) -> datetime | None:
        return None if seconds < 0 else datetime.now(UTC) + timedelta(seconds=seconds)

    def _expire(self) -> None:
        """Unload each model whose keep_alive ran out, once its engine has no request in flight."""
        while not self._stopping.wait(0.5):
            now = datetime.now(UTC)
            with self._lock:
                for served in list(self.models.values()):
                    if (served.loaded and served.expires_at is not None and served.expires_at <= now
                            and served.engine.running() == 0):
                        self.unload(served.name)

    def close(self) -> None:
        self._stopping.set()
        for engine in self.engines.values():
            engine.close()


def _load_transformers(base: ResolvedModel, reference: str, registry: Registry) -> TransformersEngine:
    import torch

    from gemmaforge.inference.transformers_engine import TransformersEngine
    from gemmaforge.models import load_causal_lm, load_tokenizer
    from gemmaforge.train.precision import resolve_precision

    dtype = torch.bfloat16 if resolve_precision(registry.dtype, base.family) == "bf16" else torch.float32
    model = load_causal_lm(base.path, base.spec, dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    tokenizer = load_tokenizer(base.path)
    senses = Senses.of(base.path, base.spec, tokenizer)
    return TransformersEngine(model, tokenizer, base.family, max_batch=registry.max_batch,
                              max_queue=registry.max_queue, num_ctx=registry.num_ctx,
                              base_path=base.path.resolve(), base_name=reference, vision=senses.vision,
                              no_vision=senses.no_vision, audio=senses.audio, no_audio=senses.no_audio)


def _require_safetensors(folder: Path, name: str | None = None) -> None:
    found = (folder / name).is_file() if name else any(folder.glob("*.safetensors"))
    if not found:
        raise UserError(f"{folder}: no {name or '*.safetensors'} file; only safetensors and GGUF are loaded "
                        "(pickle-based .bin files can run code)")


def _adapter_base(adapter_dir: Path) -> str | None:
    import json

    config = adapter_dir / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"{adapter_dir}: no adapter_config.json (expected a PEFT adapter folder or a run directory)")
    return json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")


def _gguf_family(path: Path) -> Family:
    from gemmaforge.gguf_file import read_gguf

    try:
        arch = read_gguf(path).value("general.architecture")
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"{path}: not a readable GGUF file ({e})") from None
    family = next((f for f in FAMILIES.values() if f.gguf_arch == arch), None)
    if family is None:
        raise UserError(f"{path}: architecture {arch!r} is not a Gemma text model")
    return family


def _details(served: Served) -> dict[str, Any]:
    import gguf

    engine, gguf_file = served.engine, served.engine.kind == "llamacpp"
    params = engine.parameter_count()
    return {"parent_model": served.parent or "", "format": "gguf" if gguf_file else "safetensors",
            "family": served.family.name, "families": [served.family.name],
            "parameter_size": gguf.size_label(params, params, 0, 0), "quantization_level": engine.quantization_level()}

