"""The build: the only module that knows the order of the stages."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .log import StageTimes
from .modelsource import check_inputs, resolve_model
from .spec import LoadedSpec, load_spec

log = logging.getLogger("deepjit.build")


@dataclass
class BuildResult:
    """What a build did, for the terminal and for `--json`."""

    spec: LoadedSpec
    model_path: Path
    model_sha256: str
    synthesized: bool
    stages: list[dict[str, Any]] = field(default_factory=list)
    times: StageTimes = field(default_factory=StageTimes)
    gate_failed: bool = False

    def to_dict(self) -> dict[str, Any]:
        s = self.spec.spec
        return {
            "name": s.name,
            "spec": str(self.spec.path),
            "model": {"path": str(self.model_path), "sha256": self.model_sha256, "synthesized": self.synthesized},
            "target": {"gpu": s.target.gpu, "sm": s.target.resolved_sm},
            "stages": self.stages,
            "seconds": self.times.seconds,
            "gate_failed": self.gate_failed,
        }


def planned_stages(loaded: LoadedSpec) -> list[dict[str, Any]]:
    """The pipeline's stages as the spec declares them, in run order."""
    s = loaded.spec
    before = [c for c in s.cuts if c.add == "before"]
    after = [c for c in s.cuts if c.add == "after"]
    inside = [c for c in s.cuts if c.add is None]

    def kernel_stage(cut, where):
        return {"stage": cut.name, "kind": "kernel", "where": where,
                "kernels": [k.contract for k in cut.kernels],
                "boundary": cut.preset or (f"{cut.add} {cut.at}" if cut.add else f"{cut.inputs} -> {cut.outputs}")}

    return ([kernel_stage(c, "added before the model") for c in before]
            + [{"stage": "engine", "kind": "engine", "backend": s.engine.backend, "precision": s.engine.precision}]
            + [kernel_stage(c, "cut out of the model") for c in inside]
            + [kernel_stage(c, "added after the model") for c in after])


def build_pipeline(spec_path: str | Path, *, dry_run: bool = False, publish: bool = True) -> BuildResult:
    loaded = load_spec(spec_path)
    times = StageTimes()
    with times.stage("model"):
        resolved = resolve_model(loaded)
        check_inputs(loaded, resolved.model)
    result = BuildResult(loaded, resolved.path, resolved.sha256, resolved.synthesized, times=times)
    result.stages = planned_stages(loaded)
    return result
