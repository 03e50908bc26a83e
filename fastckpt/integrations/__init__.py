"""Adapters that bring fastckpt to other frameworks; they use only fastckpt's public names."""
