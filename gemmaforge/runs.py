"""The run directory: the one contract between stages.

Every stage reads what it needs from a RunDir and writes its outputs into it atomically (temporary
name, then rename), so a killed stage never leaves a file that looks finished.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from gemmaforge.config import RunConfig, dump_config, load_config
from gemmaforge.console import console
from gemmaforge.distributed import barrier, gather, local_rank, node_count, rank
from gemmaforge.errors import UserError
from gemmaforge.gguf_names import exports_in

_VERSIONED_PACKAGES = ("gemmaforge", "torch", "transformers", "peft", "accelerate", "gguf", "safetensors")


class RunDir:
    def __init__(self, root: Path | str, per_node: bool = False):
        self.root = Path(root)
        # whether each node of a multi-node run keeps its own copy (the nodes do not share it: RunDir.create probes)
        self.per_node = per_node

    @property
    def writes(self) -> bool:
        """Whether this process writes the run directory: rank 0, or each node's first process when every node keeps
        its own copy. Under torchrun every rank runs each stage; the others wait at barriers and train."""
        return (local_rank() if self.per_node else rank()) == 0

    # ------------------------------------------------------------------ paths
    @property
    def config_path(self) -> Path:
        return self.root / "run.yaml"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def adapter_dir(self) -> Path:
        return self.root / "adapter"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def loss_plot_path(self) -> Path:
        return self.root / "loss.png"

    @property
    def merged_dir(self) -> Path:
        return self.root / "merged"

    @property
    def gguf_dir(self) -> Path:
        return self.root / "gguf"

    @property
    def ollama_dir(self) -> Path:
        return self.root / "ollama"

    def gguf_path(self, quant: str) -> Path:
        return self.gguf_dir / f"model-{quant}.gguf"

    def model_ggufs(self) -> dict[str, list[Path]]:
        """The model GGUFs written, by quant: {"f16": [model-f16.gguf], "q8_0": [its shards ...]}."""
        return exports_in(self.gguf_dir, "model-")

    def deployed_quant(self, config: RunConfig) -> str:
        """The model GGUF that is deployed, one rule for the Modelfile, `serve --engine llamacpp` and `eval --engine
        llamacpp`: q8_0 when written (Ollama's usual size/quality trade), else the first of export.gguf that was
        written, else the first written; with none written, the one export.gguf would deploy (the caller then says
        it is missing)."""
        found = self.model_ggufs()
        quants = list(config.export.gguf)
        for quant in ("q8_0", *quants, *found):
            if quant in found:
                return quant
        if not quants:
            raise UserError("export.gguf is empty and no model GGUF was written: nothing to deploy")
        return "q8_0" if "q8_0" in quants else quants[0]

    @property
    def mmproj_path(self) -> Path:
        """A multimodal checkpoint's towers as llama.cpp's projector file."""
        return self.gguf_dir / "mmproj-f16.gguf"

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, config: RunConfig) -> RunDir:
        """Make (or reopen) the run directory for a config and write run.yaml."""
        run = cls(config.output_dir)
        try:
            run.root.mkdir(parents=True, exist_ok=True)
            # A private probe: under torchrun every rank probes the same directory at once.
            with tempfile.NamedTemporaryFile(dir=run.root, prefix=".write-test-"):
                pass
        except OSError as exc:
            raise UserError(f"output_dir '{run.root}': cannot write there ({exc.strerror})") from None
        if node_count() > 1:
            run.per_node = not run.shared_between_nodes()
        if run.writes:
            atomic_write_text(run.config_path, dump_config(config))
        return run

    def shared_between_nodes(self) -> bool:
        """Whether every node sees rank 0's run directory: rank 0 writes a random token there and each node's
        first process looks for it. Called by every rank of a multi-node run."""
        probe = self.root / ".gemmaforge-node-probe"
        token = str(gather(uuid.uuid4().hex)[0])  # rank 0's
        if rank() == 0:
            atomic_write_text(probe, token)
        barrier()
        seen = local_rank() != 0 or (probe.is_file() and probe.read_text() == token)
        shared = all(gather(seen))
        barrier()  # everyone has looked
        if rank() == 0:
            probe.unlink(missing_ok=True)
        if not shared and local_rank() == 0:
            console.print(f"[yellow]gemmaforge[/]: the nodes do not share {self.root}: each node prepares the data "
                          "and keeps its own run directory and checkpoints")
        return shared

    @classmethod
    def open(cls, root: Path | str) -> RunDir:
        run = cls(root)
        if not run.config_path.is_file():
            raise UserError(f"{run.root}: not a run directory (no run.yaml); run `gemmaforge run CONFIG` first")
        return run

    def config(self) -> RunConfig:
        return load_config(self.config_path)

    def trained_with_tools(self) -> bool:
        """Whether the prepared training data (data/stats.json) had conversations that offer tools."""
        try:
            stats = json.loads((self.data_dir / "stats.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return bool(stats.get("tool_conversations"))

    # ------------------------------------------------------------------ manifest
    def manifest(self) -> dict[str, Any]:
        if self.manifest_path.is_file():
            return json.loads(self.manifest_path.read_text(encoding="utf-8"))
        return {
            "created": _now(),
            "versions": _versions(),
            "platform": platform.platform(),
            "device": _device(),
            "stages": {},
        }

    def update_manifest(self, **fields: Any) -> None:
        if not self.writes:  # under torchrun every rank runs the stage; one writes
            return
        manifest = self.manifest()
        manifest.update(fields)
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")

    def record_stage(self, stage: str, **fields: Any) -> None:
        if not self.writes:
            return
        manifest = self.manifest()
        manifest["stages"].setdefault(stage, {}).update(fields)
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")

    def require(self, path: Path, stage: str) -> Path:
        """The output of an earlier stage, or a clear error saying which stage makes it."""
        if not path.exists():
            raise UserError(f"{path} is missing: run `gemmaforge {stage} {self.root}` first")
        return path

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Record a stage's status and timing in the manifest; the body may add fields to the dict. The process and
        host are recorded so that a dashboard can tell a running stage from one whose process died, and stop it."""
        self.record_stage(name, status="running", started=_now(), pid=os.getpid(), host=socket.gethostname())
        extra: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            yield extra
        except BaseException as exc:
            status = "stopped" if isinstance(exc, KeyboardInterrupt) else "failed"
            self.record_stage(name, status=status, runtime_s=round(time.perf_counter() - start, 3))
            raise
        self.record_stage(name, status="done", runtime_s=round(time.perf_counter() - start, 3), **extra)


# ---------------------------------------------------------------------------- atomic writes


def refuse_reward_model(run: RunDir, config: RunConfig, what: str) -> None:
    """UserError when the run trained a reward model, for `what` (a verb) that needs a model that writes text."""
    if config.train.method == "rm":
        raise UserError(f"{run.root}: a reward model (train.method: rm) scores answers and writes none, so {what} "
                        f"does not apply: `gemmaforge merge {run.root}` writes it as a sequence classifier "
                        "(transformers' AutoModelForSequenceClassification), its deployable form")


def ollama_model_name(config: RunConfig) -> str:
    """The name a run's model is created under in Ollama and served by: export.ollama.name, else the run
    directory's name."""
    return config.export.ollama.name or Path(config.output_dir).name


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces `path` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _device() -> str:
    import torch

    if torch.cuda.is_available():  # ROCm builds answer here too, with the AMD GPU's name
        return f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU)"
    return f"cpu ({os.cpu_count()} cores)"


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
