"""Making a file cold without root: its clean pages dropped from the page cache."""

import os


def drop_from_page_cache(path) -> None:
    """Writes back and drops ``path``'s pages (posix_fadvise DONTNEED); a later read of it
    comes from the disk, unless the kernel kept some pages (check with mincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
