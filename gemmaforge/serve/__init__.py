"""`gemmaforge serve` and `gemmaforge chat`: runs and models behind the Ollama and OpenAI HTTP APIs."""
