"""Serving a bundle: `deepjit export triton` writes a Triton Inference Server model repository whose
Python-backend model loads the bundle with the runtime (GPU or CPU) and answers batches of requests."""
