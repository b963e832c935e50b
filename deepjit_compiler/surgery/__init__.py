"""Graph surgery: the model and the spec's cuts in, a `Plan` out (engine segments, kernel sites,
added stages, each with the ONNX reference its kernel must match); also `suggest` for new cuts."""
