// GPUDirect Storage through cuFile, loaded with dlopen() at run time: nothing CUDA is
// needed to build, and a machine without libcufile simply reports the engine unavailable.
#pragma once
#include <pybind11/pybind11.h>

namespace fastckpt {

// Adds the cuFile functions and classes to the module.
void bind_cufile(pybind11::module_& m);

}  // namespace fastckpt
