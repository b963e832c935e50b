"""The tensors a spec's validation block names must exist: a range or a tolerance for a misspelt or
stale tensor would otherwise be ignored, and the level would run on the defaults the user meant to
replace."""
from __future__ import annotations

from ..errors import SpecError, closest


def check_names(loaded, plan, detections) -> None:
    """SpecError naming the field of the first `validation.data.random.ranges` entry that random data
    does not feed (it feeds the pipeline's inputs, and an engine segment's for the engine level and
    int8 calibration), or the first `tolerances` / `precision_tolerances` output that no level
    compares (every step's outputs are compared by some level) or that is compared as part of a
    detection set (the `detections` tolerances judge those; `detections`: the kernels' declared groups)."""
    validation, where = loaded.spec.validation, loaded.path
    fed = {t.name: None for t in (*plan.inputs, *(t for s in plan.segments for t in s.inputs))}
    compared = {t.name: None for t in (*(t for s in plan.steps for t in s.outputs), *plan.outputs)}
    random = validation.data.random
    _check(where, "validation.data.random.ranges", random.ranges if random else {}, fed, "random data feeds")
    as_sets = {n: g for g in detections for n in g.names}
    for field in ("tolerances", "precision_tolerances"):
        outputs = getattr(validation, field).outputs
        _check(where, f"validation.{field}.outputs", outputs, compared, "the levels compare")
        for name in (n for n in outputs if n in as_sets):
            raise SpecError(f"{where}: validation.{field}.outputs.{name}: '{name}' is compared as part of a detection "
                            f"set ({', '.join(as_sets[name].names)}), where atol and rtol do not apply; allowed: "
                            f"validation.{field}.detections (min_map, min_iou, score_atol, ...)")


def _check(where, field: str, given, allowed: dict, what: str) -> None:
    for name in given:
        if name not in allowed:
            raise SpecError(f"{where}: {field}.{name}: '{name}' is not one of the tensors {what}"
                            f"{closest(name, allowed)}: {', '.join(allowed)}")
