// nanobind registration of the loss family.
#include "coat/loss.h"
#include "registry.h"
#include "tensor_args.h"

namespace coat {
namespace bind {
namespace {

using nb::arg;

// (lse, target) [rows] fp32 of logits [rows, vocab], overwritten with the gradient when inv is
// given; labels [rows] int64 (negative: ignored row).
nb::tuple cross_entropy_rows_py(MutArray logits_, const Array& labels_, std::optional<Array> inv_, uintptr_t stream) {
  const View x = view_of(logits_, "logits"), labels = view_of(labels_, "labels");
  const DType dt = float_dtype(x);
  COAT_CHECK_ARG(x.shape.size() == 2, "logits must be 2-D [rows, vocab], got shape " + shape_str(x.shape));
  const int64_t rows = x.shape[0], vocab = x.shape[1];
  expect_kind(labels, Kind::kInt64);
  expect_numel(labels, rows, "one per row of logits");
  View inv;
  if (inv_) {
    inv = view_of(*inv_, "inv");
    expect_kind(inv, Kind::kFloat32);
    expect_numel(inv, 1, "one scalar");
  }
  const bool cuda = inv_ ? same_device({&x, &labels, &inv}) : same_device({&x, &labels});
  Created lse = new_tensor({rows}, NewDtype::kFloat32, x, "lse");
  Created target = new_tensor({rows}, NewDtype::kFloat32, x, "target");
  const auto* lab = static_cast<const int64_t*>(labels.data);
  const auto* iv = static_cast<const float*>(inv.data);
  auto* l = static_cast<float*>(lse.view.data);
  auto* t = static_cast<float*>(target.view.data);
  if (cuda)
    COAT_GPU_CALL(cross_entropy_rows(x.data, dt, rows, vocab, lab, iv, inv_.has_value(), l, t, stream_of(stream)));
  else
    ref::cross_entropy_rows(x.data, dt, rows, vocab, lab, iv, inv_.has_value(), l, t);
  return nb::make_tuple(lse.tensor, target.tensor);
}

void register_loss(nb::module_& m) {
  m.def("cross_entropy_rows", &cross_entropy_rows_py, restore_device(), arg("logits"), arg("labels"), arg("inv").none(), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(loss, register_loss);

}  // namespace bind
}  // namespace coat
