"""Integrations of fastckpt with other systems: remote storage through fsspec, Hugging Face
sharded checkpoints, and the training frameworks."""
