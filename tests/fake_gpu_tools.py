"""Fake `amd-smi`, `rocm-smi` and `nvidia-smi` executables that print recorded outputs, for tests that run
`gemmaforge.system.gpu_tools.query_gpus` end to end (real subprocesses, real PATH lookup).

    install_fake_tools(tmp_path, amd_smi_metric=FIXTURES / "amd_smi_metric_rx7900xtx_list.json",
                       amd_smi_static=failing("amd-smi: no GPU found", status=2),
                       rocm_smi=FIXTURES / "rocm_smi_rx7900xtx.json")
    monkeypatch.setenv("PATH", str(tmp_path))

Keywords (a tool is installed only when one of its keywords is given):
  rocm_smi        what `rocm-smi ...` does
  nvidia_smi      what `nvidia-smi ...` does
  amd_smi_metric  what `amd-smi metric ...` does
  amd_smi_static  what `amd-smi static ...` does (an amd-smi subcommand with no keyword exits 2)
Each value is a Path (its bytes are printed), a str (printed as is) or a FakeRun from `failing` or `hanging`.
Every call is appended to `calls.log` in bin_dir; `read_calls(bin_dir)` returns them as argument lists.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

KEYWORDS = {
    "rocm_smi": ("rocm-smi", ""),
    "nvidia_smi": ("nvidia-smi", ""),
    "amd_smi_metric": ("amd-smi", "metric"),
    "amd_smi_static": ("amd-smi", "static"),
}

# -S skips site-packages: the fakes need only the standard library and start faster without it.
SCRIPT = """#!{python} -S
import json, sys, time
from pathlib import Path

runs = json.loads({runs!r})
with open(Path(__file__).with_name("calls.log"), "a", encoding="utf-8") as log:
    log.write(json.dumps([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\\n")
run = runs.get(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in runs else "")
if run is None:
    sys.stderr.write(f"{{Path(sys.argv[0]).name}}: no fake output for {{sys.argv[1:]}}\\n")
    sys.exit(2)
time.sleep(run["sleep_s"])
sys.stdout.buffer.write(run["stdout"].encode("latin-1"))
sys.stderr.write(run["stderr"])
sys.exit(run["status"])
"""


@dataclass(frozen=True)
class FakeRun:
    """What one fake invocation does: wait, print, exit."""

    stdout: bytes = b""
    stderr: str = ""
    status: int = 0
    sleep_s: float = 0.0


def failing(message: str, status: int = 1) -> FakeRun:
    """A tool that prints `message` on stderr and exits with `status`."""
    return FakeRun(stderr=message + "\n", status=status)


def hanging(seconds: float = 30.0) -> FakeRun:
    """A tool that answers nothing for `seconds` (the caller's timeout should kill it first)."""
    return FakeRun(sleep_s=seconds)


def _as_run(output: str | Path | FakeRun) -> FakeRun:
    if isinstance(output, FakeRun):
        return output
    if isinstance(output, Path):
        return FakeRun(stdout=output.read_bytes())
    return FakeRun(stdout=output.encode("utf-8"))


def install_fake_tools(bin_dir: Path, **outputs: str | Path | FakeRun) -> None:
    """Write the fake executables named by `outputs` (see the module docstring) into bin_dir."""
    unknown = set(outputs) - set(KEYWORDS)
    if unknown:
        raise TypeError(f"unknown fake tool keyword(s) {sorted(unknown)}; known: {sorted(KEYWORDS)}")
    tools: dict[str, dict[str, dict[str, object]]] = {}
    for keyword, output in outputs.items():
        tool, subcommand = KEYWORDS[keyword]
        run = _as_run(output)
        # latin-1 carries any byte through JSON and back unchanged, so a fixture is printed byte for byte.
        tools.setdefault(tool, {})[subcommand] = {
            "stdout": run.stdout.decode("latin-1"),
            "stderr": run.stderr,
            "status": run.status,
            "sleep_s": run.sleep_s,
        }
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool, runs in tools.items():
        path = bin_dir / tool
        path.write_text(SCRIPT.format(python=sys.executable, runs=json.dumps(runs)), encoding="utf-8")
        path.chmod(0o755)


def read_calls(bin_dir: Path) -> list[list[str]]:
    """Each fake invocation so far, as [tool, *arguments]."""
    log = bin_dir / "calls.log"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
