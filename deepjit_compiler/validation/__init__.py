"""The accuracy gate: the plan, its engine segments and kernels in, one `LevelResult` per validation
level out (graph, precision, kernels, end_to_end, engine), compared with Polygraphy against ONNX Runtime."""
