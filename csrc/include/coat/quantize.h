// FP8 quantization: per-tensor, per-group (1 x G along the last dimension) and Dynamic Range
// Expansion (DRE) for optimizer states.
//
// Numerics (docs/numerics.md has the full contract):
// - A scale s is a dequantization multiplier: x ~= q * s. Quantization computes
//   q = fp8(x * (1/s)) with 1/s rounded to fp32 once, round-to-nearest-even, saturating to the
//   format's max magnitude (infinities too); NaN becomes the canonical NaN code 0x7F.
// - Scales derived from an amax: s = max(amax / fmt_max, 2^-126), and s = 1 when amax is 0.
//   amax ignores NaN and infinities (they cannot be represented by any scale anyway).
// - E8M0 group scales are the smallest power of two >= amax / fmt_max, stored as the biased
//   exponent byte (s = 2^(b-127)).
// - Tensors are row-major [rows, cols]; any leading dimensions are folded into rows. FP8 data is
//   one byte per element (uint8 codes). All sizes may be 0. Pointers need no particular alignment:
//   aligned data takes the vectorized path.
#pragma once

#include <cstdint>

#include "coat/common.h"

namespace coat {

// Group size of the DRE quantizer (elements per group, consecutive in the flattened tensor).
constexpr int kDreGroupSize = 128;
// log2 of the dynamic range that expansion may fill, per format (max / min |y| within a group).
// E4M3: 448^2/2 as NVlabs COAT chose; E5M2: the span from its max to its smallest normal.
constexpr float kDreLog2RangeE4M3 = 16.6147098441f;
constexpr float kDreLog2RangeE5M2 = 29.807354922f;
// k is stored as k16 = round_down(16 k) in one byte, so k lies in [1/16, 255/16]: k > 1 expands a
// narrow group onto the format's range, k < 1 compresses a group wider than the format can hold
// (an outlier beside small values). k = 1 (kDreUnitK16) is plain per-group FP8.
constexpr int kDreMinK16 = 1;
constexpr int kDreUnitK16 = 16;
constexpr int kDreMaxK16 = 255;

// ---- per-tensor ------------------------------------------------------------------------------

// q[r,c] = fp8(x[r,c] / scale[0]); if q_t is not null also q_t[c,r] = q[r,c] ([cols, rows]).
void quantize_per_tensor(const void* x, DType x_dtype, int64_t rows, int64_t cols, Fp8Format fmt,
                         const float* scale, uint8_t* q, uint8_t* q_t, cudaStream_t stream);

// Same, with amax[0] = max |x| (finite values) and scale[0] = amax / fmt_max computed in the same
// call, on the device, without a host synchronisation: one pass for the amax, one to quantize.
void quantize_per_tensor_amax(const void* x, DType x_dtype, int64_t rows, int64_t cols,
                              Fp8Format fmt, float* amax, float* scale, uint8_t* q, uint8_t* q_t,
                              cudaStream_t stream);

// A matrix X [R, cols] stored as up to kMaxStackParts row blocks in separate buffers: the separate
// weights of a fused projection ([W_q; W_k; W_v], [W_gate; W_up]). Part i holds rows[i] rows,
// row-major and contiguous, all of one dtype. R = the sum of rows[i].
constexpr int kMaxStackParts = 4;
struct StackedRows {
  const void* data[kMaxStackParts] = {};
  int64_t rows[kMaxStackParts] = {};
  int count = 0;
  int64_t cols = 0;
  DType dtype = DType::kBFloat16;
};

// Per-tensor quantization of the stacked X, reading each part where it lies (no concatenated
// copy): q [R, cols] and/or q_t [cols, R] (either may be null, not both). With amax == null the
// scale is the given scale[0]; otherwise amax[0] = max |X| and scale_out[0] = amax / fmt_max are
// computed first, on the device, as quantize_per_tensor_amax does (scale is then unused). One
// part is exactly quantize_per_tensor(_amax): same kernels, same codes.
void quantize_stacked(const StackedRows& x, Fp8Format fmt, const float* scale, float* amax,
                      float* scale_out, uint8_t* q, uint8_t* q_t, cudaStream_t stream);

// quantize_stacked with an amax that the kernel producing X already wrote (group scaling: the
// y_amax / h_amax / dgu_amax outputs of coat/norm.h and coat/swiglu.h): scale_out[0] = amax[0] /
// fmt_max and the codes, in one pass over X. Given the amax quantize_stacked would compute, the
// codes and scale are bit-identical to its own.
void quantize_stacked_from_amax(const StackedRows& x, Fp8Format fmt, const float* amax, float* scale_out,
                                uint8_t* q, uint8_t* q_t, cudaStream_t stream);

// quantize_stacked_from_amax with one amax per part: part_amax[p][0] = max |part p| over its
// finite values, as the optimizer step that wrote the weight recorded it (coat.nn.weights); the
// scale is that of their max, and the codes and scale are quantize_stacked's bit for bit when each
// is the part's true amax. Such an amax comes from outside this call and can be stale (a weight
// edited in place where no version counter saw it): a finite value above it encodes as NaN, so a
// stale amax shows as NaN outputs, never as silently saturated codes. A value below it is not
// detected (the codes are then those of a coarser scale, still within range).
void quantize_stacked_from_part_amax(const StackedRows& x, Fp8Format fmt, const float* const* part_amax,
                                     float* scale_out, uint8_t* q, uint8_t* q_t, cudaStream_t stream);

// amax[0] = max |X| over the finite values of the stacked X: quantize_stacked's amax pass alone.
// A sharded weight's local maximum, reduced over the ranks and handed to quantize_stacked_from_amax
// for each shard (FP8 all-gather under FSDP2: every rank's codes take the whole weight's scale).
void amax_stacked(const StackedRows& x, float* amax, cudaStream_t stream);

// The transpose q_t [cols, R] of stacked FP8 codes X [R, cols] (x.dtype is ignored: the parts
// hold one-byte codes), reading each part where it lies: the input-gradient GEMM's layout of an
// FP8-frozen projection group, made in one pass (no concatenated copy, no strided byte copy).
void transpose_stacked_codes(const StackedRows& x, uint8_t* q_t, cudaStream_t stream);

// y[i] = q[i] * scale[0], written as out_dtype (rounded to nearest even).
void dequantize_per_tensor(const uint8_t* q, Fp8Format fmt, int64_t n, const float* scale, void* y,
                           DType out_dtype, cudaStream_t stream);

// ---- per-group (1 x group along cols) ---------------------------------------------------------

// group in {16, 32, 64, 128} and divides cols. scales is [rows, cols/group] of fp32 or of E8M0
// bytes (scale_kind). Each group gets s = scale from its own amax.
void quantize_per_group(const void* x, DType x_dtype, int64_t rows, int64_t cols, int group,
                        Fp8Format fmt, ScaleKind scale_kind, void* scales, uint8_t* q,
                        cudaStream_t stream);

void dequantize_per_group(const uint8_t* q, Fp8Format fmt, int64_t rows, int64_t cols, int group,
                          ScaleKind scale_kind, const void* scales, void* y, DType out_dtype,
                          cudaStream_t stream);

// ---- scaled GEMM operands (row and block granularity) --------------------------------------------

// X [R, cols] (the stacked parts, float dtypes) quantized as a GEMM operand q [rows_pad, cols_pad]
// in `mode` (its K is cols) and/or as its transpose q_t [cols_pad, rows_pad] in `mode_t` (K is R),
// for the cuBLASLt scale modes (ScaleMode, coat/common.h). rows_pad >= R and cols_pad >= cols: the
// padding is zeros of X, inside their groups like any element. scale / scale_t hold
// scale_count(mode, rows_pad, cols_pad) / scale_count(mode_t, cols_pad, rows_pad) fp32 values in
// the mode's layout. Each group takes the per-tensor rules: s = scale_for(max |x| over its finite
// values), q = fp8(x * (1/s)). Null q and scale (q_t and scale_t) make neither that output nor its scales (an empty X
// may pass null codes beside its row scales, which come out 1: all-zero groups); modes are
// kRow, kVec128 or kBlock128 (kTensor is quantize_stacked). Groups inside one 128 x 128 tile (1x128,
// 128x1, 128x128, and rows or columns no longer than 128) need one read of X: each tile computes
// its groups' maxima and quantizes in the same pass. Longer kRow groups take a first pass for
// their maxima. Both outputs come from the one read of X, so q_t is X's own rounding, not a
// requantized q.
void quantize_scaled(const StackedRows& x, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                     ScaleMode mode, uint8_t* q, float* scale, ScaleMode mode_t, uint8_t* q_t,
                     float* scale_t, cudaStream_t stream);

// ---- Dynamic Range Expansion (groups of kDreGroupSize consecutive elements) ----------------------

// For each group g: gmax[g] = max |x| and k16[g] = 16 k, where, with span = log2(max/min) over the
// group's non-zero |x|: k = log2_range / span when that is >= 1 (expansion; log2_range <= 0 turns
// it off), else k = min(1, log2_normal_range(fmt) / span) (compression: a group wider than the
// format keeps its smallest value in the format's normal range instead of flushing it to zero),
// rounded down to a multiple of 1/16 and clamped to [1/16, 255/16]. A non-zero x is never stored
// as the zero code (the smallest code instead). Each element is stored as
// q = fp8(sign(x) fmt_max (|x|/gmax)^k): DRE's
// y = (|x|/c)^k with its per-group scale s = (gmax/c)^k / fmt_max folded in, so c cancels and
// each group costs 5 bytes of metadata. Zeros stay zero, |x| == gmax is stored as +-fmt_max and
// decodes to gmax exactly (so constant groups are exact), non-finite inputs never enter gmax or
// the minimum, and no finite input produces NaN or Inf.
// Split groups: where the group max is at least 16 times the largest of the others, the max is
// kept apart (to 15 bits) and the others are encoded as a group of their own below the format's
// second-largest code, so that one outlier does not set the scale of its 127 neighbours. gmax[g]
// is then a negative word (sign bit set, the max truncated to 15 mantissa bits, the others' scale
// in the low byte: common/dre.h); a non-negative gmax[g] is a whole group as above.
// n may be any size; the last group may be partial. Groups: ceil(n / 128).
void dre_quantize(const float* x, int64_t n, Fp8Format fmt, float log2_range, uint8_t* q,
                  float* gmax, uint8_t* k16, cudaStream_t stream);

// x = sign(q) gmax (|q| / fmt_max)^(1/k) (split groups: see above).
void dre_dequantize(const uint8_t* q, const float* gmax, const uint8_t* k16, int64_t n,
                    Fp8Format fmt, float* y, cudaStream_t stream);

inline float dre_default_log2_range(Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? kDreLog2RangeE4M3 : kDreLog2RangeE5M2;
}

namespace ref {
void quantize_per_tensor(const void* x, DType x_dtype, int64_t rows, int64_t cols, Fp8Format fmt,
                         const float* scale, uint8_t* q, uint8_t* q_t);
void quantize_per_tensor_amax(const void* x, DType x_dtype, int64_t rows, int64_t cols,
                              Fp8Format fmt, float* amax, float* scale, uint8_t* q, uint8_t* q_t);
void dequantize_per_tensor(const uint8_t* q, Fp8Format fmt, int64_t n, const float* scale, void* y,
                           DType out_dtype);
void amax_stacked(const StackedRows& x, float* amax);
void transpose_stacked_codes(const StackedRows& x, uint8_t* q_t);
void quantize_stacked(const StackedRows& x, Fp8Format fmt, const float* scale, float* amax,
                      float* scale_out, uint8_t* q, uint8_t* q_t);
void quantize_stacked_from_amax(const StackedRows& x, Fp8Format fmt, const float* amax, float* scale_out,
                                uint8_t* q, uint8_t* q_t);
void quantize_stacked_from_part_amax(const StackedRows& x, Fp8Format fmt, const float* const* part_amax,
                                     float* scale_out, uint8_t* q, uint8_t* q_t);
void quantize_per_group(const void* x, DType x_dtype, int64_t rows, int64_t cols, int group,
                        Fp8Format fmt, ScaleKind scale_kind, void* scales, uint8_t* q);
void dequantize_per_group(const uint8_t* q, Fp8Format fmt, int64_t rows, int64_t cols, int group,
                          ScaleKind scale_kind, const void* scales, void* y, DType out_dtype);
void dre_quantize(const float* x, int64_t n, Fp8Format fmt, float log2_range, uint8_t* q,
                  float* gmax, uint8_t* k16);
void dre_dequantize(const uint8_t* q, const float* gmax, const uint8_t* k16, int64_t n,
                    Fp8Format fmt, float* y);
void quantize_scaled(const StackedRows& x, int64_t rows_pad, int64_t cols_pad, Fp8Format fmt,
                     ScaleMode mode, uint8_t* q, float* scale, ScaleMode mode_t, uint8_t* q_t,
                     float* scale_t);
}  // namespace ref

}  // namespace coat
