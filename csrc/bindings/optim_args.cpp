#include "optim_args.h"

#include <string>
#include <vector>

namespace coat {
namespace bind {
namespace {

const float* scalar_arg(const std::optional<Array>& a, const char* name, const View& descs) {
  if (!a) return nullptr;
  View v = view_of(*a, name);
  expect_kind(v, Kind::kFloat32);
  expect_numel(v, 1, "a scalar");
  COAT_CHECK_ARG(v.cuda == descs.cuda && v.device == descs.device,
                 std::string(name) + " is on a different device than the optimizer states");
  return static_cast<const float*>(v.data);
}

DType named_dtype(int d, const char* name) {
  COAT_CHECK_ARG(d >= 0 && d <= 2, std::string(name) + " must be 0 (float32), 1 (bfloat16) or 2 (float16), got " +
                                       std::to_string(d));
  return static_cast<DType>(d);
}

}  // namespace

View descriptor_table(const MutArray& descs_) {
  View descs = view_of(descs_, "descs");
  expect_kind(descs, Kind::kInt64);
  COAT_CHECK_ARG(descs.shape.size() == 2 && descs.shape[1] == 16,
                 "descs must have shape [n, 16], got " + shape_str(descs.shape));
  return descs;
}

AdamwConfig step_config(const View& descs, double lr, const std::optional<Array>& lr_tensor, double beta1,
                        double beta2, double eps, double weight_decay, const std::optional<Array>& amp_scale,
                        const std::optional<Array>& clip_scale, bool maximize, const std::optional<Array>& found_inf,
                        int param_dtype, int grad_dtype, int master, int cpu_threads) {
  AdamwConfig c;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.lr_tensor = scalar_arg(lr_tensor, "lr", descs);
  c.amp_scale = scalar_arg(amp_scale, "amp_scale", descs);
  c.clip_scale = scalar_arg(clip_scale, "clip_scale", descs);
  c.maximize = maximize;
  c.found_inf = scalar_arg(found_inf, "found_inf", descs);
  c.param_dtype = named_dtype(param_dtype, "param_dtype");
  c.grad_dtype = named_dtype(grad_dtype, "grad_dtype");
  COAT_CHECK_ARG(master >= 0 && master <= 2, "master must be 0 (none), 1 (fp32) or 2 (bf16_sr)");
  c.master = static_cast<MasterKind>(master);
  c.cpu_threads = cpu_threads < 1 ? 1 : cpu_threads;
  return c;
}

}  // namespace bind
}  // namespace coat
