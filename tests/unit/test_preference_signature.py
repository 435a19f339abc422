"""benchmarks/preference_signature.py's dry run: the SFT set uses both openings equally, each pair differs from its
other side only in the opening, the pairs' questions are not the SFT run's, every config is valid and every
preference run starts from the SFT run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "preference_signature.py"
PREFERRED, OTHER = "咖啡师小贴士：", "温馨提示："


def test_dry_run_writes_balanced_sft_data_pairs_and_valid_configs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sft = json.loads((tmp_path / "sft.json").read_text(encoding="utf-8"))
    pairs = json.loads((tmp_path / "pairs.json").read_text(encoding="utf-8"))
    openings = [r["output"][:len(PREFERRED)].startswith(PREFERRED) for r in sft]
    assert len(sft) > 100 and abs(sum(openings) - len(sft) / 2) <= 1
    assert all(r["output"].startswith((PREFERRED, OTHER)) for r in sft)
    assert len(pairs) > 100
    assert all(p["chosen"].removeprefix(PREFERRED) == p["rejected"].removeprefix(OTHER) != p["chosen"]
               for p in pairs)
    assert not {r["instruction"] for r in sft} & {p["prompt"] for p in pairs}
    suite = yaml.safe_load((tmp_path / "suite.yaml").read_text(encoding="utf-8"))["cases"]
    assert len(suite) >= 10 and all(c["checks"] == [{"starts_with": "咖啡师小贴士"}] for c in suite)

    configs = {Path(p).stem: yaml.safe_load(Path(p).read_text(encoding="utf-8"))
               for p in json.loads(proc.stdout)["configs"]}
    assert list(configs) == ["sft", "dpo", "kto", "orpo", "rm"]
    assert "adapter" not in configs["sft"]["model"] and configs["sft"]["train"].get("method", "sft") == "sft"
    for name in ("dpo", "kto", "orpo", "rm"):
        assert configs[name]["model"]["adapter"] == str(tmp_path / "sft")
        assert configs[name]["data"]["path"] == str(tmp_path / "pairs.json")
    assert configs["orpo"]["train"]["pref_loss"] == "orpo" and configs["rm"]["export"]["gguf"] == []
    assert configs["kto"]["train"]["max_steps"] == 2 * configs["dpo"]["train"]["max_steps"]  # answers, not pairs
    assert not (tmp_path / "sft").exists()  # nothing trained
