"""Export stages: merge the adapter, write GGUF files, write the Ollama Modelfile."""
