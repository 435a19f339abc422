"""Preference tuning (`train.method: dpo`): pairs in the shapes people have (TRL's prompt/chosen/rejected as text or
messages, TRL's implicit prompt, LLaMA-Factory's ranking datasets), refused where a pair is not one; each side
rendered as SFT renders a conversation, the loss on the last answer only; each loss equal to TRL's own computation on
a tiny model; a run that learns which answer is preferred."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.cli import main
from gemmaforge.config import DataConfig
from gemmaforge.data.prepare import prepare_data, read_prepared, read_prepared_feedback, read_prepared_pairs
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.models import load_tokenizer
from gemmaforge.recipe.dpo import PairCollator, encode_pairs
from gemmaforge.recipe.kto import FeedbackCollator, encode_feedback
from gemmaforge.train.preference import PreferenceSettings, pair_logps, preference_losses

GEMMA3 = FAMILIES["gemma3"]
QUESTIONS = [f"Is roast number {i} ready?" for i in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir: Path):
    return load_tokenizer(tiny_gemma3_dir)


def pairs_file(tmp_path: Path, records: list[dict], name: str = "pairs.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return path


def prepare(tmp_path: Path, source: Path, tokenizer, method: str = "dpo", **data: object) -> dict:
    return prepare_data(DataConfig(path=str(source), val_size=2, **data), 0, tmp_path / "out", tokenizer, GEMMA3, 256,
                        method=method)


TRL_TEXT = [{"prompt": q, "chosen": "Yes, it is ready.", "rejected": f"No idea {i}."} for i, q in enumerate(QUESTIONS)]
TRL_MESSAGES = [{"prompt": [{"role": "user", "content": q}],
                 "chosen": [{"role": "assistant", "content": "Yes, it is ready."}],
                 "rejected": [{"role": "assistant", "content": f"No idea {i}."}]} for i, q in enumerate(QUESTIONS)]
TRL_IMPLICIT = [{"chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": "Yes, it is ready."}],
                 "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": f"No idea {i}."}]}
                for i, q in enumerate(QUESTIONS)]
LF_SHAREGPT = [{"conversations": [{"from": "human", "value": q}],
                "chosen": {"from": "gpt", "value": "Yes, it is ready."},
                "rejected": {"from": "gpt", "value": f"No idea {i}."}} for i, q in enumerate(QUESTIONS)]
LF_ALPACA = [{"instruction": q, "input": "", "chosen": "Yes, it is ready.", "rejected": f"No idea {i}."}
             for i, q in enumerate(QUESTIONS)]


@pytest.mark.parametrize("records", [TRL_TEXT, TRL_MESSAGES, TRL_IMPLICIT, LF_SHAREGPT, LF_ALPACA],
                         ids=["trl-text", "trl-messages", "trl-implicit", "llamafactory-sharegpt", "alpaca-ranking"])
def test_every_pair_shape_prepares_to_one_form(tmp_path: Path, tokenizer, records: list[dict]) -> None:
    stats = prepare(tmp_path, pairs_file(tmp_path, records), tokenizer, system="You are a roaster.")
    assert stats["method"] == "dpo" and stats["kept"] == len(QUESTIONS) and stats["dropped"] == {}
    pairs = read_prepared_pairs(tmp_path / "out" / "train.jsonl") + read_prepared_pairs(tmp_path / "out" / "val.jsonl")
    by_question = {prompt[-1]["content"]: (prompt, chosen, rejected) for prompt, chosen, rejected in pairs}
    prompt, chosen, rejected = by_question[QUESTIONS[3]]
    assert prompt == [{"role": "system", "content": "You are a roaster."}, {"role": "user", "content": QUESTIONS[3]}]
    assert chosen == {"role": "assistant", "content": "Yes, it is ready."}
    assert rejected == {"role": "assistant", "content": "No idea 3."}
    # the eval stage and export verify read a pair as its prompt and its chosen answer
    assert read_prepared(tmp_path / "out" / "val.jsonl")[0][-1]["content"] == "Yes, it is ready."


def test_llamafactory_dpo_demos_prepare_as_they_are(tmp_path: Path, tokenizer, llamafactory_data: Path) -> None:
    for name in ("dpo_en_demo", "dpo_zh_demo"):
        stats = prepare_data(DataConfig(path=str(llamafactory_data), dataset=[name], max_samples=40, val_size=4), 0,
                             tmp_path / name, tokenizer, GEMMA3, 4096, method="dpo")
        assert stats["records"] == 40 and stats["kept"] + sum(stats["dropped"].values()) == 40
        prompt, chosen, rejected = read_prepared_pairs(tmp_path / name / "train.jsonl")[0]
        assert prompt[-1]["role"] == "user" and chosen["role"] == rejected["role"] == "assistant"
        assert chosen["content"] != rejected["content"]


@pytest.mark.parametrize(("record", "words"), [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "pairs.json record 1: the chosen and the rejected answer "
                                                            "are the same"),
    ({"prompt": "q", "chosen": "a", "rejected": ""}, "pairs.json record 1: field 'rejected' is missing or empty"),
    ({"chosen": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]},
     "do not start with the same prompt"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
      "rejected": "b"}, "field 'chosen' must be one assistant answer to the prompt, got 2 turns"),
])
def test_a_pair_that_is_not_one_exits_naming_the_record(tmp_path: Path, tokenizer, record: dict, words: str) -> None:
    good = {"prompt": "q0", "chosen": "a", "rejected": "b"}
    if "prompt" not in record:
        good = {"chosen": [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "b"}]}
    source = pairs_file(tmp_path, [good, record])
    with pytest.raises(UserError) as e:
        prepare(tmp_path, source, tokenizer)
    assert words in str(e.value) and "pairs.json record 1: " in str(e.value)  # the second record of the array
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_method_and_the_data_must_fit(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(UserError, match=r"a preference pair .* trains with train.method: dpo"):
        prepare(tmp_path, pairs_file(tmp_path, TRL_TEXT), tokenizer, method="sft")
    conversations = [{"instruction": q, "output": "Yes."} for q in QUESTIONS]
    with pytest.raises(UserError, match=r"train.method: dpo \(and rm\) trains on preference pairs.*alpaca"):
        prepare(tmp_path, pairs_file(tmp_path, conversations, "sft.json"), tokenizer)


def test_each_side_renders_as_sft_renders_it_with_the_loss_on_the_last_answer(tokenizer) -> None:
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": QUESTIONS[0]}]
    chosen, rejected = {"role": "assistant", "content": "Yes."}, {"role": "assistant", "content": "No."}
    (pair,), dropped = encode_pairs([(prompt, chosen, rejected)], tokenizer, GEMMA3, 256)
    ids, labels = GEMMA3.chat.encode([*prompt, chosen], tokenizer, 256, mask_history=True)
    assert dropped == 0 and (pair["chosen_input_ids"], pair["chosen_labels"]) == (ids, labels)
    supervised = tokenizer.decode([t for t in pair["rejected_labels"] if t != IGNORE_INDEX])
    assert supervised == "No.<end_of_turn>"  # never the prompt, never the earlier answer
    batch = PairCollator(tokenizer.pad_token_id)([pair, pair])
    assert batch["input_ids"].shape[0] == 4 and batch["counts"].examples == 2
    assert torch.equal(batch["input_ids"][0, :len(ids)], torch.tensor(ids))  # chosen rows first, then rejected


def _pair_batch(tokenizer, n: int = 3) -> dict:
    pairs = [([{"role": "user", "content": q}], {"role": "assistant", "content": "Yes, it is ready."},
              {"role": "assistant", "content": f"No idea at all, number {i}."}) for i, q in enumerate(QUESTIONS[:n])]
    encoded, _ = encode_pairs(pairs, tokenizer, GEMMA3, 256)
    batch = PairCollator(tokenizer.pad_token_id)(encoded)
    batch.pop("counts")
    return batch


def _lora_twins(tiny_gemma3_dir: Path) -> tuple:
    """The same tiny Gemma 3 with the same random LoRA weights, twice (TRL patches the model it is given)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gemmaforge.train.loss import install_supervised_forward

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
        models.append(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")))
    install_supervised_forward(models[0], chunk_size=16)  # several chunks: the chunked path is the one compared
    return models[0], models[1]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_the_reference_losses_equal_trls_dpo_trainer(tmp_path: Path, tiny_gemma3_dir: Path, tokenizer,
                                                     loss: str) -> None:
    """Our sequence log-probabilities (chunked, supervised positions only), the reference pass with the adapter
    disabled and the loss, against TRL's DPOTrainer computing the same pairs' loss its own way (full logits)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    ours, theirs = _lora_twins(tiny_gemma3_dir)
    batch = _pair_batch(tokenizer)
    settings = PreferenceSettings(loss, beta=0.3)
    chosen, rejected, chosen_counts, rejected_counts = pair_logps(ours, batch)
    with torch.no_grad(), ours.disable_adapter():
        ref_chosen, ref_rejected, _, _ = pair_logps(ours, batch)
    got = preference_losses(settings, chosen, rejected, ref_chosen, ref_rejected, chosen_counts,
                            rejected_counts).losses.mean()

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, loss_type=[loss], report_to=[], use_cpu=True,
                     per_device_train_batch_size=3)
    trainer = DPOTrainer(model=theirs, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(TRL_TEXT[:3]))
    # TRL keeps a copy of an adapter it is given as the reference ("ref"); ours starts from LoRA's zero update, so
    # its reference is the base: the copy goes, and TRL's reference is then the model with adapters disabled
    trainer.model.delete_adapter("ref")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != IGNORE_INDEX).long()}
    expected = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    assert abs(got.item() - expected.item()) < 1e-5, (got.item(), expected.item())
    assert got.item() > 0


@pytest.mark.slow
def test_the_reference_free_losses_equal_trls_orpo_and_cpo(tiny_gemma3_dir: Path, tokenizer) -> None:
    """ORPO's odds-ratio term and SimPO's loss from TRL's own functions, on log-probabilities averaged per answer
    token as TRL's get_batch_logps averages them from the full logits."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    ours, _ = _lora_twins(tiny_gemma3_dir)
    batch = _pair_batch(tokenizer)
    chosen, rejected, chosen_counts, rejected_counts = pair_logps(ours, batch)
    causal_lm = ours.get_base_model()
    with torch.no_grad():
        logits = causal_lm.lm_head(causal_lm.model(input_ids=batch["input_ids"],
                                                   attention_mask=batch["attention_mask"]).last_hidden_state)
        softcap = causal_lm.config.final_logit_softcapping
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        mean = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
    mean_chosen, mean_rejected = mean.chunk(2)
    assert torch.allclose(chosen / chosen_counts, mean_chosen, atol=1e-5)
    assert torch.allclose(rejected / rejected_counts, mean_rejected, atol=1e-5)

    trl = SimpleNamespace(beta=0.25, simpo_gamma=0.7, label_smoothing=0.0, loss_type="simpo", alpha=0.0,
                          accelerator=SimpleNamespace(device="cpu"), cpo_alpha=0.0)
    odds, _, _, _, _ = ORPOTrainer.odds_ratio_loss(trl, mean_chosen, mean_rejected)
    orpo = preference_losses(PreferenceSettings("orpo", beta=0.25), chosen, rejected, None, None, chosen_counts,
                             rejected_counts).losses
    assert torch.allclose(orpo, -mean_chosen - odds, atol=1e-5)  # LLaMA-Factory's: SFT term minus TRL's odds term
    simpo_trl, _, _ = CPOTrainer.cpo_loss(trl, mean_chosen, mean_rejected)
    simpo = preference_losses(PreferenceSettings("simpo", beta=0.25, simpo_gamma=0.7), chosen, rejected, None, None,
                              chosen_counts, rejected_counts).losses
    assert torch.allclose(simpo, simpo_trl, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_dpo_and_kto_learn_which_answer_is_preferred(tmp_path: Path, tiny_gemma3_dir: Path, method: str) -> None:
    """Pairs whose chosen answer opens with a sign-off word the rejected one lacks (kto: each side one labelled
    answer): on held-out pairs the tuned model's reward margin is positive for every pair, from a base that has no
    preference."""
    records = [{"prompt": f"Question {i}: how is roast {i}?", "chosen": f"Barista says: roast {i} is fine.",
                "rejected": f"roast {i} is fine."} for i in range(40)]
    config = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(tiny_gemma3_dir)},
              "data": {"path": str(pairs_file(tmp_path, records)), "val_size": 8},
              "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
              "train": {"method": method, "pref_beta": 0.1, "max_steps": 12, "per_device_train_batch_size": 4,
                        "learning_rate": 1e-2, "logging_steps": 4, "save_steps": 12, "cutoff_len": 64,
                        "precision": "fp32", "eval_strategy": "steps", "eval_steps": 12}}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval_loss" in row]
    own = "rewards/accuracies" if method == "dpo" else "kl"  # pairs are ranked; kto's answers scored against kl
    assert train and {"rewards/chosen", "rewards/rejected", "rewards/margins", own} <= set(train[-1])
    assert evals[-1]["eval_rewards/margins"] > 0 and f"eval_{own}" in evals[-1]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["train"]["method"] == method
    assert manifest["stages"]["train"]["samples"] == 32 * (1 if method == "dpo" else 2)  # kto: answers
    assert main(["eval", str(run), "retention=false", "num_samples=2", "max_new_tokens=4"]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    base, tuned = results["base"], results["tuned"]
    # the chosen answers are longer, so their summed log-probability starts behind; DPO moves them up
    assert tuned["reward_accuracy"] == 1.0 and tuned["reward_margin"] > 0 and base["reward_margin"] is None
    assert tuned["preference_accuracy"] >= base["preference_accuracy"]
    assert tuned["kl_from_base"] > 0 and base["kl_from_base"] is None  # it moved away from its reference
    report = (run / "eval" / "report.md").read_text()
    assert "preference accuracy" in report and "KL from the base" in report


# KTO (train.method: kto): answers labelled desirable or undesirable, or pairs taken one side at a time
TRL_UNPAIRED = [{"prompt": q, "completion": "Yes, it is ready." if i % 2 else f"No idea {i}.", "label": bool(i % 2)}
                for i, q in enumerate(QUESTIONS)]
TRL_UNPAIRED_MESSAGES = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                          "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}
                         for r in TRL_UNPAIRED]
LF_KTO = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}],
           "label": r["label"]} for r in TRL_UNPAIRED]
ALPACA_KTO = [{"instruction": r["prompt"], "output": r["completion"], "label": r["label"]} for r in TRL_UNPAIRED]


@pytest.mark.parametrize("records", [TRL_UNPAIRED, TRL_UNPAIRED_MESSAGES, LF_KTO, ALPACA_KTO],
                         ids=["trl-text", "trl-messages", "llamafactory-messages", "alpaca-label"])
def test_every_labelled_shape_prepares_to_one_form(tmp_path: Path, tokenizer, records: list[dict]) -> None:
    stats = prepare(tmp_path, pairs_file(tmp_path, records), tokenizer, method="kto", system="You are a roaster.")
    assert stats["method"] == "kto" and stats["kept"] == len(QUESTIONS) and stats["dropped"] == {}
    examples = [*read_prepared_feedback(tmp_path / "out" / "train.jsonl"),
                *read_prepared_feedback(tmp_path / "out" / "val.jsonl")]
    by_question = {prompt[-1]["content"]: (prompt, answer, label) for prompt, answer, label in examples}
    assert by_question[QUESTIONS[3]] == ([{"role": "system", "content": "You are a roaster."},
                                          {"role": "user", "content": QUESTIONS[3]}],
                                         {"role": "assistant", "content": "Yes, it is ready."}, True)
    assert by_question[QUESTIONS[4]][1:] == ({"role": "assistant", "content": "No idea 4."}, False)
    # the eval stage asks the desirable answers' prompts and scores against them, never an undesirable answer
    conversations = read_prepared(tmp_path / "out" / "train.jsonl") + read_prepared(tmp_path / "out" / "val.jsonl")
    assert sorted(c[-1]["content"] for c in conversations) == ["Yes, it is ready."] * 5


def test_kto_takes_pairs_as_a_desirable_and_an_undesirable_answer(tmp_path: Path, tokenizer) -> None:
    stats = prepare(tmp_path, pairs_file(tmp_path, TRL_TEXT), tokenizer, method="kto")
    assert stats["kept"] == len(QUESTIONS)  # pairs, split as pairs: both sides of one prompt stay in one split
    examples = read_prepared_feedback(tmp_path / "out" / "train.jsonl")
    assert len(examples) == 2 * stats["train"] and [label for _, _, label in examples[:2]] == [True, False]
    assert examples[0][0] == examples[1][0]


def test_llamafactory_kto_demo_prepares_as_it_is(tmp_path: Path, tokenizer, llamafactory_data: Path) -> None:
    stats = prepare_data(DataConfig(path=str(llamafactory_data), dataset=["kto_en_demo"], max_samples=40,
                                    val_size=4), 0, tmp_path / "kto", tokenizer, GEMMA3, 4096, method="kto")
    assert stats["records"] == 40 and stats["kept"] + sum(stats["dropped"].values()) == 40
    labels = [label for _, _, label in read_prepared_feedback(tmp_path / "kto" / "train.jsonl")]
    assert True in labels and False in labels


@pytest.mark.parametrize(("record", "method", "words"), [
    ({"prompt": "q", "completion": "a", "label": "yes"}, "kto",
     "pairs.json record 1: field 'label' must be true (a desirable answer) or false (an undesirable one), got 'yes'"),
    ({"prompt": [{"role": "user", "content": "q"}], "label": True,
      "completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}, "kto",
     "pairs.json record 1: field 'completion' must be one assistant answer, got 2 turns"),
    ({"prompt": "q", "completion": "a", "label": True}, "sft",
     "pairs.json record 0: an answer labelled desirable or undesirable (column 'label') trains with train.method: kto"),
    ({"instruction": "q", "output": "a"}, "kto", "pairs.json record 0: train.method: kto trains on answers labelled"),
])
def test_a_labelled_answer_that_is_not_one_exits_naming_the_record(tmp_path: Path, tokenizer, record: dict,
                                                                   method: str, words: str) -> None:
    first = record if method == "sft" or "instruction" in record else {**record, "label": True}
    if isinstance(record.get("completion"), list):  # the second record's fault only
        first["completion"] = record["completion"][:1]
    source = pairs_file(tmp_path, [first, record])
    with pytest.raises(UserError) as e:
        prepare(tmp_path, source, tokenizer, method=method)
    assert words in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing written


def _feedback_batch(tokenizer) -> tuple[list[dict], dict]:
    examples = [([{"role": "user", "content": q}], {"role": "assistant", "content": answer}, desirable)
                for q, answer, desirable in ((QUESTIONS[0], "Yes, it is ready.", True),
                                             (QUESTIONS[1], "No idea at all, number 1.", False),
                                             (QUESTIONS[2], "Yes, it is ready now.", True),
                                             (QUESTIONS[3], "No idea.", False))]
    encoded, dropped = encode_feedback(examples, tokenizer, GEMMA3, 256)
    assert dropped == 0
    return encoded, FeedbackCollator(tokenizer.pad_token_id)(encoded)


def test_each_answer_has_a_mismatched_partner_half_the_data_away(tokenizer) -> None:
    encoded, batch = _feedback_batch(tokenizer)
    ids, labels = GEMMA3.chat.encode([{"role": "user", "content": QUESTIONS[0]},
                                      {"role": "assistant", "content": "Yes, it is ready."}], tokenizer, 256,
                                     mask_history=True)
    assert (encoded[0]["input_ids"], encoded[0]["labels"]) == (ids, labels)
    kl_answer = tokenizer.decode([t for t in encoded[0]["kl_labels"] if t != IGNORE_INDEX])
    assert kl_answer == "Yes, it is ready now.<end_of_turn>"  # example 2's answer to example 0's prompt
    assert QUESTIONS[0] in tokenizer.decode(encoded[0]["kl_input_ids"])
    assert batch["input_ids"].shape[0] == 8 and batch["desirable"].tolist() == [True, False, True, False]
    assert batch["counts"].examples == 4
    assert batch["counts"].supervised == sum(t != IGNORE_INDEX for ex in encoded for t in ex["labels"][1:])


@pytest.mark.slow
def test_the_kto_loss_equals_trls_kto_trainer(tmp_path: Path, tiny_gemma3_dir: Path, tokenizer) -> None:
    """Our log-probabilities, KL estimate (the mismatched rows, policy and reference) and weighted loss against TRL's
    KTOTrainer computing the same batch its own way (full logits)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from gemmaforge.train.preference import kto_losses

    ours, theirs = _lora_twins(tiny_gemma3_dir)
    _, batch = _feedback_batch(tokenizer)
    batch.pop("counts")
    desirable = batch.pop("desirable")
    settings = PreferenceSettings("sigmoid", beta=0.3, chosen_weight=1.3, rejected_weight=0.8)
    rows = {key: batch[key] for key in ("input_ids", "labels", "attention_mask")}
    out = ours(**rows, sequence_logps=True)
    with torch.no_grad(), ours.disable_adapter():
        ref = ours(**rows, sequence_logps=True)
    logps, kl_logps = out.logps.chunk(2)
    ref_logps, ref_kl_logps = ref.logps.chunk(2)
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    losses, _ = kto_losses(settings, logps, ref_logps, out.counts.chunk(2)[0], desirable, kl)

    args = KTOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, desirable_weight=1.3, undesirable_weight=0.8,
                     report_to=[], use_cpu=True, per_device_train_batch_size=4)
    trainer = KTOTrainer(model=theirs, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(TRL_UNPAIRED[:4]))
    trainer.model.delete_adapter("ref")  # as for DPO: TRL's reference is then the model with adapters disabled
    completion = (batch["labels"] != IGNORE_INDEX).long()
    half = len(desirable)
    inputs = {"input_ids": batch["input_ids"][:half], "attention_mask": batch["attention_mask"][:half],
              "completion_mask": completion[:half], "label": desirable,
              "KL_input_ids": batch["input_ids"][half:], "KL_attention_mask": batch["attention_mask"][half:],
              "KL_completion_mask": completion[half:]}
    expected = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert abs(losses.mean().item() - expected.item()) < 1e-5, (losses.mean().item(), expected.item())
    assert kl.item() >= 0 and losses.mean().item() > 0


def test_the_kl_from_the_base_is_torchs_kl_divergence_on_the_answer_tokens(tiny_gemma3_dir: Path, tokenizer) -> None:
    """The eval stage's KL of the tuned model from the base, per answer token, against torch's kl_div on the full
    logits of both (the adapter enabled and disabled); 0 for an adapter that changes nothing."""
    from gemmaforge.evaluate.scoring import kl_from_reference

    class Engine:  # what kl_from_reference asks of the serving engine: fn(model) with an adapter or the base
        def __init__(self, model):
            self.model = model

        def call(self, fn, adapter=None):
            with torch.inference_mode():
                if adapter is None:
                    with self.model.disable_adapter():
                        return fn(self.model)
                return fn(self.model)

    ours, twin = _lora_twins(tiny_gemma3_dir)  # the twin's forward is transformers' own: its full logits
    examples = [dict(zip(("input_ids", "labels"), GEMMA3.chat.encode(
        [{"role": "user", "content": q}, {"role": "assistant", "content": f"Roast {i} is ready."}], tokenizer, 256,
        mask_history=True), strict=True)) for i, q in enumerate(QUESTIONS[:3])]
    got = kl_from_reference(Engine(ours), examples, "tuned", tokenizer.pad_token_id)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            keep = torch.tensor(example["labels"][1:]) != IGNORE_INDEX
            tuned = twin(input_ids=ids).logits[0, :-1][keep].float().log_softmax(-1)
            with twin.disable_adapter():
                base = twin(input_ids=ids).logits[0, :-1][keep].float().log_softmax(-1)
            total += float(torch.nn.functional.kl_div(base, tuned, log_target=True, reduction="sum"))
            count += int(keep.sum())
    assert got == pytest.approx(total / count, abs=1e-5) and got > 0
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_B" in name:
                param.zero_()
    assert kl_from_reference(Engine(ours), examples, "tuned", tokenizer.pad_token_id) == pytest.approx(0, abs=1e-6)
