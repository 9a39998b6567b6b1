// nanobind registration of the adamw4 family (4-bit AdamW states). As for adamw: the descriptor
// table (int64 [n, 16], layout of coat::Adamw4Tensor) carries raw pointers that coat.optim built
// from tensors it validated; here the table, the scalar tensors and the configuration are checked.
#include <cstddef>

#include "coat/adamw4.h"
#include "enums.h"
#include "optim_args.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

void adamw4_step_py(MutArray descs_, int64_t n_groups, double lr, std::optional<Array> lr_tensor, double beta1,
                    double beta2, double eps, double weight_decay, std::optional<Array> amp_scale,
                    std::optional<Array> clip_scale, bool maximize, std::optional<Array> found_inf, int param_dtype,
                    int grad_dtype, int master, int cpu_threads, uintptr_t stream) {
  const View descs = descriptor_table(descs_);
  const AdamwConfig c = step_config(descs, lr, lr_tensor, beta1, beta2, eps, weight_decay, amp_scale, clip_scale,
                                    maximize, found_inf, param_dtype, grad_dtype, master, cpu_threads);
  const auto* table = static_cast<const Adamw4Tensor*>(descs.data);
  const int64_t n = descs.shape[0];
  if (same_device({&descs})) {  // throws for CUDA tensors in a build without CUDA
    COAT_GPU_CALL(adamw4_step(table, n, n_groups, c, stream_of(stream)));
  } else {
    nb::gil_scoped_release release;  // the CPU step may take a while; let other Python threads run
    ref::adamw4_step(table, n, n_groups, c);
  }
}

void register_adamw4(nb::module_& m) {
  m.attr("ADAMW4_DESC_WORDS") = 16;
  m.attr("ADAMW4_AMAX_WORD") = offsetof(Adamw4Tensor, param_amax) / 8;  // the word of param_amax
  m.attr("ADAMW4_BLOCK") = kAdamw4Block;
  m.attr("ADAMW4_KINDS") = enum_dict<Adamw4Kind>(
      {{"full", Adamw4Kind::kFull}, {"block", Adamw4Kind::kBlock}, {"rank1", Adamw4Kind::kRank1}});
  m.attr("ADAMW4_MIN_NUMEL") = kAdamw4MinNumel;
  m.def("adamw4_step", &adamw4_step_py, restore_device(), arg("descs"), arg("n_groups"), arg("lr"),
        arg("lr_tensor").none(), arg("beta1"), arg("beta2"), arg("eps"), arg("weight_decay"),
        arg("amp_scale").none(), arg("clip_scale").none(), arg("maximize"), arg("found_inf").none(), arg("param_dtype"), arg("grad_dtype"), arg("master"),
        arg("cpu_threads"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(adamw4, register_adamw4);

}  // namespace bind
}  // namespace coat
