"""The LoRA adapter as a GGUF adapter: llama.cpp applies it to the base GGUF and computes the merged model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemmaforge.cli import main
from gemmaforge.errors import UserError
from gemmaforge.export.gguf import write_gguf
from gemmaforge.export.gguf_adapter import write_adapter_gguf
from gemmaforge.gguf_file import read_gguf
from gemmaforge.model_spec import read_spec
from tests.helpers import write_config


@pytest.mark.slow
def test_llama_cpp_with_the_adapter_gguf_computes_the_merged_model(tmp_path: Path, tiny_gemma3_dir: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=2, save_steps=2)
    assert main(["train", str(config), "lora.train_template_tokens=false", "lora.use_rslora=true"]) == 0
    run = tmp_path / "run"
    assert main(["export", "gguf", str(run), "--adapter"]) == 0
    assert main(["merge", str(run)]) == 0
    reader = read_gguf(run / "gguf" / "adapter-f16.gguf")
    assert reader.fields["adapter.type"].value == "lora"
    assert reader.fields["adapter.lora.alpha"].value == pytest.approx(8 * 2.0)  # rsLoRA: alpha * sqrt(r=4)
    assert len(reader.tensors) == 2 * 4 * 2  # 2 layers x q/k/v/o x (lora_a, lora_b)
    assert read_gguf(run / "gguf" / "base-f16.gguf").fields["general.file_type"].value == 1

    assert main(["export", "ollama", str(run), "--adapter"]) == 0
    modelfile = (run / "ollama" / "Modelfile").read_text()
    assert "\nFROM ../gguf/base-f16.gguf\nADAPTER ../gguf/adapter-f16.gguf\nTEMPLATE " in modelfile

    base = write_gguf(tiny_gemma3_dir, tmp_path / "base-f32.gguf", "f32")
    tokenizer = AutoTokenizer.from_pretrained(run / "merged")
    tokens = tokenizer("<start_of_turn>user\nWhat is a flat white?<end_of_turn>\n<start_of_turn>model\n").input_ids
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want = merged(torch.tensor([tokens])).logits[0].numpy()
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)(
            torch.tensor([tokens])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(run / "gguf" / "adapter-f16.gguf"), n_ctx=128,
                          n_threads=2, logits_all=True, verbose=False)
    llm.eval(tokens)
    got = np.asarray(llm.scores[: len(tokens)])
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < 5e-3, error
    # the adapter matters: the base alone is much further from the merged model than that
    assert np.linalg.norm(base_logits - want) / np.linalg.norm(want) > 10 * error


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"use_dora": True}, "is a DoRA adapter, which llama.cpp cannot apply as an adapter"),
        ({"modules_to_save": ["lm_head"]}, "trains whole modules (lm_head)"),
        ({"trainable_token_indices": [105, 106]}, "or train with lora.train_template_tokens: false"),
        ({"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
         "adapts expert weights (experts.gate_up_proj, experts.down_proj)"),
    ],
)
def test_adapters_without_a_gguf_form_are_refused(tmp_path: Path, tiny_gemma3_dir: Path, change: dict,
                                                  expected: str) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, **change}))
    with pytest.raises(UserError, match="export the merged model instead") as info:
        write_adapter_gguf(adapter, tmp_path / "adapter-f16.gguf", read_spec(tiny_gemma3_dir))
    assert expected in str(info.value) and not (tmp_path / "adapter-f16.gguf").exists()


def test_modelfile_with_adapter_needs_the_adapter_export(tmp_path: Path, tiny_gemma3_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from gemmaforge.config import load_config
    from gemmaforge.runs import RunDir

    RunDir.create(load_config(write_config(tmp_path, tiny_gemma3_dir)))
    assert main(["export", "ollama", str(tmp_path / "run"), "--adapter"]) == 2
    assert "base-f16.gguf is missing: run `gemmaforge export gguf --adapter" in \
        " ".join(capsys.readouterr().err.split())
