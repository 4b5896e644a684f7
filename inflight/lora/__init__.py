"""LoRA adapters: their weights (`adapter`), the formats they arrive in (HF PEFT folders,
`peft`; TensorRT-LLM's `lora_weights` / `lora_config` rows, `nvidia`), the bounded cache of
adapters by task id (`cache`), and how a step applies them (`batch`)."""
