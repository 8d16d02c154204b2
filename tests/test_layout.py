"""The shape of the package (docs/architecture.md): module size, one-way imports, no cycles.

Read from the source with ``ast``, not by importing: an import cycle hidden inside a function
would not show at import time, and these checks are about what the code says.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dmuon"
MAX_LINES = 400
# the demo is an application of the whole package: it imports the backend when it runs
APPLICATIONS = {"dmuon.demo"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, *, top_level: bool) -> set[str]:
    """The dmuon modules ``name`` imports, at module level or (``top_level=False``) anywhere
    else: inside functions and methods."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    module_level = {id(node) for node in tree.body}
    found = set()
    for node in ast.walk(tree):
        if top_level != (id(node) in module_level):
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in MODULES}
    return found


def missing_imports(name: str) -> set[str]:
    """dmuon modules ``name`` imports from that do not exist (mypy, told to ignore missing
    imports for torch's sake, does not say so)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    missing = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + [node.module])
            else:
                target = node.module
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.split(".")[0] == "dmuon"]
            missing |= {t for t in targets if t not in MODULES}
            continue
        else:
            continue
        if target.split(".")[0] == "dmuon" and target not in MODULES:
            missing.add(target)
    return missing


def with_packages(importer: str, names: set[str]) -> set[str]:
    """Importing ``a.b.c`` runs ``a`` and ``a.b`` first, except the packages that hold the
    importer itself: they are already being initialised when it runs."""
    parts = importer.split(".")
    own = {".".join(parts[:i]) for i in range(1, len(parts))}
    out = set()
    for name in names:
        target = name.split(".")
        out |= {".".join(target[: i + 1]) for i in range(len(target))}
    return out - own - {importer}


GRAPH = {name: with_packages(name, imports_of(name, top_level=True)) for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_400_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def test_every_dmuon_import_names_a_module_that_exists():
    assert {name: found for name in MODULES if (found := missing_imports(name))} == {}


def test_no_import_cycle():
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for target in sorted(GRAPH[name]):
            # a package importing its own submodules is how a package is built, not a cycle
            if not target.startswith(name + "."):
                visit(target, path + [name])
        done.add(name)

    for name in sorted(MODULES):
        visit(name, [])


def test_no_dmuon_import_is_hidden_inside_a_function():
    hidden = {name: imports_of(name, top_level=False) for name in MODULES if name not in APPLICATIONS}
    assert {name: found for name, found in hidden.items() if found} == {}


def reaches(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_runtime_never_imports_the_backend():
    runtime = [n for n in MODULES if not n.startswith("dmuon.dcp") and n not in APPLICATIONS and n != "dmuon"]
    assert {n: sorted(t for t in reaches(n) if t.startswith("dmuon.dcp")) for n in runtime} == {n: [] for n in runtime}


MODEL_MODULES = ("dmuon.dedicate", "dmuon.dedicated", "dmuon.optim", "dmuon.state_dict", "dmuon.dcp.app_state")


@pytest.mark.parametrize("subpackage", ["dmuon.dcp.storage", "dmuon.dcp.format"])
def test_storage_and_format_know_nothing_of_models(subpackage):
    for name in (n for n in MODULES if n.startswith(subpackage)):
        model = sorted(t for t in reaches(name) if t.startswith(MODEL_MODULES) or t.endswith("_planner"))
        assert model == [], f"{name} reaches {model}"


def test_storage_knows_nothing_of_the_format():
    for name in (n for n in MODULES if n.startswith("dmuon.dcp.storage")):
        assert not any(t.startswith("dmuon.dcp.format") for t in reaches(name)), name


def test_only_the_tiers_package_imports_its_modules():
    """The tiers are one feature on top of the backend: ``dmuon.dcp`` takes its public names
    from the package, nothing else reaches into it; inside, only the manager ties the parts
    together, so each part reads without it."""
    outside = [n for n in MODULES if not n.startswith("dmuon.dcp.tiers") and n != "dmuon.dcp"]
    assert {n: sorted(t for t in GRAPH[n] if t.startswith("dmuon.dcp.tiers")) for n in outside} == {
        n: [] for n in outside
    }
    assert not any(t.startswith("dmuon.dcp.tiers.") for t in GRAPH["dmuon.dcp"]), sorted(GRAPH["dmuon.dcp"])
    parts = [n for n in MODULES if n.startswith("dmuon.dcp.tiers.") and n != "dmuon.dcp.tiers.manager"]
    assert [n for n in parts if "dmuon.dcp.tiers.manager" in GRAPH[n]] == []


URL_MODULES = ("dmuon.dcp.storage.registry", "dmuon.dcp.storage.local", "dmuon.dcp.storage.fsspec_store")


@pytest.mark.parametrize("name", ["dmuon.dcp.save_planner", "dmuon.dcp.load_planner", "dmuon.dcp.plan_cache", "dmuon.dcp.app_state"])
def test_planners_know_nothing_of_urls(name):
    assert not any(t.startswith(URL_MODULES) for t in reaches(name)), sorted(reaches(name))
