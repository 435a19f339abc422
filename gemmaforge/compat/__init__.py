"""Other tools' configurations read in gemmaforge's terms: LLaMA-Factory's training and merge YAMLs
(llamafactory.py)."""
