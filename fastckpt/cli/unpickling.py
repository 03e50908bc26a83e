"""Unpickling a trusted file from the command line (``--allow-pickle``) as ``python -m`` would.

A pickle names the classes it holds by module. ``python -m fastckpt`` finds a module in the
working directory because ``python -m`` puts that directory first on ``sys.path``; the
``fastckpt`` console script does not, and so failed where ``python -m`` worked. With
``--allow-pickle`` both now import from the working directory, and a module that still
cannot be found is one line naming it and the fix, not a traceback.

Example:
    >>> import os, sys
    >>> with trusted_unpickling(True):
    ...     os.getcwd() in sys.path
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fastckpt.cli._common import USAGE, CliError

__all__ = ["missing_module_message", "trusted_unpickling"]


@contextmanager
def trusted_unpickling(allow_pickle: bool, source: str | None = None) -> Iterator[None]:
    """With ``allow_pickle``: the working directory first on ``sys.path`` for the block (as
    ``python -m`` has it), and a class's module that cannot be imported becomes a
    :class:`CliError` (status 2) naming it. Without: nothing changes.

    Example:
        >>> with trusted_unpickling(True, "obj.pt"):  # doctest: +ELLIPSIS
        ...     import no_module_by_this_name
        Traceback (most recent call last):
        ...
        fastckpt.cli._common.CliError: obj.pt: unpickling needs the module 'no_module_by_this_name', ...
    """
    if not allow_pickle:
        yield
        return
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    except ModuleNotFoundError as exc:
        raise CliError(missing_module_message(exc, source), USAGE) from None
    except AttributeError as exc:
        # pickle's own words when the module imports but lacks the class (renamed, moved)
        if not str(exc).startswith("Can't get attribute"):
            raise
        where = f"{source}: " if source else ""
        raise CliError(
            f"{where}unpickling needs a class that its module no longer has ({exc}); "
            "run fastckpt with the version of that code the file was saved with",
            USAGE,
        ) from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def missing_module_message(exc: ModuleNotFoundError, source: str | None = None) -> str:
    """The one-line message for a module a pickle names that cannot be imported.

    Example:
        >>> missing_module_message(ModuleNotFoundError("No module named 'mymodels'", name="mymodels"), "a.pt")
        "a.pt: unpickling needs the module 'mymodels', which cannot be imported here (No module named 'mymodels'); run fastckpt in the directory that holds it, or add that directory to PYTHONPATH"
    """
    where = f"{source}: " if source else ""
    module = exc.name or "?"
    return (
        f"{where}unpickling needs the module {module!r}, which cannot be imported here ({exc}); "
        "run fastckpt in the directory that holds it, or add that directory to PYTHONPATH"
    )
