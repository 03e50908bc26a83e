"""The native cuFile shim against a stand-in libcufile built here from C: the documented ABI
(status structs returned in registers, descriptors, ssize_t results), short transfers,
errno and status-code errors, the split over threads and the driver's reference count.
Runs on any machine with a C compiler; each case in a fresh interpreter, since a loaded
libcufile stays loaded for the process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

STAND_IN = r"""
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct { int err; int cu_err; } status_t;
typedef struct { int type; union { int fd; void *handle; } handle; const void *fs_ops; } descr_t;

static int opened = 0;
static long env_long(const char *name, long fallback) {
  const char *s = getenv(name);
  return s ? atol(s) : fallback;
}
static status_t status(int err, int cu_err) { status_t s = {err, cu_err}; return s; }

status_t cuFileDriverOpen(void) {
  int err = (int)env_long("STANDIN_OPEN_STATUS", 0);
  if (err == 0) opened++;
  return status(err, (int)env_long("STANDIN_OPEN_CU_ERR", 0));
}
status_t cuFileDriverClose_v2(void) { opened--; return status(0, 0); }
long cuFileUseCount(void) { return opened; }
status_t cuFileGetVersion(int *v) { *v = 1234; return status(0, 0); }
status_t cuFileGetParameterBool(int p, bool *v) { *v = (p == 1); return status(0, 0); }
status_t cuFileHandleRegister(void **fh, descr_t *d) {
  if (d->type != 1 || d->fs_ops != 0) return status(5022, 0);
  *fh = (void *)(long)(d->handle.fd + 1);
  return status(0, 0);
}
void cuFileHandleDeregister(void *fh) { (void)fh; }
status_t cuFileBufRegister(const void *p, size_t n, int flags) {
  (void)p; (void)n; return status(flags == 0 ? 0 : 5022, 0);
}
status_t cuFileBufDeregister(const void *p) { (void)p; return status(0, 0); }

static ssize_t forced(void) {
  const char *s = getenv("STANDIN_RESULT");
  if (!s) return 1;
  long v = atol(s);
  if (v == -1) errno = (int)env_long("STANDIN_ERRNO", EIO);
  return v;
}
static size_t clip(size_t n) {
  long most = env_long("STANDIN_MAX", 0);
  return most > 0 && n > (size_t)most ? (size_t)most : n;
}
ssize_t cuFileRead(void *fh, void *base, size_t n, off_t off, off_t boff) {
  ssize_t f = forced();
  if (f < 1) return f;
  return pread((int)(long)fh - 1, (char *)base + boff, clip(n), off);
}
ssize_t cuFileWrite(void *fh, const void *base, size_t n, off_t off, off_t boff) {
  ssize_t f = forced();
  if (f < 1) return f;
  return pwrite((int)(long)fh - 1, (const char *)base + boff, clip(n), off);
}
"""

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    d = tmp_path_factory.mktemp("standin")
    src = d / "standin.c"
    src.write_text(STAND_IN)
    lib = d / "libcufile.so.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return str(lib)


def run(stand_in: str, tmp_path, body: str) -> dict:
    result = tmp_path / "result.json"
    code = (
        textwrap.dedent(
            f"""
        import ctypes, errno, json, os
        from fastckpt import _C
        loaded, where = _C.cufile_load([{stand_in!r}], False)
        assert loaded, where
        out = {{"where": where}}
        """
        )
        + textwrap.dedent(body)
        + f"\nopen({str(result)!r}, 'w').write(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTCKPT_", "STANDIN_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(result.read_text())


def test_load_version_parameters_and_driver_refcount(stand_in, tmp_path):
    out = run(
        stand_in,
        tmp_path,
        """
        out["version"] = _C.cufile_version()
        out["allow"], out["force"] = _C.cufile_get_bool_parameter(1), _C.cufile_get_bool_parameter(2)
        out["library"] = _C.cufile_library()
        _C.cufile_driver_open(); _C.cufile_driver_open()
        out["refs"] = [_C.cufile_driver_refs(), _C.cufile_use_count()]
        _C.cufile_driver_close()
        out["refs"] += [_C.cufile_driver_refs(), _C.cufile_use_count()]
        _C.cufile_driver_close()
        out["refs"] += [_C.cufile_driver_refs(), _C.cufile_use_count()]
        try:
            _C.cufile_driver_close()
        except RuntimeError as exc:
            out["extra_close"] = str(exc)
        """,
    )
    assert out["where"] == stand_in == out["library"]
    assert out["version"] == 1234 and out["allow"] is True and out["force"] is False
    assert out["refs"] == [2, 1, 1, 1, 0, 0]  # one cuFileDriverOpen, closed by the last close
    assert "without a matching" in out["extra_close"]


def test_driver_statuses_become_named_exceptions(stand_in, tmp_path):
    out = run(
        stand_in,
        tmp_path,
        """
        from fastckpt.errors import FastCkptError
        for code, cu in ((5001, 0), (5011, 100), (5099, 0)):
            os.environ["STANDIN_OPEN_STATUS"] = str(code)
            os.environ["STANDIN_OPEN_CU_ERR"] = str(cu)
            try:
                _C.cufile_driver_open()
            except _C.CuFileError as exc:
                out[str(code)] = [exc.status, exc.code, exc.cuda_error, str(exc), exc.filename,
                                  isinstance(exc, FastCkptError), isinstance(exc, RuntimeError)]
        out["refs"] = _C.cufile_driver_refs()
        os.environ["STANDIN_OPEN_STATUS"] = "5026"  # already open elsewhere: fine, and not ours to close
        _C.cufile_driver_open(); _C.cufile_driver_close()
        out["use_count"] = _C.cufile_use_count()
        """,
    )
    status, code, cuda_error, message, filename, is_fastckpt, is_runtime = out["5001"]
    assert (status, code, cuda_error, filename) == ("CU_FILE_DRIVER_NOT_INITIALIZED", 5001, 0, None)
    assert is_fastckpt and is_runtime
    assert message.startswith("cuFileDriverOpen failed: CU_FILE_DRIVER_NOT_INITIALIZED (5001")
    assert "allow_compat_mode" in message
    assert out["5011"][:3] == ["CU_FILE_CUDA_DRIVER_ERROR", 5011, 100]
    assert "CUDA error 100" in out["5011"][3]
    assert out["5099"][0] == "CU_FILE_UNKNOWN_5099"
    assert out["refs"] == 0 and out["use_count"] == 0


def test_transfers_roundtrip_in_parts(stand_in, tmp_path):
    out = run(
        stand_in,
        tmp_path,
        """
        n = (5 << 20) + 7
        src = (ctypes.c_ubyte * n).from_buffer(bytearray(os.urandom(n)))
        for threads in (1, 3, 8):
            for most in (0, 4096 * 3 + 5):  # 0: whole transfers; else short ones, continued
                os.environ["STANDIN_MAX"] = str(most)
                dst = (ctypes.c_ubyte * (n + 100))()
                path = os.path.abspath(f"data-{threads}-{most}.bin")
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                h = _C.cufile_handle_register(fd, path)
                _C.cufile_write(h, ctypes.addressof(src), n, 4096 + 7, 0, threads, path)
                _C.cufile_read(h, ctypes.addressof(dst), n - 10, 4096 + 17, 100, threads, path)
                _C.cufile_handle_deregister(h)
                os.close(fd)
                with open(path, "rb") as f:
                    on_disk = f.read()
                out[f"{threads}-{most}"] = [
                    len(on_disk),
                    on_disk[4096 + 7 :] == bytes(src),
                    bytes(dst)[100 : 100 + n - 10] == bytes(src)[10:],
                    bytes(dst)[:100] == bytes(100) and bytes(dst)[100 + n - 10 :] == bytes(10),
                ]
        """,
    )
    out.pop("where")
    assert len(out) == 6
    for case, (size, written, read, untouched) in out.items():
        assert size == 4096 + 7 + (5 << 20) + 7, case
        assert written and read and untouched, case


def test_transfer_errors(stand_in, tmp_path):
    out = run(
        stand_in,
        tmp_path,
        """
        buf = (ctypes.c_ubyte * 8192)()
        path = os.path.abspath("e.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        h = _C.cufile_handle_register(fd, path)

        def attempt(result, write=False, threads=1, errno_value=None, nbytes=4096):
            os.environ["STANDIN_RESULT"] = str(result)
            if errno_value is not None:
                os.environ["STANDIN_ERRNO"] = str(errno_value)
            move = _C.cufile_write if write else _C.cufile_read
            try:
                move(h, ctypes.addressof(buf), nbytes, 0, 0, threads, path)
                return None
            except Exception as exc:
                return [type(exc).__name__, getattr(exc, "errno", None), getattr(exc, "status", None),
                        getattr(exc, "filename", None), str(exc)]

        out["eio"] = attempt(-1)
        out["enospc"] = attempt(-1, write=True, errno_value=errno.ENOSPC)
        out["negated_errno"] = attempt(-errno.ENOENT)
        out["status"] = attempt(-5022, write=True)
        out["eof"] = attempt(0)
        out["no_progress"] = attempt(0, write=True)
        out["threaded"] = attempt(-5012, threads=4, nbytes=8 << 20)
        os.environ["STANDIN_RESULT"] = "1"
        try:
            _C.cufile_handle_register(-1, path)
        except OSError as exc:
            out["bad_fd"] = exc.errno
        """,
    )
    p = str(tmp_path / "e.bin")
    assert out["eio"][:2] == ["OSError", 5] and out["eio"][3] == p
    assert "cuFileRead of 4096 bytes at file offset 0 failed" in out["eio"][4]
    assert out["enospc"][:2] == ["OSError", 28] and "cuFileWrite" in out["enospc"][4]
    assert out["negated_errno"][:2] == ["FileNotFoundError", 2]
    assert out["status"][0] == "CuFileError" and out["status"][2] == "CU_FILE_INVALID_VALUE"
    assert out["status"][3] == p and "CU_FILE_INVALID_VALUE (5022" in out["status"][4]
    assert out["eof"][:2] == ["OSError", 61] and "end of the file" in out["eof"][4]
    assert out["no_progress"][:2] == ["OSError", 5] and "made no progress" in out["no_progress"][4]
    assert out["threaded"][2] == "CU_FILE_CUDA_POINTER_INVALID"
    assert out["bad_fd"] == 9
