"""The shape of the package (docs/architecture.md): module size, one-way imports, no cycles.

Read from the source with ``ast``, not by importing: an import cycle hidden inside a function
would not show at import time, and these checks are about what the code says.

``dmuon`` and ``dmuon.dcp`` import their public names when first used (``dmuon/lazy.py``), from
the modules their ``PUBLIC`` table names: those count as the package's imports here, and the
imports under ``if TYPE_CHECKING:`` (the same names, for type checkers) count as none.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dmuon"
MAX_LINES = 400
# the demo is an application of the whole package: it imports the backend when it runs
APPLICATIONS = {"dmuon.demo"}
# the command line answers --help from its parser alone: a command imports what it runs when it
# runs (cli_commands), which tests/dcp/test_cli.py checks by what --help imports
RUNS_WHAT_IT_NEEDS = {"dmuon.dcp.cli": {"dmuon.dcp.cli_commands"}}


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
    typing_only = {id(n) for node in tree.body if _is_type_checking_block(node) for n in ast.walk(node)}
    found = lazy_imports(name) if top_level else set()
    for node in ast.walk(tree):
        if top_level != (id(node) in module_level) or id(node) in typing_only:
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


def _is_type_checking_block(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def lazy_imports(name: str) -> set[str]:
    """The modules a package's ``PUBLIC`` table (name -> module) has it import on first use."""
    for node in ast.parse(MODULES[name].read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PUBLIC"]:
            return {v for v in ast.literal_eval(node.value).values() if v in MODULES}
    return set()


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
    hidden = {name: imports_of(name, top_level=False) - RUNS_WHAT_IT_NEEDS.get(name, set())
              for name in MODULES if name not in APPLICATIONS}
    assert {name: found for name, found in hidden.items() if found} == {}


def test_every_lazy_public_name_names_a_module_that_exists():
    for package in ("dmuon", "dmuon.dcp"):
        tree = ast.parse(MODULES[package].read_text())
        [table] = [ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["PUBLIC"]]
        assert {name: module for name, module in table.items() if module not in MODULES} == {}


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


# The ground floor: modules every other one may import, which themselves import no dmuon module.
# (compat: every private torch name dmuon uses, which format/ needs to read torch's metadata)
GROUND_FLOOR = {"dmuon.compat", "dmuon.dcp.errors", "dmuon.dcp.gc_pause"}


def test_the_ground_floor_imports_nothing_of_dmuon():
    assert {n: sorted(GRAPH[n] - {"dmuon", "dmuon.dcp"}) for n in GROUND_FLOOR} == {n: [] for n in GROUND_FLOOR}


@pytest.mark.parametrize("subpackage", ["dmuon.dcp.storage", "dmuon.dcp.format"])
def test_storage_and_format_import_of_the_rest_of_dcp_only_the_ground_floor(subpackage):
    """What ``storage/`` and ``format/`` import from outside themselves: each other (format on
    top of storage) and the ground floor, never the flat modules of ``dcp/`` above them."""
    below = ("dmuon.dcp.storage", "dmuon.dcp.format")
    for name in (n for n in MODULES if n.startswith(subpackage)):
        upward = sorted(t for t in GRAPH[name] if t.startswith("dmuon") and not t.startswith(below)
                        and t not in GROUND_FLOOR | {"dmuon", "dmuon.dcp"})
        assert upward == [], f"{name} imports {upward}"


# Locations are understood in storage/ alone (docs/architecture.md): what parses a URL or path
# by hand: a scheme separator, urllib's parser, a location split on "/" or os.sep, its trailing
# "/" dropped.
URL_PARSING = re.compile(
    r'"://"|://"|urlparse|urlsplit|\.split\("/"|\.rsplit\("/"|\.rpartition\("/"|os\.sep\b|\.rstrip\("/"\)'
)
# modules of the checkpointer stack that still do, until the step-root abstraction (issue 34,
# item 2) takes their locations over: each must still be here, so that this list only shrinks
NOT_YET_MOVED: set[str] = set()


def test_urls_and_paths_are_parsed_in_storage_alone():
    found = {}
    for name, path in MODULES.items():
        if name.startswith("dmuon.dcp.storage"):
            continue
        hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                if URL_PARSING.search(line) and not line.lstrip().startswith("#")]
        if hits:
            found[name] = hits
    assert {name: hits for name, hits in found.items() if name not in NOT_YET_MOVED} == {}
    assert sorted(NOT_YET_MOVED - set(found)) == [], "parsed in storage/ now: take them off NOT_YET_MOVED"


# What the library writes into the process's environment: nothing (docs/architecture.md lists
# what it reads). A setting meant for a client goes to that client as an argument.
ENVIRONMENT_WRITE = re.compile(r"os\.environ(\[[^]]+\]\s*=(?!=)|\.(update|setdefault|pop|clear)\()|os\.putenv|os\.unsetenv")


def test_the_library_writes_no_environment_variable():
    found = {name: [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                    if ENVIRONMENT_WRITE.search(line)] for name, path in MODULES.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def _environment_table() -> dict[str, list[str]]:
    """docs/architecture.md's table of the variables dmuon reads: module -> variables."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Environment variables", 1)[1]
    table: dict[str, list[str]] = {}
    for row in re.findall(r"^\| (`[A-Z].*?) \| `([^`]+)` \|", text, re.M):
        table.setdefault("dmuon." + row[1].removesuffix(".py").replace("/", "."), []).extend(re.findall(r"`(\w+)`", row[0]))
    return table


def test_every_environment_variable_read_is_in_the_table_with_its_module():
    readers = {name for name, path in MODULES.items() if re.search(r"os\.environ|os\.getenv", path.read_text())}
    table = _environment_table()
    assert readers - set(table) == set(), "reads the environment, not in docs/architecture.md's table"
    for name, variables in table.items():
        source = MODULES[name].read_text()
        assert [v for v in variables if v not in source] == [], name


def test_the_map_names_every_module():
    """docs/architecture.md is the map for newcomers: every module of the package has its row
    (a package's ``__init__`` aside), so a new module cannot arrive unlisted."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    unlisted = [name for name, path in MODULES.items()
                if path.name != "__init__.py" and f"`{path.name}`" not in text and f"{path.name}`" not in text]
    assert unlisted == [], unlisted


def _private_torch_imports(path: Path) -> set[str]:
    """``torch...`` modules with a private component, and private names imported from torch."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")
            found |= {node.module for part in parts if part.startswith("_")}
            found |= {f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names
                      if alias.name.split(".")[0] == "torch" and any(p.startswith("_") for p in alias.name.split("."))}
    return found


def test_private_torch_names_are_reached_through_compat_only():
    """compat.py checks each private name against the installed torch and fails loudly by
    feature; one imported elsewhere would break with an ImportError at import time instead."""
    found = {name: _private_torch_imports(path) for name, path in MODULES.items() if name != "dmuon.compat"}
    assert {name: imports for name, imports in found.items() if imports} == {}
