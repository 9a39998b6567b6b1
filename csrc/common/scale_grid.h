// Where the scale of element (r, c) of X [rows, cols] lives when X is quantized as a GEMM operand
// in a ScaleMode (coat/common.h): as q (X's rows are the operand's rows, K = cols) or as its
// transpose q_t (K = rows). Shared by the scaled quantizer's CPU reference and its kernel, and by
// the GEMM reference, so all three read one layout.
#pragma once

#include "coat/common.h"
#include "fp8.h"

namespace coat {

struct ScaleGrid {
  // The group extent along X's rows and cols: 1, kScaleBlock, or 0 (the whole axis).
  int64_t group_r = 0, group_c = 0;
  // scale index = (r / group_r) * stride_r + (c / group_c) * stride_c (an axis of extent 0 adds 0).
  int64_t stride_r = 0, stride_c = 0;

  COAT_HD int64_t index(int64_t r, int64_t c) const {
    return (group_r ? r / group_r * stride_r : 0) + (group_c ? c / group_c * stride_c : 0);
  }
  // Whether each group lies inside one kScaleBlock x kScaleBlock tile of X [rows, cols].
  COAT_HD bool tile_local(int64_t rows, int64_t cols) const {
    return (group_r != 0 || rows <= kScaleBlock) && (group_c != 0 || cols <= kScaleBlock);
  }
};

COAT_HD int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }
COAT_HD int64_t blocks_of(int64_t v) { return (v + kScaleBlock - 1) / kScaleBlock; }

// The grid of X [rows, cols] quantized in mode m, as q (transposed false) or q_t (true).
COAT_HD ScaleGrid scale_grid(ScaleMode m, bool transposed, int64_t rows, int64_t cols) {
  ScaleGrid g;
  const int64_t B = kScaleBlock;
  switch (m) {
    case ScaleMode::kTensor: break;
    case ScaleMode::kRow:  // one per operand row: X's rows (q) or X's columns (q_t)
      if (transposed) g.group_c = 1, g.stride_c = 1;
      else g.group_r = 1, g.stride_r = 1;
      break;
    case ScaleMode::kVec128:  // [K / 128][operand rows]
      if (transposed) g.group_r = B, g.group_c = 1, g.stride_r = cols, g.stride_c = 1;
      else g.group_r = 1, g.group_c = B, g.stride_r = 1, g.stride_c = rows;
      break;
    case ScaleMode::kBlock128:  // [operand rows / 128][round_up(K / 128, 4)]
      g.group_r = B, g.group_c = B;
      if (transposed) g.stride_r = 1, g.stride_c = round_up4(blocks_of(rows));
      else g.stride_r = round_up4(blocks_of(cols)), g.stride_c = 1;
      break;
  }
  return g;
}

}  // namespace coat
