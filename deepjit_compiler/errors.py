"""Exceptions and exit codes.

Exit code 1: the build ran and the accuracy gate said no. Exit code 2: bad input (spec, model,
template, missing dependency). Anything that is not a DeepJITError is a bug: exit code 3.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class DeepJITError(Exception):
    """A user-facing error: printed without a traceback."""

    exit_code = 2

    def __reduce__(self):
        return (type(self), self.args)


class ConfigError(DeepJITError):
    """An environment setting (DEEPJIT_*) is wrong: the message names the variable and what is allowed."""


class SpecError(DeepJITError):
    """The spec file is wrong: the message names file, line, column and field."""


class ModelError(DeepJITError):
    """The ONNX model is missing, unreadable or does not fit the spec."""


class SurgeryError(DeepJITError):
    """A cut cannot be made: the message names the cut and the tensor or node."""


class KernelError(DeepJITError):
    """A kernel contract, its params or its template are wrong."""


class KernelCompileError(KernelError):
    """NVRTC rejected a rendered kernel; the message maps its log back to the template."""


class EngineError(DeepJITError):
    """An engine could not be built or loaded."""


class RuntimeInputError(DeepJITError):
    """Inputs given to a loaded pipeline do not fit it."""


class BundleError(DeepJITError):
    """A bundle is malformed, tampered with or incompatible."""


class OutputError(DeepJITError):
    """An output path cannot be written (disk full, read-only, not a folder): nothing was half written."""


class ServeError(DeepJITError):
    """A serving export is refused: an option, the bundle's tensors, or a destination DeepJIT did not write."""


class StoreError(DeepJITError):
    """Artifact storage refused an operation."""


class MissingDependency(DeepJITError):
    """An optional dependency (TensorRT, a GPU) is needed for this operation."""


class GateFailed(DeepJITError):
    """The accuracy gate rejected the build; carries the report (and the build's result, for `--json`)."""

    exit_code = 1

    def __init__(self, message: str, report=None, result=None):
        super().__init__(message)
        self.report, self.result = report, result

    def __reduce__(self):
        return (type(self), (self.args[0], self.report, self.result))


def closest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest valid name, or ''."""
    match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
