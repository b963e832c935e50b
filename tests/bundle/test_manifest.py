"""manifest.json as bytes: canonical JSON, the digest over it, and the check that fields are plain
JSON without paths of this machine (so the same build gives the same digest anywhere)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

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
