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
