"""Doctest collection over the package: modules whose optional framework is not installed
(their import would fail with an ImportError naming the extra) are left out."""

import importlib.util

collect_ignore = []
if (
    importlib.util.find_spec("lightning") is None
    and importlib.util.find_spec("pytorch_lightning") is None
):
    collect_ignore += ["fastckpt/lightning.py"]
    collect_ignore_glob = ["fastckpt/integrations/lightning*.py"]
if importlib.util.find_spec("fsspec") is None:
    collect_ignore += ["fastckpt/api.py"]
