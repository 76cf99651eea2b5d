"""Pure PyTorch: the model, FSDP2 wrapping, the per-worker loop, DCP checkpoints, evaluation. No Prefect."""
