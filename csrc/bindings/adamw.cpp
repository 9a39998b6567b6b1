// nanobind registration of the adamw family. The descriptor table (int64 [n, 16], one row per
// parameter tensor, layout of coat::AdamwTensor) carries raw pointers that coat.optim built from
// tensors it validated itself; here the table, the scalar tensors and the configuration are checked.
#include <cstddef>

#include "coat/adamw.h"
#include "optim_args.h"
#include "registry.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

void adamw_step_py(MutArray descs_, int64_t n_groups, double lr, std::optional<Array> lr_tensor,
                   double beta1, double beta2, double eps, double weight_decay, std::optional<Array> amp_scale,
                   std::optional<Array> clip_scale, bool maximize, std::optional<Array> found_inf, int param_dtype,
                   int grad_dtype, int master, int m_fmt, int v_fmt, bool expansion,
                   float m_log2_range, float v_log2_range, int cpu_threads, uintptr_t stream) {
  const View descs = descriptor_table(descs_);
  AdamwConfig c = step_config(descs, lr, lr_tensor, beta1, beta2, eps, weight_decay, amp_scale, clip_scale, maximize,
                              found_inf, param_dtype, grad_dtype, master, cpu_threads);
  c.m_fmt = fp8_format(m_fmt);
  c.v_fmt = fp8_format(v_fmt);
  c.expansion = expansion;
  c.m_log2_range = m_log2_range;
  c.v_log2_range = v_log2_range;
  const auto* table = static_cast<const AdamwTensor*>(descs.data);
  const int64_t n = descs.shape[0];
  if (same_device({&descs})) {  // throws for CUDA tensors in a build without CUDA
    COAT_GPU_CALL(adamw_step(table, n, n_groups, c, stream_of(stream)));
  } else {
    nb::gil_scoped_release release;  // the CPU step may take a while; let other Python threads run
    ref::adamw_step(table, n, n_groups, c);
  }
}

void register_adamw(nb::module_& m) {
  m.attr("ADAMW_DESC_WORDS") = 16;
  m.attr("ADAMW_AMAX_WORD") = offsetof(AdamwTensor, param_amax) / 8;  // the word of param_amax
  m.def("adamw_step", &adamw_step_py, restore_device(), arg("descs"), arg("n_groups"), arg("lr"), arg("lr_tensor").none(),
        arg("beta1"), arg("beta2"), arg("eps"), arg("weight_decay"), arg("amp_scale").none(),
        arg("clip_scale").none(), arg("maximize"), arg("found_inf").none(), arg("param_dtype"), arg("grad_dtype"), arg("master"), arg("m_fmt"),
        arg("v_fmt"), arg("expansion"), arg("m_log2_range"), arg("v_log2_range"), arg("cpu_threads"),
        arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(adamw, register_adamw);

}  // namespace bind
}  // namespace coat
