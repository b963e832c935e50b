"""The ONNX Runtime backend: the portable engine, and what validates every other one.

Building is the segment's ONNX itself (checked to load). The runner is an ONNX Runtime
InferenceSession on the CPU, or on the CUDA execution provider when onnxruntime-gpu is installed.
On CUDA, `enqueue` binds our device buffers with IO binding and runs on our stream through the
provider option `user_compute_stream` (ONNX Runtime >= 1.17), with the run option
`disable_synchronize_execution_providers` so the call returns without waiting for the stream.
ONNX Runtime fixes a session's stream when it creates the session, so there is one session per
stream (and, for its own CUDA graph, per set of buffers); a binding is made once per set of
buffers. TF32 is off unless the spec's engine.tf32 allows it. Written against ONNX Runtime's
documented Python API (IOBinding.bind_input/bind_output, InferenceSession.run_with_iobinding, the
CUDA provider options use_tf32 and enable_cuda_graph); onnxruntime-gpu is not installed on the
machines DeepJIT is developed on, so the CUDA path runs only where it is (the H200).
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
    log.info("segment '%s': ONNX Runtime engine (%d bytes)", segment_name, len(data))
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
                 name: str | None = None, tf32: bool = False):
        super().__init__(self._session, name=name)  # first: Polygraphy's __del__ reads its attributes
        if device not in DEVICES:
            raise EngineError(f"ONNX Runtime device must be one of {', '.join(DEVICES)}, got '{device}'")
        if device == "cuda" and not cuda_available():
            raise MissingDependency(_NO_CUDA)
        self._model = _model_bytes(model)
        self.device = "cuda" if device == "cuda" or (device == "auto" and cuda_available()) else "cpu"
        self.device_id = device_id
        self.tf32 = tf32
        self._stream_sessions: dict[int, ort.InferenceSession] = {}
        self._bound: dict[tuple, tuple] = {}  # (stream, own graph, bindings, shapes) -> (session, IO binding)
        self._graphless = False  # set when ONNX Runtime refused a CUDA graph for this model

    def describe(self) -> str:
        """What runs the segment, for `run`/`bench`/the build: e.g. 'cuda (ONNX Runtime 1.31.1, tf32 off)'."""
        return f"{self.device} (ONNX Runtime {ort.__version__}" + \
            (f", tf32 {'on' if self.tf32 else 'off'})" if self.device == "cuda" else ")")

    def output_shapes(self, input_shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        """ONNX Runtime tells output shapes only by running: none here (the runtime works them out)."""
        return {}

    @property
    def own_graphs(self) -> bool:
        """Whether `enqueue(own_graph=True)` can replay ONNX Runtime's own CUDA graph (its CUDA provider)."""
        return self.device == "cuda" and not self._graphless

    def _session(self, stream_handle: int | None = None, cuda_graph: bool = False) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.device == "cpu":
            return ort.InferenceSession(self._model, so, providers=[CPU_EP])
        # TF32 convolutions and matmuls are ONNX Runtime's default on Ampere and newer; an fp32 segment
        # means fp32 unless the spec's engine.tf32 allows it (1e-3 relative error, measured as 1.19 abs).
        options = {"device_id": str(self.device_id), "use_tf32": "1" if self.tf32 else "0"}
        if stream_handle is not None:
            options.update(has_user_compute_stream="1", user_compute_stream=str(stream_handle))
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        _preload_cuda_libraries()
        sess = ort.InferenceSession(self._model, so, providers=[(CUDA_EP, options), CPU_EP])
        if sess.get_providers()[0] != CUDA_EP:  # ONNX Runtime falls back to the CPU with only a log line
            raise EngineError(f"{self.name}: ONNX Runtime could not start its CUDA provider (CUDA or cuDNN "
                              f"libraries not found?); it has {', '.join(sess.get_providers())}")
        return sess

    def enqueue(self, stream_handle: int, bindings: Mapping[str, int], shapes: Mapping[str, Shape], *,
                own_graph: bool = False) -> None:
        """Run on `stream_handle` over device buffers: `bindings` and `shapes` cover every input and
        output (ONNX Runtime writes outputs into given buffers only when it knows their shapes).
        own_graph: through ONNX Runtime's CUDA graph (enable_cuda_graph), captured on its first runs
        and replayed after; it needs the same buffers every run, so there is one session per binding."""
        if not self.is_active:
            raise EngineError(f"{self.name}: enqueue before activate()")
        if self.device != "cuda":
            raise MissingDependency(_NO_CUDA)
        if not stream_handle:
            raise RuntimeInputError("ONNX Runtime treats stream 0 as 'no user stream' and would run on its own "
                                    "stream: enqueue on a created CUDA stream")
        key = (stream_handle, own_graph and not self._graphless, tuple(sorted(bindings.items())),
               tuple(sorted((k, tuple(v)) for k, v in shapes.items())))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._bind(self._session_for(stream_handle, key[1]), bindings, shapes)
        sess, io = bound
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        try:
            sess.run_with_iobinding(io, run_options)
        except Exception:
            if key[1]:  # its own graph could not be captured: none for this model from now on
                self._graphless = True
                del self._bound[key]
            raise

    def _session_for(self, stream_handle: int, cuda_graph: bool) -> ort.InferenceSession:
        if not cuda_graph:
            sess = self._stream_sessions.get(stream_handle)
            if sess is None:
                sess = self._stream_sessions[stream_handle] = self._session(stream_handle)
            return sess
        try:
            return self._session(stream_handle, cuda_graph=True)
        except Exception as e:  # e.g. a node ONNX Runtime places on the CPU: no CUDA graph for the session
            log.warning("%s: ONNX Runtime cannot run it as a CUDA graph (%s); running it plainly",
                        self.name, str(e).splitlines()[0][:200])
            self._graphless = True
            return self._session_for(stream_handle, False)

    def _bind(self, sess: ort.InferenceSession, bindings: Mapping[str, int], shapes: Mapping[str, Shape]):
        io = sess.io_binding()
        for kind, nodes in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
            for node in nodes:
                if node.name not in bindings or node.name not in shapes:
                    raise RuntimeInputError(f"{self.name}: no device pointer and shape for {kind} '{node.name}'; "
                                            f"the segment's tensors are {_io_names(sess)}")
                bind = io.bind_input if kind == "input" else io.bind_output
                dtype = DataType.to_dtype(DataType.from_dtype(node.type, "onnxruntime"), "numpy")
                bind(node.name, "cuda", self.device_id, dtype, list(shapes[node.name]), int(bindings[node.name]))
        return sess, io

    def deactivate(self):
        self._bound.clear()
        self._stream_sessions.clear()
        super().deactivate()


_preloaded = False


def _preload_cuda_libraries() -> None:
    """Once per process, before the first CUDA session: onnxruntime-gpu finds CUDA and cuDNN from the
    nvidia-* wheels (or PyTorch's) only when asked to (`preload_dlls`, ONNX Runtime >= 1.21), and its
    default logger is quieted."""
    global _preloaded
    if not _preloaded:
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        # The CUDA provider logs to stdout through ONNX Runtime's default logger: each cuDNN frontend
        # plan it tries and drops ("No execution plans support the graph", dozens per session) and a
        # plugin-device warning per session. A failure that matters raises with its message anyway.
        ort.set_default_logger_severity(4)
    _preloaded = True


def _io_names(sess: ort.InferenceSession) -> list[str]:
    return [n.name for n in (*sess.get_inputs(), *sess.get_outputs())]


_NO_CUDA = ("running ONNX Runtime on a CUDA stream needs onnxruntime-gpu (CUDAExecutionProvider); this ONNX "
            f"Runtime has {', '.join(ort.get_available_providers())}")
