"""The package's layers point one way (README, "Architecture"): every gemmaforge module imports only from its own
layer or the ones below, function-level imports included. A new module must be given its layer here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "gemmaforge"

# bottom up; a module belongs to the layer of its longest matching name
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("gemmaforge", "gemmaforge.errors", "gemmaforge.console", "gemmaforge.units", "gemmaforge.families",
              "gemmaforge.llamafactory_config",
              "gemmaforge.templates", "gemmaforge.config", "gemmaforge.distributed", "gemmaforge.runs",
              "gemmaforge.model_spec", "gemmaforge.models", "gemmaforge.gguf_file")),
    ("system", ("gemmaforge.system",)),
    ("training library", ("gemmaforge.train",)),
    ("inference", ("gemmaforge.inference",)),
    ("data stage", ("gemmaforge.data",)),
    ("train stage", ("gemmaforge.recipe.trainer", "gemmaforge.recipe.troubleshoot")),
    ("export stage", ("gemmaforge.export",)),
    ("evaluate stage", ("gemmaforge.evaluate",)),
    ("pipeline", ("gemmaforge.pipeline",)),
    ("front ends", ("gemmaforge.cli", "gemmaforge.__main__", "gemmaforge.serve", "gemmaforge.doctor", "gemmaforge.ui")),
]


def layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} has no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST) -> list[tuple[str, int]]:
    """(gemmaforge module, line) for every import anywhere in the file; `from gemmaforge import x` names the
    submodule x when there is one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith("gemmaforge")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gemmaforge":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file() or \
                    (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                found.append((sub if is_module else node.module, node.lineno))
    return found


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for target, line in imported(ast.parse(path.read_text(encoding="utf-8"))):
            if layer_of(target) > layer_of(source):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} ({LAYERS[layer_of(source)][0]}) "
                              f"imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    tree = ast.parse("def f():\n    from gemmaforge.cli import main\n")
    assert imported(tree) == [("gemmaforge.cli", 2)]
    assert layer_of("gemmaforge.recipe.trainer") > layer_of("gemmaforge.train.loss") \
        > layer_of("gemmaforge.system.rocm")


def test_the_readme_draws_these_layers() -> None:
    """README's "Architecture" names the layers above, bottom up (the four stages as one step, in their order)."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Architecture")[1].split("\n## ")[0]
    drawn = re.findall(r"^\d\. \*\*([a-z ]+)\*\*", section, flags=re.MULTILINE)
    names = [name if not name.endswith(" stage") else "stages" for name, _ in LAYERS]
    assert drawn == list(dict.fromkeys(names))
    stages = [name.removesuffix(" stage") for name, _ in LAYERS if name.endswith(" stage")]
    assert re.search(r"\*\*stages\*\*, in this order: `data/`.*the train recipe.*`export/`.*`evaluate/`",
                     section.replace("\n", " ")) and stages == ["data", "train", "export", "evaluate"]


def test_test_modules_share_builders_only_through_helper_modules() -> None:
    """Tests import shared builders from tests/*.py helper modules or take fixtures, never from conftest.py or
    another test module (whose import would run its collection-time code twice)."""
    tests = PACKAGE.parent / "tests"
    reaching = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if re.fullmatch(r"tests\.(conftest|(unit|integration)\..*)", name):
                    reaching.append(f"{path.relative_to(tests.parent)}:{node.lineno}: imports {name}")
    assert not reaching, "\n".join(reaching)
