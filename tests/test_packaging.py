"""kernels/ and templates/ are found from a checkout and from an installed wheel."""
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

from deepjit_compiler.config import data_dir


def test_checkout_finds_data():
    assert data_dir("kernels") == REPO / "kernels"
    assert (data_dir("templates") / "yolov8_decode.cu.j2").is_file()


@pytest.mark.slow
def test_wheel_carries_kernels_and_templates(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("deepjit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for kernel in ("yolov8_decode", "nms", "letterbox"):
        assert f"deepjit_compiler/_data/kernels/{kernel}.yaml" in names
        assert f"deepjit_compiler/_data/templates/{kernel}.cu.j2" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from deepjit_compiler.config import data_dir; from deepjit_compiler.jit.contracts import load_contract;"
            "print(data_dir('kernels')); print(load_contract('nms').template_path)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    kernels, template = r.stdout.split()
    assert kernels == str(site / "deepjit_compiler/_data/kernels")
    assert template == str(site / "deepjit_compiler/_data/templates/nms.cu.j2")
