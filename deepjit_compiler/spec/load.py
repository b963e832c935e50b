"""`load_spec(path) -> LoadedSpec`: read, parse and validate a spec file.

Every error names the file, the line and column of the offending key, what is allowed, and the
closest valid name for a typo."""
from __future__ import annotations

import hashlib
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import SpecError
from .locate import describe_errors
from .models import Spec


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
    """Read, parse and validate a spec file; every problem is a SpecError naming file:line:col."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read spec: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise SpecError(f"{where}: YAML error: {e.problem or e.context}"
                        + (" (only plain YAML is allowed: no Python tags)" if "python" in str(e) else "")) from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: YAML error: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1:1: a spec is a mapping with keys {', '.join(Spec.model_fields)}")
    try:
        spec = Spec.model_validate(data, context={"base": path.parent.resolve()})
    except ValidationError as e:  # only now the node tree, for the file:line:col of each problem
        raise SpecError(describe_errors(e, path, yaml.compose(text, Loader=yaml.SafeLoader), Spec)) from None
    return LoadedSpec(spec=spec, path=path.resolve(), text=text)


def json_schema() -> dict:
    """The JSON Schema of the spec language (for editors)."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "DeepJIT pipeline spec"
    return schema
