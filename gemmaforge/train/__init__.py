"""The training library: LoRA wrapping, loss, packing and collation, the patches, precision, checkpoints and the
memory planner. The train stage's recipe that assembles them is `gemmaforge.recipe`."""
