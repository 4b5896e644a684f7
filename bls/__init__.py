"""The `tensorrt_llm_bls` model's logic, without Triton: the request flow and stop strings."""
