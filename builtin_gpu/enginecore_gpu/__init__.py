"""The GPU backend's quantized projections: weights kept in their blocks on the device and
multiplied by Triton kernels.

Registered as the ``gguf_triton`` linear method (``plugin.py``), which the model runner picks
on CUDA for GGUF files, AWQ / GPTQ checkpoints and ``model.quantization: int8``.
"""
