"""Every module imports, and the CLI starts, without TensorRT or TensorRT-RTX (Polygraphy's
test_dependencies).

Runs in a fresh interpreter where `import tensorrt` and `import tensorrt_rtx` fail even if they are
installed, so this checks what a user without them gets, on any machine.
"""
from __future__ import annotations

import ast
import graphlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import deepjit_compiler

REPO = Path(__file__).resolve().parent.parent

# sys.modules[name] = None makes `import name` raise ImportError.
BLOCK_TENSORRT = "import sys; sys.modules['tensorrt'] = None; sys.modules['tensorrt_rtx'] = None\n"


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(deepjit_compiler.__path__, "deepjit_compiler."))


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TENSORRT + code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_every_module_imports_without_tensorrt():
    names = modules()
    assert {"deepjit_compiler.precision.rewrite", "deepjit_compiler.precision.calibration",
            "deepjit_compiler.engines.tensorrt", "deepjit_compiler.engines.onnxrt", "deepjit_compiler.engines.base",
            "deepjit_compiler.engines.flavours", "deepjit_compiler.engines.plans",
            "deepjit_compiler.engines.worker"} <= set(names)
    proc = run("import importlib, sys\n"
               f"for name in {names!r}:\n"
               "    importlib.import_module(name)\n"
               "assert sys.modules['tensorrt'] is None, 'something replaced the tensorrt block'\n"
               "assert sys.modules['tensorrt_rtx'] is None, 'something replaced the tensorrt_rtx block'\n")
    assert proc.returncode == 0, proc.stderr


def test_tensorrt_use_without_tensorrt_is_a_missing_dependency():
    proc = run("from deepjit_compiler.engines import TENSORRT_RTX, EngineSettings, rtx_sms, tensorrt_importable\n"
               "from deepjit_compiler.engines.plans import build_engine\n"
               "from deepjit_compiler.errors import MissingDependency\n"
               "assert tensorrt_importable() is False and rtx_sms() is None\n"
               "for kw in ({}, {'flavour': TENSORRT_RTX}):\n"
               "    try:\n"
               "        build_engine('x.onnx', EngineSettings(target_sm=75), **kw)\n"
               "    except MissingDependency as e:\n"
               "        print(e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "building TensorRT engines needs TensorRT: install deepjit[tensorrt] or set engine.backend: onnxruntime" \
        in proc.stdout
    assert "TensorRT-RTX plans need TensorRT-RTX: install deepjit[tensorrt-rtx] or set engine.backend: onnxruntime" \
        in proc.stdout


def test_cli_help_without_tensorrt():
    proc = run("import runpy, sys\n"
               "sys.argv = ['deepjit', '--help']\n"
               "runpy.run_module('deepjit_compiler.cli', run_name='__main__')\n")
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout and "build" in proc.stdout


# --- the import graph, from the source (nothing is imported) -------------------------------------------
PACKAGE = REPO / "deepjit_compiler"
# Stages import downward only: a package may import its own modules and those of the layers above it
# in this list, never one below it (so no cycle can form between packages either).
LAYERS = (
    {"", "errors", "config", "files", "log", "_optional", "images", "choices"},
    {"spec"},
    {"graph"},
    {"model", "jit"},
    {"surgery", "precision", "engines"},
    {"bundle"},
    {"store", "runtime"},
    {"validation"},
    {"serve"},
    {"stagecache", "build", "materialize", "report", "cli"},
)
# Third-party modules a function may import on first use: optional, or heavy and on a rare path.
# Modules the process DeepJIT runs in provides, which no package can bring (so none is declared for them).
HOST_PROVIDED = {"triton_python_backend_utils": "Triton's Python backend's own module, importable only in its stub"}
LAZY_OK = {"onnxruntime.tools.symbolic_shape_infer": "sympy, only when ONNX's shape inference gives up",
           "PIL": "the optional `images` extra",
           "onnx_graphsurgeon.logger": "brings onnx and numpy: log.setup() alone needs it, `--help` not",
           "polygraphy.logger": "beside GraphSurgeon's, in log.setup()", **HOST_PROVIDED}
# Modules whose functions may import DeepJIT modules: the import graph above still holds those imports (it
# reads them wherever they are), so the stage order and the cycle check see them.
LAZY_STAGES = {"deepjit_compiler/cli.py": "each command imports the stages it drives when it runs: imported up "
                                           "front they took `deepjit --help` ~1.5 s"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path):
    """(line, imported deepjit_compiler module, at module level?) and third-party function-local imports."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    base = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            target, names = None, [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("deepjit_compiler"):
                module = name if (REPO / Path(*name.split("."))).is_dir() or \
                    (REPO / Path(*name.split("."))).with_suffix(".py").is_file() else target
                yield node.lineno, module, id(node) in top
            elif id(node) not in top:
                yield node.lineno, "third-party:" + (target or name), False


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        mine = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)}  # packages running already
        deps = graph.setdefault(me, set())
        for _, module, _ in package_imports(path):
            if module.startswith("deepjit_compiler"):
                parts = module.split(".")  # importing a module runs its packages' __init__ first
                deps.update({".".join(parts[:i]) for i in range(1, len(parts) + 1)} - mine)
    for module, deps in graph.items():
        deps.discard(module)
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 60 and "deepjit_compiler.runtime.pipeline" in graph["deepjit_compiler.validation.end_to_end"]
    order = graphlib.TopologicalSorter(graph)
    try:
        order.prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_the_cycle_check_finds_a_cycle():
    """The check above is only worth something if it fails on a cycle: feed it one."""
    graph = import_graph()
    graph["deepjit_compiler.spec.load"].add("deepjit_compiler.build")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        assert "deepjit_compiler.build" in e.args[1]
    else:
        raise AssertionError("a cycle through build and spec.load went unnoticed")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}

    def top(module: str) -> str:
        return module.removeprefix("deepjit_compiler").lstrip(".").split(".")[0]

    unknown = {top(m) for m in graph} - set(layer)
    assert not unknown, f"packages missing from LAYERS: {sorted(unknown)}"
    return sorted(f"{module} imports {dep}" for module, deps in graph.items() for dep in deps
                  if top(dep) != top(module) and layer[top(dep)] > layer[top(module)])


def test_packages_import_downward_only():
    wrong = upward_imports(import_graph())
    assert not wrong, "imports against the stage order:\n" + "\n".join(wrong)


def test_an_upward_import_is_found():
    graph = import_graph()
    graph["deepjit_compiler.surgery.cut"].add("deepjit_compiler.validation.gate")
    assert upward_imports(graph) == ["deepjit_compiler.surgery.cut imports deepjit_compiler.validation.gate"]


def test_no_function_local_import_hides_a_dependency():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module, at_top in package_imports(path):
            if at_top:
                continue
            lazy = module.removeprefix("third-party:")
            if module.startswith("deepjit_compiler") and str(path.relative_to(REPO)) in LAZY_STAGES:
                continue
            if module.startswith("deepjit_compiler") or not any(lazy == ok or lazy.startswith(ok + ".") for ok in LAZY_OK):
                found.append(f"{path.relative_to(REPO)}:{line}: {lazy}")
    assert not found, "function-local imports (move them to the top of the module):\n" + "\n".join(found)


def test_the_design_notes_module_table_names_every_module():
    """docs/design.md's table of packages and modules is how a newcomer finds their way: each module is
    named (in backquotes) in its package's row, top-level modules in a '(top)' row."""
    rows: dict[str, str] = {}
    for line in (REPO / "docs" / "design.md").read_text().splitlines():
        if cells := re.fullmatch(r"\| (`\w+/`|\(top\)) \| (.*) \| .* \|", line):
            rows[cells[1].strip("`/")] = rows.get(cells[1].strip("`/"), "") + cells[2]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = path.parent.name if path.parent != PACKAGE else "(top)"
        if path.name != "__init__.py" and f"`{path.stem}`" not in rows.get(package, ""):
            missing.append(module_name(path))
    assert len(rows) > 10 and not missing, f"modules docs/design.md's table does not name: {missing}"
