"""The train stage: the recipe that turns a prepared dataset and a base model into a run's adapter (trainer.py),
and the diagnoses it gives when training goes wrong (troubleshoot.py). It assembles the parts in `train/`."""
