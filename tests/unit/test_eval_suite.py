"""Suite files, checks and the CJK-aware reference metrics of `gemmaforge eval`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaforge.errors import UserError
from gemmaforge.evaluate.metrics import reference_scores, tokenize
from gemmaforge.evaluate.scoring import retention_probes
from gemmaforge.evaluate.suite import CHECKS, load_suite, val_sample_suite

SUITE = """\
cases:
  - prompt: "手冲咖啡的水温应该是多少？"
    system: "你是咖啡师。"
    reference: "90到96摄氏度。"
    checks:
      - starts_with: "您好"
      - contains: "摄氏度"
      - not_contains: "抱歉"
      - regex: "\\\\d+"
      - max_chars: 20
  - id: json
    prompt: "Give me JSON"
    checks: [{json_valid: true}, {ends_with: "}"}, {min_chars: 2}]
"""


def write(tmp_path: Path, text: str, name: str = "suite.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_suite_cases_and_every_check(tmp_path: Path) -> None:
    first, second = load_suite(write(tmp_path, SUITE))
    assert first.messages == [{"role": "system", "content": "你是咖啡师。"},
                              {"role": "user", "content": "手冲咖啡的水温应该是多少？"}]
    assert first.reference == "90到96摄氏度。" and first.id == "1" and second.id == "json"
    good = "您好，水温是92摄氏度。"
    assert all(c.passes(good) for c in first.checks)
    assert [c.passes("抱歉，我不知道92摄氏度。") for c in first.checks] == [False, True, False, True, True]
    assert not first.checks[4].passes("您好" + "很" * 30 + "1摄氏度")  # max_chars
    assert [c.passes('  {"a": 1}\n') for c in second.checks] == [True, True, True]  # answers are stripped
    assert [c.passes("{oops}") for c in second.checks] == [False, True, True]


def test_jsonl_suite_with_a_conversation(tmp_path: Path) -> None:
    path = write(tmp_path, '{"prompt": "hi", "checks": [{"contains": "hello"}]}\n\n'
                 '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
                 '{"role": "user", "content": "c"}], "reference": "d"}\n', "suite.jsonl")
    one, two = load_suite(path)
    assert one.prompt == "hi" and one.checks[0].passes("well hello")
    assert two.prompt == "c" and len(two.messages) == 3 and two.reference == "d" and two.checks == []


@pytest.mark.parametrize(
    ("text", "name", "expected"),
    [
        ("cases:\n  - prompt: [unclosed\n", "suite.yaml", "suite.yaml line 3: not valid YAML"),
        ("cases:\n  - prompt: a\n  - prompt: b\n    checks: [{startswith: x}]\n", "suite.yaml",
         "suite.yaml case 2 (line 3): unknown check 'startswith'; known checks: " + ", ".join(CHECKS)),
        ("cases:\n  - prompt: a\n    checks: [{max_chars: many}]\n", "suite.yaml",
         "case 1 (line 2): check 'max_chars' takes int, got 'many'"),
        ("cases:\n  - prompt: a\n    checks: [{regex: '(unclosed'}]\n", "suite.yaml",
         "is not a valid regular expression"),
        ("cases:\n  - reference: a\n", "suite.yaml", "case 1 (line 2): give `prompt` (text) or `messages`"),
        ("cases:\n  - prompt: a\n    expected: b\n", "suite.yaml", "unknown key(s) expected"),
        ("- prompt: a\n", "suite.yaml", "expected a mapping with a `cases:` list"),
        ("cases: []\n", "suite.yaml", "the suite has no cases"),
        ('{"prompt": "a"}\n{"prompt": "b",}\n', "suite.jsonl", "suite.jsonl line 2: not valid JSON"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n', "suite.jsonl",
         "must end with a user turn"),
    ],
)
def test_bad_suites_name_the_line_or_case(tmp_path: Path, text: str, name: str, expected: str) -> None:
    with pytest.raises(UserError, match=None) as info:
        load_suite(write(tmp_path, text, name))
    assert expected in str(info.value)


def test_image_cases_place_their_pictures(tmp_path: Path) -> None:
    """`image:` opens the prompt with its picture (as Ollama places a message's images); `<image>` places them."""
    from PIL import Image

    (tmp_path / "pics").mkdir()
    for name in ("a", "b"):
        Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / "pics" / f"{name}.png")
    suite = ("cases:\n  - prompt: What is it?\n    image: pics/a.png\n"
             "  - prompt: 'Compare <image> with <image>.'\n    images: [pics/b.png, pics/a.png]\n")
    first, second = load_suite(write(tmp_path, suite, "suite.yaml"))
    assert first.messages[-1]["content"] == "<image>What is it?" and first.images == [tmp_path / "pics" / "a.png"]
    assert second.messages[-1]["content"] == "Compare <image> with <image>."
    assert second.images == [tmp_path / "pics" / "b.png", tmp_path / "pics" / "a.png"]


@pytest.mark.parametrize(("case", "expected"), [
    ("image: pics/none.png", "case 1 (line 2): image 1: image pics/none.png not found"),
    ("image: a.png\n    images: [a.png]", "give `image` (one path) or `images` (a list), not both"),
    ("images: pics/a.png", "`images` a list of paths"),
    ("image: notes.txt", "notes.txt: not a picture PIL can read (no image format it knows)"),
])
def test_bad_image_cases_name_the_case(tmp_path: Path, case: str, expected: str) -> None:
    (tmp_path / "notes.txt").write_text("words")
    with pytest.raises(UserError) as info:
        load_suite(write(tmp_path, f"cases:\n  - prompt: What is it?\n    {case}\n", "suite.yaml"))
    assert expected in str(info.value)


def test_missing_suite_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="suite file not found"):
        load_suite(tmp_path / "nope.yaml")


def test_default_suite_cuts_val_conversations_before_their_last_answer() -> None:
    val = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(10)]
    cases = val_sample_suite(val, 4, seed=1)
    assert len(cases) == 4 and cases == val_sample_suite(val, 4, seed=1)
    for case in cases:
        i = int(case.prompt[1:])
        assert case.messages == val[i][:1] and case.reference == f"a{i}" and case.id == f"val-{i + 1}"


def test_tokens_are_characters_for_chinese_and_japanese_words_elsewhere() -> None:
    assert tokenize("Hello, World! 水温90到96摄氏度。abc中文 カタカナ") == [
        "hello", "world", "水", "温", "90", "到", "96", "摄", "氏", "度", "abc", "中", "文", "カ", "タ", "カ", "ナ"]


def test_reference_metrics_agree_with_sacrebleus_chinese_tokenizer() -> None:
    """On Chinese without punctuation, our character tokens are what sacrebleu's own zh tokenizer makes."""
    from sacrebleu.metrics import BLEU

    answers, references = (["手冲水温九十度左右最好", "冷萃需要十二小时"],
                           ["手冲水温九十二度最好", "冷萃咖啡需要浸泡十二小时"])
    ours = reference_scores(answers, references)
    assert ours.bleu == pytest.approx(BLEU(tokenize="zh").corpus_score(answers, [references]).score, abs=0.01)
    assert reference_scores(references, references).bleu == 100.0
    assert reference_scores(references, references).rouge_l == 1.0
    assert reference_scores(["完全无关"], ["水温九十度"]).rouge_l == 0.0
    # ROUGE-L by hand for the second case: LCS of 冷萃需要十二小时 / 冷萃咖啡需要浸泡十二小时 is 8 of 8 and 12 tokens
    assert ours.per_case[1][1] == pytest.approx(2 * (8 / 8) * (8 / 12) / (8 / 8 + 8 / 12), abs=1e-4)


def test_shipped_retention_probes() -> None:
    probes = retention_probes()  # docs/quickstart.md: 60 probes, 30 in English and 30 in Chinese
    assert len(probes) == 60 and len({p.id for p in probes}) == len(probes)
    assert sorted(p.lang for p in probes) == ["en"] * 30 + ["zh"] * 30
    france = next(p for p in probes if p.id == "en-capital-france")
    assert france.correct("The capital is PARIS.") and france.correct("巴黎") and not france.correct("Lyon")


def test_regressions_are_flagged_beyond_the_tolerances() -> None:
    from gemmaforge.config import EvalConfig
    from gemmaforge.evaluate.evaluation import regressions

    base = {"retention_accuracy": 0.6, "general_text_perplexity": 20.0, "stopped_rate": 1.0}
    within = {"retention_accuracy": 0.55, "general_text_perplexity": 24.0, "stopped_rate": 0.9}
    assert regressions(base, within, EvalConfig()) == []
    worse = {"retention_accuracy": 0.45, "general_text_perplexity": 26.0, "stopped_rate": 0.5}
    found = regressions(base, worse, EvalConfig())
    assert len(found) == 3
    assert found[0].startswith("knowledge retention fell from 60% to 45%")
    assert found[1].startswith("general-text perplexity rose from 20.00 to 26.00 (+30%")
    assert "ran into eval.max_new_tokens" in found[2]
    assert regressions(base, worse, EvalConfig(retention_tolerance=0.2, perplexity_tolerance=0.5)) == [found[2]]
    no_probes = {"retention_accuracy": None, "general_text_perplexity": None, "stopped_rate": 1.0}
    assert regressions(no_probes, no_probes, EvalConfig()) == []


def test_answer_summary_counts_what_each_answer_did() -> None:
    """Hand-made answers where every metric has a value other than 0 and 1: stopped 2 of 3, 6 tokens on
    average, 1 of 2 probes answered, the referenced case half right."""
    from gemmaforge.evaluate.evaluation import Answers, answer_summary
    from gemmaforge.evaluate.generate import Generation
    from gemmaforge.evaluate.scoring import Probe
    from gemmaforge.evaluate.suite import Case, Check

    cases = [Case([{"role": "user", "content": "a"}], checks=[Check("contains", "咖啡")]),
             Case([{"role": "user", "content": "b"}], reference="水温 九十 度", checks=[Check("max_chars", 3)]),
             Case([{"role": "user", "content": "c"}])]
    suite = [Generation("手冲咖啡", 4, True), Generation("水温 九十", 9, False), Generation("ok", 5, True)]
    probes = [Probe("p1", "en", "Capital of France?", ("Paris",)), Probe("p2", "zh", "一加一？", ("二", "2"))]
    answers = Answers(suite, [Generation("It is paris.", 4, True), Generation("三", 1, True)], seconds=2.5)
    got = answer_summary(cases, answers, probes)
    assert got["suite_pass_rate"] == 0.5 and got["check_pass_rates"] == {"contains": 1.0, "max_chars": 0.0}
    assert got["stopped_rate"] == round(2 / 3, 4) and got["answer_tokens_mean"] == 6.0
    assert got["answer_chars_mean"] == pytest.approx((4 + 5 + 2) / 3, abs=0.05)
    assert got["retention_accuracy"] == 0.5
    assert got["prompts_per_second"] == 2.0  # 3 cases and 2 probes in 2.5 s
    assert (got["bleu"], got["rouge_l"]) == (reference_scores(["水温 九十"], ["水温 九十 度"]).bleu,
                                             reference_scores(["水温 九十"], ["水温 九十 度"]).rouge_l)
    assert 0 < got["rouge_l"] < 1


def test_cases_without_a_system_prompt_get_the_deployed_one(tmp_path: Path) -> None:
    """docs/evaluation.md: a case's system defaults to the system prompt the model is deployed with: the export's own
    (export.ollama.system), else the one it trained with (data.system), as the Modelfile and serve give it."""
    from gemmaforge.config import RunConfig
    from gemmaforge.evaluate.evaluation import suite_cases

    suite = tmp_path / "suite.yaml"
    suite.write_text("cases:\n  - prompt: a\n  - prompt: b\n    system: own\n", encoding="utf-8")
    trained = RunConfig(output_dir="x", data={"path": "d.json", "system": "trained"}, eval={"suite": str(suite)})
    exported = trained.model_copy(update={"export": trained.export.model_copy(
        update={"ollama": trained.export.ollama.model_copy(update={"system": "exported"})})})
    untold = RunConfig(output_dir="x", data={"path": "d.json"}, eval={"suite": str(suite)})
    for config, deployed in ((trained, "trained"), (exported, "exported"), (untold, None)):
        assert config.deployed_system == deployed
        cases, _ = suite_cases(config.eval, [], config.deployed_system)
        assert [c.messages for c in cases] == [
            [*([{"role": "system", "content": deployed}] if deployed else []), {"role": "user", "content": "a"}],
            [{"role": "system", "content": "own"}, {"role": "user", "content": "b"}],
        ]
