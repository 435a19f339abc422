from pathlib import Path

import pytest
import yaml

from gemmaforge.config import RunConfig, dump_config, load_config
from gemmaforge.errors import UserError

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads_and_names_its_command(path: Path) -> None:
    config = load_config(path)
    assert Path(config.data.path).is_file()
    assert path.read_text(encoding="utf-8").startswith(f"# gemmaforge run examples/{path.name}")
    if config.eval.suite:
        assert Path(config.eval.suite).is_file()


@pytest.mark.parametrize("path", sorted((EXAMPLES / "suites").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_suite_loads(path: Path) -> None:
    from gemmaforge.evaluate.suite import load_suite

    assert load_suite(path)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\ntrain: {lerning_rate: 1e-4}\n")
    with pytest.raises(UserError, match=r"train\.lerning_rate: unknown key; did you mean 'learning_rate'"):
        load_config(path)


def test_unknown_section_and_missing_key(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ntrian: {}\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    assert "trian: unknown key; did you mean 'train'" in str(err.value)
    assert "data: required key is missing" in str(err.value)


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\nlora: {r: many}\n")
    with pytest.raises(UserError, match=r"lora\.r: .*'many'"):
        load_config(path)


def test_the_training_method_is_one_the_recipe_has(tmp_path: Path) -> None:
    from gemmaforge.compat.llamafactory import STAGES
    from gemmaforge.config import METHODS
    from gemmaforge.recipe.trainer import METHODS as RECIPES

    assert set(METHODS) == set(RECIPES) == set(STAGES) and all(RECIPES[name].name == name for name in RECIPES)
    assert load_config(write(tmp_path, "output_dir: r\ndata: {path: d.json}\n")).train.method == "sft"
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\ntrain: {method: ppo}\n")
    with pytest.raises(UserError, match=r"train\.method: .*'sft'.*'rm'"):
        load_config(path)
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\ntrain: {method: dpo, pref_loss: kto_pair}\n")
    with pytest.raises(UserError, match=r"train\.pref_loss: .*'kto_pair'"):
        load_config(path)


def test_gguf_split_size_is_read_or_named(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\nexport: {split_max_size: 2G, split_max_tensors: 64}\n")
    assert (load_config(path).export.split().max_bytes, load_config(path).export.split().max_tensors) == (2 * 10**9, 64)
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\nexport: {split_max_size: two gigs}\n")
    with pytest.raises(UserError, match=r"export\.split_max_size: .*split size 'two gigs': expected a positive size"):
        load_config(path)


def test_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\n")
    config = load_config(path, ["train.learning_rate=1e-3", "lora.target_modules=[q_proj]", "output_dir=other"])
    assert config.train.learning_rate == 1e-3
    assert config.lora.target_modules == ["q_proj"]
    assert config.output_dir == "other"


@pytest.mark.parametrize("override", ["train.learning_rate", "=3", "train.learning_rate.x=1"])
def test_bad_overrides(tmp_path: Path, override: str) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: d.json}\ntrain: {learning_rate: 1e-4}\n")
    with pytest.raises(UserError):
        load_config(path, [override])


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "output_dir: r\ndata: {path: [\n")
    with pytest.raises(UserError, match=r"c\.yaml line \d+: not valid YAML"):
        load_config(path)


def test_dump_writes_every_default_and_round_trips(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "output_dir: r\ndata: {path: d.json}\n"))
    text = dump_config(config)
    raw = yaml.safe_load(text)
    assert raw["train"]["cutoff_len"] == 512 and raw["lora"]["r"] == 8
    assert RunConfig.model_validate(raw) == config


def test_the_configuration_page_shows_the_shipped_quickstart_config() -> None:
    """docs/configuration.md quotes examples/quickstart.yaml: the same settings, key for key."""
    root = Path(__file__).parents[2]
    section = (root / "docs" / "configuration.md").read_text(encoding="utf-8")
    quoted = yaml.safe_load(section.split("```yaml\n")[1].split("```")[0])
    assert quoted == yaml.safe_load((root / "examples" / "quickstart.yaml").read_text(encoding="utf-8"))


def test_the_quickstart_suite_asks_unseen_questions_and_checks_the_persona() -> None:
    """README and docs/quickstart.md: 252 questions answered in the persona (every answer opens with 咖啡师小贴士),
    and a suite of 12 coffee questions they do not hold, the 11 Chinese ones checked for that opening."""
    import json

    from gemmaforge.evaluate.suite import load_suite

    cases = load_suite(EXAMPLES / "suites" / "coffee.yaml")
    records = json.loads((EXAMPLES / "data" / "coffee_qa.json").read_text(encoding="utf-8"))
    assert len(records) == 252 and all(r["output"].startswith("咖啡师小贴士：") for r in records)
    training = json.dumps(records, ensure_ascii=False)
    assert len(cases) == 12 and not [c.prompt for c in cases if c.prompt in training]
    persona = [c for c in cases if any(k.name == "starts_with" and k.value == "咖啡师小贴士" for k in c.checks)]
    assert len(persona) == 11 and all(c.prompt.isascii() for c in cases if c not in persona)


def test_the_defaults_readme_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """eval's max_new_tokens 192, batch_size 32 and num_samples 16; models under ~/.cache/gemmaforge unless
    GEMMAFORGE_HOME says otherwise."""
    from gemmaforge.config import EvalConfig
    from gemmaforge.models import default_home

    defaults = EvalConfig()
    assert (defaults.max_new_tokens, defaults.batch_size, defaults.num_samples) == (192, 32, 16)
    monkeypatch.delenv("GEMMAFORGE_HOME", raising=False)
    assert default_home() == Path.home() / ".cache" / "gemmaforge"
    monkeypatch.setenv("GEMMAFORGE_HOME", "/srv/models")
    assert default_home() == Path("/srv/models")



def test_with_packing_a_quickstart_row_holds_about_4_5_of_its_examples(gemma3_tokenizer) -> None:
    """docs/configuration.md (the quickstart config): packing into rows of cutoff_len 512 would put ~4.5 of the coffee
    examples in each row, where the unpacked step has one per row."""
    import json

    from gemmaforge.data.formats import detect_schema, to_messages
    from gemmaforge.families import FAMILIES
    from gemmaforge.train.packing import pack_examples

    config = load_config(EXAMPLES / "quickstart.yaml")
    records = json.loads((EXAMPLES / "data" / "coffee_qa.json").read_text(encoding="utf-8"))
    schema = detect_schema(records[0], "coffee_qa.json")
    examples = []
    for record in records:
        messages = to_messages(record, schema, "coffee_qa.json")
        ids, labels = FAMILIES["gemma3"].chat.encode(messages, gemma3_tokenizer, config.train.cutoff_len)
        examples.append({"input_ids": ids, "labels": labels})
    rows = pack_examples(examples, config.train.cutoff_len)
    assert config.train.cutoff_len == 512 and not config.train.packing
    assert len(examples) / len(rows) == pytest.approx(4.5, abs=0.05)


def test_train_and_lora_keys_are_training_arguments_and_lora_config_names_but_the_documented_extras() -> None:
    """docs/configuration.md: the `train` and `lora` keys are transformers' TrainingArguments and PEFT's LoraConfig
    names, plus the extras it lists; warmup_ratio is LLaMA-Factory's (transformers 5 reads a float warmup_steps)."""
    import dataclasses

    from peft import LoraConfig
    from transformers import TrainingArguments

    from gemmaforge.config import LoraSection, TrainConfig

    section = (EXAMPLES.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    train_extras = set(TrainConfig.model_fields) - {f.name for f in dataclasses.fields(TrainingArguments)}
    lora_extras = set(LoraSection.model_fields) - {f.name for f in dataclasses.fields(LoraConfig)}
    assert train_extras == {"method", "cutoff_len", "packing", "attention", "logits_chunk_size",
                            "early_stopping_patience", "precision", "check_memory", "warmup_ratio",
                            "pref_loss", "pref_beta", "pref_ftx", "simpo_gamma", "kto_chosen_weight",
                            "kto_rejected_weight"}
    assert lora_extras == {"train_template_tokens", "freeze_vision_tower", "freeze_multi_modal_projector",
                           "freeze_audio_tower", "freeze_audio_projector"}
    documented = [f"`{key}`" in section or f"`train.{key}`" in section for key in train_extras]
    assert all(documented) and "`lora.train_template_tokens`" in section
    assert all(f"`{key}`" in section for key in lora_extras - {"train_template_tokens"})
