// The cuFile shim: dlopen()s libcufile, resolves the handful of entry points fastckpt
// uses, and turns every status into an exception carrying the status code's name.
#include "cufile.h"

#include <Python.h>
#include <dlfcn.h>
#include <pybind11/stl.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>

#include "alignment.h"
#include "io_error.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace fastckpt {
namespace {

// ---- The documented cuFile C ABI (only what is used) --------------------------------
// CUfileOpError and CUresult are C enums, i.e. ints; the struct is returned in registers.
struct CUfileStatus {
  int err;
  int cu_err;
};
constexpr int kHandleTypeOpaqueFd = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD
struct CUfileDescr {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;  // only for user-space file systems; null here
};
using CUfileHandle = void*;

using DriverOpenFn = CUfileStatus (*)();
using DriverCloseFn = CUfileStatus (*)();
using HandleRegisterFn = CUfileStatus (*)(CUfileHandle*, CUfileDescr*);
using HandleDeregisterFn = void (*)(CUfileHandle);
using BufRegisterFn = CUfileStatus (*)(const void*, size_t, int);
using BufDeregisterFn = CUfileStatus (*)(const void*);
using ReadFn = ssize_t (*)(CUfileHandle, void*, size_t, off_t, off_t);
using WriteFn = ssize_t (*)(CUfileHandle, const void*, size_t, off_t, off_t);
using GetVersionFn = CUfileStatus (*)(int*);
using GetParameterBoolFn = CUfileStatus (*)(int, bool*);  // enum parameter: an int
using UseCountFn = long (*)();

// The CUDA driver calls used to carry the caller's context onto worker threads and to
// name CUDA errors. Resolved only from a libcuda the process has already loaded.
using CtxGetCurrentFn = int (*)(void**);
using CtxSetCurrentFn = int (*)(void*);
using GetErrorNameFn = int (*)(int, const char**);

constexpr int kCuFileBase = 5000;

struct StatusInfo {
  int code;
  const char* name;
  const char* description;
};

// Every CUfileOpError of the GDS releases up to CUDA 13 (the names are the ABI's; the
// descriptions are ours).
const StatusInfo kStatuses[] = {
    {0, "CU_FILE_SUCCESS", "success"},
    {5001, "CU_FILE_DRIVER_NOT_INITIALIZED",
     "the nvidia-fs kernel driver is not loaded (set \"allow_compat_mode\": true in cufile.json, "
     "see CUFILE_ENV_PATH_JSON, to run in compatibility mode without it)"},
    {5002, "CU_FILE_DRIVER_INVALID_PROPS", "invalid driver property"},
    {5003, "CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "driver property out of range"},
    {5004, "CU_FILE_DRIVER_VERSION_MISMATCH",
     "nvidia-fs driver and libcufile versions do not match"},
    {5005, "CU_FILE_DRIVER_VERSION_READ_ERROR", "could not read the nvidia-fs driver version"},
    {5006, "CU_FILE_DRIVER_CLOSING", "the cuFile driver is shutting down"},
    {5007, "CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage is not supported on this platform"},
    {5008, "CU_FILE_IO_NOT_SUPPORTED",
     "GPUDirect Storage is not supported for this file or file system"},
    {5009, "CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage is not supported on this GPU"},
    {5010, "CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl failed"},
    {5011, "CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver call failed"},
    {5012, "CU_FILE_CUDA_POINTER_INVALID", "not a valid device pointer"},
    {5013, "CU_FILE_CUDA_MEMORY_TYPE_INVALID", "memory of an unsupported type"},
    {5014, "CU_FILE_CUDA_POINTER_RANGE_ERROR", "range goes past the end of the allocation"},
    {5015, "CU_FILE_CUDA_CONTEXT_MISMATCH", "memory belongs to another CUDA context"},
    {5016, "CU_FILE_INVALID_MAPPING_SIZE", "access beyond the maximum pinned size"},
    {5017, "CU_FILE_INVALID_MAPPING_RANGE", "access beyond the registered range"},
    {5018, "CU_FILE_INVALID_FILE_TYPE", "not a regular file of a supported type"},
    {5019, "CU_FILE_INVALID_FILE_OPEN_FLAG",
     "file opened with unsupported flags (GDS needs O_DIRECT)"},
    {5020, "CU_FILE_DIO_NOT_SET", "file descriptor is not opened with O_DIRECT"},
    {5021, "CU_FILE_EXPECTED_FILE_MODE", "unexpected file mode"},
    {5022, "CU_FILE_INVALID_VALUE", "invalid argument"},
    {5023, "CU_FILE_MEMORY_ALREADY_REGISTERED", "memory is already registered"},
    {5024, "CU_FILE_MEMORY_NOT_REGISTERED", "memory is not registered"},
    {5025, "CU_FILE_PERMISSION_DENIED", "permission denied by the driver or the file"},
    {5026, "CU_FILE_DRIVER_ALREADY_OPEN", "the cuFile driver is already open"},
    {5027, "CU_FILE_HANDLE_NOT_REGISTERED", "file handle is not registered"},
    {5028, "CU_FILE_HANDLE_ALREADY_REGISTERED", "file handle is already registered"},
    {5029, "CU_FILE_DEVICE_NOT_FOUND", "GPU not found"},
    {5030, "CU_FILE_INTERNAL_ERROR", "internal cuFile error"},
    {5031, "CU_FILE_GETNEWFD_FAILED", "could not obtain a new file descriptor"},
    {5033, "CU_FILE_NVFS_SETUP_ERROR",
     "cuFile initialization failed (is a CUDA driver installed?)"},
    {5034, "CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by configuration for this file"},
    {5035, "CU_FILE_BATCH_SUBMIT_FAILED", "batch submission failed"},
    {5036, "CU_FILE_GPU_MEMORY_PINNING_FAILED", "not enough GPU memory (BAR1) to pin the buffer"},
    {5037, "CU_FILE_BATCH_FULL", "batch queue is full"},
    {5038, "CU_FILE_ASYNC_NOT_SUPPORTED", "stream operations are not supported"},
    {5039, "CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "internal batch setup error"},
    {5040, "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "internal batch submit error"},
    {5041, "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR", "internal batch status error"},
    {5042, "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "internal batch cancel error"},
    {5043, "CU_FILE_NOMEM_ERROR", "cuFile is out of memory"},
    {5044, "CU_FILE_IO_ERROR", "I/O error"},
    {5045, "CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "internal buffer registration error"},
    {5046, "CU_FILE_HASH_OPR_ERROR", "internal hash table error"},
    {5047, "CU_FILE_INVALID_CONTEXT_ERROR", "invalid CUDA context"},
    {5048, "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvidia-fs internal driver error"},
    {5049, "CU_FILE_BATCH_NOCOMPAT_ERROR", "batch I/O needs compatibility mode, which is off"},
    {5050, "CU_FILE_IO_MAX_ERROR", "GPUDirect Storage error"},
};

const StatusInfo* find_status(int code) {
  for (const auto& s : kStatuses)
    if (s.code == code) return &s;
  return nullptr;
}

struct Api {
  void* lib = nullptr;
  std::string path;
  DriverOpenFn driver_open = nullptr;
  DriverCloseFn driver_close = nullptr;
  HandleRegisterFn handle_register = nullptr;
  HandleDeregisterFn handle_deregister = nullptr;
  BufRegisterFn buf_register = nullptr;
  BufDeregisterFn buf_deregister = nullptr;
  ReadFn read = nullptr;
  WriteFn write = nullptr;
  GetVersionFn get_version = nullptr;               // optional (GDS >= 1.1)
  GetParameterBoolFn get_parameter_bool = nullptr;  // optional (GDS >= 1.9)
  UseCountFn use_count = nullptr;                   // optional
};

std::mutex g_mu;                   // guards loading and the driver's reference count
std::atomic<Api*> g_api{nullptr};  // set once, never freed: libcufile is never unloaded
int g_driver_refs = 0;
bool g_driver_owned = false;  // false when someone else in the process had opened it

template <typename F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

// Fills `api` from `lib`; returns the first missing required symbol, or "" when complete.
std::string resolve(void* lib, Api& api) {
  api.lib = lib;
  api.driver_open = symbol<DriverOpenFn>(lib, "cuFileDriverOpen");
  // cufile.h maps cuFileDriverClose to the _v2 entry point; older releases only have the first.
  api.driver_close = symbol<DriverCloseFn>(lib, "cuFileDriverClose_v2");
  if (!api.driver_close) api.driver_close = symbol<DriverCloseFn>(lib, "cuFileDriverClose");
  api.handle_register = symbol<HandleRegisterFn>(lib, "cuFileHandleRegister");
  api.handle_deregister = symbol<HandleDeregisterFn>(lib, "cuFileHandleDeregister");
  api.buf_register = symbol<BufRegisterFn>(lib, "cuFileBufRegister");
  api.buf_deregister = symbol<BufDeregisterFn>(lib, "cuFileBufDeregister");
  api.read = symbol<ReadFn>(lib, "cuFileRead");
  api.write = symbol<WriteFn>(lib, "cuFileWrite");
  api.get_version = symbol<GetVersionFn>(lib, "cuFileGetVersion");
  api.get_parameter_bool = symbol<GetParameterBoolFn>(lib, "cuFileGetParameterBool");
  api.use_count = symbol<UseCountFn>(lib, "cuFileUseCount");
  const std::pair<const void*, const char*> required[] = {
      {reinterpret_cast<const void*>(api.driver_open), "cuFileDriverOpen"},
      {reinterpret_cast<const void*>(api.driver_close), "cuFileDriverClose"},
      {reinterpret_cast<const void*>(api.handle_register), "cuFileHandleRegister"},
      {reinterpret_cast<const void*>(api.handle_deregister), "cuFileHandleDeregister"},
      {reinterpret_cast<const void*>(api.buf_register), "cuFileBufRegister"},
      {reinterpret_cast<const void*>(api.buf_deregister), "cuFileBufDeregister"},
      {reinterpret_cast<const void*>(api.read), "cuFileRead"},
      {reinterpret_cast<const void*>(api.write), "cuFileWrite"},
  };
  for (const auto& [fn, name] : required)
    if (!fn) return name;
  return "";
}

std::string loaded_path(void* fn, const std::string& fallback) {
  Dl_info info{};
  if (fn && dladdr(fn, &info) && info.dli_fname) return info.dli_fname;
  return fallback;
}

const Api& api() {
  Api* a = g_api.load(std::memory_order_acquire);
  if (!a) throw std::runtime_error("libcufile is not loaded (fastckpt.gds.engine_info() says why)");
  return *a;
}

// libcuda, only if the process already has it (torch loads it on CUDA initialization).
struct CudaDriver {
  CtxGetCurrentFn ctx_get_current = nullptr;
  CtxSetCurrentFn ctx_set_current = nullptr;
  GetErrorNameFn get_error_name = nullptr;
};

CudaDriver cuda_driver() {
  static std::mutex mu;
  static CudaDriver found;
  static bool have = false;
  std::lock_guard<std::mutex> lock(mu);
  if (have) return found;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) {
    dlerror();  // clear; looked up again next time (torch may load libcuda later)
    return CudaDriver{};
  }
  // The reference dlopen added is kept: libcuda stays loaded for the process anyway.
  found.ctx_get_current = symbol<CtxGetCurrentFn>(lib, "cuCtxGetCurrent");
  found.ctx_set_current = symbol<CtxSetCurrentFn>(lib, "cuCtxSetCurrent");
  found.get_error_name = symbol<GetErrorNameFn>(lib, "cuGetErrorName");
  have = true;
  return found;
}

std::string describe_status(int code, int cuda_error) {
  std::string text = cufile_status_name(code) + " (" + std::to_string(code) + ": " +
                     cufile_status_description(code);
  if (code == 5011 && cuda_error != 0) {
    text += "; CUDA error " + std::to_string(cuda_error);
    CudaDriver d = cuda_driver();
    const char* name = nullptr;
    if (d.get_error_name && d.get_error_name(cuda_error, &name) == 0 && name) {
      text += std::string(" ") + name;
    }
  }
  return text + ")";
}

void check(const CUfileStatus& st, const std::string& what, const std::string& path = "") {
  if (st.err == 0) return;
  throw CuFileError(what + " failed: " + describe_status(st.err, st.cu_err), st.err, st.cu_err,
                    path);
}

std::string describe_io(bool write, uint64_t nbytes, uint64_t offset) {
  return std::string(write ? "cuFileWrite of " : "cuFileRead of ") + std::to_string(nbytes) +
         " bytes at file offset " + std::to_string(offset);
}

// Linux moves at most 0x7ffff000 bytes per call; stay well under it and on a page multiple.
constexpr uint64_t kMaxPerCall = uint64_t{1} << 30;

void transfer_range(const Api& a, CUfileHandle fh, char* base, uint64_t buf_offset, uint64_t nbytes,
                    uint64_t file_offset, bool write, const std::string& path) {
  uint64_t done = 0;
  while (done < nbytes) {
    const size_t n = static_cast<size_t>(std::min(nbytes - done, kMaxPerCall));
    const off_t foff = static_cast<off_t>(file_offset + done);
    const off_t boff = static_cast<off_t>(buf_offset + done);
    errno = 0;
    const ssize_t r = write ? a.write(fh, base, n, foff, boff) : a.read(fh, base, n, foff, boff);
    if (r > 0) {
      done += static_cast<uint64_t>(r);
      continue;
    }
    const uint64_t at = file_offset + done;
    if (r == 0) {
      throw IoError(write ? EIO : ENODATA,
                    describe_io(write, nbytes - done, at) +
                        (write ? " made no progress" : " hit the end of the file"),
                    path);
    }
    if (r == -1) {
      const int e = errno;
      if (e == EINTR || e == EAGAIN) continue;
      throw IoError(e ? e : EIO, describe_io(write, nbytes - done, at) + " failed", path);
    }
    const int code = static_cast<int>(-r);
    if (code < kCuFileBase) {  // a negated errno, which some releases return instead of -1
      throw IoError(code, describe_io(write, nbytes - done, at) + " failed", path);
    }
    throw CuFileError(
        describe_io(write, nbytes - done, at) + " failed: " + describe_status(code, 0), code, 0,
        path);
  }
}

}  // namespace

CuFileError::CuFileError(const std::string& what, int code, int cuda_error, std::string path)
    : std::runtime_error(path.empty() ? what : what + ": '" + path + "'"),
      code_(code),
      cuda_error_(cuda_error),
      name_(cufile_status_name(code)),
      path_(std::move(path)) {}

std::string cufile_status_name(int code) {
  const StatusInfo* s = find_status(code);
  return s ? s->name : "CU_FILE_UNKNOWN_" + std::to_string(code);
}

std::string cufile_status_description(int code) {
  const StatusInfo* s = find_status(code);
  return s ? s->description : "unknown cuFile status";
}

std::pair<bool, std::string> cufile_load(const std::vector<std::string>& candidates,
                                         bool search_default) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (Api* a = g_api.load()) return {true, a->path};
  std::vector<std::string> failures;
  auto attempt = [&](const std::string& name, int flags) -> bool {
    dlerror();
    void* lib = dlopen(name.c_str(), flags);
    if (!lib) {
      if (!(flags & RTLD_NOLOAD)) {
        const char* err = dlerror();
        failures.push_back(err ? std::string(err) : name + ": cannot be loaded");
      }
      return false;
    }
    auto* a = new Api;
    std::string missing = resolve(lib, *a);
    if (!missing.empty()) {
      failures.push_back(name + ": has no symbol " + missing + " (not a libcufile?)");
      delete a;
      dlclose(lib);
      return false;
    }
    a->path = loaded_path(reinterpret_cast<void*>(a->driver_open), name);
    g_api.store(a, std::memory_order_release);
    return true;
  };
  if (attempt("libcufile.so.0", RTLD_NOW | RTLD_NOLOAD)) return {true, g_api.load()->path};
  if (search_default) {
    for (const char* name : {"libcufile.so.0", "libcufile.so"})
      if (attempt(name, RTLD_NOW | RTLD_LOCAL)) return {true, g_api.load()->path};
  }
  for (const auto& path : candidates)
    if (attempt(path, RTLD_NOW | RTLD_LOCAL)) return {true, g_api.load()->path};
  std::string reason = "libcufile could not be loaded";
  if (failures.empty()) reason += ": no candidate to try";
  for (size_t i = 0; i < failures.size(); ++i) reason += (i ? "; " : ": ") + failures[i];
  return {false, reason};
}

void cufile_driver_open() {
  const Api& a = api();
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_driver_refs == 0) {
    CUfileStatus st = a.driver_open();
    if (st.err == 5026) {  // CU_FILE_DRIVER_ALREADY_OPEN: opened by another user in this process
      g_driver_owned = false;
    } else {
      check(st, "cuFileDriverOpen");
      g_driver_owned = true;
    }
  }
  ++g_driver_refs;
}

void cufile_driver_close() {
  const Api& a = api();
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_driver_refs == 0) {
    throw std::logic_error("cufile_driver_close() without a matching cufile_driver_open()");
  }
  if (--g_driver_refs == 0 && g_driver_owned) {
    g_driver_owned = false;
    check(a.driver_close(), "cuFileDriverClose");
  }
}

void cufile_transfer(uintptr_t handle, uintptr_t base, uint64_t nbytes, uint64_t file_offset,
                     uint64_t buf_offset, bool write, unsigned threads, const std::string& path) {
  if (nbytes == 0) return;
  if (handle == 0) throw std::invalid_argument("handle: not a registered cuFile handle");
  if (base == 0) throw std::invalid_argument("address: null pointer");
  constexpr uint64_t kMaxOff = static_cast<uint64_t>(INT64_MAX);  // off_t
  if (nbytes > kMaxOff || file_offset > kMaxOff - nbytes || buf_offset > kMaxOff - nbytes) {
    throw std::invalid_argument("nbytes/file_offset/buf_offset: out of range");
  }
  const Api& a = api();
  auto* fh = reinterpret_cast<CUfileHandle>(handle);
  char* ptr = reinterpret_cast<char*>(base);

  // Parts start on page multiples of the file (the first excepted) and are at least
  // kMinPart long, so small transfers stay on the calling thread.
  constexpr uint64_t kPage = kDirectIoAlignment, kMinPart = uint64_t{1} << 20;
  const uint64_t parts =
      std::max<uint64_t>(1, std::min<uint64_t>(threads, (nbytes + kMinPart - 1) / kMinPart));
  std::vector<uint64_t> cuts{0};
  const uint64_t per = (nbytes + parts - 1) / parts;
  for (uint64_t k = 1; k < parts; ++k) {
    uint64_t end_in_file = file_offset + k * per;
    end_in_file = (end_in_file + kPage - 1) / kPage * kPage;
    const uint64_t cut = std::min(nbytes, end_in_file - file_offset);
    if (cut > cuts.back() && cut < nbytes) cuts.push_back(cut);
  }
  cuts.push_back(nbytes);
  if (cuts.size() == 2) {
    transfer_range(a, fh, ptr, buf_offset, nbytes, file_offset, write, path);
    return;
  }

  // Workers run in the caller's CUDA context, which cuFile needs to resolve device memory.
  CudaDriver d = cuda_driver();
  void* ctx = nullptr;
  if (d.ctx_get_current && d.ctx_set_current && d.ctx_get_current(&ctx) != 0) ctx = nullptr;

  std::vector<std::exception_ptr> errors(cuts.size() - 1);
  run_parts(static_cast<unsigned>(cuts.size() - 1), [&](unsigned i) {
    try {
      if (ctx) d.ctx_set_current(ctx);
      const uint64_t lo = cuts[i], hi = cuts[i + 1];
      transfer_range(a, fh, ptr, buf_offset + lo, hi - lo, file_offset + lo, write, path);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  });
  // Every part has finished before anything is raised: none still touches the memory.
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

namespace {

PyObject* g_error_type = nullptr;  // fastckpt._C.CuFileError, alive for the process

py::object make_error_type() {
  py::object base;
  try {
    base = py::module_::import("fastckpt.errors").attr("FastCkptError");
  } catch (py::error_already_set&) {
    base = py::reinterpret_borrow<py::object>(PyExc_Exception);
  }
  py::tuple bases = py::make_tuple(base, py::reinterpret_borrow<py::object>(PyExc_RuntimeError));
  const char* doc =
      "A cuFile call failed. Attributes: status (the CUfileOpError name, e.g. "
      "'CU_FILE_DRIVER_NOT_INITIALIZED'), code (its value), cuda_error (the CUresult when status "
      "is CU_FILE_CUDA_DRIVER_ERROR, else 0), filename (or None).";
  PyObject* type = PyErr_NewExceptionWithDoc("fastckpt._C.CuFileError", doc, bases.ptr(), nullptr);
  if (!type) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(type);
}

void raise_cufile_error(const CuFileError& e) {
  PyObject* exc = PyObject_CallFunction(g_error_type, "s", e.what());
  if (!exc) return;  // the failed call set its own error
  py::object status = py::str(e.name());
  py::object code = py::int_(e.code());
  py::object cuda = py::int_(e.cuda_error());
  py::object filename = e.path().empty() ? py::none() : py::object(py::str(e.path()));
  PyObject_SetAttrString(exc, "status", status.ptr());
  PyObject_SetAttrString(exc, "code", code.ptr());
  PyObject_SetAttrString(exc, "cuda_error", cuda.ptr());
  PyObject_SetAttrString(exc, "filename", filename.ptr());
  PyErr_SetObject(g_error_type, exc);
  Py_DECREF(exc);
}

std::optional<bool> get_bool_parameter(int parameter) {
  const Api& a = api();
  if (!a.get_parameter_bool) return std::nullopt;
  bool value = false;
  if (a.get_parameter_bool(parameter, &value).err != 0) return std::nullopt;
  return value;
}

}  // namespace

void bind_cufile(py::module_& m) {
  py::object type = make_error_type();
  g_error_type = type.inc_ref().ptr();  // kept for the life of the process
  m.attr("CuFileError") = type;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CuFileError& e) {
      raise_cufile_error(e);
    }
  });

  m.def("cufile_load", &cufile_load, py::arg("candidates") = std::vector<std::string>{},
        py::arg("search_default") = true,
        "Loads libcufile once per process: a copy already loaded, then (with search_default) "
        "libcufile.so.0/libcufile.so from the linker's search path, then each candidate path. "
        "Returns (loaded, path or the reasons every attempt failed).",
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "cufile_library",
      []() -> std::string {
        Api* a = g_api.load();
        return a ? a->path : "";
      },
      "Path of the loaded libcufile, or '' when none is.");
  m.def("cufile_status_name", &cufile_status_name, py::arg("code"));
  m.def("cufile_status_description", &cufile_status_description, py::arg("code"));
  m.def(
      "cufile_version",
      []() -> std::optional<int> {
        const Api& a = api();
        int version = 0;
        if (!a.get_version || a.get_version(&version).err != 0) return std::nullopt;
        return version;
      },
      "cuFileGetVersion(), or None where the library lacks it.");
  m.def("cufile_get_bool_parameter", &get_bool_parameter, py::arg("parameter"),
        "cuFileGetParameterBool(parameter) (1: allow_compat_mode, 2: force_compat_mode), or None "
        "where the library lacks it or refuses.");
  m.def("cufile_use_count", []() -> std::optional<long> {
    const Api& a = api();
    if (!a.use_count) return std::nullopt;
    return a.use_count();
  });
  m.def("cufile_driver_open", &cufile_driver_open, py::call_guard<py::gil_scoped_release>(),
        "Opens the cuFile driver (reference counted); raises CuFileError naming the status.");
  m.def("cufile_driver_close", &cufile_driver_close, py::call_guard<py::gil_scoped_release>());
  m.def("cufile_driver_refs", []() {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_driver_refs;
  });
  m.def(
      "cufile_handle_register",
      [](int fd, const std::string& path) {
        const Api& a = api();
        if (fd < 0) throw IoError(EBADF, "cuFileHandleRegister", path);
        CUfileDescr descr{};
        descr.type = kHandleTypeOpaqueFd;
        descr.handle.fd = fd;
        descr.fs_ops = nullptr;
        CUfileHandle fh = nullptr;
        check(a.handle_register(&fh, &descr), "cuFileHandleRegister", path);
        return reinterpret_cast<uintptr_t>(fh);
      },
      py::arg("fd"), py::arg("path") = "", py::call_guard<py::gil_scoped_release>(),
      "Registers an open descriptor (O_DIRECT for true GDS); returns the handle as an int.");
  m.def(
      "cufile_handle_deregister",
      [](uintptr_t handle) {
        if (handle) api().handle_deregister(reinterpret_cast<CUfileHandle>(handle));
      },
      py::arg("handle"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "cufile_buf_register",
      [](uintptr_t address, size_t nbytes, int flags) {
        check(api().buf_register(reinterpret_cast<const void*>(address), nbytes, flags),
              "cuFileBufRegister");
      },
      py::arg("address"), py::arg("nbytes"), py::arg("flags") = 0,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "cufile_buf_deregister",
      [](uintptr_t address) {
        check(api().buf_deregister(reinterpret_cast<const void*>(address)), "cuFileBufDeregister");
      },
      py::arg("address"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "cufile_read",
      [](uintptr_t handle, uintptr_t address, uint64_t nbytes, uint64_t file_offset,
         uint64_t buf_offset, unsigned threads, const std::string& path) {
        cufile_transfer(handle, address, nbytes, file_offset, buf_offset, false, threads, path);
      },
      py::arg("handle"), py::arg("address"), py::arg("nbytes"), py::arg("file_offset"),
      py::arg("buf_offset") = 0, py::arg("threads") = 1, py::arg("path") = "",
      py::call_guard<py::gil_scoped_release>(),
      "Reads nbytes at file_offset into address + buf_offset (all of them, or raises).");
  m.def(
      "cufile_write",
      [](uintptr_t handle, uintptr_t address, uint64_t nbytes, uint64_t file_offset,
         uint64_t buf_offset, unsigned threads, const std::string& path) {
        cufile_transfer(handle, address, nbytes, file_offset, buf_offset, true, threads, path);
      },
      py::arg("handle"), py::arg("address"), py::arg("nbytes"), py::arg("file_offset"),
      py::arg("buf_offset") = 0, py::arg("threads") = 1, py::arg("path") = "",
      py::call_guard<py::gil_scoped_release>(),
      "Writes nbytes from address + buf_offset at file_offset (all of them, or raises).");
}

}  // namespace fastckpt
