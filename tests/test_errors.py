"""Exceptions and exit codes (errors.py): bad input is exit 2, a failed gate exit 1; errors cross processes."""
from __future__ import annotations

import pickle

import pytest

from deepjit_compiler import errors
from deepjit_compiler.errors import DeepJITError, GateFailed, KernelCompileError, KernelError, closest

BAD_INPUT = ["ConfigError", "SpecError", "ModelError", "SurgeryError", "KernelError", "KernelCompileError",
             "EngineError", "RuntimeInputError", "BundleError", "OutputError", "ServeError", "StoreError",
             "MissingDependency"]


@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_is_a_deepjit_error_with_exit_code_2_that_survives_pickling(name):
    cls = getattr(errors, name)
    error = pickle.loads(pickle.dumps(cls("spec.yaml:3:5: precision: 'fp17' is not allowed")))
    assert type(error) is cls and isinstance(error, DeepJITError) and not isinstance(error, OSError)
    assert error.exit_code == 2 and str(error) == "spec.yaml:3:5: precision: 'fp17' is not allowed"


def test_a_failed_gate_is_exit_1_and_keeps_its_report_and_result_across_pickling():
    error = pickle.loads(pickle.dumps(GateFailed("gate: 3 of 40 samples differ", {"levels": [1, 2]}, {"bundle": "b"})))
    assert type(error) is GateFailed and error.exit_code == 1
    assert (str(error), error.report, error.result) == ("gate: 3 of 40 samples differ", {"levels": [1, 2]},
                                                        {"bundle": "b"})
    assert issubclass(KernelCompileError, KernelError)


def test_closest_suggests_the_nearest_name_or_nothing():
    assert closest("precison", ["precision", "profile", "pipeline"]) == " (did you mean 'precision'?)"
    assert closest("bucket", ["buckets", "bucket_sizes"]) == " (did you mean 'buckets'?)"
    assert closest(8, [16, 80, 800]) == " (did you mean '80'?)"
    assert closest("zzz", ["pizza", "profile"]) == ""  # "pizza" is too far
