"""ONNX helpers every stage uses: tensor signatures, serialization, shapes, graph navigation,
composition and CPU runs. No stage logic lives here."""
