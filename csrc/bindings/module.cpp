// coat._C: the compiled core. Only coat/_ops.py calls into it.
#include <nanobind/nanobind.h>

#include "coat/common.h"
#include "coat/quantize.h"

namespace nb = nanobind;

namespace coat {
namespace bind {
void register_quantize(nb::module_& m);
}  // namespace bind
}  // namespace coat

NB_MODULE(_C, m) {
  m.doc() = "coat core kernels (C++17/CUDA); use coat.functional, not this module";
  m.def("built_with_cuda", &coat::built_with_cuda);
  m.attr("DRE_GROUP_SIZE") = coat::kDreGroupSize;
  m.attr("DRE_LOG2_RANGE_E4M3") = coat::kDreLog2RangeE4M3;
  m.attr("DRE_LOG2_RANGE_E5M2") = coat::kDreLog2RangeE5M2;
  coat::bind::register_quantize(m);
}
