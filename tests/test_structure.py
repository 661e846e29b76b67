"""The import structure of the project's packages, read from the source (``ast``) and checked by importing.

- No import cycle between modules, counting imports inside functions too: a function-level import that
  only breaks a cycle hides it (the module still needs the other one; it just imports it later).
- No import up the package order ``ORDER``: a package imports only the packages before it (``target_model/`` only
  ``common/``, ``drafter/`` only those two, ...). ``bench/`` and ``tests/`` may import anything; no package
  imports ``bench/``.
- Every import inside a function of a package is listed in ``LAZY`` with the reason it is late (a heavy
  dependency a command can do without), so a new one is a decision, never a way around a cycle.
- Every module imports in a fresh interpreter on its own: nothing relies on another module having been
  imported first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("common", "target_model", "engine", "drafter", "data_prep", "train", "eval", "pipeline")
FREE = ("bench",)  # scripts over everything (tests/ too, not read here)

# Imports of project modules inside functions, (importer, imported): why each is late.
LAZY = {
    ("data_prep.steps", "data_prep.regenerate"): "`python -m data_prep ingest` imports neither torch nor the target",
    ("data_prep.steps", "data_prep.capture"): "`python -m data_prep ingest` imports neither torch nor the target",
    ("data_prep.steps", "data_prep.self_prompts"): "`python -m data_prep ingest` imports neither torch nor the target",
    ("data_prep.steps", "data_prep.symbol_runs"): "`python -m data_prep ingest` imports neither torch nor the target",
    ("data_prep.backends", "engine.batched"): "regenerate's openai backend never imports torch (hf does)",
    ("data_prep.backends", "engine.continuous_batching"): "regenerate's openai backend never imports torch",
    ("data_prep.backends", "engine.sampling"): "regenerate's openai backend never imports torch",
    ("data_prep.backends", "engine.sizing"): "regenerate's openai backend never imports torch",
    ("data_prep.backends", "target_model.hf_model"): "regenerate's openai backend never imports torch",
    ("train.module", "train.attention"): "flex_attention (torch.compile) is loaded only on CUDA, where it runs",
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages and of bench/."""
    out = {}
    for pkg in ORDER + FREE:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import of ``name`` loads last (``a.b.c`` -> ``a.b`` when c is a name in it)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def project_imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module by a project module, at module level or inside a function."""
    found = []
    for importer, path in modules.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool, importer: str = importer, package: str = package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: from the importer's package up level - 1
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*up, base] if base else up)
                    names = [f"{base}.{a.name}" for a in child.names]  # a submodule, or a name in ``base``
                else:
                    visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))
                    continue
                for name in names:
                    imported = _resolve(name, modules)
                    if imported is not None and imported != importer:
                        found.append(Import(importer, imported, child.lineno, in_function))

        visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
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

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


MODULES = module_files()
IMPORTS = project_imports(MODULES)


def test_the_graph_is_read():
    """A guard on the reader itself: known edges of both kinds are found."""
    edges = {(i.importer, i.imported, i.in_function) for i in IMPORTS}
    assert ("data_prep.ingest", "data_prep.step_failed", False) in edges  # from a.b import Name
    assert ("eval.live_gate", "eval.breakeven", False) in edges  # from a import b
    assert ("data_prep.steps", "data_prep.capture", True) in edges  # inside a function
    assert {"common.files", "eval.gate", "bench.results"} <= set(MODULES)


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        edges.setdefault(i.importer, set()).add(i.imported)
    problems = []
    for component in cycles(edges):
        members = set(component)
        inside = [f"{i.importer}:{i.line} -> {i.imported}{' (inside a function)' if i.in_function else ''}"
                  for i in IMPORTS if i.importer in members and i.imported in members]
        problems.append(" <-> ".join(component) + ":\n    " + "\n    ".join(sorted(set(inside))))
    assert not problems, ("import cycles (move what both sides need into a module of its own that imports "
                          "neither):\n" + "\n".join(problems))


def test_no_upward_imports():
    rank = {p: r for r, p in enumerate(ORDER)}
    bad = []
    for i in IMPORTS:
        src, dst = _package(i.importer), _package(i.imported)
        if src in rank and (dst not in rank or rank[dst] > rank[src]):
            bad.append(f"{MODULES[i.importer].relative_to(ROOT)}:{i.line}: {i.importer} imports {i.imported}")
    assert not bad, (f"imports against the package order {' < '.join(ORDER)} (bench/ and tests/ import anything; "
                     "nothing imports them):\n" + "\n".join(sorted(bad)))


def test_function_level_imports_are_listed_with_a_reason():
    lazy = [i for i in IMPORTS if i.in_function and _package(i.importer) in ORDER]
    unlisted = [f"{MODULES[i.importer].relative_to(ROOT)}:{i.line}: {i.importer} -> {i.imported}"
                for i in lazy if (i.importer, i.imported) not in LAZY]
    assert not unlisted, ("imports inside functions that LAZY does not list: import them at module level, or "
                          "list them with the heavy dependency they keep a command from loading:\n"
                          + "\n".join(unlisted))
    stale = sorted(set(LAZY) - {(i.importer, i.imported) for i in lazy})
    assert not stale, f"LAZY lists imports that are no longer inside a function: {stale}"


# Run in a fresh interpreter: third-party libraries are imported once, then each project module is imported in a
# forked child that has no project module loaded yet, so an import that works only after another module's fails.
# torch._dynamo among them: the modules that use torch.compile would each spend 1.6 s importing it (and sympy).
CHILD = textwrap.dedent("""
    import importlib, os, sys, traceback
    root, packages, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    sys.path.insert(0, root)
    for lib in ("torch", "torch._dynamo", "numpy", "safetensors", "accelerate", "transformers", "pydantic", "yaml",
                "tqdm"):
        importlib.import_module(lib)
    failed = 0
    for name in names:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
                for loaded, mod in list(sys.modules.items()):  # another checkout's copy (an editable install)
                    where = os.path.realpath(getattr(mod, "__file__", None) or root)
                    if loaded.split(".")[0] in packages and not where.startswith(os.path.realpath(root) + os.sep):
                        raise ImportError(f"importing {name} loaded {loaded} from {where}, not from {root}")
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status:
            print(f"FAILED: import {name}", file=sys.stderr)
            failed += 1
    sys.exit(1 if failed else 0)
""")


def test_every_module_imports_on_its_own():
    project = sorted(m for m in MODULES if not m.endswith("__main__"))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), ",".join(ORDER + FREE), *project],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
