"""The server's routes, one router per kind: completions, embeddings, model listings, Ollama's model admin and
vLLM's adapter loading. Each route takes the app's state (gemmaforge/serve/state.py) as a dependency."""
