// fastckpt._C: the private native core. It takes raw pointers, lengths, offsets and file
// descriptors only; the Python side keeps the memory alive until each op completes.
// Every call that can block releases the GIL.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "alignment.h"
#include "byteplane.h"
#include "crc32c.h"
#include "cufile.h"
#include "engine.h"
#include "executor.h"
#include "file_copy.h"
#include "io_error.h"
#include "memory.h"

namespace py = pybind11;
using namespace fastckpt;

namespace {

char* as_ptr(uintptr_t address) { return reinterpret_cast<char*>(address); }

std::pair<bool, std::string> engine_status(const std::string& name) {
  EngineStatus st{true, ""};
  switch (parse_engine_kind(name)) {
    case EngineKind::io_uring:
      st = probe_io_uring();
      break;
    case EngineKind::libaio:
      st = probe_libaio();
      break;
    case EngineKind::threads:
    case EngineKind::failing:
      break;
  }
  return {st.available, st.reason};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastckpt's private native I/O core (no torch, no CUDA headers).";
  m.attr("DIRECT_IO_ALIGNMENT") = kDirectIoAlignment;

  // IoError -> OSError(errno, message, filename): Python picks the errno's subclass
  // (FileNotFoundError, PermissionError, ...).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      py::object filename = e.path().empty() ? py::none() : py::object(py::str(e.path()));
      py::object exc = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "isO", e.err(), e.what(), filename.ptr()));
      if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("engine_status", &engine_status, py::arg("name"),
        "(available, reason) of the engine 'io_uring', 'libaio' or 'threads'.",
        py::call_guard<py::gil_scoped_release>());

  py::class_<Executor>(m, "Executor")
      .def(py::init([](const std::string& engine, uint64_t block_size, unsigned queue_depth,
                       bool single_submit, bool overlap_events, unsigned parallelism) {
             ExecutorConfig c;
             c.engine = parse_engine_kind(engine);
             c.block_size = block_size;
             c.queue_depth = queue_depth;
             c.single_submit = single_submit;
             c.overlap_events = overlap_events;
             c.parallelism = parallelism;
             py::gil_scoped_release release;
             return new Executor(c);
           }),
           py::arg("engine"), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("parallelism"))
      .def(
          "submit",
          [](Executor& ex, int fd_direct, int fd_buffered, uintptr_t address, uint64_t nbytes,
             uint64_t offset, bool write, const std::string& path, uint64_t alignment,
             unsigned max_parts) {
            OpSpec s;
            s.fd_direct = fd_direct;
            s.fd_buffered = fd_buffered;
            s.ptr = as_ptr(address);
            s.len = nbytes;
            s.offset = offset;
            s.write = write;
            s.path = path;
            s.alignment = alignment;
            s.max_parts = max_parts;
            py::gil_scoped_release release;
            return ex.submit(s);
          },
          py::arg("fd_direct"), py::arg("fd_buffered"), py::arg("address"), py::arg("nbytes"),
          py::arg("offset"), py::arg("write"), py::arg("path"),
          py::arg("alignment") = kDirectIoAlignment, py::arg("max_parts") = 0)
      .def("wait", &Executor::wait, py::arg("op_id"), py::call_guard<py::gil_scoped_release>())
      .def("is_pending", &Executor::is_pending, py::arg("op_id"))
      .def("cancel", &Executor::cancel, py::arg("op_id"))
      .def("wait_all", &Executor::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("pending", &Executor::pending);

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init([](size_t nbytes, bool lock, bool strict, bool reused) {
             py::gil_scoped_release release;  // mlock of a large buffer faults every page in
             return new AlignedBuffer(nbytes, lock, strict, reused);
           }),
           py::arg("nbytes"), py::arg("lock") = false, py::arg("strict") = false,
           py::arg("reused") = false)
      .def_property_readonly(
          "address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &AlignedBuffer::size)
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  m.def(
      "registered_memory_count",
      [](uintptr_t address) {
        return address ? RegisteredMemory::registrations_of(as_ptr(address))
                       : RegisteredMemory::registrations();
      },
      py::arg("address") = 0,
      "Pieces of reused buffers registered with I/O engines, over all engines; of the buffer "
      "starting at `address` alone when given (for tests).");
  m.def(
      "is_locked", [](uintptr_t address) { return is_locked(as_ptr(address)); },
      py::arg("address"));
  m.def(
      "memcpy",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, unsigned threads) {
        parallel_memcpy(as_ptr(dst), as_ptr(src), nbytes, threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("threads") = 1,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "memcpy_crc",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, const std::vector<size_t>& cuts,
         unsigned threads) {
        return parallel_memcpy_crc(as_ptr(dst), as_ptr(src), nbytes, cuts, threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("cuts") = std::vector<size_t>{},
      py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>());
  m.def(
      "crc32c",
      [](uintptr_t address, size_t nbytes, uint32_t value) {
        return crc32c_extend(value, as_ptr(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("value") = 0,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "pread_crc",
      [](int fd, uintptr_t dst, size_t nbytes, uint64_t offset, const std::vector<size_t>& cuts,
         bool checksum, const std::string& path) {
        return pread_crc(fd, as_ptr(dst), nbytes, offset, cuts, checksum, path);
      },
      py::arg("fd"), py::arg("dst"), py::arg("nbytes"), py::arg("offset"),
      py::arg("cuts") = std::vector<size_t>{}, py::arg("checksum") = true, py::arg("path") = "",
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "pwrite_crc",
      [](int fd, uintptr_t src, size_t nbytes, uint64_t offset, const std::vector<size_t>& cuts,
         bool checksum, const std::string& path) {
        return pwrite_crc(fd, as_ptr(src), nbytes, offset, cuts, checksum, path);
      },
      py::arg("fd"), py::arg("src"), py::arg("nbytes"), py::arg("offset"),
      py::arg("cuts") = std::vector<size_t>{}, py::arg("checksum") = true, py::arg("path") = "",
      py::call_guard<py::gil_scoped_release>());
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"));
  m.def("crc32c_hardware", &crc32c_hardware);
  m.def("dio_alignment", &dio_alignment, py::arg("fd"));
  m.def("preallocate", &preallocate, py::arg("fd"), py::arg("nbytes"), py::arg("path") = "",
        py::call_guard<py::gil_scoped_release>());

  bind_cufile(m);
  bind_byteplane(m);
}
