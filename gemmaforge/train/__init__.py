"""The training stage: LoRA supervised fine-tuning with transformers + PEFT."""
