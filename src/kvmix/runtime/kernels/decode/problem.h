// What one call attends: float segments, packed blocks (channel planes or per-token
// groups), the problem of one sequence, its units of work and partial results.
#pragma once

namespace {

// ---- the problem -------------------------------------------------------------------------------

struct FloatSegment {  // float keys/values [n, H, t, D]; heads `head_stride` elements apart
  const void* keys;    // float32, or float16 or bfloat16 (`dtype`: a 32-bit model's sink and
  const void* values;  // residual slots, the vLLM plugin's staging), widened as they are read
  int64_t blocks, tokens;
  bool causal;  // the new tokens themselves: query i sees token j <= i
  int64_t head_stride;
  at::ScalarType dtype = at::kFloat;
  // values packed per token instead (the vLLM plugin's values="token"): tokens
  // [value_first, value_first + tokens) of pool page `value_page` (-1: the float values)
  int64_t value_page = -1, value_first = 0;
};

struct Plane {
  const uint8_t* codes;  // [n, bytes per block]: codes [H, C, G]
  int64_t block_bytes, channels;
  int bits;
  const int64_t* index;  // [H, C]
  const float* mult;     // [H, C]
  PlaneFn kernel;
  IntFn ints;  // the integer kernel, where the CPU and the row length have one
};

struct Stats {  // per-token groups: codes [n, H, G, J, group], (scale, min) [n, H, G, J]
  const uint8_t* codes = nullptr;
  int64_t block_bytes = 0;
  const at::Half* scale = nullptr;
  const at::Half* minimum = nullptr;  // null: symmetric levels (code - 2^(b-1) + 1/2)·scale
  int bits = 0;
  int64_t group = 0;
};

struct Packed {
  int64_t blocks = 0, group = 0;
  const int64_t* lengths = nullptr;  // tokens held per block
  int64_t skip = 0;                  // tokens at the front of block 0 a sliding window hides
  const int64_t* pages = nullptr;    // block n's page in the pool (null: block n itself)
  int key_mode = 0;                  // 1 channel planes, 2 per-token groups
  std::vector<Plane> planes;
  const at::Half* key_scale = nullptr;  // mode 1: [n, H, D]
  const at::Half* key_min = nullptr;
  const float* key_offset = nullptr;  // [H, D]
  Stats keys, values;
  DotsFn key_dots = nullptr;
  ValuesFn value_kernel = nullptr;
  IntFn value_ints = nullptr;
};

struct Problem {
  int64_t heads, kv_heads, group_size, queries, dim, rows;  // rows = group_size · queries
  int64_t padded;                                           // rows rounded up to RB
  const float* query;                                       // [Hq, q, D]
  float scale;                                              // folded into the query
  std::vector<FloatSegment> segments;
  Packed packed;
};

struct Unit {  // a block of a float segment (segment >= 0) or a packed block (-1)
  int segment;
  int64_t block;
};

struct Partial {  // online-softmax state of one task: per row max, sum, acc[D]
  std::vector<float> max, sum, acc;
};

}  // namespace
