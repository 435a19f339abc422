"""`model.adapter` (LLaMA-Factory's adapter_name_or_path): a run that starts from an earlier run's adapter trains on
the base with that adapter merged in (the merge stage's own code, cached by contents), which is then the reference of
a preference run and the base of every later stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from gemmaforge.cli import main
from tests.helpers import write_config


def weights(folder: Path) -> dict:
    found: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


@pytest.mark.slow
def test_a_dpo_run_starts_from_an_sft_runs_adapter(tmp_path: Path, tiny_gemma3_dir: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The SFT run's adapter merged into the base is the DPO run's base (bitwise the SFT run's own merge), the DPO
    adapter trains on it, and the DPO run's merge carries both."""
    home = tmp_path / "home"
    monkeypatch.setenv("GEMMAFORGE_HOME", str(home))
    (tmp_path / "sft").mkdir()
    sft = write_config(tmp_path / "sft", tiny_gemma3_dir, max_steps=2, precision="fp32")
    assert main(["train", str(sft)]) == 0
    sft_run = tmp_path / "sft" / "run"
    records = [{"prompt": f"Is roast {i} ready?", "chosen": f"Barista says: roast {i} is ready.",
                "rejected": f"roast {i} is ready."} for i in range(12)]
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "dpo"), "model": {"name_or_path": str(tiny_gemma3_dir), "adapter": str(sft_run)},
        "data": {"path": str(tmp_path / "pairs.json"), "val_size": 2},
        "train": {"method": "dpo", "max_steps": 2, "per_device_train_batch_size": 2, "cutoff_len": 64,
                  "precision": "fp32", "save_steps": 2}}))
    assert main(["train", str(dpo)]) == 0
    assert "(model.adapter, once)" in capsys.readouterr().err
    base = json.loads((tmp_path / "dpo" / "manifest.json").read_text())["base_model"]
    assert base["adapter"] == str(sft_run) and Path(base["path"]).parent == home / "models"
    assert main(["merge", str(sft_run)]) == 0
    sft_model, adapted = weights(sft_run / "merged"), weights(Path(base["path"]))
    assert sft_model.keys() == adapted.keys() and all(sft_model[k].equal(adapted[k]) for k in sft_model)
    assert main(["merge", str(tmp_path / "dpo")]) == 0  # on the SFT model: its base is the adapted one
    dpo_model = weights(tmp_path / "dpo" / "merged")
    assert any(not dpo_model[k].equal(sft_model[k]) for k in sft_model)

    capsys.readouterr()
    assert main(["train", str(dpo), "output_dir=" + str(tmp_path / "again")]) == 0  # cached: merged once
    assert "(model.adapter, once)" not in capsys.readouterr().err


def test_what_is_not_an_adapter_to_start_from_exits_2(tmp_path: Path, tiny_gemma3_dir: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMAFORGE_HOME", str(tmp_path / "home"))
    (tmp_path / "runs").mkdir()
    config = write_config(tmp_path / "runs", tiny_gemma3_dir, max_steps=1)
    assert main(["train", str(config), f"model.adapter={tmp_path / 'nowhere'}"]) == 2
    assert f"model.adapter '{tmp_path / 'nowhere'}': expected a run directory that trained an adapter" \
        in capsys.readouterr().err
    adapter = tmp_path / "reward"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "modules_to_save": ["score"]}))
    assert main(["train", str(config), f"model.adapter={adapter}"]) == 2
    assert "a reward model's adapter scores answers" in capsys.readouterr().err
    assert not (tmp_path / "home" / "models").exists()  # nothing merged
