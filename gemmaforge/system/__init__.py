"""What the machine offers training: GPU readings, memory plans and activation counts."""
