"""Bounded YAML: an alias bomb, deep nesting, a recursive alias, an oversized file and a key given
twice are refused at once, naming file, line and column (spec/safeyaml.py)."""
from __future__ import annotations

import time

import pytest

from deepjit_compiler.errors import SpecError
from deepjit_compiler.spec.load import load_spec
from deepjit_compiler.spec.safeyaml import MAX_BYTES, load_yaml

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)},"
    f" *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))


def test_an_alias_bomb_in_a_typed_field_is_refused_at_once(write_spec):
    spec = write_spec({"    shape: [batch, 3, 640, 640]": "    shape: *i"})  # 9**9 elements
    spec.write_text(BOMB + spec.read_text())
    start = time.perf_counter()
    with pytest.raises(SpecError, match=r"spec.yaml:\d+:\d+: expands to more than 100000 nodes"):
        load_spec(spec)
    assert time.perf_counter() - start < 1.0


def test_anchors_and_aliases_that_stay_small_are_fine():
    data, _ = load_yaml("p: &p {block: 256}\nk1: {params: *p}\nk2: {params: *p}\n", "x.yaml", SpecError)
    assert data["k2"]["params"] == {"block": 256}


@pytest.mark.parametrize("text, message", [
    ("a: 1\nb: 2\na: 3\n", r"x.yaml:3:1: key 'a' is given twice in this mapping \(first at line 1\)"),
    ("a: &r [*r]\n", "x.yaml:1:4: a recursive alias"),
    ("v: " + "[" * 80 + "]" * 80 + "\n", "nested deeper than 64 levels"),
    ("a: !!python/object/apply:os.system [echo hi]\n", "only plain YAML is allowed: no Python tags"),
])
def test_refused_documents_name_file_line_and_column(text, message):
    with pytest.raises(SpecError, match=message):
        load_yaml(text, "x.yaml", SpecError)


def test_an_oversized_spec_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(SpecError, match="larger than 1024 KiB"):
        load_spec(path)
