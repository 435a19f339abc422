"""Reference metrics, CJK-aware: BLEU (sacrebleu) and ROUGE-L (Google's rouge-score) over tokens that
are single characters for Chinese and Japanese script and lower-cased words elsewhere.

Both libraries tokenize English well and Chinese badly (rouge-score drops every non-ASCII character;
sacrebleu's default 13a tokenizer makes a whole Chinese sentence one token), so both are given the same
mixed tokenization: Chinese answers are compared character by character, as is usual for Chinese.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # kana and CJK ideographs
# One token per CJK character; otherwise runs of letters and digits (punctuation is not a token).
_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class _RougeTokenizer:
    """The interface rouge-score expects of a tokenizer."""

    def tokenize(self, text: str) -> list[str]:
        return tokenize(text)


@dataclass(frozen=True)
class ReferenceScores:
    bleu: float  # corpus BLEU, 0-100
    rouge_l: float  # mean ROUGE-L F1, 0-1
    per_case: list[tuple[float, float]]  # sentence BLEU, ROUGE-L F1 of each scored case


def reference_scores(answers: list[str], references: list[str]) -> ReferenceScores:
    from rouge_score.rouge_scorer import RougeScorer
    from sacrebleu.metrics import BLEU

    hyps = [" ".join(tokenize(a)) for a in answers]
    refs = [" ".join(tokenize(r)) for r in references]
    corpus = BLEU(tokenize="none").corpus_score(hyps, [refs]).score
    sentence = BLEU(tokenize="none", effective_order=True)  # short answers: no zero from a missing 4-gram
    rouge = RougeScorer(["rougeL"], tokenizer=_RougeTokenizer())
    per_case = [
        (sentence.sentence_score(h, [r]).score, rouge.score(ref, ans)["rougeL"].fmeasure)
        for h, r, ans, ref in zip(hyps, refs, answers, references)
    ]
    mean_rouge = sum(r for _, r in per_case) / len(per_case) if per_case else 0.0
    return ReferenceScores(round(corpus, 2), round(mean_rouge, 4), [(round(b, 2), round(r, 4)) for b, r in per_case])
