"""The engine's ground: TensorRT-LLM's Executor-interface types (`Request`, `Response`,
`SamplingConfig`, ...), its configs (`ExecutorConfig`, ...), iteration stats and which request
features an engine has. Everything else in `inflight/` and its adapters import these; this
package imports nothing of `inflight/`. No torch."""
