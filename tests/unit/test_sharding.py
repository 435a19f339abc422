"""Several GPUs (docs/several-gpus.md): the shipped launch recipes as accelerate's own launcher reads them, the strategy
gemmaforge takes from what they hand to every rank, the refusals, and the memory planner per rank. The recipes are run
for real by tests/integration/test_distributed.py (DDP, FSDP2, two nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmaforge.cli import main
from gemmaforge.errors import UserError
from gemmaforge.models import resolve_model
from gemmaforge.train.memory_plan import Device, Planner
from gemmaforge.train.sharding import STRATEGIES, check_strategy, planned_as
from tests.helpers import run_config, write_config

RECIPES = Path(__file__).parents[2] / "examples" / "distributed"
QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def launcher_environment(recipe: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file RECIPE` gives every rank, from accelerate's own parser,
    validation and launcher preparation (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(RECIPES / recipe), "-m", "gemmaforge", "train",
                                               "config.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.num_processes == 2
    if args.use_deepspeed:  # as launch_command does before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    assert args.multi_gpu or args.use_fsdp
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize(("recipe", "strategy", "planned"), [
    ("ddp.yaml", "single", "ddp"),  # one process until torchrun sets WORLD_SIZE
    ("fsdp2.yaml", "fsdp2", "fsdp2"),
    ("deepspeed_zero2.yaml", "deepspeed-zero2", "zero2"),
    ("deepspeed_zero3.yaml", "deepspeed-zero3", "zero3"),
])
def test_each_recipe_is_read_by_accelerate_as_the_strategy_it_names(recipe: str, strategy: str, planned: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    env = launcher_environment(recipe)
    for name, value in env.items():
        if name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(name, value)
    assert check_strategy() == strategy and planned_as(strategy) == planned
    if recipe == "fsdp2.yaml":
        from gemmaforge.train.sharding import fsdp_plugin

        plugin = fsdp_plugin("no")
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type) and plugin.transformer_cls_names_to_wrap is None
    if recipe.startswith("deepspeed"):
        from accelerate.utils import DeepSpeedPlugin

        config = DeepSpeedPlugin().deepspeed_config  # accelerate's own reading, as the Trainer gets it
        zero = config["zero_optimization"]
        assert zero["stage"] == int(recipe[-6]) and zero["offload_optimizer"]["device"] == "none"
        assert config["gradient_accumulation_steps"] == config["train_micro_batch_size_per_gpu"] == "auto"
        assert zero.get("stage3_gather_16bit_weights_on_model_save", False) is (recipe == "deepspeed_zero3.yaml")


def test_fsdp1_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UserError, match="FSDP version 1; gemmaforge trains with FSDP2: set fsdp_version: 2"):
        check_strategy()


def test_sharded_checkpoints_need_a_shared_run_directory(tmp_path: Path, tiny_gemma3_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP2 checkpoints are shards from every rank: with nodes that keep their own run directory, training is
    refused before the model loads."""
    from gemmaforge import runs

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setattr(runs, "node_count", lambda: 2)  # two nodes whose run directories the probe finds apart
    monkeypatch.setattr(runs.RunDir, "shared_between_nodes", lambda self: False)
    assert main(["train", str(write_config(tmp_path, tiny_gemma3_dir))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "fsdp2 writes each checkpoint as shards from every rank" in err and "the nodes do not share" in err
    assert not (tmp_path / "run" / "adapter").exists()


GPU = Device("gpu", "a GPU", 24 * 2**30, 512 * 2**20)


def test_each_strategy_shares_out_the_model_state(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Per rank of N: DDP replicates everything and adds its fp32 gradient buckets; ZeRO-2 shards the gradients
    and AdamW moments (12 of the 16 bytes per trainable parameter); FSDP2 and ZeRO-3 shard weights and trainable
    state and add what is gathered whole (two decoder layers, the tied embedding). Activations stay per rank."""
    planner = Planner(run_config(), resolve_model(str(tiny_gemma3_dir), tmp_path), "bf16", GPU)
    counts = planner.counts
    trainable = counts.trainable_params
    single = planner.parts(4, 128, False)
    assert all(planner.parts(4, 128, False, 1, strategy) == single for strategy in STRATEGIES)
    ddp = planner.parts(4, 128, False, 4, "ddp")
    assert ddp["weights"] == counts.frozen_bytes and ddp["ddp buckets"] == 4 * trainable
    zero2 = planner.parts(4, 128, False, 4, "zero2")
    assert zero2["weights"] == counts.frozen_bytes and zero2["trainable"] == 4 * trainable + 3 * trainable
    fsdp = planner.parts(4, 128, False, 4, "fsdp2")
    assert fsdp == planner.parts(4, 128, False, 4, "zero3")
    assert fsdp["weights"] == -(-counts.frozen_bytes // 4) and fsdp["trainable"] == 4 * trainable
    # the tiny model: 2 decoder layers of 64 wide, and the 262144 x 64 tied embedding in bf16
    assert counts.embedding_bytes == 262144 * 64 * 2
    assert 0 < counts.largest_layer_bytes < counts.frozen_bytes - counts.embedding_bytes
    assert fsdp["gathered"] == 2 * counts.largest_layer_bytes + counts.embedding_bytes
    for name in ("activations", "backward", "logits", "runtime"):
        assert ddp[name] == zero2[name] == fsdp[name] == single[name]


@pytest.mark.slow
def test_plan_verb_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(QUICKSTART), "--gpu-memory", "24GiB", "--nproc", "4", "--strategy", "fsdp2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ranks"] == 4 and result["strategy"] == "fsdp2" and "gathered" in result["parts"]
    assert result["smallest_setup"] == "ddp x 1, zero2 x 1, fsdp2 x 1, zero3 x 1"  # 270M fits one card anyway
    assert main(["plan", str(QUICKSTART), "--gpu-memory", "24GiB", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "memory plan per rank (2 ranks, ddp)" in out and "ddp buckets" in out
    assert "fewest ranks of this device that fit, per strategy: ddp x 1" in out


def test_plan_verb_refuses_bad_rank_counts_and_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(QUICKSTART), "--nproc", "0"]) == 2
    assert "--nproc 0: expected 1 or more processes" in capsys.readouterr().err
    assert main(["plan", str(QUICKSTART), "--strategy", "zero4"]) == 2
    assert "invalid choice: 'zero4'" in capsys.readouterr().err


def test_qlora_under_fsdp2_stores_the_4_bit_weights_in_the_compute_dtype() -> None:
    """FSDP shards floating-point parameters only: sharded, the packed NF4 values are stored in bf16."""
    import torch

    from gemmaforge.models import four_bit_config

    sharded, alone = four_bit_config(torch.bfloat16, shard=True), four_bit_config(torch.bfloat16, shard=False)
    assert sharded.bnb_4bit_quant_storage == torch.bfloat16 and alone.bnb_4bit_quant_storage == torch.uint8
    assert sharded.bnb_4bit_compute_dtype == alone.bnb_4bit_compute_dtype == torch.bfloat16
    assert sharded.load_in_4bit and sharded.bnb_4bit_quant_type == "nf4" and sharded.bnb_4bit_use_double_quant


def test_qlora_with_zero3_is_refused_with_the_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert check_strategy(load_in_4bit=False) == "deepspeed-zero3"
    with pytest.raises(UserError, match="QLoRA.*ZeRO-3.*fsdp2.yaml.*deepspeed_zero2.yaml"):
        check_strategy(load_in_4bit=True)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert check_strategy(load_in_4bit=True) == "deepspeed-zero2"
