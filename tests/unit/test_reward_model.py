"""Reward models (`train.method: rm`): a score head on each answer's last token trained on preference pairs; its
loss equal to TRL's RewardTrainer on a tiny model, the run learning to rank held-out pairs, merged into a sequence
classifier that transformers' AutoModelForSequenceClassification loads and that scores as training scored."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from gemmaforge.cli import main
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.model_spec import ARCHITECTURES, reward_classifier
from gemmaforge.models import load_tokenizer
from gemmaforge.recipe.dpo import PairCollator, encode_pairs

GEMMA3 = FAMILIES["gemma3"]


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir: Path):
    return load_tokenizer(tiny_gemma3_dir)


def pair_batch(tokenizer, n: int = 3) -> dict:
    pairs = [([{"role": "user", "content": f"Is roast {i} ready?"}], {"role": "assistant", "content": "Yes, it is."},
              {"role": "assistant", "content": f"No idea at all, number {i}."}) for i in range(n)]
    encoded, _ = encode_pairs(pairs, tokenizer, GEMMA3, 256)
    batch = PairCollator(tokenizer.pad_token_id)(encoded)
    batch.pop("counts")
    return batch


def test_the_reward_loss_equals_trls_reward_trainer(tiny_gemma3_dir: Path, tokenizer) -> None:
    """Our scores (the head on each row's last attended position, through the installed forward) and pairwise loss
    against TRL's RewardTrainer.compute_loss on transformers' own Gemma3TextForSequenceClassification holding the
    same weights (LoRA merged, the trained head as its `score`): the classifier the merge writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextForSequenceClassification
    from trl import RewardTrainer

    from gemmaforge.train.loss import install_supervised_forward
    from gemmaforge.train.preference import reward_losses
    from gemmaforge.train.reward_head import attach_reward_head

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    attach_reward_head(base)
    ours = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, modules_to_save=["score"],
                                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    install_supervised_forward(ours, 16)
    ours.eval()
    batch = pair_batch(tokenizer)
    assert (batch["input_ids"] == tokenizer.pad_token_id).any()  # rows of several lengths: the padding is skipped
    with torch.no_grad():
        chosen, rejected = ours(**batch, rewards=True).rewards.chunk(2)
    got = reward_losses(chosen, rejected).mean()

    config = AutoConfig.from_pretrained(tiny_gemma3_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    classifier = Gemma3TextForSequenceClassification(config).eval()
    missing, unexpected = classifier.load_state_dict(ours.merge_and_unload().state_dict(), strict=False)
    assert missing == [] and set(unexpected) <= {"lm_head.weight"}
    trl = SimpleNamespace(model=classifier, args=SimpleNamespace(center_rewards_coefficient=None),
                          accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
                          _total_train_tokens=0, _metrics={"eval": defaultdict(list)})
    with torch.no_grad():
        expected = RewardTrainer.compute_loss(trl, classifier, {"input_ids": batch["input_ids"],
                                                                "attention_mask": batch["attention_mask"]})
    assert abs(got.item() - expected.item()) < 1e-5, (got.item(), expected.item())
    assert trl._metrics["eval"]["accuracy"] == [(chosen > rejected).float().mean().item()]


def test_a_checkpoint_without_a_sequence_classifier_is_refused() -> None:
    """Gemma 4 trains, but transformers has no sequence classifier to save its reward model as: refused up front."""
    assert reward_classifier(SimpleNamespace(architecture=ARCHITECTURES["Gemma3ForCausalLM"])) == \
        "Gemma3TextForSequenceClassification"
    with pytest.raises(UserError, match="Gemma4ForCausalLM .* has no sequence classifier in transformers"):
        reward_classifier(SimpleNamespace(architecture=ARCHITECTURES["Gemma4ForCausalLM"]))


@pytest.mark.slow
def test_a_reward_model_learns_to_rank_and_merges_into_a_sequence_classifier(tmp_path: Path,
                                                                              tiny_gemma3_dir: Path) -> None:
    """Pairs whose chosen answer opens with a sign-off word: the reward model ranks every held-out pair; merged, it
    loads with AutoModelForSequenceClassification and gives the scores the eval stage gave; GGUF and Ollama refuse
    it (it writes no text)."""
    from transformers import AutoModelForSequenceClassification

    from gemmaforge.data.prepare import read_prepared_pairs
    from gemmaforge.evaluate.reward_eval import load_reward_model, pair_rewards
    from gemmaforge.models import resolve_model

    records = [{"prompt": f"Question {i}: how is roast {i}?", "chosen": f"Barista says: roast {i} is fine.",
                "rejected": f"roast {i} is fine."} for i in range(40)]
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    config = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(tiny_gemma3_dir)},
              "data": {"path": str(tmp_path / "pairs.json"), "val_size": 8},
              "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
              "train": {"method": "rm", "max_steps": 12, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                        "logging_steps": 4, "save_steps": 12, "cutoff_len": 64, "precision": "fp32"}}
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(rows[-1])
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["train"]["planned_parts"]["logits"] == 0  # the output layer never runs
    assert manifest["stages"]["merge"]["sequence_classifier"] == "Gemma3TextForSequenceClassification"
    assert "export_gguf" not in manifest["stages"] and not (run / "gguf").exists()
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["tuned"]["reward_accuracy"] == 1.0 and results["tuned"]["reward_margin"] > 0
    assert results["base"]["reward_accuracy"] is None  # no head before training
    assert "held-out preference pairs scored" in (run / "eval" / "report.md").read_text()

    tokenizer = load_tokenizer(run / "merged")
    val = read_prepared_pairs(run / "data" / "val.jsonl")
    pairs, _ = encode_pairs(val, tokenizer, GEMMA3, 64)
    prompt, chosen, _ = val[0]  # the merged folder's own chat template renders what was scored (docs' snippet)
    assert tokenizer.apply_chat_template([*prompt, chosen], return_dict=True)["input_ids"] == \
        pairs[0]["chosen_input_ids"]
    trained = pair_rewards(load_reward_model(resolve_model(str(tiny_gemma3_dir), tmp_path), run / "adapter"), pairs,
                           tokenizer.pad_token_id, 4)
    scorer = AutoModelForSequenceClassification.from_pretrained(run / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        merged = [[scorer(input_ids=torch.tensor([pair[f"{side}_input_ids"]])).logits.item() for pair in pairs]
                  for side in ("chosen", "rejected")]
    assert merged[0] == pytest.approx(trained[0], abs=1e-4) and merged[1] == pytest.approx(trained[1], abs=1e-4)
    assert all(c > r for c, r in zip(*merged))
    for verb in (["export", "gguf", str(run)], ["export", "ollama", str(run)], ["export", "verify", str(run)]):
        assert main(verb) == 2
