"""lmpress's compact runtime: its own Llama-family decoder, a static KV cache, sampling and speculative decoding."""
