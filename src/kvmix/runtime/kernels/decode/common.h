// What every part of the op shares: the query rows computed together, the prefetch distance,
// -inf, and the bytes of a packed row.
#pragma once

namespace {

using at::Tensor;
constexpr int RB = 4;  // query rows computed together
constexpr size_t AHEAD = 4;  // blocks ahead of the one computed whose codes are prefetched
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

int64_t row_bytes(int64_t n, int bits) { return bits == 3 ? n / 4 + n / 8 : n * bits / 8; }

}  // namespace
