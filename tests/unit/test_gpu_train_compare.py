"""benchmarks/gpu_train_compare.py's dry run on a machine without a GPU: the long-tailed data, the real
architectures' configs with the family's chat format, every trainer reported as skipped, the table written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_train_compare.py"


@pytest.mark.slow
def test_dry_run_prepares_every_input_and_reports_every_trainer(tmp_path: Path, embedded_model) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run",
                           "--models", "gemma3-1b,gemma4-e2b"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "compare.json").read_text())
    setup = results["setup"]
    assert setup["records"] == 256 and 400 <= setup["median_chars"] <= 600 and 2000 < setup["longest_chars"] <= 3300
    assert list(results["runs"]) == [f"{m}:{t}" for m in ("gemma3-1b", "gemma4-e2b")
                                     for t in ("recipe", "trl", "unsloth", "gemmaforge")]
    assert all(r == {"status": "skipped", "reason": "--dry-run"} for r in results["runs"].values())
    work = tmp_path / "out-work"
    one_b = AutoConfig.from_pretrained(work / "gemma3-1b")
    assert (type(one_b).__name__, one_b.num_hidden_layers, one_b.hidden_size) == ("Gemma3TextConfig", 26, 1152)
    e2b = AutoConfig.from_pretrained(work / "gemma4-e2b")
    assert (type(e2b).__name__, e2b.num_kv_shared_layers) == ("Gemma4TextConfig", 20)
    assert json.loads((work / "gemma4-e2b" / "config.json").read_text())["global_head_dim"] == 512
    rendered = AutoTokenizer.from_pretrained(work / "gemma4-e2b").apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|turn>user" in rendered
    assert "| gemma4-e2b | gemmaforge |" in (out / "summary.md").read_text()


def test_an_unknown_trainer_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", "unused", "--dry-run", "--trainers", "axolotl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown model or trainer: axolotl" in proc.stderr
