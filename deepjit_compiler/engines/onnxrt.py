"""The ONNX Runtime backend: the portable engine, and what validates every other one.

Building is the segment's ONNX itself (checked to load). The runner is an ONNX Runtime
InferenceSession on the CPU, or on the CUDA execution provider when onnxruntime-gpu is installed.
On CUDA, `enqueue` binds our device buffers with IO binding and runs on our stream through the
provider option `user_compute_stream` (ONNX Runtime >= 1.17), with the run option
`disable_synchronize_execution_providers` so the call returns without waiting for the stream.
ONNX Runtime fixes a session's stream when it creates the session, so there is one session per
stream. Written against ONNX Runtime's documented Python API (IOBinding.bind_input/bind_output,
InferenceSession.run_with_iobinding, the CUDA provider options); onnxruntime-gpu is not installed
on the machines DeepJIT is developed on, so the CUDA path runs only where it is.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import onnx
import onnxruntime as ort
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.datatype import DataType

from ..errors import EngineError, MissingDependency, RuntimeInputError
from .base import EngineArtifact, EngineSettings, Shape

log = logging.getLogger("deepjit.engines.onnxruntime")

CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
DEVICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    return CUDA_EP in ort.get_available_providers()


def build_engine(segment: onnx.ModelProto | bytes | str | Path, segment_name: str,
                 settings: EngineSettings) -> EngineArtifact:
    """The ONNX Runtime 'engine' of a segment: its model bytes, checked to load in ONNX Runtime."""
    data = _model_bytes(segment)
    try:
        ort.InferenceSession(data, providers=[CPU_EP])
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... classes
        raise EngineError(f"segment '{segment_name}': ONNX Runtime cannot load it: {e}") from None
    log.info("segment %s: ONNX Runtime engine (%d bytes)", segment_name, len(data))
    return EngineArtifact("onnxruntime", segment_name, {f"{segment_name}.onnx": data}, settings.to_json())


def _model_bytes(segment: onnx.ModelProto | bytes | str | Path) -> bytes:
    if isinstance(segment, onnx.ModelProto):
        return segment.SerializeToString()
    if isinstance(segment, bytes):
        return segment
    return Path(segment).read_bytes()


class OnnxrtEngineRunner(OnnxrtRunner):
    """Polygraphy's ONNX Runtime runner over a segment, plus `enqueue` on a CUDA stream.

    device: "cpu", "cuda" (needs onnxruntime-gpu) or "auto" (CUDA when present)."""

    def __init__(self, model: onnx.ModelProto | bytes | str | Path, *, device: str = "auto", device_id: int = 0,
                 name: str | None = None):
        super().__init__(self._session, name=name)  # first: Polygraphy's __del__ reads its attributes
        if device not in DEVICES:
            raise EngineError(f"ONNX Runtime device must be one of {', '.join(DEVICES)}, got '{device}'")
        if device == "cuda" and not cuda_available():
            raise MissingDependency(_NO_CUDA)
        self._model = _model_bytes(model)
        self.device = "cuda" if device == "cuda" or (device == "auto" and cuda_available()) else "cpu"
        self.device_id = device_id
        self._stream_sessions: dict[int, ort.InferenceSession] = {}

    def _session(self, stream_handle: int | None = None) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.device == "cpu":
            return ort.InferenceSession(self._model, so, providers=[CPU_EP])
        options = {"device_id": str(self.device_id)}
        if stream_handle is not None:
            options.update(has_user_compute_stream="1", user_compute_stream=str(stream_handle))
        return ort.InferenceSession(self._model, so, providers=[(CUDA_EP, options), CPU_EP])

    def enqueue(self, stream_handle: int, bindings: Mapping[str, int], shapes: Mapping[str, Shape]) -> None:
        """Run on `stream_handle` over device buffers: `bindings` and `shapes` cover every input and
        output (ONNX Runtime writes outputs into given buffers only when it knows their shapes)."""
        if not self.is_active:
            raise EngineError(f"{self.name}: enqueue before activate()")
        if self.device != "cuda":
            raise MissingDependency(_NO_CUDA)
        if not stream_handle:
            raise RuntimeInputError("ONNX Runtime treats stream 0 as 'no user stream' and would run on its own "
                                    "stream: enqueue on a created CUDA stream")
        sess = self._stream_sessions.get(stream_handle)
        if sess is None:
            sess = self._stream_sessions[stream_handle] = self._session(stream_handle)
        io = sess.io_binding()
        for kind, nodes in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
            for node in nodes:
                if node.name not in bindings or node.name not in shapes:
                    raise RuntimeInputError(f"{self.name}: no device pointer and shape for {kind} '{node.name}'; "
                                            f"the segment's tensors are {_io_names(sess)}")
                bind = io.bind_input if kind == "input" else io.bind_output
                bind(node.name, "cuda", self.device_id, DataType.to_dtype(DataType.from_dtype(node.type, "onnxruntime"),
                                                                         "numpy"),
                     list(shapes[node.name]), int(bindings[node.name]))
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        sess.run_with_iobinding(io, run_options)

    def deactivate(self):
        self._stream_sessions.clear()
        super().deactivate()


def _io_names(sess: ort.InferenceSession) -> list[str]:
    return [n.name for n in (*sess.get_inputs(), *sess.get_outputs())]


_NO_CUDA = ("running ONNX Runtime on a CUDA stream needs onnxruntime-gpu (CUDAExecutionProvider); this ONNX "
            f"Runtime has {', '.join(ort.get_available_providers())}")
