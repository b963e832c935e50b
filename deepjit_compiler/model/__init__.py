"""The ONNX model a spec names: resolved (loaded, or synthesized when missing), checked against the
spec's inputs, and described (`deepjit inspect MODEL`)."""
