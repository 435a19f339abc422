"""Facts about this machine: GPUs and their tools, ROCm, memory, the attention kernels that run here."""
