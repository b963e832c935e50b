"""A bundle on one CUDA stream: `Pipeline.load(bundle)`, buffers allocated once, a CUDA graph per batch
bucket; `deepjit run` and `deepjit bench` on top of it."""
