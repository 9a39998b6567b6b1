// The enums of the core's public headers, exported as name -> value dicts (see enums.h). The names
// are the ones Python uses: FP8 format names, torch dtype names, optimizer master kinds, norm kinds,
// gated activations ("gelu_tanh": torch's gelu(approximate="tanh"), transformers' "gelu_pytorch_tanh").
#include "enums.h"

#include "coat/adamw.h"
#include "coat/common.h"
#include "coat/gemm.h"
#include "coat/norm.h"
#include "coat/swiglu.h"
#include "registry.h"

namespace coat {
namespace bind {
namespace {

void register_enums(nanobind::module_& m) {
  m.attr("FP8_FORMATS") = enum_dict<Fp8Format>({{"e4m3", Fp8Format::kE4M3}, {"e5m2", Fp8Format::kE5M2}});
  m.attr("DTYPES") = enum_dict<DType>(
      {{"float32", DType::kFloat32}, {"bfloat16", DType::kBFloat16}, {"float16", DType::kFloat16}});
  m.attr("SCALE_KINDS") = enum_dict<ScaleKind>({{"fp32", ScaleKind::kFloat32}, {"e8m0", ScaleKind::kE8M0}});
  m.attr("MASTER_KINDS") = enum_dict<MasterKind>(
      {{"none", MasterKind::kNone}, {"fp32", MasterKind::kFp32}, {"bf16_sr", MasterKind::kBf16Sr}});
  m.attr("GEMM_OUTS") = enum_dict<GemmOut>(
      {{"float32", GemmOut::kFloat32}, {"bfloat16", GemmOut::kBFloat16}, {"float8_e4m3fn", GemmOut::kE4M3}});
  m.attr("NORM_KINDS") =
      enum_dict<NormKind>({{"scaled", NormKind::kScaled}, {"unit_offset", NormKind::kUnitOffset}});
  m.attr("GATED_ACTS") = enum_dict<GatedAct>({{"silu", GatedAct::kSilu}, {"gelu_tanh", GatedAct::kGeluTanh}});
}

}  // namespace

COAT_REGISTER_BINDINGS(enums, register_enums);

}  // namespace bind
}  // namespace coat
