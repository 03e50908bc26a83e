#include "cufile.h"

namespace fastckpt {

void bind_cufile(pybind11::module_& m) { (void)m; }

}  // namespace fastckpt
