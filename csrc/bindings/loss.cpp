// nanobind registration of the loss family.
#include "coat/loss.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

// logits [rows, vocab] (overwritten with the gradient when inv is given); labels [rows] int64
// (negative: ignored row); lse, target [rows] fp32.
void cross_entropy_rows_py(MutArray logits_, const Array& labels_, std::optional<Array> inv_, MutArray lse_,
                           MutArray target_, uintptr_t stream) {
  const View x = view_of(logits_, "logits"), labels = view_of(labels_, "labels"), lse = view_of(lse_, "lse"),
             target = view_of(target_, "target");
  const DType dt = float_dtype(x);
  COAT_CHECK_ARG(x.shape.size() == 2, "logits must be 2-D [rows, vocab], got shape " + shape_str(x.shape));
  const int64_t rows = x.shape[0], vocab = x.shape[1];
  expect_kind(labels, Kind::kInt64);
  expect_numel(labels, rows, "one per row of logits");
  expect_kind(lse, Kind::kFloat32);
  expect_numel(lse, rows, "one per row of logits");
  expect_kind(target, Kind::kFloat32);
  expect_numel(target, rows, "one per row of logits");
  View inv;
  if (inv_) {
    inv = view_of(*inv_, "inv");
    expect_kind(inv, Kind::kFloat32);
    expect_numel(inv, 1, "one scalar");
  }
  const bool cuda = inv_ ? same_device({&x, &labels, &lse, &target, &inv}) : same_device({&x, &labels, &lse, &target});
  const auto* lab = static_cast<const int64_t*>(labels.data);
  const auto* iv = static_cast<const float*>(inv.data);
  auto* l = static_cast<float*>(lse.data);
  auto* t = static_cast<float*>(target.data);
  if (cuda)
    COAT_GPU_CALL(cross_entropy_rows(x.data, dt, rows, vocab, lab, iv, inv_.has_value(), l, t, stream_of(stream)));
  else
    ref::cross_entropy_rows(x.data, dt, rows, vocab, lab, iv, inv_.has_value(), l, t);
}

void register_loss(nb::module_& m) {
  m.def("cross_entropy_rows", &cross_entropy_rows_py, arg("logits"), arg("labels"), arg("inv").none(), arg("lse"),
        arg("target"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(loss, register_loss);

}  // namespace bind
}  // namespace coat
