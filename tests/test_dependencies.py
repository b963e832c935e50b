"""Every package DeepJIT imports is declared in pyproject.toml (.ci/run installs into a venv without the
system's site-packages, so an undeclared one fails there; this says which, on any machine)."""
from __future__ import annotations

import ast
import importlib
import re
import sys
from importlib import metadata

from conftest import REPO
from test_imports import HOST_PROVIDED, LAZY_OK

PACKAGE = REPO / "deepjit_compiler"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions deepjit's installed metadata requires, its extras' included."""
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in metadata.requires("deepjit") or ()}


def imported_top_levels() -> dict[str, str]:
    """Top-level third-party modules imported anywhere in the package -> the first file importing it."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "deepjit_compiler" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_every_imported_package_is_declared():
    dists = metadata.packages_distributions()
    wanted = declared()
    missing = []
    for top, where in sorted(imported_top_levels().items()):
        if top in HOST_PROVIDED:
            continue
        owners = {_norm(d) for d in dists.get(top, ())}
        if not owners & wanted:
            missing.append(f"{top} (imported in {where}; installed from {sorted(owners) or 'nothing'})")
    assert not missing, "imported but not declared in pyproject.toml:\n  " + "\n  ".join(missing)


def test_what_a_lazy_import_needs_is_installed():
    """A lazy import pulls in what its library no longer declares (ONNX Runtime's symbolic shape
    inference needs sympy, which onnxruntime >= 1.32 does not bring): it must import here."""
    for module in set(LAZY_OK) - set(HOST_PROVIDED):
        importlib.import_module(module)


def test_the_check_finds_an_undeclared_package(monkeypatch):
    monkeypatch.setattr(metadata, "requires", lambda dist: ["numpy>=1.24"])
    try:
        test_every_imported_package_is_declared()
    except AssertionError as e:
        assert "onnx (imported in" in str(e)
    else:
        raise AssertionError("an undeclared onnx went unnoticed")


def test_ci_installs_into_an_isolated_venv():
    script = (REPO / ".ci/run").read_text()
    assert re.search(r"^python3 -m venv ", script, re.M) and "--system-site-packages" not in script.replace(
        "no --system-site-packages", "")
    assert script.index("/bin/activate") < script.index('eval "$INSTALL"')
