"""The value types of compressed weights, below every package that makes, stores or runs them.

``scheme``: ``QuantScheme`` and ``QuantizedWeight`` (codes, scales, zeros, act-order ``g_idx``), the one packed
form every method writes and every exporter and the runtime read; ``pack``: the formats' bit layouts;
``qlinear``: ``QuantizedLinear``; ``apply``: putting a quantized weight into a model; ``float8`` and
``int8_linear``: FP8 and W8A8 layers; ``kquant``: llama.cpp's k-quant scale grid.
"""
