"""Lightning checkpoints written and read by fastckpt.

Three ways in, from the most explicit to the shortest:

- :class:`FastCkptIO`: a Lightning ``CheckpointIO`` plugin, ``Trainer(plugins=[FastCkptIO()])``.
  Every checkpoint the Trainer saves becomes a fastckpt (safetensors) file, written with
  direct I/O and committed atomically.
- :class:`AsyncFastCkptIO`: the same, but the training loop waits only for the snapshot of
  the tensors (:func:`fastckpt.async_save`); the write goes on in the background.
- :class:`FastCkptCheckpoint`: a ``ModelCheckpoint`` that installs :class:`AsyncFastCkptIO`
  for its Trainer, ``Trainer(callbacks=[FastCkptCheckpoint(dirpath=..., every_n_train_steps=500)])``.

What is stored, and how (no pickle by default):

- The checkpoint goes through fastckpt's tree (:mod:`fastckpt.checkpoint.tree`), one
  encoding for every object: tensors, dicts (also with int keys), OrderedDicts with their
  ``_metadata``, lists, tuples, None, bool, int, float, str, bytes,
  ``torch.dtype``/``Size``/``device``, and the configuration objects hyper-parameters come
  in: ``AttributeDict``, ``argparse.Namespace``, OmegaConf ``DictConfig``/``ListConfig``
  (unresolved, so interpolations survive) and the class Lightning stores beside OmegaConf
  hyper-parameters (``hparams_type``). Rebuilding never imports anything by a name read
  from the file: those classes are a fixed table. A default ``LightningModule`` saves and
  resumes with ``trainer.fit(ckpt_path=...)`` out of the box.
- The model's weights are stored under their own ``state_dict`` keys, so
  ``safetensors.torch.load_file(path)`` returns the ``state_dict`` (tied weights under
  each of their names) and, with ``save_weights_only=True``, nothing else; the rest
  (epoch, global step, hyper-parameters...) is in the tree, in the file's metadata.
- A hyper-parameter that is no data (a file system object, a loss module, a class) is left
  out of the checkpoint with one warning naming it, so that no run ends at its first
  checkpoint; pass it again to ``load_from_checkpoint``. Anything else that is no data is
  refused with a ``TypeError`` that names where it sits in the checkpoint.
  ``allow_pickle=True`` stores such objects pickled instead, each marked as such in the
  file; loading them then needs ``weights_only=False`` (``trainer.fit(...,
  weights_only=False)``), since unpickling can run code.
- OmegaConf values resolve ``${...}`` interpolations when read, and a resolver can read
  the environment (``oc.env``) or run any code the program registered. Loading with the
  default ``weights_only`` therefore refuses an OmegaConf value that would call a resolver
  (:class:`~fastckpt.errors.WeightsOnlyError`, as ``torch.load(weights_only=True)`` refuses
  what it cannot load safely), and so does :func:`load_from_checkpoint` for plain
  hyper-parameters that Lightning would turn into a ``DictConfig``; node interpolations
  (``${model.width}``) are kept. ``weights_only=False`` loads them as saved.

Loading reads fastckpt files and, for a smooth switch, also files written by
``torch.save`` (Lightning's default format, any pickle protocol), which it hands to
``TorchCheckpointIO``.

Files are plain fastckpt files: ``fastckpt.load(path)`` reads them outside Lightning (the
same objects, types included), ``fastckpt verify`` checks them, every safetensors reader
opens them. Paths are local files or fsspec URLs (``s3://``, ``memory://``; ``https://`` to
read). ``MyModule.load_from_checkpoint(path)`` reads them once this module is imported (it
recognizes a fastckpt file by its first bytes and leaves every other file to Lightning's own
loader); a Trainer without these plugins, or a process that never imported this module, reads
with ``torch.load`` and cannot: use :func:`load_from_checkpoint`, :class:`FastCkptLoadingMixin`
or the plugins.
Strategies that write sharded checkpoints themselves (FSDP, DeepSpeed) bypass
``CheckpointIO``; these classes serve single-file strategies (single device, DDP, rank 0
writes). The modules ``lightning_framework``, ``lightning_checkpoint_io``, ``lightning_loading``,
``lightning_async_checkpoint_io``, ``lightning_manager_checkpoint_io`` and
``lightning_callback`` beside this one hold the parts; the public names are here and in
:mod:`fastckpt.lightning`. The classes derive from ``lightning``'s; the plugins are also registered with the
standalone ``pytorch_lightning`` package, so its ``Trainer`` accepts them too.

Example:
    >>> import lightning.pytorch as pl
    >>> from fastckpt.lightning import AsyncFastCkptIO
    >>> trainer = pl.Trainer(plugins=[AsyncFastCkptIO()], logger=False, enable_progress_bar=False)
"""

from fastckpt.integrations.lightning_async_checkpoint_io import AsyncFastCkptIO
from fastckpt.integrations.lightning_callback import FastCkptCheckpoint
from fastckpt.integrations.lightning_checkpoint_io import CheckpointNotFoundError, FastCkptIO
from fastckpt.integrations.lightning_loading import FastCkptLoadingMixin, load_from_checkpoint

__all__ = [
    "FastCkptIO",
    "AsyncFastCkptIO",
    "FastCkptCheckpoint",
    "FastCkptLoadingMixin",
    "CheckpointNotFoundError",
    "load_from_checkpoint",
]
