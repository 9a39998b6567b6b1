// coat._C: the compiled core. Only the coat._ops package calls into it.
#include <nanobind/nanobind.h>

#include "coat/common.h"
#include "registry.h"

NB_MODULE(_C, m) {
  m.doc() = "coat core kernels (C++17/CUDA); use coat.functional, not this module";
  m.def("built_with_cuda", &coat::built_with_cuda);
  for (auto& [name, fn] : coat::bind::registry()) fn(m);
}
