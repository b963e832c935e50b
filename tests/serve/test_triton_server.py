"""A real Triton Inference Server (nvidia-pytriton's tritonserver, on 127.0.0.1) serving exported bundles,
queried with tritonclient over HTTP and gRPC: the detections equal `deepjit run --device cpu` on the same
inputs, bad requests get Triton's errors (or DeepJIT's, as the request's own) and the server keeps
serving, and concurrent requests are batched. Skips, with the reason, where the server cannot start.

The models run in this test's own Python environment (EXECUTION_ENV_PATH = sys.prefix): it must be a
virtual environment with numpy < 2 (the test extra's nvidia-pytriton pins it), as any serving
environment of Triton's Python backend must be. DEEPJIT_TRITON_ENV names another one (a machine whose
own numpy is 2: bench/h200_check.sh's triton part makes one)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import HAS_GPU, run_cli
from PIL import Image

from deepjit_compiler.errors import MissingDependency
from deepjit_compiler.runtime.run import run_bundle
from deepjit_compiler.serve.local import LocalTritonServer, statistics_after
from deepjit_compiler.serve.triton import TritonOptions, export_triton
from deepjit_compiler.surgery.references import letterbox_numpy

grpc = pytest.importorskip("tritonclient.grpc", reason="the test queries the server with tritonclient")
from tritonclient.utils import InferenceServerException  # noqa: E402  (after the skip above)

try:
    import tritonclient.http as http
    NO_HTTP = ""
except (ImportError, RuntimeError) as e:  # tritonclient without its http extra (gevent): the gRPC tests still run
    http, NO_HTTP = None, f"tritonclient's HTTP client is not installed here ({e})"

SLOW_QUEUE_US = 2_000_000   # the batching model waits up to 2 s for a second request


def serving_env() -> str:
    """DEEPJIT_TRITON_ENV, else this environment if Triton's Python backend can run DeepJIT from it; else
    skip saying why."""
    if not sys.platform.startswith("linux"):
        pytest.skip("nvidia-pytriton's tritonserver runs on Linux only")
    if os.environ.get("DEEPJIT_TRITON_ENV"):
        return os.environ["DEEPJIT_TRITON_ENV"]
    if sys.prefix == sys.base_prefix:
        pytest.skip("the models run in this Python environment (EXECUTION_ENV_PATH needs a virtual environment's "
                    "bin/activate): run the tests in a venv")
    if int(np.__version__.split(".")[0]) >= 2:
        pytest.skip(f"numpy {np.__version__} here: Triton's Python backend needs numpy < 2 in the model's "
                    "environment (the test extra's nvidia-pytriton brings numpy < 2)")
    return sys.prefix


def start(repo: Path, tmp: Path) -> LocalTritonServer:
    try:
        return LocalTritonServer(repo, log_file=tmp / "tritonserver.log").start()
    except MissingDependency as e:  # no pytriton, no stub for this Python, or a server that cannot run here
        pytest.skip(f"no Triton server here: {e}")


def bgr(png: Path) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(Image.open(png).convert("RGB"))[..., ::-1])


@pytest.fixture(scope="module")
def server(real_bundles, tmp_path_factory):
    env = serving_env()
    tmp = tmp_path_factory.mktemp("triton")
    repo = tmp / "repo"
    export_triton(real_bundles["gpu_letterbox"], repo, TritonOptions(name="images", kind="cpu", env=env))
    export_triton(real_bundles["host_letterbox"], repo, TritonOptions(name="tensors", kind="cpu", env=env,
                                                                     max_queue_delay_us=SLOW_QUEUE_US))
    srv = start(repo, tmp)
    yield srv
    srv.close()
    assert not list(Path("/dev/shm").glob(srv.shm_prefix + "*")), "shared memory regions left behind"


def client_module(protocol: str):
    """tritonclient's module for the protocol; skip when its HTTP client is not installed."""
    if protocol == "http" and http is None:
        pytest.skip(NO_HTTP)
    return http if protocol == "http" else grpc


def infer(protocol, url: str, model: str, name: str, array: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    module = client_module(protocol)
    # Closed on leaving: an open keep-alive connection holds the server's shutdown for its 30 s exit timeout.
    with module.InferenceServerClient(url) as client:
        inp = module.InferInput(name, list(array.shape), dtype)
        inp.set_data_from_numpy(array)
        result = client.infer(model, [inp])
        return {k: result.as_numpy(k) for k in ("num_dets", "boxes", "scores", "classes")}


def same_as_run(got: dict[str, np.ndarray], row: int, record: dict) -> None:
    """A server answer's row against `deepjit run`'s record (which rounds boxes to 3 decimals, scores to 6)."""
    n = int(got["num_dets"][row, 0])
    assert n == record["num_dets"] > 0, record["source"]
    assert [int(c) for c in got["classes"][row, :n]] == [d["class"] for d in record["detections"]]
    np.testing.assert_allclose(got["scores"][row, :n], [d["score"] for d in record["detections"]], atol=1e-6)
    np.testing.assert_allclose(got["boxes"][row, :n], [d["box"] for d in record["detections"]], atol=1e-3)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_raw_images_get_the_detections_of_deepjit_run_on_the_cpu(server, real_bundles, photos, protocol):
    pngs = list(photos.values())
    records = run_bundle(real_bundles["gpu_letterbox"], pngs, device="cpu")["results"]
    url = server.http_url if protocol == "http" else server.grpc_url
    for png, record in zip(pngs, records):
        got = infer(protocol, url, "images", "raw_images", bgr(png)[None], "UINT8")
        assert got["boxes"].shape == (1, 100, 4) and got["num_dets"].shape == (1, 1)
        same_as_run(got, 0, record)


def test_a_request_of_two_images_equals_deepjit_run_on_both(server, real_bundles, photos, tmp_path):
    image = bgr(photos["astronaut"])
    batch = np.stack([image, np.ascontiguousarray(image[:, ::-1])])
    np.save(tmp_path / "two.npy", batch)
    proc = run_cli("run", str(real_bundles["gpu_letterbox"]), "--device", "cpu", "-i", str(tmp_path / "two.npy"),
                   "--json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)["results"]
    got = infer("http", server.http_url, "images", "raw_images", batch, "UINT8")
    for row, record in enumerate(records):
        same_as_run(got, row, record)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, real_bundles, photos, tmp_path):
    pngs = [photos["coffee"], photos["chelsea"]]
    tensors = np.concatenate([letterbox_numpy(bgr(p)[None], size=320, swap_rb=True)["images"] for p in pngs])
    np.save(tmp_path / "tensors.npy", tensors)
    records = run_bundle(real_bundles["host_letterbox"], [tmp_path / "tensors.npy"], device="cpu")["results"]
    with client_module("http").InferenceServerClient(server.http_url, concurrency=2) as client:
        before = client.get_inference_statistics("tensors")["model_stats"][0]
        pending = []
        for i in range(2):
            inp = http.InferInput("images", [1, 3, 320, 320], "FP32")
            inp.set_data_from_numpy(tensors[i:i + 1])
            pending.append(client.async_infer("tensors", [inp]))
        results = [p.get_result() for p in pending]   # once each: a result reads its response as it is parsed
        answers = [{k: r.as_numpy(k) for k in ("num_dets", "boxes", "scores", "classes")} for r in results]
        after = statistics_after(lambda: client.get_inference_statistics("tensors")["model_stats"][0], before,
                                 {"inference_count": 2, "execution_count": 1})
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 2
    assert int(after["execution_count"]) - int(before.get("execution_count", 0)) == 1   # one batch of two
    for answer, record in zip(answers, records):
        assert record["boxes_in"] == "input"
        same_as_run(answer, 0, record)


def test_the_load_benchmark_counts_every_request_it_sent(server):
    """bench/triton_load.py's statistics cover its last execution too (read after the clients return,
    they could miss it, and its mean batch with it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import triton_load

    image = np.random.default_rng(3).uniform(0, 1, (1, 3, 320, 320)).astype(np.float32)
    r = triton_load.load(server.grpc_url, "tensors", [("images", image, "FP32")], clients=2, requests=4)
    assert (r["requests"], r["errors"]) == (4, 0)
    assert r["inferences"] == 4
    assert 2 <= r["executions"] <= 4 and r["mean_batch"] == 4 / r["executions"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_errors_and_the_server_keeps_serving(server, photos, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    image = bgr(photos["chelsea"])[None]
    rng = np.random.default_rng(3)
    bad = [(image.astype(np.float32), "FP32", "data-type is 'FP32', but model 'images' expects 'UINT8'"),
           (np.ascontiguousarray(image[..., :2]), "UINT8", "unexpected shape for input 'raw_images'"),
           (np.repeat(image, 3, 0), "UINT8", "batch-size must be <= 2"),
           (rng.integers(0, 256, (1, 16, 16, 3), dtype=np.uint8), "UINT8",
            "input 'raw_images' dim 1 is 16, allowed 32..1024")]     # DeepJIT's own check, the request's error
    for array, dtype, message in bad:
        with pytest.raises(InferenceServerException) as e:
            infer(protocol, url, "images", "raw_images", array, dtype)
        assert message in e.value.message()
    assert server.alive()
    assert int(infer(protocol, url, "images", "raw_images", image, "UINT8")["num_dets"][0, 0]) > 0


@pytest.mark.gpu
def test_kind_gpu_instances_serve_from_the_gpu(real_bundles, photos, tmp_path):
    """On a GPU machine: the bundle (built for this GPU) served by a KIND_GPU instance equals `deepjit run`
    of it on this GPU."""
    if not HAS_GPU:
        pytest.skip("needs an NVIDIA GPU")
    env = serving_env()
    export_triton(real_bundles["gpu_letterbox"], tmp_path / "repo", TritonOptions(name="images", kind="gpu",
                                                                                gpus=(0,), env=env))
    pngs = list(photos.values())
    records = run_bundle(real_bundles["gpu_letterbox"], pngs, device="gpu")["results"]
    srv = start(tmp_path / "repo", tmp_path)
    try:
        for png, record in zip(pngs, records):
            same_as_run(infer("grpc", srv.grpc_url, "images", "raw_images", bgr(png)[None], "UINT8"), 0, record)
        assert "GPU device 0" in srv.log_file.read_text()
    finally:
        srv.close()
