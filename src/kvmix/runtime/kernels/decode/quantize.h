// kvmix::quantize (and quantize_mixed, encode_pages: PN-Mix's keys, sealed groups written into
// their pages) — min-max (or bin-center) groups quantized and packed on CPU, bit for bit
// kvmix's torch encoder (quantizers.quantize_codes, packing.pack), as kvmix.core.fused's Triton
// kernel is on a GPU. Every step repeats the torch encoder's arithmetic in the input's dtype
// (T: float, at::Half or at::BFloat16): each operation done in float32 and rounded to T, as
// torch's elementwise kernels do; divisions IEEE; rounding half to even; the float16 statistics
// rounded outward one float16 ulp at a time, as torch.nextafter steps. Built without
// -ffast-math; no step multiplies, so none can be contracted into a fused multiply-add. One
// difference in bits, none in values: a group whose minimum is both +0 and -0 may keep the
// other zero than torch's amin, whose choice follows its reduction order.
#pragma once

namespace {

constexpr float ROUNDER = 12582912.f;  // 1.5·2^23
constexpr int LANES = 8;  // groups (or a group's elements) computed side by side
constexpr int64_t MAX_GROUP = 256;  // elements of a group (fused.CPU_MAX_GROUP)

template <typename T>
inline float in_dtype(float v) { return static_cast<float>(T(v)); }  // v rounded to T

// The float16 neighbour of r towards +inf (up) or -inf: torch.nextafter on float16.
inline at::Half next_half(at::Half r, bool up) {
  uint16_t raw = r.x;
  const bool negative = raw & 0x8000, zero = (raw & 0x7fff) == 0;
  if (zero) raw = up ? 0x0001 : 0x8001;
  else raw = (negative != up) ? raw + 1 : raw - 1;
  at::Half out;
  out.x = raw;
  return out;
}

// v rounded to float16 in one direction, compared in T (quantizers._round16).
template <typename T>
inline at::Half round_half(float v, bool down) {
  const at::Half r(v);
  const float back = in_dtype<T>(static_cast<float>(r));
  return (down ? back > v : back < v) ? next_half(r, !down) : r;
}

// x's code against a group's minimum m and scale (safe: 1 for a constant group), both in T:
// clamped first (to integers, so as after rounding), then floor (truncation, >= 0) or half to
// even (adding and taking away 1.5·2^23 rounds to an integer in that mode).
template <typename T>
inline uint8_t code_of(float x, float m, float safe, float top, bool center) {
  const float steps = in_dtype<T>(in_dtype<T>(x - m) / safe);
  const float v = std::min(std::max(steps, 0.f), top);
  return uint8_t(center ? v : (v + ROUNDER) - ROUNDER);
}

#ifdef __AVX512F__
// code_of for 16 elements at once (each lane its own minimum, scale, top and center): the same
// operations in the same order, IEEE in every lane, so the same codes for finite inputs.
template <typename T>
inline __m128i codes16(__m512 x, __m512 m, __m512 safe, __m512 top, __mmask16 center) {
  const __m512 steps = in_dtype16<T>(_mm512_div_ps(in_dtype16<T>(_mm512_sub_ps(x, m)), safe));
  const __m512 v = _mm512_min_ps(_mm512_max_ps(steps, _mm512_setzero_ps()), top);
  const __m512 rounder = _mm512_set1_ps(ROUNDER);
  const __m512 nearest = _mm512_sub_ps(_mm512_add_ps(v, rounder), rounder);
  return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_mask_mov_ps(nearest, center, v)));
}
#endif

// A group's float16 statistics from its range, and what its codes are computed against (the
// minimum and the scale, or 1 for a constant group, back in T).
template <typename T>
struct Grid {
  at::Half scale, minimum;
  float m, safe;

  Grid(float lo, float hi, int bits, bool center) {
    const bool constant = hi == lo;
    minimum = constant ? at::Half(lo) : round_half<T>(lo, true);
    m = in_dtype<T>(static_cast<float>(minimum));
    const float levels = float(center ? 1 << bits : (1 << bits) - 1);
    const float step = in_dtype<T>(in_dtype<T>(hi - m) / levels);
    scale = constant ? at::Half(0.f) : round_half<T>(step, false);
    const float s = in_dtype<T>(static_cast<float>(scale));
    safe = s > 0.f ? s : 1.f;
  }

  uint8_t code(float x, float top, bool center) const {
    return code_of<T>(x, m, safe, top, center);
  }
};

// One group of n elements `inner` apart (DENSE: 1 apart) -> its statistics and codes [n].
template <typename T, int BITS, bool DENSE>
void quantize_group(const T* x, int64_t n, int64_t stride, bool center, at::Half& scale,
                    at::Half& minimum, uint8_t* codes) {
  const int64_t inner = DENSE ? 1 : stride;
  float lo[LANES], hi[LANES];  // n >= 8: each lane a share of the elements
  for (int l = 0; l < LANES; ++l) lo[l] = hi[l] = static_cast<float>(x[l * inner]);
  for (int64_t i = LANES; i < n; i += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[(i + l) * inner]);
      lo[l] = v < lo[l] ? v : lo[l];
      hi[l] = v > hi[l] ? v : hi[l];
    }
  for (int l = 1; l < LANES; ++l) {
    lo[0] = lo[l] < lo[0] ? lo[l] : lo[0];
    hi[0] = hi[l] > hi[0] ? hi[l] : hi[0];
  }
  const Grid<T> grid(lo[0], hi[0], BITS, center);
  scale = grid.scale;
  minimum = grid.minimum;
  constexpr float top = float((1 << BITS) - 1);
  for (int64_t i = 0; i < n; ++i)
    codes[i] = grid.code(static_cast<float>(x[i * inner]), top, center);
}

// LANES groups side by side (group l's elements at x[i·inner + l]: per-channel keys read
// across channels) -> their statistics and codes [n][LANES], one vector op for all lanes.
template <typename T, int BITS>
void quantize_lanes(const T* x, int64_t n, int64_t inner, bool center, at::Half* scale,
                    at::Half* minimum, uint8_t (*codes)[LANES]) {
  float lo[LANES], hi[LANES];
  for (int l = 0; l < LANES; ++l) lo[l] = hi[l] = static_cast<float>(x[l]);
  for (int64_t i = 1; i < n; ++i)
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[i * inner + l]);
      lo[l] = v < lo[l] ? v : lo[l];
      hi[l] = v > hi[l] ? v : hi[l];
    }
  float m[LANES], safe[LANES];
  for (int l = 0; l < LANES; ++l) {
    const Grid<T> grid(lo[l], hi[l], BITS, center);
    scale[l] = grid.scale;
    minimum[l] = grid.minimum;
    m[l] = grid.m;
    safe[l] = grid.safe;
  }
  constexpr float top = float((1 << BITS) - 1);
  for (int64_t i = 0; i < n; ++i)
    for (int l = 0; l < LANES; ++l)
      codes[i][l] = code_of<T>(static_cast<float>(x[i * inner + l]), m[l], safe[l], top, center);
}

// codes [n], `step` apart -> one packed row: byte w holds codes w, w + W, ... at shifts 0, b,
// ... (3 bits: the 2-bit plane, then the 1-bit plane).
template <int BITS>
void pack_row(const uint8_t* codes, int64_t n, uint8_t* out, int64_t step = 1) {
  if constexpr (BITS == 3) {
    uint8_t low[MAX_GROUP], top[MAX_GROUP];
    for (int64_t i = 0; i < n; ++i) low[i] = codes[i * step] & 3, top[i] = codes[i * step] >> 2;
    pack_row<2>(low, n, out);
    pack_row<1>(top, n, out + n / 4);
  } else {
    constexpr int per = 8 / BITS;
    const int64_t W = n * BITS / 8;
    int64_t w = 0;
    // eight bytes at once (little-endian: byte j of a load is code j; a code shifted within
    // its byte never carries into the next)
    if (step == 1 && std::endian::native == std::endian::little)
      for (; w + 8 <= W; w += 8) {
        uint64_t word = 0;
        for (int s = 0; s < per; ++s) {
          uint64_t lane;
          std::memcpy(&lane, codes + s * W + w, 8);
          word |= lane << (s * BITS);
        }
        std::memcpy(out + w, &word, 8);
      }
    for (; w < W; ++w) {
      uint8_t byte = 0;
      for (int s = 0; s < per; ++s) byte |= uint8_t(codes[(s * W + w) * step] << (s * BITS));
      out[w] = byte;
    }
  }
}

// Where the groups start, in the order of x's other dimensions: in x (its strides) and in a
// contiguous tensor of x's shape, walked one group after another (no division per group).
struct GroupIndex {
  std::vector<int64_t> sizes, strides, dense;  // x's dimensions but the group's
  int64_t dense_inner = 1;  // a group's elements apart, in the contiguous tensor

  GroupIndex(const at::Tensor& x, int64_t dim) {
    int64_t step = 1;
    for (int64_t k = x.dim() - 1; k >= 0; --k) {
      if (k == dim) {
        dense_inner = step;
      } else {
        sizes.insert(sizes.begin(), x.size(k));
        strides.insert(strides.begin(), x.stride(k));
        dense.insert(dense.begin(), step);
      }
      step *= x.size(k);
    }
  }

  struct Cursor {
    const GroupIndex& index;
    std::vector<int64_t> at;  // the multi-index of the current group
    int64_t source = 0, target = 0;

    Cursor(const GroupIndex& index, int64_t g) : index(index), at(index.sizes.size()) {
      for (int64_t k = int64_t(at.size()) - 1; k >= 0; --k) {
        at[k] = g % index.sizes[k];
        g /= index.sizes[k];
        source += at[k] * index.strides[k];
        target += at[k] * index.dense[k];
      }
    }

    void next() {
      for (int64_t k = int64_t(at.size()) - 1; k >= 0; --k) {
        source += index.strides[k];
        target += index.dense[k];
        if (++at[k] < index.sizes[k]) return;
        source -= at[k] * index.strides[k];
        target -= at[k] * index.dense[k];
        at[k] = 0;
      }
    }
  };
};

// x groups of n elements `inner` apart, placed by `index`: codes uint8 shaped like x, or
// packed [B, bytes] (groups in order, a row each); scale, min float16 [groups]. Where groups
// lie side by side (the last other dimension has stride 1 and a multiple of LANES elements),
// LANES of them at a time.
template <typename T, int BITS>
void quantize_groups(const T* x, const GroupIndex& index, int64_t groups, int64_t n,
                     int64_t inner, bool center, bool packed, uint8_t* codes,
                     at::Half* scale, at::Half* min) {
  const int64_t width = row_bytes(n, BITS);
  const bool lanes = inner != 1 && !index.sizes.empty() && index.strides.back() == 1 &&
                     index.sizes.back() % LANES == 0;
  const int64_t step = lanes ? LANES : 1;
  at::parallel_for(0, groups / step, 8, [&](int64_t begin, int64_t end) {
    uint8_t rows[MAX_GROUP][LANES];  // [n][step]: element i of group l at rows[i][l]
    GroupIndex::Cursor group(index, begin * step);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t g = b * step;
      const T* first = x + group.source;
      if (lanes)
        quantize_lanes<T, BITS>(first, n, inner, center, scale + g, min + g, rows);
      else if (inner == 1)
        quantize_group<T, BITS, true>(first, n, 1, center, scale[g], min[g], &rows[0][0]);
      else
        quantize_group<T, BITS, false>(first, n, inner, center, scale[g], min[g], &rows[0][0]);
      for (int64_t l = 0; l < step; ++l, group.next()) {
        const uint8_t* row = &rows[0][lanes ? l : 0];
        const int64_t apart = lanes ? LANES : 1;
        if (packed) {
          pack_row<BITS>(row, n, codes + (g + l) * width, apart);
        } else {
          uint8_t* out = codes + group.target;
          for (int64_t i = 0; i < n; ++i) out[i * index.dense_inner] = row[i * apart];
        }
      }
    }
  });
}

// quantize_groups at a width known at run time.
template <typename T>
void quantize_groups(const T* x, const GroupIndex& index, int64_t groups, int64_t n,
                     int64_t inner, int bits, bool center, bool packed, uint8_t* codes,
                     at::Half* scale, at::Half* min) {
  for_bits(bits, [&]<int B>() {
    quantize_groups<T, B>(x, index, groups, n, inner, center, packed, codes, scale, min);
  });
}

// One head of per-channel keys, mixed-precision where k > 0 (PN-Mix): x [G tokens `token`
// apart, D channels `channel` apart]; channels `index` [k] at `high` bits (min-max), the others
// at `low` (bin-center when `center`), both grids from the channel's one range, so its minimum
// is the same. Writes the low plane [D rows of G codes at `low` bits: a high channel's top
// `low` bits], the refinement plane [k rows: the high channels' bottom `high - low` bits] and
// scale, minimum [D] (a high channel's scale from its high grid), as quantizers.quantize_mixed.
template <typename T>
void quantize_mixed_head(const T* x, int64_t G, int64_t D, int64_t token, int64_t channel,
                         const int64_t* index, int64_t k, int high, int low, bool center,
                         uint8_t* low_plane, uint8_t* refine, at::Half* scale,
                         at::Half* minimum) {
  const int shift = high - low;
  std::vector<float> lo(D), hi(D), m(D), safe(D), top(D);
  std::vector<uint8_t> is_high(D, 0), codes(G * D);  // codes [G][D]
  std::vector<uint8_t> centered(D);
  for (int64_t j = 0; j < k; ++j) is_high[index[j]] = 1;
#ifdef __AVX512F__
  const bool vector = channel == 1 && D % 16 == 0;
#else
  const bool vector = false;
#endif
  if (vector) {
#ifdef __AVX512F__
    for (int64_t d = 0; d < D; d += 16) {
      __m512 l = load16(x + d), u = l;
      for (int64_t g = 1; g < G; ++g) {
        const __m512 v = load16(x + g * token + d);
        l = _mm512_min_ps(v, l);  // v < l ? v : l, as the scalar loop
        u = _mm512_max_ps(v, u);
      }
      _mm512_storeu_ps(lo.data() + d, l);
      _mm512_storeu_ps(hi.data() + d, u);
    }
#endif
  } else {
    for (int64_t d = 0; d < D; ++d) lo[d] = hi[d] = static_cast<float>(x[d * channel]);
    for (int64_t g = 1; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(x[g * token + d * channel]);
        lo[d] = v < lo[d] ? v : lo[d];
        hi[d] = v > hi[d] ? v : hi[d];
      }
  }
  for (int64_t d = 0; d < D; ++d) {
    const int bits = is_high[d] ? high : low;
    centered[d] = !is_high[d] && center;
    const Grid<T> grid(lo[d], hi[d], bits, centered[d]);
    scale[d] = grid.scale;
    minimum[d] = grid.minimum;
    m[d] = grid.m;
    safe[d] = grid.safe;
    top[d] = float((1 << bits) - 1);
  }
  if (vector) {
#ifdef __AVX512F__
    for (int64_t d = 0; d < D; d += 16) {
      __mmask16 center_lanes = 0;
      for (int l = 0; l < 16; ++l) center_lanes |= __mmask16(centered[d + l] ? 1u << l : 0u);
      const __m512 md = _mm512_loadu_ps(m.data() + d), sd = _mm512_loadu_ps(safe.data() + d);
      const __m512 td = _mm512_loadu_ps(top.data() + d);
      for (int64_t g = 0; g < G; ++g)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes.data() + g * D + d),
                         codes16<T>(load16(x + g * token + d), md, sd, td, center_lanes));
    }
#endif
  } else {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        codes[g * D + d] = code_of<T>(static_cast<float>(x[g * token + d * channel]), m[d],
                                      safe[d], top[d], centered[d]);
  }
  uint8_t row[MAX_GROUP];
  const int64_t low_width = row_bytes(G, low), refine_width = row_bytes(G, shift);
  for_bits(low, [&]<int B>() {
    for (int64_t d = 0; d < D; ++d) {
      const uint8_t* c = codes.data() + d;
      const int s = is_high[d] ? shift : 0;
      for (int64_t g = 0; g < G; ++g) row[g] = c[g * D] >> s;
      pack_row<B>(row, G, low_plane + d * low_width);
    }
  });
  if (k == 0) return;  // no high channel (per-channel keys at one width: high = low)
  const uint8_t mask = uint8_t((1 << shift) - 1);
  for_bits(shift, [&]<int B>() {
    for (int64_t j = 0; j < k; ++j) {
      const uint8_t* c = codes.data() + index[j];
      for (int64_t g = 0; g < G; ++g) row[g] = c[g * D] & mask;
      pack_row<B>(row, G, refine + j * refine_width);
    }
  });
}

}  // namespace

namespace {

#ifdef __AVX512F__
// quantize_group (min-max) of n contiguous elements, n a multiple of 16, sixteen at a time.
template <typename T>
void quantize_group16(const T* x, int64_t n, int bits, at::Half& scale, at::Half& minimum,
                      uint8_t* codes) {
  __m512 lo = load16(x), hi = lo;
  for (int64_t i = 16; i < n; i += 16) {
    const __m512 v = load16(x + i);
    lo = _mm512_min_ps(v, lo);
    hi = _mm512_max_ps(v, hi);
  }
  const Grid<T> grid(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), bits, false);
  scale = grid.scale;
  minimum = grid.minimum;
  const __m512 m = _mm512_set1_ps(grid.m), safe = _mm512_set1_ps(grid.safe);
  const __m512 top = _mm512_set1_ps(float((1 << bits) - 1));
  for (int64_t i = 0; i < n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     codes16<T>(load16(x + i), m, safe, top, 0));
}
#endif

// One head's tokens x [G tokens `token` apart, D channels `channel` apart] as per-token values:
// groups of `group` channels at BITS (min-max) -> codes [G, D / group rows], scale, minimum
// [G · D / group], as quantizers.quantize_per_token stores them.
template <typename T, int BITS>
void quantize_token_values(const T* x, int64_t G, int64_t D, int64_t token, int64_t channel,
                           int64_t group, uint8_t* codes, at::Half* scale, at::Half* minimum) {
  const int64_t J = D / group, width = row_bytes(group, BITS);
  uint8_t row[MAX_GROUP];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < J; ++j) {
      const int64_t at = g * J + j;
      const T* first = x + g * token + j * group * channel;
#ifdef __AVX512F__
      if (channel == 1 && group % 16 == 0) {
        quantize_group16<T>(first, group, BITS, scale[at], minimum[at], row);
        pack_row<BITS>(row, group, codes + at * width);
        continue;
      }
#endif
      if (channel == 1)
        quantize_group<T, BITS, true>(first, group, 1, false, scale[at], minimum[at], row);
      else
        quantize_group<T, BITS, false>(first, group, channel, false, scale[at], minimum[at],
                                       row);
      pack_row<BITS>(row, group, codes + at * width);
    }
}

}  // namespace
