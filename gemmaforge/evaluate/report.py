"""RUN_DIR/eval/: results.json (everything), report.md (readable at a glance), report.html (the same with
the loss curves and the base and tuned answers side by side). Written together, atomically."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from gemmaforge.runs import RunDir, atomic_dir

# (key, label, better when higher)
SUMMARY_ROWS = (
    ("suite_pass_rate", "suite pass rate (cases whose checks all pass)", True),
    ("bleu", "BLEU against references (0-100)", True),
    ("rouge_l", "ROUGE-L F1 against references", True),
    ("eval_loss", "eval loss (val split)", False),
    ("perplexity", "perplexity (val split)", False),
    ("preference_accuracy", "preference accuracy (held-out pairs: the chosen answer likelier)", True),
    ("reward_accuracy", "reward accuracy (held-out pairs: the chosen answer's reward higher)", True),
    ("reward_margin", "mean reward margin, chosen over rejected (held-out pairs)", True),
    ("kl_from_base", "KL from the base on the tuned answers (nats per token)", None),
    ("retention_accuracy", "knowledge retention (probes answered)", True),
    ("general_text_perplexity", "general-text perplexity", False),
    ("stopped_rate", "answers ended on the stop token", True),
    ("answer_chars_mean", "mean answer length (characters)", None),
    ("prompts_per_second", "prompts/s", None),
)
# preference runs' own rows (train.method: dpo, kto; a reward model's: rm)
METHOD_ROWS = ("preference_accuracy", "reward_accuracy", "reward_margin", "kl_from_base")
ANSWER_CHARS = 160  # answers are cut to this in report.md tables; results.json keeps them whole


def write_report(run: RunDir, results: dict[str, Any]) -> Path:
    eval_dir = run.root / "eval"
    with atomic_dir(eval_dir) as tmp:
        (tmp / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / "report.md").write_text(markdown(results), encoding="utf-8")
        (tmp / "report.html").write_text(html_report(results, run.loss_plot_path), encoding="utf-8")
    return eval_dir


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and 0 <= value <= 1:
        return f"{value:.3f}"
    return f"{value}"


def _change(base: Any, tuned: Any, higher_better: bool | None) -> str:
    if base is None or tuned is None or higher_better is None or base == tuned:
        return ""
    better = (tuned > base) == higher_better
    return "better" if better else "worse"


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    base, tuned = results["base"], results["tuned"]
    rows = [(label, _fmt(base.get(key)), _fmt(tuned.get(key)), _change(base.get(key), tuned.get(key), hb))
            for key, label, hb in SUMMARY_ROWS
            if key not in METHOD_ROWS or key in base]  # a method's own rows in its runs' reports only
    for name in tuned["check_pass_rates"]:
        b, t = base["check_pass_rates"].get(name), tuned["check_pass_rates"][name]
        rows.append((f"check `{name}` pass rate", _fmt(b), _fmt(t), _change(b, t, True)))
    return rows


def _cell(text: str | None) -> str:
    if text is None:
        return "-"
    text = text.replace("\n", " ").replace("|", "\\|")
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS] + "…"


def markdown(results: dict[str, Any]) -> str:
    suite = results["suite"]
    intro = (f"A reward model: {suite['pairs']} held-out preference pairs scored (it writes no answers: no suite, "
             "no retention probes; the model before training has no score head)." if "pairs" in suite else
             f"Suite: {suite['source']}: {suite['cases']} cases, {suite['with_checks']} with checks, "
             f"{suite['with_reference']} with a reference answer. Tuned answers from: "
             f"{'the exported GGUF (llama.cpp)' if results['engine'] == 'llamacpp' else 'the adapter (transformers)'}; "
             f"{'sampled' if results['sampling']['do_sample'] else 'greedy'}, at most "
             f"{results['sampling']['max_new_tokens']} new tokens.")
    lines = [
        "# Evaluation: base vs tuned",
        "",
        intro,
        "",
        "| metric | base | tuned | |",
        "|---|---|---|---|",
        *(f"| {label} | {b} | {t} | {c} |" for label, b, t, c in summary_rows(results)),
        "",
    ]
    if results["regressions"]:
        lines += ["## Regressions", "", *(f"- **{r}**" for r in results["regressions"]), ""]
    else:
        lines += ["No regression against the base model beyond the configured tolerances.", ""]
    if results["agreement"]:
        a = results["agreement"]
        lines += ["## GGUF against the merged model", "",
                  f"`{a['gguf']}` gave the merged model's exact answer in {_fmt(a['exact_match'])} of the cases "
                  f"(ROUGE-L between the two: {_fmt(a['rouge_l'])}).", ""]
    lines += ["## Cases", "", "| case | prompt | checks | base answer | tuned answer |", "|---|---|---|---|---|"]
    for case in results["cases"]:
        marks = {side: _mark(case[side]["passed"]) for side in ("base", "tuned")}
        lines.append(
            f"| {case['id']} | {_cell(case['messages'][-1]['content'])} | {_cell(', '.join(case['checks']) or None)} "
            f"| {marks['base']}{_cell(case['base']['answer'])} | {marks['tuned']}{_cell(case['tuned']['answer'])} |"
        )
    if results["retention"]:
        wrong = [p for p in results["retention"] if p["base"]["correct"] and not p["tuned"]["correct"]]
        lines += ["", "## Knowledge retention", "",
                  f"{len(results['retention'])} probes; answered by base "
                  f"{_fmt(results['base']['retention_accuracy'])}, "
                  f"by tuned {_fmt(results['tuned']['retention_accuracy'])}. Forgotten (base right, tuned wrong): "
                  + (", ".join(f"{p['id']} ({_cell(p['tuned']['answer'])})" for p in wrong) or "none") + "."]
    return "\n".join(lines) + "\n"


def _mark(passed: bool | None) -> str:
    return "" if passed is None else ("✅ " if passed else "❌ ")


def html_report(results: dict[str, Any], loss_plot: Path) -> str:
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(label)}</td><td>{esc(b)}</td><td>{esc(t)}</td><td class='{c}'>{esc(c)}</td></tr>"
                   for label, b, t, c in summary_rows(results))
    plot = ""
    if loss_plot.is_file():
        data = base64.b64encode(loss_plot.read_bytes()).decode()
        plot = f"<h2>Training and eval loss</h2><img alt='loss curves' src='data:image/png;base64,{data}'>"
    cases = "".join(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td>{}</tr>".format(
            esc(case["id"]), esc(case["messages"][-1]["content"]), esc(case["reference"] or ""),
            esc("; ".join(case["checks"])),
            "".join(f"<td class='{_css(case[side]['passed'])}'>{esc(case[side]['answer'])}</td>"
                    for side in ("base", "tuned")),
        )
        for case in results["cases"]
    )
    regressions = "".join(f"<li>{esc(r)}</li>" for r in results["regressions"]) or "<li>none</li>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gemmaforge evaluation</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;white-space:pre-wrap}}.better{{color:#070}}
.worse{{color:#a00}}.pass{{background:#efe}}.fail{{background:#fee}}img{{max-width:800px}}</style></head><body>
<h1>Evaluation: base vs tuned</h1><p>{esc(results['suite']['source'])}, engine {esc(results['engine'])}</p>
<table><tr><th>metric</th><th>base</th><th>tuned</th><th></th></tr>{rows}</table>
<h2>Regressions</h2><ul>{regressions}</ul>{plot}
<h2>Answers side by side</h2><table><tr><th>case</th><th>prompt</th><th>reference</th><th>checks</th>
<th>base</th><th>tuned</th></tr>{cases}</table>
</body></html>
"""


def _css(passed: bool | None) -> str:
    return "" if passed is None else ("pass" if passed else "fail")
