"""The documentation: the site builds with MkDocs in strict mode (every link and anchor resolves, every page is in
the navigation), its reference pages are written from the code, and the README stays a page that fits a screen or
five, every link of it pointing at something that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr, done.stderr
    return out


def text_of(page: Path) -> str:
    return re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))


def test_the_config_reference_lists_every_key_with_its_default(site: Path) -> None:
    from pydantic import BaseModel

    from gemmaforge.config import RunConfig, TrainConfig

    def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            sub = next((a for a in (info.annotation, *getattr(info.annotation, "__args__", ()))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)
            out += keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
        return out

    page = " ".join(text_of(site / "reference" / "config" / "index.html").split())
    listed = re.findall(r"\b([a-z_]+(?:\.[a-z_0-9]+)*) (?=\S)", page)
    missing = [key for key in keys(RunConfig) if key not in listed]
    assert not missing and len(keys(RunConfig)) > 80, missing
    html = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    rows = {cells[0]: cells[1:] for cells in ([" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in
                                               re.findall(r"<td>(.*?)</td>", row, re.S)]
                                              for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)) if cells}
    assert rows["train.cutoff_len"][:2] == ["int, ≥ 8", str(TrainConfig.model_fields["cutoff_len"].default)]
    assert rows["train.method"][1] == '"sft"' and "supervised fine-tuning" in rows["train.method"][2]


def test_the_cli_reference_is_each_verbs_own_help(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import html

    from gemmaforge.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "gguf", "--help"])
    own = capsys.readouterr().out
    page = html.unescape(text_of(site / "reference" / "cli" / "index.html"))
    assert " ".join(own.split()) in " ".join(page.split())
    assert page.count("usage: gemmaforge") >= 18  # the program, every verb and every sub-verb


def test_the_llamafactory_page_lists_every_ignored_and_refused_key_with_its_reason(site: Path) -> None:
    from gemmaforge.compat.llamafactory import EXPORT_IGNORED, EXPORT_REFUSED, IGNORED, IGNORED_PREFIXES, REFUSED

    html = (site / "llamafactory" / "index.html").read_text(encoding="utf-8")
    rows = [" ".join(re.sub(r"<[^>]+>", " ", row).split()) for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)]
    reasons = {**IGNORED, **{f"{p}*": why for p, why in IGNORED_PREFIXES.items()}, **EXPORT_IGNORED,
               **{key: why for key, (_value, why) in {**REFUSED, **EXPORT_REFUSED}.items()}}
    missing = [key for key, why in reasons.items()
               if not any(row.startswith(key + " ") and " ".join(why.replace("`", "").split()) in row for row in rows)]
    assert not missing, missing
    (optim,) = [row for row in rows if row.startswith("optim ")]
    assert '"adamw_torch"' in optim and '"adamw_torch_fused"' in optim
    (media,) = [row for row in rows if row.startswith("media_dir ")]
    assert "the value of dataset_dir" in media


def test_benchmarks_readme_joins_the_site_with_its_screenshots(site: Path) -> None:
    assert "Benchmarks" in text_of(site / "benchmarks" / "index.html")
    shown = re.findall(r'src="([^"]+\.png)"', (site / "benchmarks" / "index.html").read_text(encoding="utf-8"))
    assert shown and all((site / "benchmarks" / src).is_file() for src in shown)


def test_the_readme_fits_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert local and [link for link in local if not (ROOT / link).exists()] == []
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    linked = {link.removeprefix("docs/") for link in local if link.startswith("docs/")}
    assert pages - {"index.md"} <= linked | {"reference/config.md", "reference/cli.md"}, pages - linked
