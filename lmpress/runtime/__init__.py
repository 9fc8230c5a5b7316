"""lmpress's compact runtime: a Llama-family decoder with fused kernels, a static KV cache and speculative decoding."""
