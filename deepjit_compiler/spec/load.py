"""`load_spec(path) -> LoadedSpec`: read, parse and validate a spec file.

Every error names the file, the line and column of the offending key, what is allowed, and the
closest valid name for a typo."""
from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import SpecError
from .locate import describe_errors
from .models import Spec
from .safeyaml import load_yaml, read_text


class LoadedSpec(BaseModel):
    """A validated spec with where it came from (its text is part of the bundle)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    spec: Spec
    path: Path
    text: str

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_spec(path: str | Path) -> LoadedSpec:
    """Read, parse and validate a spec file (bounded YAML: spec/safeyaml.py); every problem is a
    SpecError naming file:line:col."""
    path = Path(path)
    text = read_text(path, SpecError, "spec file")
    data, root = load_yaml(text, path, SpecError)
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1:1: a spec is a mapping with keys {', '.join(Spec.model_fields)}")
    try:
        spec = Spec.model_validate(data, context={"base": path.parent.resolve()})
    except ValidationError as e:  # only now the node tree, for the file:line:col of each problem
        raise SpecError(describe_errors(e, path, root, Spec)) from None
    return LoadedSpec(spec=spec, path=path.resolve(), text=text)


def json_schema() -> dict:
    """The JSON Schema of the spec language (for editors)."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "DeepJIT pipeline spec"
    return schema
