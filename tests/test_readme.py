"""The README's own-kernel example compiles as shown (the README stays true)."""
import re

from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel


def test_readme_kernel_example_compiles(tmp_path):
    blocks = dict((b.splitlines()[0], b) for b in re.findall(r"```(?:yaml|cuda)\n(.*?)```",
                                                          (REPO / "README.md").read_text(), re.S))
    folder = tmp_path / "my_kernels"
    folder.mkdir()
    (folder / "scale.yaml").write_text(blocks["# my_kernels/scale.yaml"])
    (folder / "scale.cu.j2").write_text(blocks["// my_kernels/scale.cu.j2"])
    kernel = compile_site_kernel("my_kernels/scale.yaml", {"factor": 3.0}, None, sm=75, spec_dir=tmp_path,
                                 cache_dir=tmp_path / "cache")
    assert kernel.symbol("scale") == "scale_kernel"
    assert kernel.cubin[:4] == b"\x7fELF" and ".entry scale_kernel" in kernel.ptx
    assert "0x1.8p+1" in kernel.source.code.replace("0x1.8000000000000p+1", "0x1.8p+1")  # factor 3.0 baked in


def _section_table(text: str, lead: str) -> str:
    """The table that follows the line starting with `lead`."""
    after = text.split(lead, 1)[1]
    return next(block for block in after.split("\n\n") if block.lstrip().startswith("|"))


def test_readme_lists_the_manifests_top_level_keys(t4_build):
    from deepjit_compiler.bundle.folder import read_bundle

    table = _section_table((REPO / "README.md").read_text(), "`manifest.json` has these top-level keys")
    keys = {k for row in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \|", table, re.M) for k in re.findall(r"`(\w+)`", row)}
    assert keys == set(read_bundle(t4_build.bundle.path).manifest)


def test_readme_commands_and_their_options_exist():
    """Every command of the README's command-line table, with every option it shows, is in the CLI."""
    import click
    from click.testing import CliRunner

    from deepjit_compiler.cli import cli

    table = _section_table((REPO / "README.md").read_text(), "## Command line")
    rows = re.findall(r"^\| `deepjit ([^`]+)` \|", table, re.M)
    assert len(rows) >= 12
    for usage in rows:
        command, group = [], cli
        for word in usage.split():  # down through the groups: `model synth`, `export triton`
            if not isinstance(group, click.Group) or word not in group.commands:
                break
            command.append(word)
            group = group.commands[word]
        assert command, f"README shows `deepjit {usage}`, which is no command"
        result = CliRunner().invoke(cli, [*command, "--help"])
        assert result.exit_code == 0, (usage, result.output)
        for option in re.findall(r"--[a-z-]+", usage):
            assert option in result.output, f"README shows `deepjit {usage}`, but {option} is not an option"


def test_readme_cut_with_its_own_kernel_builds(tmp_path):
    """The README's `cuts:` example, verbatim, with its contract and template, on a model where t [N, 64]
    becomes y = 2 * t: the build cuts that region out and compiles the user's kernel in its place."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from deepjit_compiler.build import build_pipeline

    text = (REPO / "README.md").read_text()
    blocks = dict((b.splitlines()[0], b) for b in re.findall(r"```(?:yaml|cuda)\n(.*?)```", text, re.S))
    (folder := tmp_path / "my_kernels").mkdir()
    (folder / "scale.yaml").write_text(blocks["# my_kernels/scale.yaml"])
    (folder / "scale.cu.j2").write_text(blocks["// my_kernels/scale.cu.j2"])
    bias = numpy_helper.from_array(np.random.default_rng(5).standard_normal(64).astype(np.float32), "bias")
    two = numpy_helper.from_array(np.float32(2.0).reshape(()), "two")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["a"]), helper.make_node("Relu", ["a"], ["t"]),
         helper.make_node("Mul", ["t", "two"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])], [bias, two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "spec.yaml").write_text(
        "name: scaled\nmodel: {path: m.onnx}\ntarget: {gpu: T4}\n"
        "inputs:\n  x: {shape: [N, 64], profile: {min: [1, 64], opt: [2, 64], max: [4, 64]}}\n"
        + blocks["cuts:"] + "bundle: {path: out/scaled}\n")
    result = build_pipeline(tmp_path / "spec.yaml", publish=False)
    steps = result.bundle.manifest["plan"]["steps"]
    assert [(s["name"], s["kind"]) for s in steps] == [("segment", "segment"), ("scale", "kernel")]
    (kernel,) = steps[1]["kernels"]
    assert kernel["contract"] == "scale" and kernel["params"]["factor"] == 2.0
    assert result.bundle.manifest["validation"]["levels"]["graph"]["status"] == "passed"
