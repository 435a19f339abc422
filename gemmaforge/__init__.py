"""gemmaforge: from an instruction dataset to a LoRA-tuned Gemma answering in Ollama."""

__version__ = "0.1.0"
