// What every fused optimizer step binding takes (adamw, adamw4): the descriptor table and the
// shared part of coat::AdamwConfig (hyperparameters, the three gradient transforms, the skip flag,
// dtypes, the master kind), checked here once. Each family adds its own fields.
#pragma once

#include <optional>

#include "coat/adamw.h"
#include "tensor_args.h"

namespace coat {
namespace bind {

// descs: int64 [n, 16], one row per parameter tensor (the family's descriptor layout).
View descriptor_table(const MutArray& descs);

// The shared configuration; every scalar tensor is fp32 with one element, on the table's device.
AdamwConfig step_config(const View& descs, double lr, const std::optional<Array>& lr_tensor, double beta1,
                        double beta2, double eps, double weight_decay, const std::optional<Array>& amp_scale,
                        const std::optional<Array>& clip_scale, bool maximize, const std::optional<Array>& found_inf,
                        int param_dtype, int grad_dtype, int master, int cpu_threads);

}  // namespace bind
}  // namespace coat
