"""The eval stage: the base model and the tuned model on the same loss, suite and retention probes.

One model is loaded, in the inference engine `serve` runs, with the run's adapter beside it: the base answers
and scores with the adapter disabled, the tuned model with it, all on the engine's thread. With
the llama.cpp engine the tuned answers come from the exported GGUF itself (what Ollama will run), and
the merged model's answers (the adapter in transformers) are kept to report how far the two agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmaforge.config import EvalConfig, RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import (
    read_prepared,
    read_prepared_audios,
    read_prepared_images,
    read_prepared_pairs,
    read_prepared_texts,
)
from gemmaforge.errors import UserError
from gemmaforge.evaluate.generate import EngineGenerator, Generation, Sampling, prompt_ids
from gemmaforge.evaluate.metrics import reference_scores
from gemmaforge.evaluate.reward_eval import evaluate_reward_model
from gemmaforge.evaluate.scoring import (
    Probe,
    general_text_examples,
    kl_from_reference,
    mean_loss,
    pair_logps,
    perplexity,
    preference_summary,
    probe_conversation,
    retention_probes,
)
from gemmaforge.evaluate.suite import Case, load_suite, val_sample_suite
from gemmaforge.families import Family
from gemmaforge.gguf_names import gguf_parts
from gemmaforge.inference.llamacpp_images import projector_beside
from gemmaforge.intake import picture_sizes
from gemmaforge.models import ResolvedModel, load_causal_lm, load_tokenizer
from gemmaforge.recipe.dpo import encode_pairs
from gemmaforge.recipe.pt import encode_texts
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses

if TYPE_CHECKING:
    from gemmaforge.inference.transformers_engine import TransformersEngine

PREFERENCE_METHODS = ("dpo", "kto")  # their reports add the held-out pairs' metrics and the KL from the base
PROBE_TOKENS = 48  # probe answers are a word or a number; a short limit keeps retention cheap


@dataclass
class Answers:
    suite: list[Generation]
    probes: list[Generation]
    seconds: float


def evaluate(run: RunDir, config: RunConfig, base: ResolvedModel) -> dict[str, Any]:
    """Everything results.json holds (see report.py for the files)."""
    import torch

    from gemmaforge.inference.llamacpp_engine import LlamaCppEngine
    from gemmaforge.inference.transformers_engine import TransformersEngine

    if config.train.method == "rm":  # it scores answers and writes none
        return evaluate_reward_model(run, config, base)
    ec = config.eval
    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    val_path = run.require(run.data_dir / "val.jsonl", "data")
    pretraining = config.train.method == "pt"  # raw text: no conversations to draw a default suite from
    val, val_images, val_audios = ([], [], []) if pretraining else \
        (read_prepared(val_path), read_prepared_images(val_path), read_prepared_audios(val_path))
    system = config.deployed_system
    cases, source = ([], "none (a continued-pretraining run is asked the cases of eval.suite)") \
        if pretraining and not ec.suite else suite_cases(ec, val, system, val_images, val_audios)
    if ec.fail_under is not None and not any(case.checks for case in cases):
        raise UserError(f"eval.fail_under={ec.fail_under} needs a suite with checks; {source} has none")
    gguf = deployed_gguf(run, config) if ec.engine == "llamacpp" else None
    family = base.family
    tokenizer = load_tokenizer(adapter)
    probes = retention_probes() if ec.retention else []
    probe_chats = [probe_conversation(p, system) for p in probes]
    chats = [*(c.messages for c in cases), *probe_chats]
    senses = Senses.of(base.path, base.spec, tokenizer)
    vision = senses.vision
    num_ctx = max((len(prompt_ids(tokenizer, family, chat)) for chat in chats), default=0) + ec.max_new_tokens + 1
    if vision is not None or senses.audio is not None:
        num_ctx += max(((vision.prompt_tokens(picture_sizes(c.images), tokenizer) if vision else 0)
                        + (senses.audio.most_prompt_tokens(len(c.audios)) if senses.audio else 0) for c in cases),
                       default=0)
    sampling = Sampling(ec.max_new_tokens, ec.do_sample, ec.temperature, ec.top_p, ec.seed)
    # the engine serve runs, in fp32, the run's adapter loaded by name: base answers name no adapter
    engine = TransformersEngine(load_causal_lm(base.path, base.spec, torch.float32), tokenizer, family,
                                max_batch=ec.batch_size, max_queue=len(chats), num_ctx=num_ctx,
                                vision=vision, no_vision=senses.no_vision, audio=senses.audio,
                                no_audio=senses.no_audio)
    try:
        engine.load_adapter("tuned", adapter)
        val_examples = encode_texts(read_prepared_texts(val_path), tokenizer, config.train.cutoff_len) \
            if pretraining else _encode((val, val_images, val_audios), tokenizer, family, config, senses)
        sides, answers = _base_and_tuned(engine, cases, probe_chats, sampling, config, val_examples, tokenizer,
                                         senses)
        pair_scores: dict[str, tuple[list[float], list[float]]] = {}
        if config.train.method in PREFERENCE_METHODS:  # how far the tuned model moved from its reference
            console.print(f"[bold]eval[/]: KL from the base on the tuned answers to {len(cases)} cases ...")
            answered = [family.chat.encode([*case.messages, {"role": "assistant", "content": answer.text}],
                                           tokenizer, num_ctx, mask_history=True)
                        for case, answer in zip(cases, answers["tuned"].suite)
                        if not case.images and not case.audios and answer.text]
            sides["tuned"]["kl_from_base"] = kl_from_reference(
                engine, [{"input_ids": ids, "labels": labels} for ids, labels in answered], "tuned",
                tokenizer.pad_token_id)
            sides["base"]["kl_from_base"] = None
        pairs, _ = encode_pairs(read_prepared_pairs(val_path), tokenizer, family, config.train.cutoff_len) \
            if config.train.method in PREFERENCE_METHODS else ([], 0)
        if pairs:  # held-out pairs (dpo's, kto's when it trained on pairs): which answer each model finds likelier
            console.print(f"[bold]eval[/]: {len(pairs)} held-out preference pairs, base and tuned ...")
            pair_scores = {side: engine.call(lambda model: pair_logps(model, pairs, tokenizer.pad_token_id,
                                                                      ec.batch_size), adapter)
                           for side, adapter in (("base", None), ("tuned", "tuned"))}
    finally:
        engine.close()
    agreement = None
    if gguf is not None:
        console.print(f"[bold]eval[/]: tuned answers from {gguf} (llama.cpp) ...")
        mmproj, several = projector_beside(gguf)
        llama = LlamaCppEngine(gguf, family, num_ctx=num_ctx, max_queue=len(chats), mmproj=mmproj, no_vision=several)
        try:
            merged = answers["tuned"]
            answers["tuned"] = answer_all(EngineGenerator(llama, tokenizer), cases, probe_chats, sampling)
        finally:
            llama.close()
        agreement = agreement_summary(merged.suite, answers["tuned"].suite, gguf)
    for side in sides:
        sides[side].update(answer_summary(cases, answers[side], probes))
    if pair_scores:
        for side, values in preference_summary(pair_scores["base"], pair_scores["tuned"],
                                               config.train.pref_beta).items():
            sides[side].update(values)
    return {
        "engine": ec.engine,
        "suite": {"source": source, "cases": len(cases), "with_checks": sum(bool(c.checks) for c in cases),
                  "with_reference": sum(c.reference is not None for c in cases)},
        "sampling": {"do_sample": ec.do_sample, "max_new_tokens": ec.max_new_tokens,
                     **({"temperature": ec.temperature, "top_p": ec.top_p, "seed": ec.seed} if ec.do_sample else {})},
        "base": sides["base"],
        "tuned": sides["tuned"],
        "regressions": regressions(sides["base"], sides["tuned"], ec),
        "agreement": agreement,
        "cases": case_records(cases, answers),
        "retention": [
            {"id": p.id, "lang": p.lang, "prompt": p.prompt, "answers": list(p.answers),
             **{side: {"answer": answers[side].probes[i].text, "correct": p.correct(answers[side].probes[i].text)}
                for side in ("base", "tuned")}}
            for i, p in enumerate(probes)
        ],
    }


def _base_and_tuned(engine: TransformersEngine, cases: list[Case], probe_chats: list[list[dict[str, str]]],
                    sampling: Sampling, config: RunConfig, val_examples: list[dict],
                    tokenizer: Any, senses: Senses) -> tuple[dict[str, dict[str, Any]], dict[str, Answers]]:
    """Loss on the encoded val split, perplexities and answers of the base model (the adapter disabled) and the
    tuned one."""
    ec = config.eval
    general = general_text_examples(tokenizer, config.train.cutoff_len) if ec.retention else []
    sides: dict[str, dict[str, Any]] = {}
    answers: dict[str, Answers] = {}
    for side, adapter in (("base", None), ("tuned", "tuned")):
        console.print(f"[bold]eval[/]: {side} model: loss, {len(cases)} cases, {len(probe_chats)} retention probes ...")
        loss = engine.call(lambda model: mean_loss(model, val_examples, tokenizer.pad_token_id, ec.batch_size,
                                                   senses), adapter)
        general_loss = engine.call(lambda model: mean_loss(model, general, tokenizer.pad_token_id, ec.batch_size),
                                   adapter) if general else None
        answers[side] = answer_all(EngineGenerator(engine, tokenizer, adapter), cases, probe_chats, sampling)
        sides[side] = {"eval_loss": _round(loss), "perplexity": perplexity(loss),
                       "general_text_perplexity": perplexity(general_loss)}
    return sides, answers


def suite_cases(ec: EvalConfig, val: list[list[dict[str, str]]], system: str | None,
                val_images: list[list[Path]] | None = None, val_audios: list[list[Path]] | None = None
                ) -> tuple[list[Case], str]:
    """The user's suite (cases without a system prompt get the one the model is deployed with), or a
    sample of val prompts with their answers as references."""
    if ec.suite:
        cases = load_suite(Path(ec.suite))
        if system:
            for case in cases:
                if case.messages[0]["role"] != "system":
                    case.messages.insert(0, {"role": "system", "content": system})
        return cases, ec.suite
    cases = val_sample_suite(val, ec.num_samples, ec.seed, val_images, val_audios)
    if not cases:
        raise UserError("the val split is empty, so there is no default suite: give eval.suite (or --suite FILE)")
    return cases, f"val sample ({len(cases)} of {len(val)} conversations)"


def deployed_gguf(run: RunDir, config: RunConfig) -> Path:
    """The file llama.cpp opens (the first shard of a split export): eval.gguf, else the deployed one."""
    ec = config.eval
    if ec.gguf:
        parts = gguf_parts(run.gguf_path(ec.gguf))
        return parts[0] if parts else run.require(run.gguf_path(ec.gguf), "export gguf")
    found = run.model_ggufs()
    if not found:
        raise UserError(f"{run.gguf_dir} has no model-<quant>.gguf: run `gemmaforge export gguf {run.root}` first")
    return found[run.deployed_quant(config)][0]


def _encode(val: tuple[list[list[dict[str, str]]], list[list[Path]], list[list[Path]]], tokenizer: Any,
            family: Family, config: RunConfig, senses: Senses) -> list[dict]:
    from gemmaforge.train.collate import tokenize_conversations

    examples, _dropped = tokenize_conversations(
        val[0], tokenizer, family, config.train.cutoff_len, "data/val.jsonl",
        train_on_prompt=config.data.train_on_prompt, mask_history=config.data.mask_history,
        images=val[1], audios=val[2], senses=senses,
    )
    return examples


def answer_all(engine: EngineGenerator, cases: list[Case], probe_chats: list[list[dict[str, str]]],
               sampling: Sampling) -> Answers:
    start = time.perf_counter()
    suite = engine.generate([c.messages for c in cases], sampling, [c.images for c in cases],
                            [c.audios for c in cases])
    probes = engine.generate(probe_chats, Sampling(min(PROBE_TOKENS, sampling.max_new_tokens), sampling.do_sample,
                                                    sampling.temperature, sampling.top_p, sampling.seed))
    return Answers(suite, probes, time.perf_counter() - start)


def answer_summary(cases: list[Case], answers: Answers, probes: list[Probe]) -> dict[str, Any]:
    gens = answers.suite
    checked = [all(check.passes(g.text) for check in c.checks) for c, g in zip(cases, gens) if c.checks]
    by_name: dict[str, list[bool]] = {}
    for case, gen in zip(cases, gens):
        for check in case.checks:
            by_name.setdefault(check.name, []).append(check.passes(gen.text))
    scored = [(g.text, c.reference) for c, g in zip(cases, gens) if c.reference is not None]
    refs = reference_scores([a for a, _ in scored], [r for _, r in scored]) if scored else None
    correct = [p.correct(g.text) for p, g in zip(probes, answers.probes)]
    n = len(gens)
    asked = len(gens) + len(answers.probes)
    return {
        "suite_pass_rate": _mean(checked),
        "check_pass_rates": {name: _mean(results) for name, results in by_name.items()},
        "bleu": refs.bleu if refs else None,
        "rouge_l": refs.rouge_l if refs else None,
        "retention_accuracy": _mean(correct),
        "answer_chars_mean": round(sum(len(g.text) for g in gens) / n, 1) if n else None,
        "answer_tokens_mean": round(sum(g.tokens for g in gens) / n, 1) if n else None,
        "stopped_rate": _mean([g.stopped for g in gens]),  # ended on the stop token, not the token limit
        "prompts_per_second": round(asked / answers.seconds, 3) if asked else None,
    }


def agreement_summary(merged: list[Generation], deployed: list[Generation], gguf: Path) -> dict[str, Any]:
    """How often the GGUF answers exactly as the merged model does, and how close it is otherwise."""
    scores = reference_scores([d.text for d in deployed], [m.text for m in merged])
    return {
        "gguf": str(gguf),
        "exact_match": _mean([m.text == d.text for m, d in zip(merged, deployed)]),
        "rouge_l": scores.rouge_l,
        "merged_answers": [m.text for m in merged],
    }


def regressions(base: dict[str, Any], tuned: dict[str, Any], ec: EvalConfig) -> list[str]:
    found = []
    if (base["retention_accuracy"] is not None
            and tuned["retention_accuracy"] < base["retention_accuracy"] - ec.retention_tolerance):
        found.append(
            f"knowledge retention fell from {base['retention_accuracy']:.0%} to {tuned['retention_accuracy']:.0%} "
            f"of the probes (tolerance eval.retention_tolerance={ec.retention_tolerance})"
        )
    b, t = base["general_text_perplexity"], tuned["general_text_perplexity"]
    if b is not None and t > b * (1 + ec.perplexity_tolerance):
        found.append(
            f"general-text perplexity rose from {b:.2f} to {t:.2f} (+{t / b - 1:.0%}; tolerance "
            f"eval.perplexity_tolerance={ec.perplexity_tolerance})"
        )
    if base["stopped_rate"] is not None and tuned["stopped_rate"] < base["stopped_rate"] - 0.25:
        found.append(
            f"tuned answers end on the stop token less often ({tuned['stopped_rate']:.0%} against "
            f"{base['stopped_rate']:.0%}): the rest ran into eval.max_new_tokens"
        )
    return found


def case_records(cases: list[Case], answers: dict[str, Answers]) -> list[dict[str, Any]]:
    records = []
    for i, case in enumerate(cases):
        record: dict[str, Any] = {"id": case.id, "messages": case.messages, "reference": case.reference,
                                  "checks": [c.describe() for c in case.checks]}
        if case.images:
            record["images"] = [str(path) for path in case.images]
        if case.audios:
            record["audios"] = [str(path) for path in case.audios]
        for side, got in answers.items():
            gen = got.suite[i]
            results = [c.passes(gen.text) for c in case.checks]
            side_record = {"answer": gen.text, "tokens": gen.tokens, "stopped": gen.stopped, "checks": results,
                           "passed": all(results) if results else None}
            if case.reference is not None:
                scores = reference_scores([gen.text], [case.reference]).per_case[0]
                side_record.update(bleu=scores[0], rouge_l=scores[1])
            record[side] = side_record
        records.append(record)
    return records


def _mean(values: list[bool]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
