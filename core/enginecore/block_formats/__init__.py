"""Quantized block formats shared by the linear methods and loaders: GGUF's files, its
32-element and K-quant blocks."""
