"""Quantized HF checkpoints (config.json's `quantization_config`: GPTQ, AWQ,
compressed-tensors, fp8) read into quant/tensor.py's QuantizedTensor forms
without widening to float; see source.py."""
