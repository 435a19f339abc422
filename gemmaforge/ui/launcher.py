"""Start, stop and resume runs from the dashboard, each as its own `gemmaforge run` process.

A run started here is exactly `gemmaforge run RUN_DIR/run.yaml output_dir=RUN_DIR` in a new session: closing
the browser or stopping the dashboard leaves it training, and the dashboard learns how it goes from the run
directory alone, as it does for runs started in a terminal. Its console output goes to RUN_DIR/run.log.
Stopping sends the running stage's process (recorded in the manifest) SIGINT: the stage records 'stopped',
and a resume continues training from its last complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gemmaforge.config import RunConfig, dump_config
from gemmaforge.errors import UserError
from gemmaforge.runs import RunDir, atomic_write_text
from gemmaforge.ui.overview import read_json, running_pid

LOG_NAME = "run.log"
# `gemmaforge run` as the child's program. A shell that starts the dashboard in the background (`gemmaforge ui &`)
# hands SIGINT down ignored, and Python then raises no KeyboardInterrupt for it: the child takes it back, so that
# Stop reaches the stage.
_CHILD = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from gemmaforge.cli import main; sys.exit(main())")


class Launcher:
    def __init__(self) -> None:
        self._children: dict[Path, subprocess.Popen[bytes]] = {}

    def start(self, config: RunConfig) -> Path:
        """Write the run's run.yaml and start `gemmaforge run` on it; the run directory."""
        root = Path(config.output_dir).resolve()
        self.check_free(root)
        config = config.model_copy(update={"output_dir": str(root)})
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(root / "run.yaml", dump_config(config))
        self._spawn(root)
        return root

    def check_free(self, root: Path) -> None:
        """Refuse a new run in a folder that holds one (running or not)."""
        root = root.resolve()
        if self.busy(root):
            raise UserError(f"{root} is running already: stop it first")
        if (root / "run.yaml").exists() and (root / "manifest.json").exists():
            raise UserError(f"{root} holds a run already: resume it, or choose another output_dir")

    def resume(self, root: Path) -> None:
        """Run the pipeline again on the run's own run.yaml: training continues from its last checkpoint."""
        if self.busy(root):
            raise UserError(f"{root} is running already")
        RunDir.open(root)
        self._spawn(root)

    def stop(self, root: Path) -> bool:
        """Interrupt the run's process; False when nothing of it is running."""
        self.reap()
        pid = running_pid(read_json(root / "manifest.json") or {})
        child = self._children.get(root.resolve())
        if pid is None and child is not None:  # started here, no stage recorded yet (still loading)
            pid = child.pid
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    def busy(self, root: Path) -> bool:
        self.reap()
        return root.resolve() in self._children or running_pid(read_json(root / "manifest.json") or {}) is not None

    def reap(self) -> None:
        """Forget the children that have ended (and collect their exit status, so none is left a zombie)."""
        for root, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[root]

    def _spawn(self, root: Path) -> None:
        command = [sys.executable, "-c", _CHILD, "run", str(root / "run.yaml"), f"output_dir={root}"]
        with (root / LOG_NAME).open("ab") as log:
            self._children[root.resolve()] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"},
            )


def log_tail(root: Path, lines: int = 40) -> str:
    """The last lines of a run's console output (progress bars' carriage returns kept to their last state)."""
    path = root / LOG_NAME
    if not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n")[-lines:])
