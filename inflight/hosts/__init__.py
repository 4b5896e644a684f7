"""What drives an `LLMEngine`: the Executor-interface thread (`executor.py`), the engine process
behind the `tensorrt_llm` model (`engine_process.py`), the offline `ModelRunner`
(`runtime.py`), and the choice between the builtin engine and TensorRT-LLM (`backend.py`)."""
