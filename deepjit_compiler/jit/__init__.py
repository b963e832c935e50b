"""JIT kernels: a contract (kernels/*.yaml) and its params in, rendered CUDA (sandboxed Jinja) out,
compiled by NVRTC into a cubin for the target SM plus PTX, through an on-disk cache."""
