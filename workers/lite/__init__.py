"""The torch-free CPU worker for GGUF checkpoints (docs/cpu_kernels.md)."""
