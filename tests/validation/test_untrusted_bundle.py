"""A pulled bundle is untrusted: resealed (so read_bundle verifies it) with hostile content, it never
makes ONNX Runtime, validation or `deepjit validate` read or write a file of this machine outside the
bundle, and a malformed manifest is exit 2 naming the field."""
from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from deepjit_compiler.bundle.folder import read_bundle, update_bundle
from deepjit_compiler.bundle.view import BundleView
from deepjit_compiler.errors import BundleError, MissingDependency, OutputError
from deepjit_compiler.runtime.layout import Layout
from deepjit_compiler.runtime.segments import engine_runner
from deepjit_compiler.validation import gpu as gpu_levels_mod

SEGMENT = "engines/segment.onnx"


def resealed(t4_build, folder: Path, files=None, **fields) -> Path:
    """A copy of the T4 bundle with `files` replaced and top-level manifest `fields` set, sealed again."""
    path = shutil.copytree(t4_build.bundle.path, folder)
    update_bundle(path, files or {}, fields)
    return path


def _external(name: str, *locations: str) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (*(("location", loc) for loc in locations), ("offset", "0"), ("length", "16")):
        t.external_data.add(key=key, value=value)
    return t


def _with_external_initializer(model: onnx.ModelProto, location: str) -> bytes:
    model.graph.initializer.append(_external("leak", location))
    return model.SerializeToString()


@pytest.mark.parametrize("location", [".env", "../../secret.bin", "/etc/passwd", "segment.rtx.plan"])
def test_a_segment_naming_external_data_is_refused_before_onnx_runtime_reads_it(t4_build, tmp_path, monkeypatch,
                                                                                location):
    """ONNX Runtime, given a model's bytes, looks for its external data in the working folder: the
    runtime's and the engine level's ONNX Runtime path would read the user's ./.env as weights."""
    segment = onnx.load(str(t4_build.bundle.path / SEGMENT))
    bundle = resealed(t4_build, tmp_path / "b", {SEGMENT: _with_external_initializer(segment, location)})
    (cwd := tmp_path / "cwd").mkdir()
    (cwd / ".env").write_bytes(b"SECRET=hunter2-hunter2")
    monkeypatch.chdir(cwd)
    view = read_bundle(bundle)
    layout = Layout.from_bundle(view)
    step = next(s for s in layout.steps if s.kind == "segment")
    refused = f"'{SEGMENT}' keeps tensor 'leak' in an external file '{location}'"
    with pytest.raises(BundleError, match=refused):
        engine_runner(view, layout, step, engine="onnxruntime", device_sm=None)
    with pytest.raises(BundleError, match=refused):  # onnx.load's own ValidationError was exit 3
        view.onnx(SEGMENT)


def _tiny_bundle(folder: Path, models: dict[str, onnx.ModelProto], extra=None, reference=None) -> BundleView:
    """A BundleView over `models` (and `extra` files) written into `folder` (what file() lists)."""
    files = {}
    for rel, data in {**{r: m.SerializeToString() for r, m in models.items()}, **(extra or {})}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return BundleView(folder, {"files": files, **({"model": {"file": reference}} if reference else {})})


def _identity(graph_nodes, initializers=(), functions=()) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph(graph_nodes, "g", [x], [y], initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                             functions=list(functions))


def _in_subgraph() -> onnx.ModelProto:
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    branch = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "b", [], [out],
                               initializer=[_external("w", ".env")])
    cond = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))
    return _identity([cond, helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)])


def _in_function() -> onnx.ModelProto:
    const = helper.make_node("Constant", [], ["w"], value=_external("w", ".env"))
    fn = helper.make_function("local", "Leak", ["x"], ["y"], [const, helper.make_node("Add", ["x", "w"], ["y"])],
                              [helper.make_opsetid("", 17)])
    return _identity([helper.make_node("Leak", ["x"], ["y"], domain="local")], functions=[fn])


def _in_sparse_initializer() -> onnx.ModelProto:
    model = _identity([helper.make_node("Identity", ["x"], ["y"])])
    indices = numpy_helper.from_array(np.array([1], dtype=np.int64), "w_indices")
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(_external("w", ".env"), indices, [4]))
    return model


def _in_node_attribute() -> onnx.ModelProto:
    return _identity([helper.make_node("Constant", [], ["w"], value=_external("w", ".env")),
                      helper.make_node("Add", ["x", "w"], ["y"])])


def _without_the_external_flag() -> onnx.ModelProto:
    """External data entries on a tensor whose data_location was left DEFAULT: a reader may still follow them."""
    w = _external("w", ".env")
    w.data_location = TensorProto.DEFAULT
    return _identity([helper.make_node("Add", ["x", "w"], ["y"])], [w])


@pytest.mark.parametrize("model", [_in_subgraph, _in_function, _in_sparse_initializer, _in_node_attribute,
                                   _without_the_external_flag],
                         ids=["subgraph", "function", "sparse", "attribute", "flag-unset"])
def test_external_data_is_refused_in_subgraphs_and_functions(tmp_path, model):
    view = _tiny_bundle(tmp_path, {"steps/m.onnx": model()})
    with pytest.raises(BundleError, match="'steps/m.onnx' keeps tensor 'w' in an external file '.env'"):
        view.file("steps/m.onnx")


def test_the_reference_model_reads_its_weights_only_from_bundle_files_beside_it(tmp_path):
    """The build copies the reference model's external weights beside it; nothing else may be named."""
    w = np.arange(4, dtype=np.float32)
    model = _identity([helper.make_node("Add", ["x", "w"], ["y"])], [_external("w", "m.onnx.data")])
    view = _tiny_bundle(tmp_path / "b", {"reference/m.onnx": model}, {"reference/m.onnx.data": w.tobytes()},
                        reference="reference/m.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(view.onnx("reference/m.onnx").graph.initializer[0]), w)
    (tmp_path / "outside.data").write_bytes(w.tobytes())
    for i, locations in enumerate([("../../outside.data",), ("m.onnx.data", "../../outside.data")]):
        outside = _identity([helper.make_node("Add", ["x", "w"], ["y"])], [_external("w", *locations)])
        view = _tiny_bundle(tmp_path / f"c{i}", {"reference/m.onnx": outside}, {"reference/m.onnx.data": w.tobytes()},
                            reference="reference/m.onnx")
        with pytest.raises(BundleError, match="outside.data', which is not one of the bundle's files beside it"):
            view.onnx("reference/m.onnx")


def _spec_with_data(t4_build, data: str) -> bytes:
    text = (t4_build.bundle.path / "spec.yaml").read_text()
    random = "    random:\n      ranges: {images: [0.0, 1.0]}\n"
    assert random in text, "test bug: the T4 spec's validation data changed"
    return text.replace(random, f"    folder: {data}\n").encode()


@pytest.mark.parametrize("folder", ["ABS", "../private", "data/../../private"])
def test_a_bundle_spec_never_points_validation_at_local_files(t4_build, tmp_path, folder):
    (tmp_path / "private").mkdir()
    folder = str(tmp_path / "private") if folder == "ABS" else folder
    view = read_bundle(resealed(t4_build, tmp_path / "b", {"spec.yaml": _spec_with_data(t4_build, folder)}))
    with pytest.raises(BundleError, match="validation.data.folder .* is outside the bundle; a bundle's spec "
                                          "validates on `random` data or on a folder inside the bundle"):
        view.spec()


def test_the_user_names_local_validation_data_with_data(t4_build, tmp_path):
    """What a bundle may not pick, its user may: `--data` (here the bundle was built on local photos)."""
    (tmp_path / "photos").mkdir()
    bundle = resealed(t4_build, tmp_path / "b", {"spec.yaml": _spec_with_data(t4_build, str(tmp_path / "photos"))})
    assert read_bundle(bundle).spec(tmp_path / "photos").validation.data.folder == tmp_path / "photos"
    (tmp_path / "other").mkdir()
    assert read_bundle(bundle).spec(tmp_path / "other").validation.data.folder == tmp_path / "other"
    for command in ("validate", "materialize"):
        r = run_cli(command, str(bundle))
        assert r.returncode == 2 and "is outside the bundle" in r.stderr and "--data" in r.stderr, r.stderr
    r = run_cli("validate", str(bundle), "--data", str(tmp_path / "photos"))  # past the data, to the GPU check
    assert r.returncode == 2 and "outside the bundle" not in r.stderr and "need an NVIDIA GPU" in r.stderr, r.stderr


@pytest.mark.parametrize("change, where", [("  samples: ", "validation.samples"), ("  gate: ", "validation.gatez")])
def test_a_broken_bundle_spec_names_its_line_and_field(t4_build, tmp_path, change, where):
    text = (t4_build.bundle.path / "spec.yaml").read_text()
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(change))
    broken = [ln if i != line else (ln.replace(change, "  samples: -5  #") if "samples" in change
                                    else ln.replace("gate:", "gatez:")) for i, ln in enumerate(text.splitlines(), 1)]
    view = read_bundle(resealed(t4_build, tmp_path / "b", {"spec.yaml": "\n".join(broken).encode() + b"\n"}))
    with pytest.raises(BundleError, match=rf"its spec.yaml is not a valid spec:\nspec.yaml:{line}:\d+: {where}"):
        view.spec()


def test_a_bundle_spec_may_validate_on_data_it_carries(t4_build, tmp_path):
    sample = np.random.default_rng(3).uniform(0, 1, (1, 3, 640, 640)).astype(np.float32)
    files = {"spec.yaml": _spec_with_data(t4_build, "data"), "data/a.npy": _npy(sample)}
    view = read_bundle(resealed(t4_build, tmp_path / "b", files))
    assert view.spec().validation.data.folder == (view.root / "data").resolve()


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


# ----------------------------------------------------------------------------- `deepjit validate`
def test_validate_refuses_a_report_folder_that_is_not_deepjits(t4_build, tmp_path, monkeypatch):
    """`deepjit validate` writes RunResults into <bundle>.report/, as the build does: never into a
    user's own folder of that name, nor through a link."""
    monkeypatch.setattr(gpu_levels_mod, "local_device_sm", lambda: None)
    bundle = shutil.copytree(t4_build.bundle.path, tmp_path / "b")
    report = tmp_path / "b.report"
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"b.report: holds files DeepJIT did not write \(notes.txt\)"):
        gpu_levels_mod.validate_bundle(bundle)
    shutil.rmtree(report)
    (tmp_path / "elsewhere").mkdir()
    report.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutputError, match="b.report: exists and is not a report folder"):
        gpu_levels_mod.validate_bundle(bundle)
    report.unlink()
    report.mkdir()  # DeepJIT's own report: validate goes on (and here stops for want of a GPU)
    (report / "build-report.json").write_text("{}")
    (report / "kernels.decode+nms.runresults.json").write_text("{}")
    with pytest.raises(MissingDependency):
        gpu_levels_mod.validate_bundle(bundle)


def test_a_malformed_manifest_is_exit_2_naming_the_field(t4_build, tmp_path):
    inputs = copy.deepcopy(read_bundle(t4_build.bundle.path).manifest["inputs"])
    inputs["images"]["buckets"] = ["a"]
    bundle = resealed(t4_build, tmp_path / "b", inputs=inputs)
    assert json.loads((bundle / "manifest.json").read_text())["inputs"]["images"]["buckets"] == ["a"]
    r = run_cli("inspect", str(bundle))
    assert r.returncode == 2, r.stderr
    assert "manifest.json 'inputs.images.buckets[0]': Input should be a valid integer, got 'a'" in r.stderr
