"""fastckpt.io.interrupts: a Ctrl-C during a wait is raised only once the work is over."""

from __future__ import annotations

import _thread
import concurrent.futures
import threading
import time

import pytest

from fastckpt.io.interrupts import result_when_done, wait_through_interrupts


def _slow_work(finished: threading.Event, fail: bool = False) -> int:
    time.sleep(2.0)  # far past the Ctrl-C at 0.1 s, even on a machine loaded with other work
    finished.set()
    if fail:
        raise OSError(5, "the work's own error")
    return 7


@pytest.mark.parametrize("fail", [False, True])
def test_ctrl_c_is_raised_after_the_work_ends(fail):
    finished = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_slow_work, finished, fail)
        timer = threading.Timer(0.1, _thread.interrupt_main)  # Ctrl-C, as the signal does
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            result_when_done(future)
        assert finished.is_set(), "the interrupt was raised while the work still ran"
        timer.join()


def test_wait_through_interrupts_returns_none_without_one():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(sum, [i, 1]) for i in range(4)]
        assert wait_through_interrupts(futures) is None
        assert [f.result() for f in futures] == [1, 2, 3, 4]
