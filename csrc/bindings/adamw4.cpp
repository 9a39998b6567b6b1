// nanobind registration of the adamw4 family (4-bit AdamW states). As for adamw: the descriptor
// table (int64 [n, 16], layout of coat::Adamw4Tensor) carries raw pointers that coat.optim built
// from tensors it validated; here the table, the scalar tensors and the configuration are checked.
#include "coat/adamw4.h"
#include "enums.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

const float* scalar_arg(const std::optional<Array>& a, const char* name, std::vector<View>& views) {
  if (!a) return nullptr;
  View v = view_of(*a, name);
  expect_kind(v, Kind::kFloat32);
  expect_numel(v, 1, "a scalar");
  views.push_back(v);
  return static_cast<const float*>(v.data);
}

void adamw4_step_py(MutArray descs_, int64_t n_groups, double lr, std::optional<Array> lr_tensor, double beta1,
                    double beta2, double eps, double weight_decay, std::optional<Array> grad_scale,
                    std::optional<Array> found_inf, int param_dtype, int grad_dtype, int master, int cpu_threads,
                    uintptr_t stream) {
  const View descs = view_of(descs_, "descs");
  expect_kind(descs, Kind::kInt64);
  COAT_CHECK_ARG(descs.shape.size() == 2 && descs.shape[1] == 16,
                 "descs must have shape [n, 16], got " + shape_str(descs.shape));
  std::vector<View> views{descs};
  AdamwConfig c;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.lr_tensor = scalar_arg(lr_tensor, "lr", views);
  c.grad_scale = scalar_arg(grad_scale, "grad_scale", views);
  c.found_inf = scalar_arg(found_inf, "found_inf", views);
  c.param_dtype = dtype_arg(param_dtype);
  c.grad_dtype = dtype_arg(grad_dtype);
  COAT_CHECK_ARG(master >= 0 && master <= 2, "master must be 0 (none), 1 (fp32) or 2 (bf16_sr)");
  c.master = static_cast<MasterKind>(master);
  c.cpu_threads = cpu_threads < 1 ? 1 : cpu_threads;
  for (const View& v : views) {
    COAT_CHECK_ARG(v.cuda == descs.cuda && v.device == descs.device,
                   std::string(v.name) + " is on a different device than the optimizer states");
  }
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
  m.attr("ADAMW4_BLOCK") = kAdamw4Block;
  m.attr("ADAMW4_KINDS") = enum_dict<Adamw4Kind>(
      {{"full", Adamw4Kind::kFull}, {"block", Adamw4Kind::kBlock}, {"rank1", Adamw4Kind::kRank1}});
  m.attr("ADAMW4_MIN_NUMEL") = kAdamw4MinNumel;
  m.def("adamw4_step", &adamw4_step_py, restore_device(), arg("descs"), arg("n_groups"), arg("lr"),
        arg("lr_tensor").none(), arg("beta1"), arg("beta2"), arg("eps"), arg("weight_decay"),
        arg("grad_scale").none(), arg("found_inf").none(), arg("param_dtype"), arg("grad_dtype"), arg("master"),
        arg("cpu_threads"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(adamw4, register_adamw4);

}  // namespace bind
}  // namespace coat
