"""Progress bars for long work: tqdm on a terminal, silent otherwise.

Bars are off when stderr is not a terminal, when ``FASTCKPT_NO_PROGRESS`` is set (to
anything but ``0``), or when the caller passes ``enabled=False``; ``enabled=True`` forces
one on.

Example:
    >>> with progress_bar(1024, "saving", enabled=False) as bar:
    ...     bar.update(1024)
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

from fastckpt import config


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress_enabled(enabled: bool | None = None) -> bool:
    """Whether a bar should be shown, under the rules above."""
    if enabled is not None:
        return enabled
    if config.progress_hidden():
        return False
    return sys.stderr.isatty()


@contextmanager
def progress_bar(
    total: int, desc: str, *, enabled: bool | None = None, unit: str = "B"
) -> Iterator[Any]:
    """A bar counting to ``total`` (bytes by default); a no-op object when bars are off."""
    if not progress_enabled(enabled):
        yield _Silent()
        return
    from tqdm import tqdm

    scale = unit == "B"
    with tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        leave=False,
        file=sys.stderr,
    ) as bar:
        yield bar
