"""Integrations of fastckpt with training frameworks and storage systems."""
