"""LoRA supervised fine-tuning with transformers + PEFT: the training library (wrapping, loss, packing, patches,
the memory planner) and the train recipe (trainer.py, troubleshoot.py)."""
