// sipp's CPU attention for small batches (kernels/attention.cpp).
#pragma once

#include "ggml-cpu-impl.h"
#include "ggml.h"

#include <cstddef>

namespace sipp {

// Whether the kernel takes this FLASH_ATTN_EXT: f32 queries, f16 keys and
// values, an f16 mask shared by the heads, no sinks, ALiBi or soft-capping,
// and any number of query rows.
bool attention_usable(const ggml_tensor * op);

// Work buffer bytes for `n_threads`.
size_t attention_work_size(const ggml_tensor * op, int n_threads);

// Computes the op; every thread of the graph calls it.
void attention_compute(ggml_compute_params * params, ggml_tensor * op);

// Products run so far.
unsigned long long attention_calls();

}  // namespace sipp
