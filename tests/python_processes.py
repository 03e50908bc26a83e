"""Python processes for the tests, forked from a server that imported torch once.

Many tests run Python in a process of its own: each rank of a multi-rank test, the command
line (``python -m fastckpt ...``). Importing torch costs about 2.5 CPU-seconds a process
on a small machine, and the suite starts hundreds of them, so :func:`launch` and :func:`run`
fork them from a multiprocessing forkserver (one per test worker) that imported torch once.
Each process then does what ``python script.py ARGS``, ``python -m module ARGS`` or
``python -c CODE ARGS`` does: fastckpt is imported by the process itself, after its
environment is in place (its configuration reads the environment), and the interpreter's
exit (non-daemon threads joined, atexit handlers) runs at the end.

Tests about a fresh interpreter itself (what a command imports, first use) keep
:mod:`subprocess`.

Example:
    >>> import sys
    >>> run([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a"]).stdout
    "['a']\\n"
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

_PRELOAD = ["torch", "torch.distributed"]
_context: Any = None
_running: weakref.WeakSet[ForkedProcess] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """A process a test left running never holds its worker at exit (multiprocessing would
    join it)."""
    for child in list(_running):
        child.kill()


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _what_to_run(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``(kind, target, sys.argv)`` for ``[python, script | -m module | -c code, args...]``,
    or None when ``argv`` is anything else."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    first = argv[1]
    if first == "-m" and len(argv) >= 3:
        return "module", argv[2], [argv[2], *argv[3:]]
    if first == "-c" and len(argv) >= 3:
        return "code", argv[2], ["-c", *argv[3:]]
    if first.endswith(".py"):
        return "script", first, list(argv[1:])
    return None


def _child(
    what: tuple[str, str, list[str]],
    env: dict[str, str],
    cwd: str,
    umask: int | None,
    out: str,
    err: str,
) -> None:
    """In the new process: the interpreter's work for ``what``, then its exit."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    # a server other tests started may have imported fastckpt (its configuration read the
    # server's environment): this process imports its own
    for name in [n for n in sys.modules if n.split(".")[0] in ("fastckpt", "tests")]:
        del sys.modules[name]
    os.chdir(cwd)
    if umask is not None:
        os.umask(umask)
    kind, target, sys.argv = what[0], what[1], list(what[2])
    code = 0
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        if kind == "script":
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            namespace = runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.path[0] = cwd
            namespace = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), namespace)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # as the interpreter's exit does: threads, atexit, then the program's objects
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        namespace.clear()
        gc.collect()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedProcess:
    """A Python process forked from the forkserver; the subset of Popen's API tests use
    (its output is captured in files and read back by :meth:`communicate`)."""

    def __init__(
        self,
        what: tuple[str, str, list[str]],
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        cwd: str | None,
        umask: int | None = None,
    ):
        self._files = tempfile.mkdtemp(prefix="fastckpt-process-")
        self._out = os.path.join(self._files, "stdout")
        self._err = os.path.join(self._files, "stderr")
        for path in (self._out, self._err):
            open(path, "wb").close()
        environ = dict(os.environ if env is None else env)
        self._process = _forkserver().Process(
            target=_child,
            args=(what, environ, cwd or os.getcwd(), umask, self._out, self._err),
            daemon=False,  # (a daemonic process may not start processes of its own)
        )
        self._process.start()
        _running.add(self)
        self.pid: int = self._process.pid
        self.args = list(argv)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        with open(self._out, encoding="utf-8", errors="replace") as out:
            stdout = out.read()
        with open(self._err, encoding="utf-8", errors="replace") as err:
            stderr = err.read()
        shutil.rmtree(self._files, ignore_errors=True)
        return stdout, stderr

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        if getattr(self, "returncode", 0) is None and self._process.is_alive():
            self._process.kill()
        shutil.rmtree(self._files, ignore_errors=True)


def launch(
    argv: Sequence[Any],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    umask: int | None = None,
) -> ForkedProcess | subprocess.Popen[str]:
    """Starts ``argv`` (``[sys.executable, script.py | -m module | -c code, args...]``);
    its output is captured as text, read back by ``communicate()``. Anything else runs as
    a plain :class:`subprocess.Popen` with pipes."""
    argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]
    what = _what_to_run(argv)
    if what is not None:
        return ForkedProcess(what, argv, env, cwd, umask)
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),  # noqa: PLW0108
    )


def run(
    argv: Sequence[Any],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    umask: int | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """:func:`subprocess.run` with ``capture_output=True, text=True``, through :func:`launch`."""
    child = launch(argv, env, cwd, umask)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    done = subprocess.CompletedProcess(list(map(str, argv)), child.returncode or 0, stdout, stderr)
    if check:
        done.check_returncode()
    return done
