"""gemmaforge: from an instruction dataset to a LoRA-tuned Gemma answering in Ollama.

Layers, bottom up (docs/architecture.md; checked by tests/unit/test_layers.py): core (errors, console, units,
families, templates, config, distributed, runs, model_spec, models) -> system (this machine) -> the training
library (train/) -> stages (data/, the train recipe, export/, evaluate/) -> pipeline -> front ends (cli, serve/,
doctor).
"""

__version__ = "0.1.0"
