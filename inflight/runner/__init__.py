"""The device side of the engine: the `Worker` (one execute = prepare inputs → run model →
sample), a step's device inputs, CUDA graphs for decode and mixed steps, KV-cache sizing,
start-up compilation, and the tensor-parallel ranks that follow rank 0's worker."""
