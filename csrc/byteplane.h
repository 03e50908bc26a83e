// Byte planes of floating-point elements (fastckpt/codec/byteplane.py): each element rotated
// left by `rotation` bits (with one, the sign moves to the bottom and the top byte holds
// exponent bits), then byte k of every element gathered into plane itemsize-1-k. merge is the
// exact inverse.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastckpt {

// itemsize is 2, 4 or 8; nbytes a multiple of it; rotation 1 to 8 * itemsize - 1; planes
// holds itemsize addresses of nbytes / itemsize bytes each. Throws std::invalid_argument
// otherwise.
void byteplane_split(const void* src, size_t nbytes, unsigned itemsize, unsigned rotation,
                     const std::vector<uintptr_t>& planes);
void byteplane_merge(void* dst, size_t nbytes, unsigned itemsize, unsigned rotation,
                     const std::vector<uintptr_t>& planes);

void bind_byteplane(pybind11::module_& m);

}  // namespace fastckpt
