"""The library's layers: a layer imports only the layers below it (every import, also those inside functions), none
imports its entry points (DAGs, Spark scripts, the CLI), no import cycles (imports inside functions included: a
cycle hidden in a function is still a cycle; only imports under ``if TYPE_CHECKING``, which never run, are left
out), the serving hot path loads no torch, the CLI module runs, and the module
paths, commands and flags README and docs name are real."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Layer -> the layers it may import (itself always). ``models`` is the top-level torch package.
ALLOWED = {
    "root": set(),
    "core": set(),
    "dev": {"core"},
    "models": {"core"},
    "data": {"core"},
    "online": {"core"},
    "pipeline": {"core", "models", "data"},
    "learning": {"core", "models", "data", "online", "pipeline"},
    "evaluation": {"core", "models", "data", "online", "pipeline", "learning"},
    "flows": {"core", "models", "data", "online", "pipeline", "learning", "evaluation", "dev"},
}
# Exceptions, each with its reason: (module, imported layer) -> why.
EXCEPTIONS = {("solaris_jobs.online.ranker", "models"): "the ranker integration scores with a VM checkpoint; the "
                                                         "serving hot path (reader) stays free of torch"}


# Entry points and glue above the library: nothing in it imports them (nor the CLI, whose callers are these).
GLUE = ("spark_jobs", "dags", "feature_repo", "tests", "benchmarks")


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    if parts[0] != "solaris_jobs":
        return None
    if len(parts) == 1 or parts[1] == "__init__":
        return "root"
    return parts[1] if parts[1] in ALLOWED else "root"


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in ("solaris_jobs", "models"):
        for p in sorted((root / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(path: Path, module: str, type_checking: bool = True) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement in a file, at module level or inside functions and
    classes; ``from a.b import c`` gives ``a.b.c`` (c may be a submodule). Without ``type_checking``, the imports
    under ``if TYPE_CHECKING`` (which never run) are left out."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    nodes = []

    def walk(body):
        for n in body:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                nodes.append(n)
            elif isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
                if type_checking:
                    walk(n.body)
                walk(n.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(n, field, []) or [])

    walk(tree.body)
    out = []
    for n in nodes:
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
            continue
        base = n.module or ""
        if n.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (n.level - 1)]
            base = ".".join(pkg + ([n.module] if n.module else []))
        out += [(n.lineno, f"{base}.{a.name}") for a in n.names]
    return out


def violations(root: Path) -> list[str]:
    found = []
    for module, path in modules(root).items():
        mine = layer_of(module)
        for line, target in imports(path, module):
            if target.split(".")[0] in GLUE or (target.startswith("solaris_jobs.flows.cli")
                                                 and module != "solaris_jobs.flows.cli"):
                found.append(f"{path.relative_to(root)}:{line}: library module imports the entry point {target}")
                continue
            theirs = layer_of(target)
            if theirs is None or theirs == mine or theirs == "root":
                continue
            if theirs in ALLOWED[mine] or (module, theirs) in EXCEPTIONS:
                continue
            found.append(f"{path.relative_to(root)}:{line}: layer {mine} imports {target} (layer {theirs})")
    return found


def cycles(root: Path) -> list[list[str]]:
    """The import cycles between the modules under ``root``: the graph has an edge for every import statement that
    can run (module level, inside functions or classes; not under ``if TYPE_CHECKING``)."""
    mods = modules(root)
    graph = {}
    for module, path in mods.items():
        deps = set()
        for _, target in imports(path, module, type_checking=False):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                deps.add(target)
        graph[module] = deps
    found, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_layers_import_only_downwards_and_without_cycles():
    assert violations(ROOT) == []
    assert cycles(ROOT) == []


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
    for f, text in {"solaris_jobs/__init__.py": "", "solaris_jobs/core/__init__.py": "",
                    "solaris_jobs/core/a.py": "def f():\n    from solaris_jobs.online import reader\n",
                    "solaris_jobs/core/b.py": "from solaris_jobs.core import c\n",
                    "solaris_jobs/core/c.py": "from . import b\n",
                    # A cycle through an import inside a function is a cycle; one under TYPE_CHECKING is not.
                    "solaris_jobs/core/d.py": "class D:\n    def f(self):\n        from solaris_jobs.core import e\n",
                    "solaris_jobs/core/e.py": "from solaris_jobs.core.d import D\n",
                    "solaris_jobs/core/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from solaris_jobs.core import g\n",
                    "solaris_jobs/core/g.py": "from solaris_jobs.core import f\n",
                    "solaris_jobs/online/__init__.py": "", "solaris_jobs/online/reader.py": "import models.vm\n",
                    "solaris_jobs/online/ranker.py": "import models.vm\n",
                    "solaris_jobs/flows/__init__.py": "",
                    "solaris_jobs/flows/demo.py": "from solaris_jobs.flows import cli\n",
                    "models/__init__.py": "", "models/vm.py": "from solaris_jobs.core import a\n"}.items():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(text)
    assert violations(tmp_path) == [
        "solaris_jobs/core/a.py:2: layer core imports solaris_jobs.online.reader (layer online)",
        "solaris_jobs/flows/demo.py:1: library module imports the entry point solaris_jobs.flows.cli",
        "solaris_jobs/online/reader.py:1: layer online imports models.vm (layer models)"]
    # models.vm -> core.a -> (in a function) online.reader -> models.vm: a cycle, as are b-c and d-e; f-g is not.
    assert cycles(tmp_path) == [["models.vm", "solaris_jobs.core.a", "solaris_jobs.online.reader", "models.vm"],
                                ["solaris_jobs.core.b", "solaris_jobs.core.c", "solaris_jobs.core.b"],
                                ["solaris_jobs.core.d", "solaris_jobs.core.e", "solaris_jobs.core.d"]]


def test_the_serving_hot_path_loads_no_torch_spark_or_feast():
    code = ("import sys, solaris_jobs.online.reader, solaris_jobs.online.coverage; "
            "print(sorted(m for m in ('torch', 'pyspark', 'feast') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_cli_module_runs_and_the_checkout_is_found():
    from solaris_jobs.core.settings import PROJECT_ROOT
    from solaris_jobs.dev.airflow_local import DAGS
    assert PROJECT_ROOT == ROOT and (DAGS / "solaris_refresh.py").exists()
    out = subprocess.run([sys.executable, "-m", "solaris_jobs.flows.cli", "--help"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert "Usage: python -m solaris_jobs.flows.cli" in out.stdout and "evaluate" in out.stdout


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` names a module, or a name reached from the longest importable module prefix of it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_docs_module_paths_are_real():
    text = "\n".join(p.read_text() for p in DOCS)
    named = set(re.findall(r"solaris_jobs(?:\.[A-Za-z_]\w*)+", text))
    for module, names in re.findall(r"from (solaris_jobs[\w.]*) import ([\w, ]+)", text):
        named |= {f"{module}.{n.strip()}" for n in names.split(",")}
    assert {"solaris_jobs.online.reader.FeatureReader", "solaris_jobs.online.store_config"} <= named
    assert [p for p in sorted(named) if not resolves(p)] == []
    assert not resolves("solaris_jobs.serving") and not resolves("solaris_jobs.online.reader.NoSuchName")


def _code(text: str) -> list[str]:
    """The code of a markdown text: fenced blocks (a line ending in a backslash joined to the next) and inline
    spans."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    lines = [ln for b in blocks for ln in re.sub(r"\\\n\s*", " ", b).splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", rest.replace("\n", " "))


def solaris_commands(text: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """Every ``solaris ...`` command written in the code of ``text``: (its path, one per alternative of an
    ``a|b`` word, and the ``--flags`` that follow it up to the next command or a ``#`` comment)."""
    out = []
    for code in _code(text):
        code = code.split(" #")[0]
        start = r"(?<![\w.-])solaris"            # also .venv/bin/solaris; not solaris_jobs, not a path's part
        for m in re.finditer(start + r"((?: [a-z][a-z-]*(?:\|[a-z][a-z-]*)*)+)(.*?)(?=" + start + " |$)", code):
            words = m.group(1).split()
            flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2))
            out.append((tuple(words), flags))
    return out


def test_every_solaris_command_and_flag_in_the_docs_exists():
    """README and docs name only commands the CLI has, with only flags those commands take."""
    import click

    from solaris_jobs.flows.cli import main

    def resolve(words):
        """The commands (or groups) a written path names (an ``a|b`` word gives one per alternative), or None."""
        found = [main]
        for w in words:
            if not isinstance(found[0], click.Group):
                break                               # an argument of the command (a path, a value)
            nxt = [g.commands.get(alt) for g in found for alt in w.split("|")]
            if None in nxt:
                return None
            found = nxt
        return found

    def flags_of(cmd):
        return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}

    seen, bad = set(), []
    for path in DOCS:
        for words, flags in solaris_commands(path.read_text()):
            cmds = resolve(words)
            if cmds is None:
                bad.append((path.name, "solaris " + " ".join(words)))
                continue
            seen |= {c.name for c in cmds}
            bad += [(path.name, "solaris " + " ".join(words), f) for f in flags
                    if any(f not in flags_of(c) for c in cmds)]
    assert bad == []
    assert {"demo", "evaluate", "materialize", "backfill", "status", "fm", "vm"} <= seen, seen
    # The parser itself: a made-up command and a made-up flag are caught.
    assert resolve(("evaluate-nothing",)) is None and resolve(("data", "nothing")) is None
    (words, flags), = solaris_commands("run `solaris evaluate --out x --no-such-flag` now")
    assert "--no-such-flag" in flags and "--no-such-flag" not in flags_of(resolve(words)[0])
