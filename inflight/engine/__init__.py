"""The request side of the engine: `LLMEngine` (one step = schedule → execute → update), the
intake that checks and admits requests, each live request's state and responses (beam search's
too), and a step's sampled tokens turned into responses. It drives a `runner.Worker` and holds
no CUDA of its own."""
