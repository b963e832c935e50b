"""Bounded YAML: an alias bomb, deep nesting, a recursive alias, an oversized file and a key given
twice are refused at once, naming file, line and column (spec/safeyaml.py)."""
from __future__ import annotations

import time

import pytest

from deepjit_compiler.errors import SpecError
from deepjit_compiler.spec import safeyaml
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


def test_an_alias_bomb_as_a_mapping_key_is_refused_before_it_is_built():
    """Keys are counted like values: two aliases of 9**5 scalars as one key, not built into a list first."""
    bomb_key = "".join(BOMB.splitlines(keepends=True)[:5]) + "? [*e, *e]\n: 1\n"
    with pytest.raises(SpecError, match=r"x.yaml:6:3: expands to more than 100000 nodes"):
        load_yaml(bomb_key, "x.yaml", SpecError)


@pytest.mark.parametrize("copies, refused", [(98, False), (100, True)])
def test_the_node_bound_is_100000_nodes_with_aliases_expanded(copies, refused):
    """A 1000-node list and a list of `copies` aliases of it: 99,004 nodes in all pass; the list of 100 is
    100,001 nodes on its own."""
    text = "a: &a [" + ", ".join(["x"] * 999) + "]\nb: [" + ", ".join(["*a"] * copies) + "]\n"
    if refused:
        with pytest.raises(SpecError, match=r"x.yaml:2:4: expands to more than 100000 nodes"):
            load_yaml(text, "x.yaml", SpecError)
    else:
        assert len(load_yaml(text, "x.yaml", SpecError)[0]["b"]) == copies


def test_merge_keys_may_repeat_in_one_mapping():
    data, _ = load_yaml("a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n", "x.yaml", SpecError)
    assert data["c"] == {"x": 1, "y": 2}


@pytest.mark.parametrize("text", ["a: 1\n" + "#" * MAX_BYTES, "a: 1\n# " + "\u00e9" * (MAX_BYTES // 2 - 3)])
def test_a_document_past_1_mib_of_utf8_is_refused_by_load_yaml_too(text):
    """Counted in UTF-8 bytes, not characters: the second is 524,285 characters and 1,048,578 bytes."""
    with pytest.raises(SpecError, match=r"^x.yaml: larger than 1024 KiB; refused$"):
        load_yaml(text, "x.yaml", SpecError)


@pytest.mark.parametrize("body", [b"", b"# only a comment\n", b"just words\n", b"- a\n- b\n"])
def test_a_spec_that_is_not_a_mapping_names_the_keys_a_spec_has(tmp_path, body):
    (tmp_path / "spec.yaml").write_bytes(body)
    with pytest.raises(SpecError, match=r"spec.yaml:1:1: a spec is a mapping with keys name, model, target, inputs"):
        load_spec(tmp_path / "spec.yaml")


def test_a_spec_that_is_not_utf8_names_the_byte(tmp_path):
    (tmp_path / "spec.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match=r"spec.yaml: spec file is not UTF-8 text \(invalid continuation byte at "
                                        r"byte 9\)"):
        load_spec(tmp_path / "spec.yaml")


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


@pytest.mark.parametrize("text, where", [
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "x.yaml:1:68:"),
    ("a: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "x.yaml:1:257:"),
    ("- " * 100_000 + "x\n", "x.yaml:1:131:"),
])
def test_nesting_thousands_deep_is_refused_before_python_recurses(text, where):
    with pytest.raises(SpecError, match=f"{where} nested deeper than 64 levels; refused"):
        load_yaml(text, "x.yaml", SpecError)


def test_a_recursion_error_is_still_a_spec_error(monkeypatch):
    monkeypatch.setattr(safeyaml, "MAX_DEPTH", 10**9)  # as if the bound missed a way PyYAML recurses
    with pytest.raises(SpecError, match="x.yaml: nested deeper than"):
        load_yaml("a: " + "[" * 5000 + "]" * 5000 + "\n", "x.yaml", SpecError)


def test_aliases_cannot_chain_nesting_past_the_bound():
    levels = "[" * 60, "]" * 60
    text = f"a0: &a0 {levels[0]}1{levels[1]}\n" + "".join(
        f"a{i}: &a{i} {levels[0]}*a{i - 1}{levels[1]}\n" for i in range(1, 30))  # 1800 deep, 27,000 nodes
    with pytest.raises(SpecError, match="x.yaml:1:5: nested deeper than 64 levels once its aliases are expanded"):
        load_yaml(text, "x.yaml", SpecError)
    fits = "a: &a " + "[" * 30 + "1" + "]" * 30 + "\nb: " + "[" * 33 + "*a" + "]" * 33 + "\n"  # 64 deep
    assert load_yaml(fits, "x.yaml", SpecError)[0]["b"][0]


def test_an_oversized_spec_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(SpecError, match=r"big.yaml: spec file is larger than 1024 KiB; refused"):
        load_spec(path)


def test_a_fifo_where_a_spec_or_contract_is_expected_is_refused_at_once(tmp_path):
    """A plain open() of a FIFO waits for a writer forever: the build hung."""
    import os
    import threading

    from deepjit_compiler.errors import KernelError
    from deepjit_compiler.jit.contracts import load_contract

    os.mkfifo(tmp_path / "fifo.yaml")
    outcome = {}

    def load():
        for what, call, error in (("spec", lambda: load_spec(tmp_path / "fifo.yaml"), SpecError),
                                  ("contract", lambda: load_contract(str(tmp_path / "fifo.yaml")), KernelError)):
            try:
                call()
            except error as e:
                outcome[what] = str(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # let the stuck open return, then fail
        with open(tmp_path / "fifo.yaml", "wb"):
            pass
        pytest.fail("reading a FIFO as a spec or contract blocked")
    assert set(outcome) == {"spec", "contract"} and all("not a regular file" in m for m in outcome.values()), outcome
