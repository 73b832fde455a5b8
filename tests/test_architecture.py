"""The import layering of src/hyperdryrun: no import cycles, and no import upward against the layer order in
docs/ARCHITECTURE.md ("## Layers"), nor between the side-by-side parts of one layer (``config`` and ``parallel``). Module-level and function-level imports count alike in the source; at run time,
importing a module loads no module of a higher layer, and the torch-free entry points load no torch."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "hyperdryrun"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

# Imports that go against the layer order or close a cycle, each in a file another change owns: (importer,
# imported) -> what it is and how its owner can remove it. test_exceptions_are_still_needed fails on an entry that
# no longer occurs or no longer breaks a rule, so the list only shrinks.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src`` by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, from every import statement anywhere in its file.

    ``from a import b`` is an import of module ``a.b`` when that is a module, else of ``a``.
    """
    modules = module_files(src, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


Layer = tuple[str, ...]
"""One layer: its parts, side by side (most layers have one); a part imports none of the others."""


def parse_layers(markdown: str) -> list[Layer]:
    """The layer order of the ``## Layers`` section, lowest first: each list item's leading backticked names, joined
    by " and " for parts side by side (``1. `config` and `parallel`: ...``)."""
    match = re.search(r"^## Layers\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if match is None:
        raise ValueError("no '## Layers' section")
    items = re.findall(r"^\s*(?:\d+\.|[-*])\s+(`[\w.]+`(?:\s+and\s+`[\w.]+`)*)", match[1], re.M)
    if not items:
        raise ValueError("the '## Layers' section lists no `layer`")
    return [tuple(re.findall(r"`([\w.]+)`", item)) for item in items]


def layer_of(module: str, package: str, layers: list[Layer]) -> tuple[int, str]:
    """Index of the layer holding ``module`` and the part of it: the longest layer name that is it or a package above
    it (``package`` itself is named as such, the rest relative to it)."""
    rel = module[len(package) + 1 :] if module != package else package
    best: tuple[int, str] | None = None
    for i, parts in enumerate(layers):
        for name in parts:
            if (rel == name or rel.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    if best is None:
        raise ValueError(f"module {module} is in no layer of the '## Layers' section")
    return best


def goes_up(importer: str, imported: str, package: str, layers: list[Layer]) -> bool:
    """Whether ``importer`` may not import ``imported``: it is in a higher layer, or in another part of the same."""
    (i, part), (j, other) = layer_of(importer, package, layers), layer_of(imported, package, layers)
    return j > i or (j == i and other != part)


def upward_imports(graph: dict[str, set[str]], package: str, layers: list[Layer]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import of a module in a higher layer than the importer's, or in another
    part of its layer."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if goes_up(a, b, package, layers))


def without(graph: dict[str, set[str]], edges: object) -> dict[str, set[str]]:
    """``graph`` less the ``(importer, imported)`` pairs in ``edges``."""
    return {a: {b for b in targets if (a, b) not in edges} for a, targets in graph.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SRC, PACKAGE)


@pytest.fixture(scope="module")
def layers() -> list[str]:
    return parse_layers(ARCHITECTURE.read_text())


def test_no_import_cycles(graph):
    assert import_cycles(without(graph, EXCEPTIONS)) == []


def named_files(markdown: str, package_dir: Path, root: Path) -> list[str]:
    """The ``.py`` files ``markdown`` names that do not exist. In the package tree (the first fenced block) a name
    is relative to its row's folders (``report/``, ``integrations/, child.py``) or to the package; elsewhere a path
    with a folder is relative to the package or the repository, a bare name is a module anywhere in the package.
    ``<name>`` placeholders are skipped."""
    modules = {path.name for path in package_dir.rglob("*.py")}
    block = re.search(r"^```\n(.*?)^```", markdown, re.M | re.S)
    tree = block[1] if block else ""
    missing: list[str] = []
    folders: list[str] = []
    for line in tree.splitlines():
        head = line[:29].strip()
        if head:
            folders = [f for f in re.findall(r"[\w/]+/", head)]
        for name in re.findall(r"(?<![\w<>/.])([\w/]+\.py)\b", line):
            bases = [package_dir / f for f in folders] + [package_dir]
            if not any((base / name).exists() for base in bases):
                missing.append(name)
    rest = markdown.replace(tree, "")
    for name in re.findall(r"(?<![\w<>/.])([\w/]+\.py)\b", rest):
        if "/" in name:
            if not ((package_dir / name).exists() or (root / name).exists()):
                missing.append(name)
        elif name not in modules:
            missing.append(name)
    return sorted(set(missing))


def test_every_file_the_architecture_page_names_exists():
    assert named_files(ARCHITECTURE.read_text(), SRC / PACKAGE, ROOT) == []


def test_the_named_files_check_reads_the_tree_by_row_folder(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "low.py": "", "mid/__init__.py": "", "mid/a.py": ""}) / "pkg"
    page = (
        "```\nlow.py                       the bottom\nmid/                         a.py, b.py, low.py\n```\n"
    )
    assert named_files(page, pkg, tmp_path) == ["b.py"]  # low.py: the package's, beside mid/'s own
    assert named_files("Prose: `mid/a.py`, `a.py`, `mid/c.py`, `zzz.py`.", pkg, tmp_path) == [
        "mid/c.py",
        "zzz.py",
    ]


def test_every_module_is_in_a_layer(graph, layers):
    for module in graph:
        layer_of(module, PACKAGE, layers)  # raises, naming the module
    names = [name for parts in layers for name in parts]
    assert len(set(names)) == len(names), f"a layer is listed twice: {layers}"


def test_config_and_parallel_are_side_by_side(graph, layers):
    """The job config and the parallelisms import neither each other (the parallelisms take ParallelDims and the
    options they use; the recipe makes them from the config), and both stand on ParallelDims."""
    config, parallel = (
        layer_of(f"{PACKAGE}.config", PACKAGE, layers),
        layer_of(f"{PACKAGE}.parallel.fsdp", PACKAGE, layers),
    )
    assert config[0] == parallel[0] and config[1] != parallel[1]
    dims = layer_of(f"{PACKAGE}.parallel_dims", PACKAGE, layers)
    assert dims[0] < config[0]
    assert {b for b in graph[f"{PACKAGE}.config"] if b.startswith(f"{PACKAGE}.parallel.")} == set()
    assert {
        a
        for a, targets in graph.items()
        if a.startswith(f"{PACKAGE}.parallel") and f"{PACKAGE}.config" in targets
    } == set()


def test_no_import_goes_up_a_layer(graph, layers):
    assert upward_imports(without(graph, EXCEPTIONS), PACKAGE, layers) == []


def test_ingest_reads_only_the_traced_step(graph):
    outside = sorted(
        (a, b)
        for a, targets in graph.items()
        if a.startswith(f"{PACKAGE}.ingest")
        for b in targets
        if not b.startswith((f"{PACKAGE}.ingest", f"{PACKAGE}.trace")) and b != f"{PACKAGE}.lazy"  # a leaf
    )
    assert outside == []


def test_exceptions_are_still_needed(graph, layers):
    upward = set(upward_imports(graph, PACKAGE, layers))
    in_cycle = {frozenset(c) for c in import_cycles(graph)}
    for (a, b), kind in EXCEPTIONS.items():
        assert b in graph.get(a, ()), f"{a} no longer imports {b}: remove the exception"
        if kind == "upward":
            assert (a, b) in upward, f"{a} -> {b} is no longer upward: remove the exception"
        else:
            assert any({a, b} <= c for c in in_cycle), f"{a} -> {b} closes no cycle: remove the exception"


# ---------------------------------------------------------------- what Python actually loads

_LOAD_EACH = r"""
import importlib, json, sys
own = lambda m: m == "hyperdryrun" or m.startswith("hyperdryrun.")
out = {}
for name in json.loads(sys.argv[1]):
    for m in [m for m in sys.modules if own(m)]:
        del sys.modules[m]  # third-party modules (torch) stay loaded: only the package is imported afresh
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:  # an optional extra that is not installed
        out[name] = {"missing": err.name}
        continue
    out[name] = {"loaded": sorted(m for m in sys.modules if own(m))}
print(json.dumps(out))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def imported_names(importtime_stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports as imported (the last column of each ``import time:`` line)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    } - {"imported package"}  # the header line


def higher_layer_loads(
    loaded: dict[str, list[str]], package: str, layers: list[str]
) -> list[tuple[str, str]]:
    """``(module, loaded)`` for every module of a higher layer that importing ``module`` loaded. A package above a
    loaded module is loaded with it whatever its layer (``hyperdryrun.parallel`` with ``parallel.fsdp``), so it is
    not counted; what its ``__init__`` imports is, as the other modules loaded."""
    out = []
    for name, modules in loaded.items():
        parents = {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}
        out += [(name, m) for m in modules if m not in parents and goes_up(name, m, package, layers)]
    return sorted(out)


def test_importing_a_module_loads_no_higher_layer(graph, layers):
    run = _python("-c", _LOAD_EACH, json.dumps(sorted(graph)))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    missing = {name: r["missing"] for name, r in result.items() if "missing" in r}
    assert set(missing.values()) <= {"torchtitan", "transformers", "ray", "matplotlib"}, missing
    loaded = {name: r["loaded"] for name, r in result.items() if "loaded" in r}
    assert len(loaded) >= len(graph) - len(missing)
    assert loaded[f"{PACKAGE}.parallel_dims"] == [PACKAGE, f"{PACKAGE}.lazy", f"{PACKAGE}.parallel_dims"]
    assert higher_layer_loads(loaded, PACKAGE, layers) == []


def test_parallel_dims_imports_no_torch():
    run = _python("-X", "importtime", "-c", "import hyperdryrun.parallel_dims")
    assert run.returncode == 0, run.stderr[-3000:]
    names = imported_names(run.stderr)
    assert "hyperdryrun.parallel_dims" in names  # the parse sees the imports
    assert not {n for n in names if n.split(".")[0] in ("torch", "numpy", "pydantic")}


def test_cli_help_imports_no_torch():
    run = _python("-X", "importtime", "-m", PACKAGE, "--help")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("usage: hyperdryrun")
    names = imported_names(run.stderr)
    assert {"hyperdryrun.cli", "hyperdryrun.config"} <= names
    assert not {n for n in names if n.split(".")[0] in ("torch", "torchtitan", "transformers", "numpy")}


def test_higher_layer_loads_skips_only_the_parent_packages():
    layers = parse_layers(FAKE_LAYERS)
    loaded = {
        "pkg.mid.special": ["pkg", "pkg.mid", "pkg.mid.special", "pkg.low"],
        "pkg.low": ["pkg.low", "pkg.high"],
        "pkg.high": ["pkg.high", "pkg.low", "pkg.side"],
    }
    assert higher_layer_loads(loaded, "pkg", layers) == [("pkg.high", "pkg.side"), ("pkg.low", "pkg.high")]
    stderr = "import time: self [us] | cumulative | imported package\nimport time:   5 |   5 |   torch._C\n"
    assert imported_names(stderr) == {"torch._C"}


# ---------------------------------------------------------------- the checker itself, on a fake package


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


FAKE_LAYERS = """# Fake
## Layers
1. `low`: the bottom
2. `mid.special`: a module in a layer of its own, below the rest of its package
3. `mid`: the rest of the package
- `high` and `side`: the top, in two parts side by side (neither imports the other), `low` not a part
- `pkg`: the package's own __init__

## Next section
1. `ignored`: not a layer
"""


def test_parse_layers_reads_only_its_section():
    assert parse_layers(FAKE_LAYERS) == [("low",), ("mid.special",), ("mid",), ("high", "side"), ("pkg",)]
    with pytest.raises(ValueError, match="no '## Layers' section"):
        parse_layers("# Architecture\n## Other\n1. `low`\n")


def test_checker_finds_a_cycle_through_a_function_level_and_a_relative_import(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from pkg.low import b\n",
            "low/b.py": "def f():\n    from .c import x\n",
            "low/c.py": "import pkg.low.a as a\nx = 1\n",
            "low/d.py": "from pkg.low.a import something\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert graph["pkg.low.a"] == {"pkg.low.b"}  # `from pkg.low import b`: the module pkg.low.b
    assert graph["pkg.low.b"] == {"pkg.low.c"}
    assert graph["pkg.low.d"] == {"pkg.low.a"}  # `from pkg.low.a import something`: pkg.low.a
    assert import_cycles(graph) == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]
    assert import_cycles(without(graph, {("pkg.low.b", "pkg.low.c")})) == []


def test_checker_finds_an_upward_import(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": "from pkg import high\n",
            "low.py": "def f():\n    import pkg.high\n",
            "mid/__init__.py": "",
            "mid/special.py": "from pkg import low\nfrom pkg.mid import other\n",
            "mid/other.py": "from pkg.mid import special\n",
            "high.py": "from pkg import low\nfrom pkg.mid.special import y\n",
            "side.py": "from pkg import low\nfrom pkg import high\n",
        },
    )
    layers = parse_layers(FAKE_LAYERS)
    modules = ("pkg.low", "pkg.mid.special", "pkg.mid.other", "pkg.high", "pkg.side", "pkg")
    assert [layer_of(m, "pkg", layers) for m in modules] == [
        (0, "low"),
        (1, "mid.special"),
        (2, "mid"),
        (3, "high"),
        (3, "side"),
        (4, "pkg"),
    ]
    with pytest.raises(ValueError, match="module pkg.stray is in no layer"):
        layer_of("pkg.stray", "pkg", layers)
    graph = import_graph(src, "pkg")
    assert upward_imports(graph, "pkg", layers) == [
        ("pkg.low", "pkg.high"),
        ("pkg.mid.special", "pkg.mid.other"),
        ("pkg.side", "pkg.high"),  # the same layer, another part
    ]


# ---------------------------------------------------------------- what depends on a library's version: compat/ only

LIBRARIES = ("torch", "torchtitan", "transformers")
"""The libraries whose internals a dry run patches and whose releases it follows (docs/TORCH_VERSIONS.md)."""
REGISTRATIONS = {"impl", "define", "py_impl", "register_op_strategy", "register_prop_rule", "register_fake"}
REGISTRATIONS |= {
    "register_kernel",
    "register_autocast",
    "register_sharding",
    "custom_op",
    "fallthrough_kernel",
}
"""Calls that register kernels or rules with a library's dispatcher (torch.library, DTensor's strategies, HOPs)."""
VERSION_READERS = {
    "release",
    "installed_version",
    "torch_version",
    "torchtitan_version",
    "version",
    "Version",
}
"""Functions that read a library's version (compat.versions' and importlib.metadata's, packaging's parse)."""


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Every name an import binds anywhere in the file -> what it names (``F`` -> ``torch.nn.functional``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve_name(expr: ast.AST, names: dict[str, str]) -> str | None:
    dotted = _dotted(expr)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    full = names.get(head, head)
    return f"{full}.{rest}" if rest else full


def _library(full: str | None) -> bool:
    return full is not None and full.split(".")[0] in LIBRARIES


def version_dependent_code(path: Path, package: str) -> list[str]:
    """``line: what`` for each place in ``path`` that patches a library, registers with its dispatcher or reads or
    compares its version (what belongs in ``package.compat``).

    - a call of :class:`hyperdryrun.patches.Patch` whose owner is not one of the package's own modules (a library
      object, or one the scan cannot trace: a local variable);
    - a call of ``torch.library.*``, or of a registration (``impl``, ``py_impl``, ``register_op_strategy`` ...) on
      a library object;
    - ``<library>.__version__`` or ``<library>.version.*`` read, ``importlib.metadata.version`` or
      ``packaging.version`` called, or a comparison with what a version reader returns (``__version__``,
      ``version_info``, a call of one of :data:`VERSION_READERS`). A version kept in a variable first and compared
      later is not traced.
    """
    tree = ast.parse(path.read_text(), str(path))
    names = _bindings(tree)
    patch_names = {
        n
        for n, full in names.items()
        if full in (f"{package}.patches.Patch", f"{package}.world.patches.Patch")
    }
    patch_modules = {
        n for n, full in names.items() if full in (f"{package}.patches", f"{package}.world.patches")
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = _resolve_name(node.func, names)
            is_patch = (isinstance(node.func, ast.Name) and node.func.id in patch_names) or (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "Patch"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in patch_modules
            )
            if is_patch:
                owner = (
                    node.args[0]
                    if node.args
                    else next((k.value for k in node.keywords if k.arg == "owner"), None)
                )
                full = _resolve_name(owner, names) if owner is not None else None
                if full is None or not full.startswith(f"{package}."):
                    found.append(f"{node.lineno}: Patch of {ast.unparse(owner) if owner else '?'}")
            elif callee is not None and callee.startswith("torch.library."):
                found.append(f"{node.lineno}: {callee}")
            elif isinstance(node.func, ast.Attribute) and node.func.attr in REGISTRATIONS:
                root = _dotted(node.func.value)  # on a library object, or one the scan cannot trace
                imported = root is not None and root.split(".")[0] in names
                if not imported or _library(_resolve_name(node.func.value, names)):
                    found.append(f"{node.lineno}: registration {ast.unparse(node.func)}")
            elif callee in (
                "importlib.metadata.version",
                "packaging.version.parse",
                "packaging.version.Version",
            ):
                found.append(f"{node.lineno}: {callee}")
        elif isinstance(node, ast.Attribute):
            full = _resolve_name(node, names)
            if _library(full) and (
                node.attr == "__version__" or full.split(".")[1:2] == ["version"] and full.count(".") > 1
            ):
                found.append(f"{node.lineno}: {full}")
        elif isinstance(node, ast.Compare):
            for part in ast.walk(node):
                called = _resolve_name(part.func, names) if isinstance(part, ast.Call) else None
                if (isinstance(part, ast.Attribute) and part.attr in ("__version__", "version_info")) or (
                    called is not None and called.rsplit(".", 1)[-1] in VERSION_READERS
                ):
                    found.append(f"{node.lineno}: version comparison {ast.unparse(node)}")
                    break
    return sorted(set(found), key=lambda s: (int(s.split(":")[0]), s))


def test_what_depends_on_a_library_version_is_in_compat():
    """Patches of torch, torchtitan and transformers, dispatcher registrations and version reads or comparisons
    live in hyperdryrun/compat/ (docs/TORCH_VERSIONS.md): the rest of the package asks that layer."""
    found = {
        name: hits
        for name, path in module_files(SRC, PACKAGE).items()
        if not name.startswith(f"{PACKAGE}.compat") and name != f"{PACKAGE}.patches"
        for hits in [version_dependent_code(path, PACKAGE)]
        if hits
    }
    assert found == {}


def test_the_version_scan_finds_each_kind(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.library import Library\n"
        "from importlib import metadata\n"
        "from pkg.patches import Patch\n"
        "from pkg import patches, own\n"
        "from pkg.compat.versions import release, torch_version\n"
        "p1 = Patch(F, 'softmax', None, 'why')\n"  # 8: a torch module
        "p2 = patches.Patch(owner=torch.Tensor, name='x', new=None, reason='why')\n"  # 9
        "def f(mod):\n"
        "    return Patch(mod, 'x', None, 'why')\n"  # 11: an owner the scan cannot trace
        "p3 = Patch(own, 'x', None, 'why')\n"  # 12: the package's own module: allowed
        "lib = torch.library.Library('aten', 'IMPL')\n"  # 13
        "lib.impl('mm', None, 'AutocastCPU')\n"  # 14: on an object the scan cannot trace
        "Library('aten', 'IMPL')\n"  # 15
        "v = torch.__version__\n"  # 16
        "c = torch.version.cuda\n"  # 17
        "t = metadata.version('torchtitan')\n"  # 18: importlib.metadata.version
        "if release(torch_version()) >= (2, 12):\n"  # 19
        "    pass\n"
        "ok = {'a': 1}.get('a') == 1\n"  # 21: no version
    )
    hits = version_dependent_code(path, "pkg")
    assert [int(h.split(":")[0]) for h in hits] == [8, 9, 11, 13, 14, 15, 16, 17, 18, 19]
    assert "Patch of F" in hits[0] and "version comparison" in hits[-1]


# ---------------------------------------------------------------- edits of other libraries' state: compat/ only

STATE_LIBRARIES = ("torch", "torchtitan", "transformers", "rich", "sys")
"""The libraries whose process-wide state (module attributes, configs, class methods, registries, loggers) only
compat/ edits, each edit a reversible Patch naming the behaviour."""
MUTATORS = {"setLevel", "set_spmd_backend", "clear", "update", "pop", "popitem", "setdefault", "__setitem__"}
"""Calls that change a library object in place (a logger's level, torchtitan's SPMD backend, a registry dict)."""
IMPORT_SYSTEM = {"sys.modules", "sys.path"}
"""Registries of Python's import system, which loading a script's file edits as importlib documents it."""


def _state_library(full: str | None) -> bool:
    return full is not None and full.split(".")[0] in STATE_LIBRARIES and full not in IMPORT_SYSTEM


def library_state_edits(path: Path) -> list[str]:
    """``line: what`` for each direct edit in ``path`` of an object of :data:`STATE_LIBRARIES` reached through an
    import (``import torch._dynamo.config``, ``from rich.console import Console``, ``import sys``): an attribute or
    item assigned or deleted (``sys.excepthook = ...``, ``Console.on_broken_pipe = ...``), ``setattr``/``delattr``
    on it, or a call of one of :data:`MUTATORS` on it (``logger.setLevel``, ``store.clear()``). An object kept in a
    local variable first is not traced."""
    tree = ast.parse(path.read_text(), str(path))
    names = _bindings(tree)
    found: list[str] = []

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign | ast.Delete):
            out = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            out = [node.target]
        else:
            return []
        flat: list[ast.AST] = []
        while out:
            t = out.pop()
            if isinstance(t, ast.Tuple | ast.List):
                out.extend(t.elts)
            else:
                flat.append(t)
        return flat

    for node in ast.walk(tree):
        for t in targets(node):
            if isinstance(t, ast.Attribute | ast.Subscript) and _state_library(_resolve_name(t.value, names)):
                found.append(f"{node.lineno}: edit of {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                if _state_library(_resolve_name(node.args[0], names)):
                    found.append(f"{node.lineno}: {func.id} on {ast.unparse(node.args[0])}")
            elif isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                if _state_library(_resolve_name(func.value, names)):
                    found.append(f"{node.lineno}: {ast.unparse(func)}()")
    return sorted(set(found), key=lambda s: (int(s.split(":")[0]), s))


def test_edits_of_other_libraries_state_are_in_compat():
    """torch's, torchtitan's, transformers', rich's and Python's own process state (sys) is edited only in
    hyperdryrun/compat/, as reversible Patch entries naming the behaviour (patches.py applies them)."""
    found = {
        name: hits
        for name, path in module_files(SRC, PACKAGE).items()
        if not name.startswith(f"{PACKAGE}.compat") and name != f"{PACKAGE}.patches"
        for hits in [library_state_edits(path)]
        if hits
    }
    assert found == {}


def test_the_state_edit_scan_finds_each_kind(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import sys\n"
        "import torch._dynamo.config\n"
        "import torch.distributed._symmetric_memory as symm_mem\n"
        "import torchtitan.distributed.utils as titan_dist\n"
        "from rich.console import Console\n"
        "from torchtitan.tools.logging import logger\n"
        "sys.excepthook = None\n"  # 7: sys
        "Console.on_broken_pipe = None\n"  # 8: rich
        "setattr(torch._dynamo.config, 'x', 1)\n"  # 9: a dynamo config setattr
        "torch._dynamo.config.x += 1\n"  # 10
        "symm_mem._group_name_to_store.clear()\n"  # 11: torch's symmetric-memory store
        "titan_dist.set_spmd_backend('x')\n"  # 12: torchtitan's SPMD backend
        "logger.setLevel(10)\n"  # 13: torchtitan's logger
        "sys.argv[0] = 'x'\n"  # 14: an item of sys
        "del Console.x\n"  # 15
        "class A:\n"
        "    pass\n"
        "a = A()\n"
        "a.x = 1\n"  # 19: an object of the file's own: allowed
        "config = {}\n"
        "config.update(x=1)\n"  # 21: a local dict: allowed
        "torch.set_default_dtype(torch.float32)\n"  # 22: torch's setter API: allowed
        "sys.modules['m'] = None\n"  # 23: the import system's registry (importlib's way to load a file): allowed
    )
    hits = library_state_edits(path)
    assert [int(h.split(":")[0]) for h in hits] == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert "setattr on torch._dynamo.config" in hits[2] and "set_spmd_backend" in hits[5]
