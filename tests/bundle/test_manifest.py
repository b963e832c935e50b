"""manifest.json as bytes: canonical JSON, the digest over it, and the check that fields are plain
JSON without paths of this machine (so the same build gives the same digest anywhere)."""
from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from deepjit_compiler.bundle.manifest import canonical_json, manifest_bytes, manifest_digest, plain_manifest
from deepjit_compiler.errors import BundleError


def test_canonical_json_sorts_keys_and_drops_spaces():
    assert canonical_json({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})


def test_digest_covers_everything_but_itself():
    body = {"name": "n", "files": {"a": {"sha256": "0" * 64, "size": 1}}}
    want = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert manifest_digest(body) == want
    assert manifest_digest({**body, "digest": "sha256:whatever"}) == want
    assert manifest_digest({**body, "name": "m"}) != want


def test_manifest_bytes_are_indented_sorted_and_end_in_a_newline():
    text = manifest_bytes({"b": 1, "a": {"d": 2, "c": 3}}).decode()
    assert text == '{\n  "a": {\n    "c": 3,\n    "d": 2\n  },\n  "b": 1\n}\n'


def test_plain_manifest_makes_json_and_refuses_what_is_not(tmp_path):
    dest = tmp_path / "out" / "bundle"
    plain = plain_manifest({"t": (1, 2), "f": 1.5, "tensor": "/model.22/Concat"}, dest)
    assert plain == {"t": [1, 2], "f": 1.5, "tensor": "/model.22/Concat"}   # ONNX names are not paths
    for bad, message in ((Path("x"), "a PosixPath is not JSON"), (math.inf, "is not a finite number"),
                         (str(tmp_path / "model.onnx"), "is an absolute path of this machine"),
                         ({1: "x"}, "key 1 is not a string")):
        with pytest.raises(BundleError, match=message):
            plain_manifest({"field": {"inner": bad}}, dest)


def test_plain_manifest_makes_numpy_scalars_and_bools_plain():
    plain = plain_manifest({"n": np.int64(3), "x": np.float32(1.5), "b": True, "none": None}, Path("out/b"))
    assert plain == {"n": 3, "x": 1.5, "b": True, "none": None}
    assert [type(plain[k]) for k in ("n", "x", "b")] == [int, float, bool]
    assert json.loads(json.dumps(plain)) == plain


def test_a_local_path_is_one_under_the_output_folder_or_one_that_exists(tmp_path, monkeypatch):
    """With home, temp and the working folder elsewhere, the output's folder (as given and resolved) still
    marks a path as this machine's, and so does any path that exists here; a sibling folder's name, a
    multi-line text and an ONNX tensor name do not."""
    monkeypatch.setenv("HOME", "/nonexistent-home")
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent-tmp")
    monkeypatch.chdir("/")
    (tmp_path / "real" / "out").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    dest = tmp_path / "link" / "out" / "bundle"
    for local in (dest.parent / "model.onnx", tmp_path / "real" / "out" / "model.onnx", Path(sys.executable)):
        with pytest.raises(BundleError, match=f"'{local}' is an absolute path of this machine"):
            plain_manifest({"model": str(local)}, dest)
    not_local = {"sibling": f"{tmp_path}/link/out-other/model.onnx", "text": f"{dest.parent}/a.onnx\nname: x\n",
                 "tensor": "/model.22/Concat"}
    assert plain_manifest(not_local, dest) == not_local
