"""`gemmaforge export vllm`: the serve script for the merged model, or base + adapter within vLLM's limits."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gemmaforge.cli import main
from gemmaforge.errors import UserError
from gemmaforge.export.vllm import vllm_lora_rank
from tests.helpers import write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("vllm")
    config = write_config(tmp, tiny_gemma3_dir, max_steps=1, save_steps=1, eval_strategy="no")
    assert main(["train", str(config), "lora.train_template_tokens=false", "lora.r=12", "eval.enabled=false"]) == 0
    return tmp / "run"


def script_command(run: Path) -> list[str]:
    line = (run / "vllm" / "serve.sh").read_text().splitlines()[-1]
    assert line.startswith("exec ") and line.endswith(' "$@"')
    return shlex.split(line.removeprefix("exec ").removesuffix(' "$@"'))


@pytest.mark.slow
def test_merged_model_command_needs_merge_first(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "vllm", str(trained)]) == 2
    assert "merged/config.json is missing: run `gemmaforge merge" in " ".join(capsys.readouterr().err.split())
    assert main(["merge", str(trained)]) == 0
    assert main(["export", "vllm", str(trained)]) == 0
    assert script_command(trained) == ["vllm", "serve", str((trained / "merged").resolve()), "--served-model-name",
                                       "tiny-coffee", "--max-model-len", "4096"]
    assert (trained / "vllm" / "serve.sh").stat().st_mode & 0o111


def test_adapter_command_names_base_adapter_and_the_rank_vllm_admits(trained: Path, tiny_gemma3_dir: Path) -> None:
    assert main(["export", "vllm", str(trained), "--adapter"]) == 0
    command = script_command(trained)
    assert command[:3] == ["vllm", "serve", str(tiny_gemma3_dir.resolve())]
    assert command[command.index("--max-lora-rank") + 1] == "16"  # r=12 -> the next rank vLLM accepts
    assert command[-1] == f"tiny-coffee={(trained / 'adapter').resolve()}" and "--enable-lora" in command


def test_max_model_len_follows_the_modelfile_context_and_a_hub_base_is_named_as_given(trained: Path,
                                                                                     tiny_gemma3_dir: Path) -> None:
    """docs/export.md (export vllm): `--max-model-len` is export.ollama.num_ctx; a hub-id base goes into serve.sh as
    given (vLLM downloads it), a local or embedded base as its folder."""
    import yaml

    from gemmaforge.models import ResolvedModel
    from gemmaforge.pipeline import base_reference_for_serving

    run_yaml = trained / "run.yaml"
    original = run_yaml.read_text(encoding="utf-8")
    config = yaml.safe_load(original)
    config["export"]["ollama"]["num_ctx"] = 2048
    run_yaml.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    try:
        assert main(["export", "vllm", str(trained), "--adapter"]) == 0
    finally:
        run_yaml.write_text(original, encoding="utf-8")  # the module's other tests see the run as trained
    command = script_command(trained)
    assert command[command.index("--max-model-len") + 1] == "2048"
    spec = None  # not read by base_reference_for_serving
    hub = ResolvedModel("google/gemma-3-1b-it", tiny_gemma3_dir, "abc", spec)
    local = ResolvedModel(str(tiny_gemma3_dir), tiny_gemma3_dir, "abc", spec)
    assert base_reference_for_serving(hub) == "google/gemma-3-1b-it"
    assert base_reference_for_serving(local) == str(tiny_gemma3_dir.resolve())


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"r": 8, "use_dora": True}, "is a DoRA adapter; vLLM serves plain LoRA only"),
        ({"r": 8, "modules_to_save": ["lm_head"]}, "trains whole modules (lm_head)"),
        ({"r": 8, "trainable_token_indices": [105, 106]}, "or train with lora.train_template_tokens: false"),
        ({"r": 1024}, "rank 1024 is above vLLM's largest --max-lora-rank (512)"),
    ],
)
def test_what_vllm_cannot_serve_is_refused(tmp_path: Path, config: dict, expected: str) -> None:
    with pytest.raises(UserError, match="serve the merged model instead") as info:
        vllm_lora_rank(config, tmp_path / "adapter")
    assert expected in str(info.value)


def test_rank_pattern_counts() -> None:
    assert vllm_lora_rank({"r": 8, "rank_pattern": {"q_proj": 64}}, Path("a")) == 64
    assert vllm_lora_rank({"r": 1}, Path("a")) == 1
