"""train -> merge -> export on a tiny random Gemma 3 through the real CLI entry point."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gemmaforge.cli import main
from gemmaforge.config import dump_config, load_config
from gemmaforge.families import FAMILIES
from tests.helpers import write_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("pipeline")
    before = hashlib.sha256((tiny_gemma3_dir / "model.safetensors").read_bytes()).hexdigest()
    assert main(["run", str(write_config(tmp, tiny_gemma3_dir))]) == 0
    return tmp / "run", before


@pytest.mark.slow
def test_run_dir_contract(tiny_run: tuple[Path, str]) -> None:
    run, _ = tiny_run
    for name in ("run.yaml", "manifest.json", "metrics.jsonl", "loss.png", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors", "merged/model.safetensors", "merged/tokenizer.json",
                 "gguf/model-f16.gguf", "gguf/model-q8_0.gguf", "ollama/Modelfile", "data/train.jsonl",
                 "data/val.jsonl", "data/stats.json", "eval/results.json", "eval/report.md", "eval/report.html"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not list(run.rglob("*.tmp")), "no temporary file may survive a successful run"


@pytest.mark.slow
def test_manifest_records_versions_base_and_stages(tiny_run: tuple[Path, str], tiny_gemma3_dir: Path) -> None:
    manifest = json.loads((tiny_run[0] / "manifest.json").read_text())
    assert manifest["template_family"] == "gemma3"
    assert manifest["base_model"]["path"] == str(tiny_gemma3_dir.resolve())
    assert {"torch", "transformers", "peft", "gguf"} <= set(manifest["versions"])
    if not torch.cuda.is_available():
        assert manifest["device"] == f"cpu ({os.cpu_count()} cores)"
    stages = manifest["stages"]
    assert list(stages) == ["data", "train", "eval", "merge", "export_gguf", "export_ollama"]
    assert all(s["status"] == "done" and s["runtime_s"] >= 0 for s in stages.values())
    assert len(stages["data"]["train_sha256"]) == 64
    assert stages["train"]["steps"] == 4 and stages["train"]["precision"] in ("fp32", "bf16")
    # docs/training.md: what stages.train records, and the base model with its revision (a local folder: the hash
    # of its files)
    assert {"samples", "samples_per_second", "supervised_tokens_per_second", "peak_memory_bytes",
            "planned_peak_bytes", "device", "precision", "resumed_from_step", "best_checkpoint", "data_wait_share",
            "padding_share", "slow_step_findings", "monitor_problems"} <= set(stages["train"])
    assert len(manifest["base_model"]["revision"]) == 64
    run_yaml = yaml.safe_load((tiny_run[0] / "run.yaml").read_text(encoding="utf-8"))
    assert run_yaml == yaml.safe_load(dump_config(load_config(tiny_run[0] / "run.yaml")))  # every default written
    assert run_yaml["train"]["lr_scheduler_type"] == "linear" and run_yaml["lora"]["use_dora"] is False


@pytest.mark.slow
def test_metrics_have_one_row_per_log_step(tiny_run: tuple[Path, str]) -> None:
    rows = [json.loads(line) for line in (tiny_run[0] / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert all({"loss", "learning_rate", "grad_norm", "supervised_tokens_per_second", "peak_memory_bytes"} <= set(r)
               for r in train_rows)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]


@pytest.mark.slow
def test_base_unchanged_lora_trained_merge_applies_it(tiny_run: tuple[Path, str], tiny_gemma3_dir: Path) -> None:
    run, before = tiny_run
    assert hashlib.sha256((tiny_gemma3_dir / "model.safetensors").read_bytes()).hexdigest() == before
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    lora_b = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert len(lora_b) == 2 * len(TARGETS)  # 2 layers x 4 targets
    assert all(v.abs().sum() > 0 for v in lora_b.values()), "lora_B starts at zero: every one must have moved"
    token_deltas = [v for k, v in adapter.items() if "trainable_tokens_delta" in k]
    assert len(token_deltas) == 1 and token_deltas[0].shape[0] == 2 and token_deltas[0].abs().sum() > 0
    base = load_file(tiny_gemma3_dir / "model.safetensors")
    merged = load_file(run / "merged" / "model.safetensors")
    assert set(merged) == set(base)
    for name, tensor in base.items():
        if name.endswith("embed_tokens.weight"):  # only the chat-marker rows were trained
            changed_rows = (merged[name] != tensor).any(dim=1).nonzero().flatten().tolist()
            assert changed_rows == [105, 106]
            continue
        changed = not bool((merged[name] == tensor).all())
        assert changed == any(f"{t}.weight" in name for t in TARGETS), name


@pytest.mark.slow
def test_merged_tokenizer_renders_the_training_format(tiny_run: tuple[Path, str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_run[0] / "merged")
    messages = json.loads((tiny_run[0] / "data" / "train.jsonl").read_text().splitlines()[0])["messages"]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == \
        FAMILIES["gemma3"].chat.render(messages).text
    config = json.loads((tiny_run[0] / "merged" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    # the adapter carries the same template, and the merged model's generation stops at <end_of_turn> (106)
    adapter_tokenizer = AutoTokenizer.from_pretrained(tiny_run[0] / "adapter")
    assert adapter_tokenizer.apply_chat_template(messages, tokenize=False) == \
        FAMILIES["gemma3"].chat.render(messages).text
    generation = json.loads((tiny_run[0] / "merged" / "generation_config.json").read_text())
    assert 106 in generation["eos_token_id"] and tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"


@pytest.mark.slow
def test_modelfile_points_at_q8_and_stops_at_end_of_turn(tiny_run: tuple[Path, str]) -> None:
    text = (tiny_run[0] / "ollama" / "Modelfile").read_text()
    assert "\nFROM ../gguf/model-q8_0.gguf\n" in text
    assert 'PARAMETER stop "<end_of_turn>"' in text
    assert "<bos>" not in text
    assert "ollama create tiny-coffee -f Modelfile" in text
    assert "SYSTEM" not in text  # trained without a system prompt
    # the config's sampling defaults (export.ollama) and the Gemma Terms of Use notice as its LICENSE
    for line in ("PARAMETER temperature 0.7", "PARAMETER top_p 0.95", "PARAMETER top_k 64", "PARAMETER num_ctx 4096"):
        assert f"\n{line}\n" in text, line
    assert ('LICENSE """Gemma is provided under and subject to the Gemma Terms of Use found at '
            'ai.google.dev/gemma/terms"""') \
        in text


def test_modelfile_carries_the_training_system_prompt(tmp_path: Path) -> None:
    from gemmaforge.config import load_config
    from gemmaforge.export.ollama import render_modelfile

    config = load_config(write_config(tmp_path, "unused"), ["data.system=你是咖啡师。"])
    text = render_modelfile("../gguf/model-q8_0.gguf", FAMILIES["gemma3"], config)
    assert 'SYSTEM """你是咖啡师。"""' in text
    config = load_config(write_config(tmp_path, "unused"), ["data.system=A", "export.ollama.system=B"])
    assert 'SYSTEM """B"""' in render_modelfile("x.gguf", FAMILIES["gemma3"], config)


@pytest.mark.slow
def test_stages_run_alone_on_the_run_dir(tiny_run: tuple[Path, str]) -> None:
    run = tiny_run[0]
    (run / "ollama" / "Modelfile").unlink()
    assert main(["export", "ollama", str(run)]) == 0
    assert (run / "ollama" / "Modelfile").is_file()
    assert main(["export", "gguf", str(run), "--quant", "f32"]) == 0
    assert (run / "gguf" / "model-f32.gguf").stat().st_size > (run / "gguf" / "model-f16.gguf").stat().st_size
    (run / "gguf" / "model-f32.gguf").unlink()  # the module's later verify runs read each file back: keep two


@pytest.mark.slow
def test_export_verify_reads_back_and_compares_every_gguf(tiny_run: tuple[Path, str]) -> None:
    pytest.importorskip("llama_cpp")
    run = tiny_run[0]
    assert main(["export", "verify", str(run)]) == 0
    report = json.loads((run / "gguf" / "verify.json").read_text())
    files = report["files"]
    assert {"f16", "q8_0"} <= set(files) and report["positions"] > 100
    val = (run / "data" / "val.jsonl").read_text().splitlines()
    assert report["prompts"] == min(8, len(val)) == 4  # the first 8 val conversations, of the 4 there are
    assert files["f16"]["top1_agreement"] >= 0.99 and files["f16"]["mean_kl"] < 1e-3
    assert files["q8_0"]["mean_kl"] > files["f16"]["mean_kl"]
    for result in files.values():
        assert result["tensors"] == 2 + 2 * 13 and result["keys"] > 30 and result["tensor_bytes"] > 0
    assert files["q8_0"]["tensor_types"] == ["F32", "Q8_0"]
    stage = json.loads((run / "manifest.json").read_text())["stages"]["export_verify"]
    assert stage["status"] == "done" and set(stage["files"]) == set(files)


@pytest.mark.slow
def test_export_verify_fails_on_an_f16_file_of_another_model(tiny_run: tuple[Path, str], tmp_path: Path,
                                                             embedded_model,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF that loads but computes something else (here: another random model) is caught."""
    pytest.importorskip("llama_cpp")
    from gemmaforge.export.gguf import write_gguf
    from tests.tiny_models import build_tiny_gemma3

    run = tiny_run[0]
    other = build_tiny_gemma3(tmp_path / "other", embedded_model.path, seed=1)
    original = (run / "gguf" / "model-f16.gguf").read_bytes()
    try:
        write_gguf(other, run / "gguf" / "model-f16.gguf", "f16")
        assert main(["export", "verify", str(run)]) == 1
        assert "top-1 agreement with the merged model is" in capsys.readouterr().err
    finally:
        (run / "gguf" / "model-f16.gguf").write_bytes(original)


@pytest.mark.slow
def test_split_export_is_verified_and_kept_from_ollama(tiny_run: tuple[Path, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A split q8_0 export: verify reads every shard and runs the set in llama.cpp; the Modelfile refuses it
    (Ollama cannot import split GGUF files) and stays as it was; exporting whole again removes the shards."""
    pytest.importorskip("llama_cpp")
    run = tiny_run[0]
    gguf_dir, modelfile = run / "gguf", (run / "ollama" / "Modelfile").read_text()
    assert main(["export", "gguf", str(run), "--quant", "q8_0", "--split-max-size", "lots"]) == 2
    assert "--split-max-size 'lots': expected a positive size such as 2G" in capsys.readouterr().err
    assert main(["export", "gguf", str(run), "--quant", "q8_0", "--split-max-tensors", "0"]) == 2
    assert "--split-max-tensors: expected a positive whole number, got '0'" in capsys.readouterr().err
    try:
        assert main(["export", "gguf", str(run), "--quant", "q8_0", "--split-max-tensors", "12"]) == 0
        assert sorted(p.name for p in gguf_dir.glob("model-q8_0*")) == [f"model-q8_0-0000{i}-of-00003.gguf"
                                                                          for i in (1, 2, 3)]
        assert main(["export", "verify", str(run)]) == 0
        q8 = json.loads((gguf_dir / "verify.json").read_text())["files"]["q8_0"]
        assert q8["shards"] == 3 and q8["tensors"] == 2 + 2 * 13 and q8["file"].endswith("-00001-of-00003.gguf")
        assert q8["top1_agreement"] >= 0.9
        assert main(["export", "ollama", str(run)]) == 2
        assert "is split into 3 shards and Ollama cannot import split GGUF files" in capsys.readouterr().err
        assert (run / "ollama" / "Modelfile").read_text() == modelfile
    finally:
        assert main(["export", "gguf", str(run), "--quant", "q8_0"]) == 0
    assert sorted(p.name for p in gguf_dir.glob("model-q8_0*")) == ["model-q8_0.gguf"]


@pytest.mark.slow
def test_a_bf16_base_merges_into_bf16_weights(tmp_path: Path, tiny_gemma3_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/export.md (`gemmaforge merge`): the merge copies the base's files, adds each adapted weight in fp32 and
    stores it back in bf16: the merged bf16 weights are, bit for bit, an fp32 merge cast to bf16, in the base's files.
    """
    import shutil

    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.bfloat16).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        if (tiny_gemma3_dir / name).is_file():
            shutil.copy(tiny_gemma3_dir / name, base / name)
    config = write_config(tmp_path, base, max_steps=1, save_steps=1, eval_strategy="no")
    assert main(["train", str(config), "eval.enabled=false"]) == 0
    added_in = []
    merge_layer = LoraLinear.merge

    def recorded_merge(layer, *args, **kwargs):
        if not layer.merged:  # merge_and_unload asks again once all are merged: nothing is added then
            added_in.append(layer.get_base_layer().weight.dtype)
        return merge_layer(layer, *args, **kwargs)

    monkeypatch.setattr(LoraLinear, "merge", recorded_merge)
    assert main(["merge", str(tmp_path / "run")]) == 0
    assert added_in and set(added_in) == {torch.float32}  # each weight a LoRA delta is added to, one at a time
    assert sorted(p.name for p in (tmp_path / "run" / "merged").glob("*.safetensors")) == ["model.safetensors"]
    merged = load_file(tmp_path / "run" / "merged" / "model.safetensors")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["merge"]["dtype"] == "bfloat16"
    in_fp32 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # bf16 -> fp32 is exact
    want = PeftModel.from_pretrained(in_fp32, tmp_path / "run" / "adapter").merge_and_unload().state_dict()
    before = load_file(base / "model.safetensors")
    for name, tensor in merged.items():
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name
    assert sum(not torch.equal(tensor, before[name]) for name, tensor in merged.items()) >= 8  # q/k/v/o x 2 layers


@pytest.mark.parametrize("variant", ["use_rslora", "use_dora"])
@pytest.mark.slow
def test_rslora_and_dora_merge_into_what_the_adapter_computes(tmp_path: Path, tiny_gemma3_dir: Path,
                                                              variant: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=2, save_steps=2, eval_strategy="no")
    assert main(["train", str(config), f"lora.{variant}=true", "eval.enabled=false"]) == 0
    run = tmp_path / "run"
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())[variant] is True
    assert main(["merge", str(run)]) == 0
    ids = torch.tensor([[2, 105, 2364, 107, 9259, 106, 107, 105, 4368, 107]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    with torch.no_grad():
        want, got = adapted(ids).logits, merged(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - base).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.slow
def test_merge_of_a_qlora_run_reloads_the_base_in_full_precision(tiny_run: tuple[Path, str], tmp_path: Path) -> None:
    """A run whose config says model.load_in_4bit merges on this machine (no GPU, no 4-bit kernels) into the
    same weights: merge never reads the setting, it reloads the base in full precision."""
    import shutil

    import yaml

    run = shutil.copytree(tiny_run[0], tmp_path / "run", ignore=shutil.ignore_patterns("merged", "gguf", "checkpoints"))
    config = yaml.safe_load((run / "run.yaml").read_text(encoding="utf-8"))
    config["model"]["load_in_4bit"] = True
    (run / "run.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    assert main(["merge", str(run)]) == 0
    merged = load_file(run / "merged" / "model.safetensors")
    reference = load_file(tiny_run[0] / "merged" / "model.safetensors")
    assert merged.keys() == reference.keys() and all(torch.equal(merged[k], reference[k]) for k in reference)
    assert "quantization_config" not in json.loads((run / "merged" / "config.json").read_text())


def test_export_ollama_create_runs_ollama_create_beside_the_modelfile(tmp_path: Path, tiny_gemma3_dir: Path,
                                                                      monkeypatch, capsys) -> None:
    """`--create` runs `ollama create NAME -f Modelfile` in the Modelfile's folder (a recording `ollama` on PATH);
    its failure is the stage's (exit 1), and without `ollama` the command says what to run (exit 2)."""
    from gemmaforge.runs import RunDir

    run = RunDir.create(load_config(write_config(tmp_path, tiny_gemma3_dir))).root
    (run / "gguf").mkdir()
    (run / "gguf" / "model-q8_0.gguf").write_bytes(b"GGUF")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "ollama").write_text(f'#!/bin/sh\necho "$PWD $*" >> {calls}\nexit "${{OLLAMA_EXIT:-0}}"\n')
    (bin_dir / "ollama").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert main(["export", "ollama", str(run), "--create"]) == 0
    modelfile = run / "ollama" / "Modelfile"
    assert calls.read_text() == f"{run / 'ollama'} create tiny-coffee -f {modelfile}\n"
    monkeypatch.setenv("OLLAMA_EXIT", "3")
    assert main(["export", "ollama", str(run), "--create"]) == 1
    assert "`ollama create tiny-coffee` failed with exit code 3" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert main(["export", "ollama", str(run), "--create"]) == 2
    assert "--create needs the `ollama` command on PATH" in " ".join(capsys.readouterr().err.split())


def test_the_modelfile_serve_and_eval_deploy_the_same_gguf(tmp_path: Path) -> None:
    """One rule (docs/export.md and docs/evaluation.md: Modelfile, `serve --engine llamacpp`, `eval --engine llamacpp`):
    q8_0 when written, else the first of export.gguf that was written, else the first written; eval.gguf overrides it
    for eval, and a split export is opened at its first shard."""
    from gemmaforge.errors import UserError
    from gemmaforge.evaluate.evaluation import deployed_gguf
    from gemmaforge.runs import RunDir

    run = RunDir.create(load_config(write_config(tmp_path, "unused")))
    run.gguf_dir.mkdir()

    def written(*names: str, quants: list[str] | None = None) -> str:
        for old in run.gguf_dir.iterdir():
            old.unlink()
        for name in names:
            (run.gguf_dir / name).write_bytes(b"GGUF")
        config = run.config()
        if quants is not None:
            config.export.gguf = quants
        return run.deployed_quant(config)

    assert written("model-f16.gguf", "model-q8_0.gguf") == "q8_0"
    assert written("model-f16.gguf") == "f16"
    assert written("model-f16.gguf", "model-q4_k_m.gguf", quants=["q4_k_m", "f16"]) == "q4_k_m"
    assert written("model-bf16.gguf") == "bf16"  # written by `export gguf --quant bf16` alone
    assert written(quants=["f16"]) == "f16"  # none yet: the caller names the missing file
    with pytest.raises(UserError, match="export.gguf is empty and no model GGUF was written"):
        written(quants=[])
    written("model-f16.gguf", "model-q8_0-00001-of-00002.gguf", "model-q8_0-00002-of-00002.gguf")
    config = run.config()
    assert deployed_gguf(run, config) == run.gguf_dir / "model-q8_0-00001-of-00002.gguf"
    config.eval.engine, config.eval.gguf = "llamacpp", "f16"
    assert deployed_gguf(run, config) == run.gguf_dir / "model-f16.gguf"
