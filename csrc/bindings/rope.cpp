// nanobind registration of the rope family. The core sees q, k and v as column ranges of row-major
// tensors seen as [tokens, numel / tokens]: a fused QKV output and its three column offsets, or
// three separate tensors ([..., heads, dim]) at offset 0.
#include "coat/rope.h"
#include "registry.h"
#include "tensor_args.h"

#include <algorithm>
#include <initializer_list>

namespace coat {
namespace bind {
namespace {

using nb::arg;

// cos and sin [..., dim] (one dtype, one shape) into the arguments; their dtype is every tensor's.
RopeArgs tables(const View& cs, const View& sn, int64_t dim, int64_t tokens, bool backward) {
  RopeArgs a;
  a.dtype = float_dtype(cs);
  COAT_CHECK_ARG(dim > 0 && dim % 2 == 0, "head_dim must be even and > 0, got " + std::to_string(dim));
  COAT_CHECK_ARG(cs.last_dim() == dim && sn.shape == cs.shape,
                 "cos and sin must both be [..., head_dim = " + std::to_string(dim) + "], got " +
                     shape_str(cs.shape) + " and " + shape_str(sn.shape));
  COAT_CHECK_ARG(sn.kind == cs.kind, "sin must have cos's dtype");
  same_device({&cs, &sn});
  a.dim = dim;
  a.tokens = tokens;
  a.cos = cs.data;
  a.sin = sn.data;
  a.cs_rows = cs.rows();
  a.backward = backward;
  return a;
}

// `heads` heads of one of q, k, v: columns [off, off + heads * dim) of each token's row of src and
// dst (tensors seen as [tokens, numel / tokens]), checked against tokens, dim and cos's dtype.
RopeHeads heads_of(const View& src, int64_t src_off, const View& dst, int64_t dst_off, int64_t heads,
                   const RopeArgs& a, const View& cs) {
  RopeHeads h;
  if (heads == 0) return h;
  for (const View* v : {&src, &dst}) {
    COAT_CHECK_ARG(v->kind == cs.kind, std::string(v->name) + " is " + v->dtype_name + " but cos is " + cs.dtype_name +
                                           ": q, k, v, cos and sin share one dtype");
    COAT_CHECK_ARG(v->numel % a.tokens == 0, std::string(v->name) + " of shape " + shape_str(v->shape) +
                                                 " does not hold whole rows of " + std::to_string(a.tokens) +
                                                 " tokens");
    same_device({&cs, v});
  }
  const int64_t sw = src.numel / a.tokens, dw = dst.numel / a.tokens;
  COAT_CHECK_ARG(src_off + heads * a.dim <= sw, std::string(src.name) + " rows of " + std::to_string(sw) +
                                                    " elements do not hold " + std::to_string(heads) + " heads of " +
                                                    std::to_string(a.dim));
  COAT_CHECK(dst_off + heads * a.dim <= dw, "rope: output row too narrow");
  const int64_t es = dtype_size(a.dtype);
  h.src = static_cast<const uint8_t*>(src.data) + src_off * es;
  h.src_stride = sw;
  h.dst = static_cast<uint8_t*>(dst.data) + dst_off * es;
  h.dst_stride = dw;
  h.heads = heads;
  return h;
}

void run(const RopeArgs& a, const View& cs, uintptr_t stream) {
  if (a.tokens == 0) return;
  if (cs.cuda)
    COAT_GPU_CALL(rope_apply(a, stream_of(stream)));
  else
    ref::rope_apply(a);
}

std::vector<int64_t> lead_with(const std::vector<int64_t>& shape, size_t drop, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> s(shape.begin(), shape.end() - static_cast<std::ptrdiff_t>(std::min(drop, shape.size())));
  s.insert(s.end(), tail);
  return s;
}

// qkv [..., (hq + 2 hk) dim] -> (q [..., hq, dim], k, v [..., hk, dim]), RoPE on q and k.
nb::tuple rope_qkv_py(const Array& qkv_, const Array& cos_, const Array& sin_, int64_t hq, int64_t hk, int64_t dim,
                      uintptr_t stream) {
  const View qkv = view_of(qkv_, "qkv"), cs = view_of(cos_, "cos"), sn = view_of(sin_, "sin");
  COAT_CHECK_ARG(hq >= 0 && hk >= 0 && !qkv.shape.empty() && qkv.last_dim() == (hq + 2 * hk) * dim,
                 "qkv must be [..., (hq + 2 hk) head_dim], got " + shape_str(qkv.shape));
  const RopeArgs base = tables(cs, sn, dim, qkv.last_dim() ? qkv.rows() : 0, false);
  Created q = new_tensor(lead_with(qkv.shape, 1, {hq, dim}), new_dtype(base.dtype), qkv, "q");
  Created k = new_tensor(lead_with(qkv.shape, 1, {hk, dim}), new_dtype(base.dtype), qkv, "k");
  Created v = new_tensor(lead_with(qkv.shape, 1, {hk, dim}), new_dtype(base.dtype), qkv, "v");
  RopeArgs a = base;
  if (a.tokens) {
    a.q = heads_of(qkv, 0, q.view, 0, hq, a, cs);
    a.k = heads_of(qkv, hq * dim, k.view, 0, hk, a, cs);
    a.v = heads_of(qkv, (hq + hk) * dim, v.view, 0, hk, a, cs);
  }
  run(a, cs, stream);
  return nb::make_tuple(q.tensor, k.tensor, v.tensor);
}

// The fused QKV gradient [..., (hq + 2 hk) dim] from dq [..., hq, dim], dk and dv [..., hk, dim].
nb::object rope_qkv_bwd_py(const Array& dq_, const Array& dk_, const Array& dv_, const Array& cos_, const Array& sin_,
                           uintptr_t stream) {
  const View dq = view_of(dq_, "dq"), dk = view_of(dk_, "dk"), dv = view_of(dv_, "dv"), cs = view_of(cos_, "cos"),
             sn = view_of(sin_, "sin");
  COAT_CHECK_ARG(dq.shape.size() >= 2 && dk.shape.size() >= 2 && dk.shape == dv.shape,
                 "dq, dk and dv must be [..., heads, head_dim] with dk and dv alike, got " + shape_str(dq.shape) +
                     ", " + shape_str(dk.shape) + " and " + shape_str(dv.shape));
  const int64_t dim = dq.last_dim(), hq = dq.shape[dq.shape.size() - 2], hk = dk.shape[dk.shape.size() - 2];
  const int64_t tokens = dq.numel / std::max<int64_t>(1, hq * dim);
  const RopeArgs base = tables(cs, sn, dim, tokens, true);
  Created out = new_tensor(lead_with(dq.shape, 2, {(hq + 2 * hk) * dim}), new_dtype(base.dtype), dq, "dqkv");
  RopeArgs a = base;
  if (a.tokens) {
    a.q = heads_of(dq, 0, out.view, 0, hq, a, cs);
    a.k = heads_of(dk, 0, out.view, hq * dim, hk, a, cs);
    a.v = heads_of(dv, 0, out.view, (hq + hk) * dim, hk, a, cs);
  }
  run(a, cs, stream);
  return out.tensor;
}

// RoPE (or, with `backward`, its gradient map) on one [..., heads, dim] tensor.
nb::object rope_py(const Array& x_, const Array& cos_, const Array& sin_, bool backward, uintptr_t stream) {
  const View x = view_of(x_, "x"), cs = view_of(cos_, "cos"), sn = view_of(sin_, "sin");
  COAT_CHECK_ARG(x.shape.size() >= 2, "x must be [..., heads, head_dim], got " + shape_str(x.shape));
  const int64_t dim = x.last_dim(), heads = x.shape[x.shape.size() - 2];
  const RopeArgs base = tables(cs, sn, dim, x.numel / std::max<int64_t>(1, heads * dim), backward);
  Created out = new_tensor(x.shape, new_dtype(base.dtype), x, "out");
  RopeArgs a = base;
  if (a.tokens) a.q = heads_of(x, 0, out.view, 0, heads, a, cs);
  run(a, cs, stream);
  return out.tensor;
}

void register_rope(nb::module_& m) {
  m.def("rope_qkv", &rope_qkv_py, restore_device(), arg("qkv"), arg("cos"), arg("sin"), arg("hq"), arg("hk"), arg("dim"),
        arg("stream"));
  m.def("rope_qkv_bwd", &rope_qkv_bwd_py, restore_device(), arg("dq"), arg("dk"), arg("dv"), arg("cos"), arg("sin"), arg("stream"));
  m.def("rope", &rope_py, restore_device(), arg("x"), arg("cos"), arg("sin"), arg("backward"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(rope, register_rope);

}  // namespace bind
}  // namespace coat
