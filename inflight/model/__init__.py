"""Model code: config, RoPE, paged attention, the Llama-family decoder and its loader."""
