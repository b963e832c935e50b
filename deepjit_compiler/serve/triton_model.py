"""The Triton Python-backend model of an exported bundle: what `<version>/model.py` subclasses.

Triton starts one stub process per instance; `initialize` runs there once: it verifies the bundle
beside model.py (read_bundle: every file against its sha256, the manifest against its digest) and that
it is the bundle the export wrote (`bundle_digest`), then loads it as the instance's kind says:
KIND_GPU on the instance's GPU (`Pipeline.load(gpu=model_instance_device_id)`), KIND_CPU on ONNX
Runtime's CPU provider (`CpuPipeline`, as `deepjit run --device cpu`). `execute` runs the requests it is
handed through batches.RequestRunner and answers each with its outputs or its own error.

Only Triton's stub can import `triton_python_backend_utils`, so it is imported in `initialize`.
"""
from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle.folder import read_bundle
from ..errors import BundleError, DeepJITError, RuntimeInputError, ServeError
from ..runtime.run import load_pipeline
from .batches import RequestRunner

log = logging.getLogger("deepjit.serve")

BUNDLE_DIR = "bundle"   # beside model.py (triton.py writes it there)


class DeepJITModel:
    """A TritonPythonModel over the bundle in `<version>/bundle/`; model.py sets `bundle_digest`."""

    bundle_digest = ""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # only inside Triton's Python-backend stub

        self._pb = pb_utils
        if int(np.__version__.split(".")[0]) >= 2:
            # Triton's Python-backend stub (pybind11 over numpy 1.x) hands a model garbage inputs and
            # takes back empty outputs under numpy 2, without an error anywhere: refuse to serve instead.
            raise ServeError(f"numpy {np.__version__} in this model's Python environment: Triton's Python backend "
                             "passes tensors wrongly with numpy >= 2; install numpy<2 in the environment that "
                             "EXECUTION_ENV_PATH names (DeepJIT runs on numpy 1.24 and later)")
        folder = Path(args["model_repository"]) / args["model_version"] / BUNDLE_DIR
        bundle = read_bundle(folder)
        if bundle.digest != self.bundle_digest:
            raise BundleError(f"{folder}: bundle {bundle.digest} is not the one exported here ({self.bundle_digest}): "
                              "export the bundle again instead of replacing its files")
        kind = args["model_instance_kind"]
        if kind not in ("GPU", "CPU"):
            raise ServeError(f"instance kind {kind}: DeepJIT serves KIND_GPU and KIND_CPU instances")
        device, gpu = ("gpu", int(args["model_instance_device_id"])) if kind == "GPU" else ("cpu", 0)
        self.pipe = load_pipeline(bundle, device, gpu=gpu)
        self.runner = RequestRunner(self.pipe)
        config = json.loads(args["model_config"])
        self.inputs = [t["name"] for t in config["input"]]
        log.info("%s: serving %s (%s) on %s", args["model_instance_name"], bundle.name, bundle.digest,
                 self.pipe.describe()["device"])

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self._pb
        try:
            feeds = [{n: pb.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs} for r in requests]
            results = self.runner.run(feeds)
        except Exception as e:  # a bug: answer every request with it and keep serving
            log.error("%s", traceback.format_exc())
            results = [DeepJITError(f"internal error in DeepJIT (a bug): {type(e).__name__}: {e}")] * len(requests)
        responses = []
        for result in results:
            if isinstance(result, DeepJITError):
                code = pb.TritonError.INVALID_ARG if isinstance(result, RuntimeInputError) else pb.TritonError.INTERNAL
                responses.append(pb.InferenceResponse(error=pb.TritonError(str(result), code)))
            else:
                responses.append(pb.InferenceResponse(
                    [pb.Tensor(name, np.ascontiguousarray(arr)) for name, arr in result.items()]))
        return responses

    def finalize(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
