"""Adapters that bring fastckpt to other frameworks and storage: Lightning,
torch.distributed.checkpoint, fsspec URLs and Hugging Face sharded directories."""
