"""Torch side of lantern: model definitions, checkpoint loading, codebook neighbours, ONNX export."""
