"""Lazy imports of optional dependencies (_optional.py): an absent or broken one is a MissingDependency (exit 2)."""
from __future__ import annotations

import pytest

from deepjit_compiler._optional import lazy_import
from deepjit_compiler.errors import MissingDependency


@pytest.mark.parametrize("body", ["raise ImportError('libnvrtc.so.12: cannot open shared object file')",
                                  "import deepjit_no_such_module_xyz"], ids=["broken", "missing-dependency"])
def test_a_module_that_fails_to_import_is_a_missing_dependency_naming_it_and_why(tmp_path, monkeypatch, body):
    (tmp_path / "deepjit_fake_backend.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = lazy_import("deepjit_fake_backend", "compiling kernels needs NVRTC")
    assert not mod.available()
    with pytest.raises(MissingDependency, match=r"compiling kernels needs NVRTC: cannot import 'deepjit_fake_backend'") as e:
        mod.compile
    assert e.value.exit_code == 2


def test_a_present_module_is_imported_on_first_use():
    mod = lazy_import("json", "reading json needs json")
    assert mod.available() and mod.loads("[1, 2]") == [1, 2]
