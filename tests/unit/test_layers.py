"""The package's layers point one way (docs/architecture.md): every gemmaforge module imports only from its own layer or
the ones below, function-level imports included. Every module is named here: a top-level module by its name, a folder by
its name when the whole folder is one layer. A new module fails until it is given its layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "gemmaforge"

# bottom up; a module belongs to the layer of its longest matching entry (a module, or a folder's package)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core: basics", ("gemmaforge", "gemmaforge.errors", "gemmaforge.console", "gemmaforge.units",
                      "gemmaforge.distributed", "gemmaforge.gguf_file",
                      "gemmaforge.gguf_names", "gemmaforge.intake", "gemmaforge.media")),
    ("core: chat formats", ("gemmaforge.chat",)),
    ("core: model facts", ("gemmaforge.families", "gemmaforge.model_spec", "gemmaforge.vision",
                           "gemmaforge.vision_unified", "gemmaforge.audio", "gemmaforge.senses")),
    ("core: configuration", ("gemmaforge.compat", "gemmaforge.config", "gemmaforge.runs")),
    ("core: models", ("gemmaforge.models",)),
    ("system", ("gemmaforge.system",)),
    ("training library", ("gemmaforge.train",)),
    ("inference", ("gemmaforge.inference",)),
    ("data stage", ("gemmaforge.data",)),
    ("train stage", ("gemmaforge.recipe",)),
    ("export stage", ("gemmaforge.export",)),
    ("evaluate stage", ("gemmaforge.evaluate",)),
    ("pipeline", ("gemmaforge.pipeline",)),
    ("front ends: server and checks", ("gemmaforge.serve", "gemmaforge.doctor")),
    ("front ends: dashboard", ("gemmaforge.ui",)),
    ("front ends: command line", ("gemmaforge.cli", "gemmaforge.__main__")),
]
# "gemmaforge" (the package's __init__) is an exact entry: it must not take in modules nobody placed
EXACT = {"gemmaforge"}


def layer_of(module: str) -> int:
    matches = [(len(entry), rank) for rank, (_, entries) in enumerate(LAYERS) for entry in entries
               if module == entry or (entry not in EXACT and module.startswith(entry + "."))]
    assert matches, f"{module} has no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


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


def test_the_walk_finds_every_module_and_every_entry_names_one() -> None:
    found = modules()
    assert len(found) > 100 and {"gemmaforge.recipe.trainer", "gemmaforge.cli", "gemmaforge.errors"} <= set(found)
    stale = [entry for _, entries in LAYERS for entry in entries
             if not any(m == entry or m.startswith(entry + ".") for m in found)]
    assert not stale, f"entries naming no module: {stale}"
    for module in found:
        layer_of(module)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for source, path in modules().items():
        for target, line in imported(ast.parse(path.read_text(encoding="utf-8"))):
            if layer_of(target) > layer_of(source):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} ({LAYERS[layer_of(source)][0]}) "
                              f"imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_imports_are_absolute() -> None:
    """`from . import x` would hide the module's layer from the check above."""
    relative = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                for path in modules().values() for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"relative imports: {relative}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's nodes, as found by a depth-first walk (one path per cycle entered)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_neither_modules_nor_folders_import_each_other_in_a_circle() -> None:
    """Within a layer imports may go either way; a circle of them means two modules (or two folders, such as
    data/ and train/ once were) that cannot be understood, tested or moved apart."""
    found = modules()
    graph = {m: {t for t, _ in imported(ast.parse(p.read_text(encoding="utf-8"))) if t != m}
             for m, p in found.items()}
    assert not cycles(graph), cycles(graph)
    folder = {m: ".".join(m.split(".")[:2]) for m in found}
    folders: dict[str, set[str]] = {}
    for m, targets in graph.items():
        outside = {folder[t] for t in targets if t in folder} - {folder[m]}
        folders.setdefault(folder[m], set()).update(outside)
    assert not cycles(folders), cycles(folders)


def test_the_checks_see_what_they_must() -> None:
    tree = ast.parse("def f():\n    from gemmaforge.cli import main\n")
    assert imported(tree) == [("gemmaforge.cli", 2)]
    assert layer_of("gemmaforge.recipe.trainer") > layer_of("gemmaforge.train.loss") \
        > layer_of("gemmaforge.system.rocm") > layer_of("gemmaforge.models") > layer_of("gemmaforge.errors")
    assert layer_of("gemmaforge.cli.serve") > layer_of("gemmaforge.ui.playground") > layer_of("gemmaforge.serve.app")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert not cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()})
    try:
        layer_of("gemmaforge.placed_nowhere")
    except AssertionError as e:
        assert "has no layer" in str(e)
    else:
        raise AssertionError("a module nobody placed was given a layer")


def test_the_architecture_page_draws_these_layers() -> None:
    """docs/architecture.md names the layers above, bottom up (core's and the front ends' ranks as one, the four stages
    as one step, in their order)."""
    section = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawn = re.findall(r"^\d\. \*\*([a-z ]+)\*\*", section, flags=re.MULTILINE)
    names = [name.split(":")[0] if not name.endswith(" stage") else "stages" for name, _ in LAYERS]
    assert drawn == list(dict.fromkeys(names))
    stages = [name.removesuffix(" stage") for name, _ in LAYERS if name.endswith(" stage")]
    assert re.search(r"\*\*stages\*\*, in this order: `data/`.*`recipe/`.*`export/`.*`evaluate/`",
                     section.replace("\n", " ")) and stages == ["data", "train", "export", "evaluate"]
    ranks = re.findall(r"^\d\. \*\*core\*\*.*?in (\w+) ranks: (.*?)\n\d\.", section, flags=re.MULTILINE | re.DOTALL)
    core = [name.split(": ")[1] for name, _ in LAYERS if name.startswith("core: ")]
    words = ["one", "two", "three", "four", "five", "six"]
    assert ranks and ranks[0][0] == words[len(core) - 1], ranks
    assert all(rank in " ".join(ranks[0][1].split()) for rank in core), ranks


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
