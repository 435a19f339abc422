"""Inference engines: the transformers engine (continuous batching, LoRA adapters by name) and the llama.cpp
engine (a GGUF file), with the jobs and events they exchange. `serve` answers HTTP requests through them; they
sit below the stages so that `eval` can answer through them too (it still has its own batched generator: the
engine prefills one request at a time, which made eval 38% slower when tried)."""
