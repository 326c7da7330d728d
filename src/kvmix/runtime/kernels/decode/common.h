// What every part of the op shares: the query rows computed together, the prefetch distance,
// -inf, the bytes of a packed row, and the dispatch on a tile's real rows.
#pragma once

namespace {

using at::Tensor;
constexpr int RB = 4;  // query rows computed together
constexpr size_t AHEAD = 4;  // blocks ahead of the one computed whose codes are prefetched
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

int64_t row_bytes(int64_t n, int bits) { return bits == 3 ? n / 4 + n / 8 : n * bits / 8; }

// pick<R>() for a tile of R = 1..RB real query rows: the last tile of a KV head's rows computes
// only its real ones (a query group of 3 is one tile of 3, not 3 and a row of zeros; 6 is 4 + 2).
template <typename Pick>
auto for_rows(int64_t rows, Pick pick) -> decltype(pick.template operator()<1>()) {
  switch (rows) {
    case 1: return pick.template operator()<1>();
    case 2: return pick.template operator()<2>();
    case 3: return pick.template operator()<3>();
    default: return pick.template operator()<RB>();
  }
}

}  // namespace
