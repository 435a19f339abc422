"""LLaMA-Factory configs run unchanged: its own example YAMLs (../shared/llamafactory/examples, read there) with the
model and template pointed at a tiny Gemma 3 and its data/ folder, the walkthrough's nested lora_config /
training_args form, its merge_lora export YAML, and the keys that cannot be translated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gemmaforge.cli import main
from gemmaforge.compat.llamafactory import IGNORED, REFUSED, STAGES, TRANSLATED

# the walkthrough's blocks (../shared/seeds, section 4.1 and 4.2) as its author wrote them, the two lines it leaves
# commented out (model and dataset) filled in
WALKTHROUGH = """\
model_name_or_path: {model}
dataset: identity
dataset_dir: {data}
template: gemma3
lora_config:
  r: 16
  lora_alpha: 32
  target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
  lora_dropout: 0.05
  bias: none
  use_rslora: false
  use_dora: false
training_args:
  output_dir: {out}
  num_train_epochs: 3
  per_device_train_batch_size: 4
  per_device_eval_batch_size: 4
  gradient_accumulation_steps: 4
  learning_rate: 2e-4
  warmup_steps: 100
  logging_steps: 10
  save_steps: 200
  evaluation_strategy: steps
  eval_steps: 100
  save_total_limit: 3
  bf16: true
  tf32: false
  gradient_checkpointing: true
  dataloader_num_workers: 4
  report_to: none
"""


def example(llamafactory_data: Path, name: str, tmp_path: Path, gemma: Path, **changes: object) -> Path:
    """LLaMA-Factory's example YAML `name` with the model, template, data folder and output_dir pointed here."""
    raw = yaml.safe_load((llamafactory_data.parent / "examples" / name).read_text(encoding="utf-8"))
    raw.update({"model_name_or_path": str(gemma), "template": "gemma3", "dataset_dir": str(llamafactory_data),
                "output_dir": str(tmp_path / "saves"), **changes})
    path = tmp_path / Path(name).name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def converted(path: Path, capsys) -> tuple[dict, str]:
    assert main(["config", "convert", str(path)]) == 0
    text = capsys.readouterr().out
    return yaml.safe_load(text), text


def test_the_sft_example_converts_key_by_key(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                             capsys) -> None:
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir)
    config, text = converted(path, capsys)
    assert config["model"]["name_or_path"] == str(tiny_gemma3_dir)
    assert config["data"]["dataset"] == ["identity", "alpaca_en_demo"]
    assert config["data"]["path"] == str(llamafactory_data) and config["data"]["max_samples"] == 1000
    assert config["lora"] | {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "target_modules": "all-linear"} == \
        config["lora"]  # lora_alpha: twice the rank, dropout 0, all linear layers: LLaMA-Factory's defaults
    train = config["train"]
    assert (train["per_device_train_batch_size"], train["gradient_accumulation_steps"], train["learning_rate"],
            train["num_train_epochs"], train["lr_scheduler_type"], train["warmup_ratio"], train["cutoff_len"],
            train["precision"], train["save_steps"], train["logging_steps"], train["dataloader_num_workers"]) == \
        (1, 8, 1e-4, 3.0, "cosine", 0.1, 2048, "bf16", 500, 10, 4)
    assert config["output_dir"] == str(tmp_path / "saves")
    assert train["gradient_checkpointing"] is True  # LLaMA-Factory's default (disable_gradient_checkpointing)
    # LLaMA-Factory's sft: padded batches, over-long examples cut, no evaluation during training, no cleaning
    assert (train["packing"], train["eval_strategy"], config["data"]["clean"]["overlong"]) == (False, "no", "truncate")
    assert config["data"]["clean"] | {"strip_html": False, "remove_control_chars": False, "dedup": "none"} == \
        config["data"]["clean"]
    for ignored in ("trust_remote_code", "preprocessing_num_workers", "plot_loss", "overwrite_output_dir",
                    "save_only_model", "ddp_timeout"):
        assert f"#   {ignored}: " in text  # each listed once, with its reason
    assert "#   template -> checked against the model's family" in text


@pytest.mark.slow
def test_plan_reads_it_too(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path, capsys) -> None:
    """`gemmaforge plan` on the LLaMA-Factory file: its batch and cutoff, as translated, are what is planned."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir)
    assert main(["plan", str(path), "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert (plan["batch_size"], plan["cutoff_len"]) == (1, 2048)


def test_every_key_of_the_examples_is_in_one_table(llamafactory_data: Path) -> None:
    """No key of LLaMA-Factory's own SFT, pretraining, DPO and KTO examples (every one its sdist ships, LoRA and
    QLoRA) falls through: each is translated, ignored or refused."""
    tables = TRANSLATED.keys() | IGNORED.keys() | REFUSED.keys()
    examples = llamafactory_data.parent / "examples"
    checked = []
    for path in sorted([*examples.glob("train_lora/*.yaml"), *examples.glob("train_qlora/*.yaml")]):
        raw = yaml.safe_load(path.read_text())
        if raw.get("stage") in STAGES:
            assert set(raw) - tables == set(), path.name
            checked.append(path.name)
    assert {"qwen3_lora_sft.yaml", "qwen3_lora_sft_ds3.yaml", "qwen3vl_lora_sft.yaml",
            "qwen3_lora_pretrain.yaml", "qwen3_lora_dpo.yaml", "qwen3_lora_kto.yaml"} <= set(checked), checked


def test_the_llamafactory_page_explains_every_translated_key() -> None:
    """docs/llamafactory.md's hand-written table explains each key the translation translates (the ignored and
    refused ones are tables written from the code when the site is built: tests/unit/test_docs.py)."""
    from gemmaforge.compat.llamafactory import PEFT_KEYS

    page = (Path(__file__).parents[2] / "docs" / "llamafactory.md").read_text(encoding="utf-8")
    assert [key for key in [*TRANSLATED, *PEFT_KEYS] if f"`{key}`" not in page] == []


def test_the_walkthrough_nested_form(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                     capsys) -> None:
    path = tmp_path / "train_config.yaml"
    path.write_text(WALKTHROUGH.format(model=tiny_gemma3_dir, data=llamafactory_data, out=tmp_path / "out"))
    config, text = converted(path, capsys)
    assert config["lora"]["r"] == 16 and config["lora"]["lora_alpha"] == 32 and config["lora"]["lora_dropout"] == 0.05
    assert config["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]
    train = config["train"]
    assert (train["num_train_epochs"], train["per_device_train_batch_size"], train["gradient_accumulation_steps"],
            train["learning_rate"], train["warmup_steps"], train["eval_strategy"], train["eval_steps"],
            train["save_total_limit"], train["precision"], train["gradient_checkpointing"]) == \
        (3, 4, 4, 2e-4, 100, "steps", 100, 3, "bf16", True)
    assert config["eval"]["batch_size"] == 4
    assert "#   training_args.tf32: " in text and "#   lora_config.r -> lora.r: 16" in text
    path.write_text(path.read_text().replace("  lora_alpha: 32\n", "").replace("  target_modules: [q_proj, k_proj, "
                                                                           "v_proj, o_proj, gate_proj, up_proj, "
                                                                           "down_proj]\n", ""))
    config, _ = converted(path, capsys)  # PEFT's LoraConfig defaults, not LLaMA-Factory's
    assert (config["lora"]["lora_alpha"], config["lora"]["target_modules"]) == (8, ["q_proj", "v_proj"])


@pytest.mark.integration
@pytest.mark.slow
def test_the_sft_example_trains_and_its_merge_example_merges(llamafactory_data: Path, tiny_gemma3_dir: Path,
                                                             tmp_path: Path, capsys) -> None:
    """`gemmaforge run` on LLaMA-Factory's example (identity + alpaca_en_demo), a few steps, through eval, merge and
    GGUF; run.yaml holds the translation; then its merge_lora YAML, pointed at the run, merges into export_dir."""
    from safetensors import safe_open

    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir, max_samples=24,
                   cutoff_len=256, val_size=4)
    assert main(["run", str(path), "train.max_steps=2", "train.precision=fp32", "eval.num_samples=2",
                 "eval.max_new_tokens=8", "eval.retention=false", "export.gguf=[f16]"]) == 0
    err = capsys.readouterr().err
    assert "is an LLaMA-Factory config, read as gemmaforge's" in err and "ddp_timeout: " in err
    run = tmp_path / "saves"
    written = yaml.safe_load((run / "run.yaml").read_text())
    assert written["lora"]["target_modules"] == "all-linear" and written["data"]["max_samples"] == 24
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["records"] == 48  # the first 24 of each dataset (max_samples)
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert {"data", "train", "eval", "merge", "export_gguf", "export_ollama"} <= stages.keys()

    raw = yaml.safe_load((llamafactory_data.parent / "examples" / "merge_lora" / "qwen3_lora_sft.yaml").read_text())
    raw.update(model_name_or_path=str(tiny_gemma3_dir), template="gemma3", adapter_name_or_path=str(run),
               export_dir=str(tmp_path / "merged"), finetuning_type="lora", infer_dtype="auto")
    merge_yaml = tmp_path / "merge.yaml"
    merge_yaml.write_text(yaml.safe_dump(raw))
    assert main(["merge", str(merge_yaml)]) == 0
    assert "export_size: ignored (" in capsys.readouterr().err
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as merged, \
            safe_open(tiny_gemma3_dir / "model.safetensors", "pt") as base:
        assert not merged.get_tensor(name).equal(base.get_tensor(name))  # the adapter is in the weights

    # the adapter folder alone, as LLaMA-Factory's output_dir holds one: merged into model_name_or_path, the same bytes
    raw.update(adapter_name_or_path=str(run / "adapter"), export_dir=str(tmp_path / "merged-from-folder"))
    merge_yaml.write_text(yaml.safe_dump(raw))
    assert main(["merge", str(merge_yaml)]) == 0
    assert (tmp_path / "merged-from-folder" / "model.safetensors").read_bytes() == \
        (tmp_path / "merged" / "model.safetensors").read_bytes()

    raw.update(model_name_or_path="google/gemma-3-4b-it", adapter_name_or_path=str(run))  # not the run's base
    merge_yaml.write_text(yaml.safe_dump(raw))
    assert main(["merge", str(merge_yaml)]) == 2
    assert "model_name_or_path: google/gemma-3-4b-it, but" in capsys.readouterr().err
    raw.update(model_name_or_path=str(tiny_gemma3_dir), template="gemma4n")
    merge_yaml.write_text(yaml.safe_dump(raw))
    assert main(["merge", str(merge_yaml)]) == 2
    assert "template: gemma4n does not fit" in capsys.readouterr().err


@pytest.mark.parametrize(("change", "expected"), [
    ({"stage": "ppo"}, "stage: ppo: gemmaforge trains supervised fine-tuning (stage: sft), continued pretraining "
                       "(stage: pt), preference tuning (stage: dpo or kto) and reward models (stage: rm), not PPO yet"),
    ({"stage": "dpo", "ref_model": "google/gemma-3-1b-it"}, "ref_model: 'google/gemma-3-1b-it' has no gemmaforge "
                                                            "equivalent"),
    ({"stage": "dpo", "pref_loss": "kto_pair"}, "train.pref_loss"),
    ({"finetuning_type": "full"}, "finetuning_type: full: gemmaforge trains LoRA adapters only"),
    ({"template": "qwen3_nothink"}, "template: qwen3_nothink is not a Gemma template"),
    ({"template": "gemma4"}, "template: gemma4 does not fit"),
    ({"template": "gemma3n"}, "Gemma 3n checkpoints are not supported yet"),
    ({"model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507"}, "is not a Gemma checkpoint"),
    ({"lora_rnk": 8}, "lora_rnk: not an LLaMA-Factory SFT key gemmaforge knows; did you mean 'lora_rank'?"),
    ({"loraplus_lr_ratio": 16.0}, "loraplus_lr_ratio: 16.0 has no gemmaforge equivalent and changes what is trained"),
    ({"quantization_bit": 8}, "quantization_bit: 8: gemmaforge quantizes the base for QLoRA in 4 bits only"),
    ({"eval_dataset": "alpaca_en_demo"}, "eval_dataset: 'alpaca_en_demo' has no gemmaforge equivalent"),
    ({"resume_from_checkpoint": "/elsewhere/checkpoint-5"}, "a checkpoint of another directory cannot be resumed"),
    ({"learning_rate": "fast"}, "learning_rate (train.learning_rate): "),
    ({"do_train": False}, "do_train: False: gemmaforge configs train"),
    ({"model": {"name_or_path": "x"}}, "mixes LLaMA-Factory keys with gemmaforge sections (model)"),
    ({"fp16": True}, "bf16 and fp16 disagree (both set train.precision)"),
    ({"gradient_checkpointing": True, "disable_gradient_checkpointing": True},
     "disagree (both set train.gradient_checkpointing)"),
    ({"enable_thinking": False}, "enable_thinking: False has no gemmaforge equivalent"),
    ({"freeze_multi_modal_projector": False}, "freeze_multi_modal_projector: false means another thing here"),
    ({"optim": "sgd"}, "optim: 'sgd' has no gemmaforge equivalent"),
    ({"adam_epsilon": "1e-6"}, "adam_epsilon: 1e-06 has no gemmaforge equivalent"),
    ({"training_args": {"learning_rate": 1e-3}}, "training_args.learning_rate is also set at the top level"),
    ({"lora_config": {"rank": 8}}, "lora_config.rank: unknown LoRA key"),
])
def test_what_cannot_be_translated_exits_2_naming_the_key(change: dict, expected: str, llamafactory_data: Path,
                                                          tiny_gemma3_dir: Path, tmp_path: Path, capsys) -> None:
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir, **change)
    assert main(["train", str(path)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "saves").exists()  # nothing written


@pytest.mark.integration
@pytest.mark.slow
def test_the_reward_example_trains_on_dpo_en_demo(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                                  capsys) -> None:
    """LLaMA-Factory's reward-model example (stage: rm on dpo_en_demo) runs as it is, a few steps, then eval (the
    held-out pairs scored) and merge into a sequence classifier; the exports of a model that writes text refuse it."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_reward.yaml", tmp_path, tiny_gemma3_dir, max_samples=10,
                   cutoff_len=1024, val_size=2, logging_steps=1)
    assert main(["config", "convert", str(path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["method"] == "rm"
    assert main(["train", str(path), "train.max_steps=2", "train.precision=fp32",
                 "train.gradient_accumulation_steps=1"]) == 0
    run = tmp_path / "saves"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/accuracies" in row for row in rows)
    assert main(["eval", str(run)]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["suite"]["pairs"] == 2 and results["tuned"]["reward_accuracy"] is not None
    assert main(["merge", str(run)]) == 0
    config = json.loads((run / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3TextForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    capsys.readouterr()
    assert main(["export", "gguf", str(run)]) == 2
    assert "a reward model (train.method: rm) scores answers and writes none" in capsys.readouterr().err
    assert not (run / "gguf").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_the_pretraining_example_trains_on_c4_demo(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                                   capsys) -> None:
    """LLaMA-Factory's pretraining example (stage: pt on c4_demo) runs as it is, a few steps, through eval (the
    held-out text's perplexity) and merge."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_pretrain.yaml", tmp_path, tiny_gemma3_dir,
                   max_samples=24, cutoff_len=128, val_size=4)
    assert main(["config", "convert", str(path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["method"] == "pt"
    # one micro-batch a step, not the example's 8: its SFT sibling above trains with the example's accumulation
    assert main(["run", str(path), "train.max_steps=2", "train.precision=fp32", "train.gradient_accumulation_steps=1",
                 "eval.retention=false", "eval.max_new_tokens=8", "export.gguf=[f16]"]) == 0
    run = tmp_path / "saves"
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["method"] == "pt" and stats["records"] == 24 and stats["train"] + stats["val"] == stats["kept"]
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["base"]["perplexity"] > 0 and results["tuned"]["perplexity"] > 0
    assert (run / "merged" / "config.json").is_file()


@pytest.mark.integration
@pytest.mark.slow
def test_the_dpo_example_trains_on_dpo_en_demo(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                               capsys) -> None:
    """LLaMA-Factory's DPO example (stage: dpo, pref_loss sigmoid, pref_beta 0.1, on dpo_en_demo) runs as it is, a
    few steps, through eval (the val pairs' prompts answered, the chosen answers as references), merge, GGUF and the
    Modelfile: docs/training.md's worked example."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_dpo.yaml", tmp_path, tiny_gemma3_dir, max_samples=10,
                   cutoff_len=1024, val_size=2, logging_steps=1)
    assert main(["config", "convert", str(path)]) == 0
    train = yaml.safe_load(capsys.readouterr().out)["train"]
    assert (train["method"], train["pref_loss"], train["pref_beta"]) == ("dpo", "sigmoid", 0.1)
    assert main(["run", str(path), "train.max_steps=2", "train.precision=fp32", "train.gradient_accumulation_steps=1",
                 "eval.retention=false", "eval.num_samples=2", "eval.max_new_tokens=8", "export.gguf=[f16]"]) == 0
    run = tmp_path / "saves"
    modelfile = (run / "ollama" / "Modelfile").read_text().splitlines()
    assert any(line.startswith("FROM ") and line.endswith("model-f16.gguf") for line in modelfile)
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["method"] == "dpo" and stats["records"] == 10 and stats["kept"] > 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in row for row in rows)
    assert json.loads((run / "eval" / "results.json").read_text())["suite"]["cases"] == 2


@pytest.mark.integration
@pytest.mark.slow
def test_the_kto_example_trains_on_kto_en_demo(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                               capsys) -> None:
    """LLaMA-Factory's KTO example (stage: kto, pref_beta 0.1, on kto_en_demo: sharegpt messages with a kto_tag
    column) runs as it is, a few steps, then eval (the desirable val answers as references)."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_kto.yaml", tmp_path, tiny_gemma3_dir, max_samples=12,
                   cutoff_len=512, val_size=4, logging_steps=1)
    assert main(["config", "convert", str(path)]) == 0
    train = yaml.safe_load(capsys.readouterr().out)["train"]
    assert (train["method"], train["pref_beta"]) == ("kto", 0.1)
    assert main(["train", str(path), "train.max_steps=2", "train.precision=fp32",
                 "train.gradient_accumulation_steps=1"]) == 0
    run = tmp_path / "saves"
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["method"] == "kto" and stats["records"] == 12 and stats["kept"] > 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in row and row["kl"] >= 0 for row in rows if "loss" in row)
    assert main(["eval", str(run), "retention=false", "num_samples=2", "max_new_tokens=8"]) == 0


def test_a_training_config_starts_from_one_adapter(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                                    capsys) -> None:
    """adapter_name_or_path in a training config (a DPO run after an SFT run) is model.adapter; several exit 2."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_dpo.yaml", tmp_path, tiny_gemma3_dir,
                   adapter_name_or_path="saves/qwen3-4b/lora/sft")
    config, text = converted(path, capsys)
    assert config["model"]["adapter"] == "saves/qwen3-4b/lora/sft" and "adapter_name_or_path -> model.adapter" in text
    path = example(llamafactory_data, "train_lora/qwen3_lora_dpo.yaml", tmp_path, tiny_gemma3_dir,
                   adapter_name_or_path="saves/a,saves/b")
    assert main(["config", "convert", str(path)]) == 2
    assert "adapter_name_or_path: 'saves/a,saves/b': gemmaforge starts a run from one adapter" in \
        capsys.readouterr().err


def test_what_llamafactory_reads_differently_from_pyyaml_or_gemmaforge(llamafactory_data: Path, tiny_gemma3_dir: Path,
                                                                        tmp_path: Path, capsys) -> None:
    """1e-4 is a number (OmegaConf), `key: null` is the default, defaults spelled out are accepted, warmup_steps
    below 1 is a ratio (transformers 5), eval_steps falls back to logging_steps, neat_packing packs."""
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir)
    text = path.read_text().replace("learning_rate: 0.0001", "learning_rate: 1e-4").replace("warmup_ratio: 0.1\n", "")
    path.write_text(text + "adam_epsilon: 1e-8\noptim: adamw_torch_fused\ndata_seed: 42\ngreater_is_better: false\n"
                    "lora_alpha: null\nadditional_target: null\nwarmup_steps: 0.05\neval_strategy: steps\n"
                    f"val_size: 0.1\nneat_packing: true\nmedia_dir: {llamafactory_data}\n")
    assert "learning_rate: 1e-4" in path.read_text()
    config, text = converted(path, capsys)
    train = config["train"]
    assert train["learning_rate"] == 1e-4 and config["lora"]["lora_alpha"] == 16  # 2 x rank, as null means
    assert (train["warmup_ratio"], train["warmup_steps"], train["eval_steps"], train["packing"]) == (0.05, 0, 10, True)
    assert "#   adam_epsilon: at LLaMA-Factory's default" in text and "#   lora_alpha: null" in text
    assert config["data"]["clean"]["overlong"] == "drop"  # packed: over-long examples are dropped, as there


def test_notes_for_deepspeed_and_report_to(llamafactory_data: Path, tiny_gemma3_dir: Path, tmp_path: Path,
                                           capsys) -> None:
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft_ds3.yaml", tmp_path, tiny_gemma3_dir,
                   report_to=["wandb", "tensorboard"])
    config, text = converted(path, capsys)
    assert "examples/distributed/deepspeed_zero3.yaml -m gemmaforge train CONFIG` (ZeRO-3)" in text
    assert config["train"]["report_to"] == "tensorboard" and "report_to: wandb not supported" in text


def test_convert_writes_a_config_that_runs_as_gemmaforge_own(llamafactory_data: Path, tiny_gemma3_dir: Path,
                                                             tmp_path: Path, capsys) -> None:
    """`config convert -o FILE` writes the translation as a gemmaforge config; read back, it is the same config."""
    from gemmaforge.config import load_config

    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir,
                   early_stopping_steps=3, load_best_model_at_end=True, eval_strategy="steps", eval_steps=250,
                   val_size=0.1, resume_from_checkpoint=str(tmp_path / "saves" / "checkpoints" / "checkpoint-5"),
                   deepspeed="examples/deepspeed/ds_z0_config.json")
    out = tmp_path / "gemmaforge.yaml"
    assert main(["config", "convert", str(path), "-o", str(out)]) == 0
    text = out.read_text()
    assert "the run's last complete checkpoint, whichever step" in text
    assert "examples/distributed/ddp.yaml -m gemmaforge train CONFIG` (ZeRO-0)" in text
    assert load_config(out) == load_config(path)
    assert load_config(out).train.early_stopping_patience == 3


def test_lora_alpha_follows_the_rank_qlora_checkpointing_and_decoding(llamafactory_data: Path, tiny_gemma3_dir: Path,
                                                                      tmp_path: Path, capsys) -> None:
    path = example(llamafactory_data, "train_lora/qwen3_lora_sft.yaml", tmp_path, tiny_gemma3_dir, lora_rank=32,
                   quantization_bit=4, lora_target="q_proj,v_proj", additional_target="embed_tokens",
                   disable_gradient_checkpointing=True, do_sample=True, temperature=0.3, max_new_tokens=64,
                   num_beams=4)
    config, text = converted(path, capsys)
    assert config["lora"]["lora_alpha"] == 64 and config["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert config["lora"]["modules_to_save"] == ["embed_tokens"] and config["model"]["load_in_4bit"] is True
    assert config["train"]["gradient_checkpointing"] is False
    assert (config["eval"]["do_sample"], config["eval"]["temperature"], config["eval"]["max_new_tokens"]) == \
        (True, 0.3, 64)
    assert "#   num_beams: eval decodes greedily, or samples with temperature and top_p" in text


def test_bad_merge_yaml_keys_exit_2(tmp_path: Path, capsys) -> None:
    for raw, expected in (
        ({"adapter_name_or_path": "saves/x", "export_dir": "out", "export_quantization_bit": 4},
         "export_quantization_bit: 4 has no gemmaforge equivalent (GPTQ is not supported"),
        ({"adapter_name_or_path": "saves/x", "export_dir": "out", "export_legacy_format": True},
         "written as safetensors"),
        ({"export_dir": "out"}, "adapter_name_or_path: required"),
        ({"adapter_name_or_path": "saves/x", "export_dir": "out", "export_sise": 5}, "did you mean 'export_size'?"),
        ({"adapter_name_or_path": str(tmp_path / "lf_adapter"), "export_dir": "out"},
         "model_name_or_path: required to merge"),
    ):
        (tmp_path / "lf_adapter").mkdir(exist_ok=True)
        (tmp_path / "lf_adapter" / "adapter_config.json").write_text("{}")
        path = tmp_path / "merge.yaml"
        path.write_text(yaml.safe_dump(raw))
        assert main(["merge", str(path)]) == 2
        assert expected in capsys.readouterr().err


def llamafactory_fields(hparams: Path) -> dict[str, tuple[str, object, bool]]:
    """Every dataclass field of LLaMA-Factory's argument classes, read from its source with ast: name -> (class,
    default (a literal, or '<expr>' / '<factory>' / '<none>'), whether YAML can set it (init=False fields cannot))."""
    import ast

    found: dict[str, tuple[str, object, bool]] = {}
    for path in sorted(hparams.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for statement in node.body:
                if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                    continue
                default: object = "<none>"
                settable = True
                value = statement.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                    for keyword in value.keywords:
                        if keyword.arg == "default":
                            try:
                                default = ast.literal_eval(keyword.value)
                            except ValueError:
                                default = "<expr>"
                        elif keyword.arg == "default_factory":
                            default = "<factory>"
                        elif keyword.arg == "init":
                            settable = ast.literal_eval(keyword.value)
                elif value is not None:
                    try:
                        default = ast.literal_eval(value)
                    except ValueError:
                        default = "<expr>"
                found.setdefault(statement.target.id, (node.name, default, settable))
    return found


def test_the_tables_hold_llamafactorys_own_arguments_and_defaults(llamafactory_data: Path) -> None:
    """Against LLaMA-Factory's argument dataclasses in its sdist: every field a YAML can set is translated, ignored
    or refused (but its `eval` stage's own EvaluationArguments); each key refused unless at LLaMA-Factory's default
    accepts exactly that default; each default taken for a key left out is LLaMA-Factory's (or transformers'
    TrainingArguments', for the trainer's keys)."""
    import dataclasses

    from transformers import TrainingArguments

    from gemmaforge.compat.llamafactory import DEFAULTS, IGNORED_PREFIXES

    fields = llamafactory_fields(llamafactory_data.parent / "src" / "llamafactory" / "hparams")
    assert len(fields) > 200 and "cutoff_len" in fields
    tables = TRANSLATED.keys() | IGNORED.keys() | REFUSED.keys()
    unclassified = sorted(name for name, (owner, _, settable) in fields.items()
                          if settable and owner != "EvaluationArguments" and name not in tables
                          and not name.startswith(tuple(IGNORED_PREFIXES)))
    assert unclassified == []
    wrong = []
    for key, (accepted, _) in REFUSED.items():
        default = fields.get(key, (None, "<none>"))[1]
        literal = not (isinstance(default, str) and default.startswith("<"))
        if key in fields and literal and not isinstance(accepted, tuple) and accepted not in ("dataset_dir", "seed"):
            if accepted != default:
                wrong.append((key, accepted, default))
    assert wrong == []
    trainer_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for _, value, key in DEFAULTS:
        if key in fields and fields[key][1] is not None:
            assert fields[key][1] == value, key
        elif key in trainer_defaults:
            assert trainer_defaults[key] == value or str(trainer_defaults[key]) == f"IntervalStrategy.{value.upper()}" \
                or getattr(trainer_defaults[key], "value", None) == value, key
