// GPUDirect Storage through cuFile, loaded with dlopen() at run time: nothing CUDA is
// needed to build, and a machine without libcufile simply reports the engine unavailable.
//
// The few cuFile types used here are declared in cufile.cpp from the documented C ABI
// (cufile.h of the GDS release): CUfileError_t is {int err; int cu_err}, CUfileDescr_t
// holds a handle type, an fd/handle union and an fs-ops pointer, CUfileHandle_t is a
// pointer. Device memory is passed as a plain address; the Python side keeps the tensor
// alive and makes its CUDA context current on the calling thread.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fastckpt {

// A cuFile status other than success: `code` is the CUfileOpError value (5001, ...),
// `name` its enumerator name ("CU_FILE_DRIVER_NOT_INITIALIZED"), `cuda_error` the CUDA
// driver's CUresult when code is CU_FILE_CUDA_DRIVER_ERROR (else 0).
class CuFileError : public std::runtime_error {
 public:
  CuFileError(const std::string& what, int code, int cuda_error, std::string path = "");
  int code() const { return code_; }
  int cuda_error() const { return cuda_error_; }
  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }

 private:
  int code_;
  int cuda_error_;
  std::string name_;
  std::string path_;
};

// The enumerator name of a CUfileOpError value ("CU_FILE_UNKNOWN_<n>" for values this
// build does not know) and a one-line description.
std::string cufile_status_name(int code);
std::string cufile_status_description(int code);

// Loads libcufile once per process. Tries, in order: a copy already loaded in the process,
// then (when `search_default`) "libcufile.so.0" and "libcufile.so" through the dynamic
// linker's search path, then each path of `candidates` (the Python side passes the
// nvidia-cufile wheels' copies). Returns (loaded, path or the reasons every attempt
// failed). Never throws.
std::pair<bool, std::string> cufile_load(const std::vector<std::string>& candidates,
                                         bool search_default);

// Opens the cuFile driver on the first call, counting callers; the last close closes it.
void cufile_driver_open();
void cufile_driver_close();

// Moves `nbytes` between device (or host) memory at `base + buf_offset` and the registered
// cuFile handle at `file_offset`, continuing short transfers. With `threads` > 1 the range
// is split into that many contiguous parts, each moved by its own thread.
void cufile_transfer(uintptr_t handle, uintptr_t base, uint64_t nbytes, uint64_t file_offset,
                     uint64_t buf_offset, bool write, unsigned threads, const std::string& path);

// Adds the cuFile functions and the CuFileError exception to the module.
void bind_cufile(pybind11::module_& m);

}  // namespace fastckpt
