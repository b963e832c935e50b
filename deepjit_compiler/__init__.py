"""DeepJIT: a declarative pipeline compiler for GPU inference."""

__version__ = "0.1.0"
