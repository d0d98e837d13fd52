"""Torch side of lantern: model definitions, checkpoint loading, codebook neighbors, ONNX export."""
