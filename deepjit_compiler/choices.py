"""The values an option takes both on the command line and in the API: here, so that the CLI can offer them
without importing the stages that act on them (`deepjit --help` starts in a fraction of a second)."""
from __future__ import annotations

ENGINE_CHOICES = ("auto", "plan", "onnxruntime")  # how a bundle's segments run (runtime/segments.py)
DEVICES = ("gpu", "cpu")                           # where `run` and `bench` run a bundle (runtime/run.py)
KINDS = ("gpu", "cpu")                             # Triton instance kinds (serve/triton.py)
