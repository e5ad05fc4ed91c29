"""`pocketllm bench …`: benchmarks anyone can rerun. Each prints a short table last."""
