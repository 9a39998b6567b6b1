// nanobind registration of the rope family. q, k and v arrive as column ranges of row-major
// tensors seen as [tokens, numel / tokens]: a fused QKV output and its three column offsets, or
// three separate tensors ([..., heads, dim]) at offset 0.
#include "coat/rope.h"
#include "registry.h"
#include "tensor_args.h"

#include <deque>

namespace coat {
namespace bind {
namespace {

using nb::arg;

// One of q, k, v: the source and output column ranges, checked against tokens, dim and dtype.
RopeHeads heads_of(const std::optional<Array>& src_, int64_t src_off, const std::optional<MutArray>& dst_,
                   int64_t dst_off, int64_t heads, int64_t dim, int64_t tokens, const char* sname,
                   const char* dname, const View& ref, std::deque<View>& keep) {
  RopeHeads h;
  COAT_CHECK_ARG(heads >= 0, std::string(sname) + ": heads must be >= 0");
  if (heads == 0) return h;
  COAT_CHECK_ARG(src_.has_value() && dst_.has_value(), std::string(sname) + " and " + dname + " must be given");
  keep.push_back(view_of(*src_, sname));
  const View& s = keep.back();
  keep.push_back(view_of(*dst_, dname));
  const View& d = keep.back();
  for (const View* v : {&s, &d}) {
    COAT_CHECK_ARG(v->kind == ref.kind, std::string(v->name) + " is " + v->dtype_name + " but " + ref.name +
                                            " is " + ref.dtype_name + ": q, k, v, cos and sin share one dtype");
    COAT_CHECK_ARG(tokens > 0 && v->numel % tokens == 0,
                   std::string(v->name) + " of shape " + shape_str(v->shape) + " does not hold whole rows of " +
                       std::to_string(tokens) + " tokens");
    same_device({&ref, v});
  }
  const int64_t sw = s.numel / tokens, dw = d.numel / tokens;
  COAT_CHECK_ARG(src_off >= 0 && src_off + heads * dim <= sw,
                 std::string(sname) + ": columns [" + std::to_string(src_off) + ", " +
                     std::to_string(src_off + heads * dim) + ") do not fit its row width " + std::to_string(sw));
  COAT_CHECK_ARG(dst_off >= 0 && dst_off + heads * dim <= dw,
                 std::string(dname) + ": columns [" + std::to_string(dst_off) + ", " +
                     std::to_string(dst_off + heads * dim) + ") do not fit its row width " + std::to_string(dw));
  const int64_t es = dtype_size(float_dtype(s));
  h.src = static_cast<const uint8_t*>(s.data) + src_off * es;
  h.src_stride = sw;
  h.dst = static_cast<uint8_t*>(d.data) + dst_off * es;
  h.dst_stride = dw;
  h.heads = heads;
  return h;
}

void rope_apply_py(const Array& q_src_, int64_t q_src_off, std::optional<Array> k_src_, int64_t k_src_off,
                   std::optional<Array> v_src_, int64_t v_src_off, MutArray q_dst_, int64_t q_dst_off,
                   std::optional<MutArray> k_dst_, int64_t k_dst_off, std::optional<MutArray> v_dst_,
                   int64_t v_dst_off, int64_t tokens, int64_t hq, int64_t hk, int64_t hv, int64_t dim,
                   const Array& cos_,
                   const Array& sin_, bool backward, uintptr_t stream) {
  const View cs = view_of(cos_, "cos"), sn = view_of(sin_, "sin");
  RopeArgs a;
  a.dtype = float_dtype(cs);
  COAT_CHECK_ARG(dim > 0 && dim % 2 == 0, "head_dim must be even and > 0, got " + std::to_string(dim));
  COAT_CHECK_ARG(cs.last_dim() == dim && sn.shape == cs.shape,
                 "cos and sin must both be [..., head_dim = " + std::to_string(dim) + "], got " +
                     shape_str(cs.shape) + " and " + shape_str(sn.shape));
  COAT_CHECK_ARG(sn.kind == cs.kind, "sin must have cos's dtype");
  same_device({&cs, &sn});
  std::deque<View> keep;  // deque: references to its elements stay valid as it grows
  const View q_src = view_of(q_src_, "q_src");
  COAT_CHECK_ARG(q_src.kind == cs.kind, std::string("q_src is ") + q_src.dtype_name + " but cos is " +
                                            cs.dtype_name + ": q, k, v, cos and sin share one dtype");
  COAT_CHECK_ARG(tokens >= 0, "tokens must be >= 0");
  a.tokens = tokens;
  if (tokens == 0) return;
  a.q = heads_of(std::optional<Array>(q_src_), q_src_off, std::optional<MutArray>(q_dst_), q_dst_off, hq, dim,
                 tokens, "q_src", "q_dst", q_src, keep);
  a.k = heads_of(k_src_, k_src_off, k_dst_, k_dst_off, hk, dim, tokens, "k_src", "k_dst", q_src, keep);
  a.v = heads_of(v_src_, v_src_off, v_dst_, v_dst_off, hv, dim, tokens, "v_src", "v_dst", q_src, keep);
  a.dim = dim;
  a.cos = cs.data;
  a.sin = sn.data;
  a.cs_rows = cs.rows();
  a.backward = backward;
  if (same_device({&q_src, &cs}))
    COAT_GPU_CALL(rope_apply(a, stream_of(stream)));
  else
    ref::rope_apply(a);
}

void register_rope(nb::module_& m) {
  m.def("rope_apply", &rope_apply_py, arg("q_src"), arg("q_src_off"), arg("k_src").none(), arg("k_src_off"),
        arg("v_src").none(), arg("v_src_off"), arg("q_dst"), arg("q_dst_off"), arg("k_dst").none(),
        arg("k_dst_off"), arg("v_dst").none(), arg("v_dst_off"), arg("tokens"), arg("hq"), arg("hk"), arg("hv"), arg("dim"),
        arg("cos"), arg("sin"), arg("backward"), arg("stream"));
}

}  // namespace

COAT_REGISTER_BINDINGS(rope, register_rope);

}  // namespace bind
}  // namespace coat
