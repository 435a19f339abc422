"""A finished run's results as the dashboard shows them: the eval report with failing cases first, the export
verification table and the command that hands the model to Ollama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gemmaforge.evaluate.report import markdown
from gemmaforge.runs import RunDir
from gemmaforge.ui.overview import read_json

_ORDER = {False: 0, None: 1, True: 2}  # tuned failed its checks, has none, passed them


def eval_report(root: Path) -> str:
    """eval/report.md's content with the cases the tuned model fails listed first."""
    results = read_json(root / "eval" / "results.json")
    if results is None:
        return "No evaluation yet: the eval stage writes eval/results.json."
    try:
        cases = sorted(results["cases"], key=lambda case: _ORDER[case["tuned"]["passed"]])
        return markdown({**results, "cases": cases})
    except (KeyError, TypeError) as exc:  # written by another version, or edited by hand
        return f"eval/results.json cannot be read as a report: missing or unexpected {exc}"


def verify_rows(root: Path) -> list[list[Any]]:
    """(quant, file, shards, top-1 agreement, mean KL) per GGUF from gguf/verify.json."""
    report = read_json(root / "gguf" / "verify.json") or {}
    return [[quant, Path(str(r.get("file", "?"))).name, r.get("shards"), r.get("top1_agreement"), r.get("mean_kl")]
            for quant, r in (report.get("files") or {}).items() if isinstance(r, dict)]


def ollama_command(root: Path) -> str:
    """`ollama create NAME -f Modelfile` for the run's exported Modelfile, or why there is none yet."""
    run = RunDir(root)
    modelfile = run.ollama_dir / "Modelfile"
    if not modelfile.is_file():
        return "# no Modelfile yet: the export ollama stage writes ollama/Modelfile"
    record = ((read_json(run.manifest_path) or {}).get("stages") or {}).get("export_ollama") or {}
    name = record.get("name") or root.name  # the stage records the name it wrote the Modelfile for
    return f"ollama create {name} -f {modelfile}"
