"""Inference engines: the transformers engine (continuous batching, LoRA adapters by name) and the llama.cpp
engine (a GGUF file), with the jobs and events they exchange. `serve` answers HTTP requests through them and
`eval` answers its suite and probes through them, so eval measures what is served."""
