// Chunk scatter/gather between a [P, L, T, Dfull] tensor and per-chunk [P, L, C, W]
// regions: argument validation and copy planning.
#pragma once

#include <cstdint>
#include <vector>

#include "copy_kernels.hpp"

namespace lmckv {

struct KvGeometry {
  uint64_t planes;       // P
  uint64_t layers;       // L
  uint64_t tokens;       // T
  uint64_t dfull;        // Dfull
  uint64_t itemsize;     // bytes per element
  uint64_t width;        // W (elements copied per row)
  uint64_t col_offset;   // first copied column
  uint64_t chunk_tokens; // C
};

// Validate everything (ValueError on the first problem, before any byte moves) and
// build the copy plan. `to_regions`: scatter (tensor -> regions) if true, else gather.
// `tensor_nbytes` is the memory that backs the tensor from `tensor_ptr` on (the Python
// side passes min(numel, what its storage still holds past the data pointer) x itemsize);
// a null `tensor_ptr` or a shape needing more bytes raises TensorSpanError.
// Every run is bounds-checked against [tensor_ptr, tensor_ptr + tensor_nbytes) and
// [region_addrs[j], region_addrs[j] + region_nbytes[j]).
CopyPlan plan_kv_copy(bool to_regions, uintptr_t tensor_ptr, uint64_t tensor_nbytes,
                      const KvGeometry& g, const std::vector<int64_t>& chunk_ids,
                      const std::vector<int64_t>& region_addrs,
                      const std::vector<int64_t>& region_nbytes);

}  // namespace lmckv
