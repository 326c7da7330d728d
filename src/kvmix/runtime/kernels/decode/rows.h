// Packed rows -> floats and the float block kernels, per code width and row length
// (the portable path every layout uses where the integer kernels do not run).
#pragma once

namespace {

// ---- packed rows -> floats, CH codes at a time ------------------------------------------------

constexpr int CH = 16;  // codes per chunk: two 8-float vectors

// Codes [k·CH, (k+1)·CH) of a packed row of N codes -> CH floats. Code t of a row sits in byte
// t mod W at shift (t div W)·BITS (W = the row's bytes), so a chunk is one run of bytes and one
// shift when W >= CH, and W-byte runs at successive shifts otherwise.
template <int N, int BITS>
inline void chunk_to_float(const uint8_t* row, int k, float* out) {
  static_assert(N >= CH && N % CH == 0, "rows of a multiple of 16 codes");
  if constexpr (BITS == 8) {
    for (int i = 0; i < CH; ++i) out[i] = float(row[k * CH + i]);
  } else if constexpr (BITS == 3) {
    chunk_to_float<N, 2>(row, k, out);
    float top[CH];
    chunk_to_float<N, 1>(row + N / 4, k, top);
    for (int i = 0; i < CH; ++i) out[i] += 4.f * top[i];
  } else {
    constexpr int W = N * BITS / 8, MASK = (1 << BITS) - 1;
    const int t0 = k * CH;
    if constexpr (W >= CH) {
      const uint8_t* src = row + t0 % W;
      const int shift = (t0 / W) * BITS;
      int32_t wide[CH];
      for (int i = 0; i < CH; ++i) wide[i] = src[i];
      for (int i = 0; i < CH; ++i) out[i] = float((wide[i] >> shift) & MASK);
    } else {
      int32_t wide[W];
      for (int w = 0; w < W; ++w) wide[w] = row[w];
      for (int s = 0; s < CH / W; ++s) {
        const int shift = (t0 / W + s) * BITS;
        for (int w = 0; w < W; ++w) out[s * W + w] = float((wide[w] >> shift) & MASK);
      }
    }
  }
}

void row_to_float_any(const uint8_t* in, int bits, int64_t n, float* out) {
  if (bits == 3) {
    row_to_float_any(in, 2, n, out);
    const int64_t W = n / 8;
    for (int i = 0; i < 8; ++i)
      for (int64_t w = 0; w < W; ++w) out[i * W + w] += float(((in[n / 4 + w] >> i) & 1) << 2);
    return;
  }
  const int per = 8 / bits, mask = (1 << bits) - 1;
  const int64_t W = n / per;
  for (int i = 0; i < per; ++i)
    for (int64_t w = 0; w < W; ++w) out[i * W + w] = float((in[w] >> (i * bits)) & mask);
}

// ---- block kernels for RB query rows (accumulators: RB x CH floats, kept in registers) -------

// scores[r][t] += Σ_i w[r][i]·code_i[t] over the C channel rows of one plane (rows `stride`
// bytes apart), for the block's G tokens; w [RB, C], scores [RB, G].
template <int G, int BITS>
void plane_scores(const uint8_t* rows, int64_t stride, int64_t C, const float* w, float* scores) {
  for (int k = 0; k < G / CH; ++k) {
    float acc[RB][CH] = {};
    float codes[CH];
    for (int64_t i = 0; i < C; ++i) {
      chunk_to_float<G, BITS>(rows + i * stride, k, codes);
      for (int r = 0; r < RB; ++r) {
        const float weight = w[r * C + i];
        for (int t = 0; t < CH; ++t) acc[r][t] += weight * codes[t];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < CH; ++t) scores[r * G + k * CH + t] += acc[r][t];
  }
}

void plane_scores_any(const uint8_t* rows, int64_t stride, int64_t C, const float* w,
                      float* scores, int bits, int64_t G, float* codes) {
  for (int64_t i = 0; i < C; ++i) {
    row_to_float_any(rows + i * stride, bits, G, codes);
    for (int r = 0; r < RB; ++r)
      for (int64_t t = 0; t < G; ++t) scores[r * G + t] += w[r * C + i] * codes[t];
  }
}

// out[r][c] += Σ_t w[r][t]·code_t[c] over one group of GS channels of the block's T tokens
// (token t's row at (t·J + j)·stride); w [RB, T], out [RB, GS].
template <int GS, int BITS>
void group_values(const uint8_t* rows, int64_t stride, int64_t J, int64_t j, int64_t T,
                  const float* w, float* out) {
  for (int k = 0; k < GS / CH; ++k) {
    float acc[RB][CH] = {};
    float codes[CH];
    for (int64_t t = 0; t < T; ++t) {
      chunk_to_float<GS, BITS>(rows + (t * J + j) * stride, k, codes);
      for (int r = 0; r < RB; ++r) {
        const float weight = w[r * T + t];
        for (int c = 0; c < CH; ++c) acc[r][c] += weight * codes[c];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CH; ++c) out[r * GS + k * CH + c] += acc[r][c];
  }
}

void group_values_any(const uint8_t* rows, int64_t stride, int64_t J, int64_t j, int64_t T,
                      const float* w, float* out, int bits, int64_t GS, float* codes) {
  for (int64_t t = 0; t < T; ++t) {
    row_to_float_any(rows + (t * J + j) * stride, bits, GS, codes);
    for (int r = 0; r < RB; ++r)
      for (int64_t c = 0; c < GS; ++c) out[r * GS + c] += w[r * T + t] * codes[c];
  }
}

// dots[r][t] = q[r]·code_t over one group of GS channels; q [RB, GS], dots [RB, T].
template <int GS, int BITS>
void group_dots(const uint8_t* rows, int64_t stride, int64_t J, int64_t j, int64_t T,
                const float* q, float* dots) {
  for (int64_t t = 0; t < T; ++t) {
    float part[RB][CH] = {};
    float codes[CH];
    for (int k = 0; k < GS / CH; ++k) {
      chunk_to_float<GS, BITS>(rows + (t * J + j) * stride, k, codes);
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < CH; ++c) part[r][c] += q[r * GS + k * CH + c] * codes[c];
    }
    for (int r = 0; r < RB; ++r) {
      float s = 0.f;
      for (int c = 0; c < CH; ++c) s += part[r][c];
      dots[r * T + t] = s;
    }
  }
}

void group_dots_any(const uint8_t* rows, int64_t stride, int64_t J, int64_t j, int64_t T,
                    const float* q, float* dots, int bits, int64_t GS, float* codes) {
  for (int64_t t = 0; t < T; ++t) {
    row_to_float_any(rows + (t * J + j) * stride, bits, GS, codes);
    for (int r = 0; r < RB; ++r) {
      float s = 0.f;
      for (int64_t c = 0; c < GS; ++c) s += q[r * GS + c] * codes[c];
      dots[r * T + t] = s;
    }
  }
}

using PlaneFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, float*);
using ValuesFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                          float*);
using DotsFn = ValuesFn;

// pick<BITS>() for a code width of 1, 2, 3, 4 or 8 bits.
template <typename Pick>
auto for_bits(int bits, Pick pick) -> decltype(pick.template operator()<1>()) {
  switch (bits) {
    case 1: return pick.template operator()<1>();
    case 2: return pick.template operator()<2>();
    case 3: return pick.template operator()<3>();
    case 4: return pick.template operator()<4>();
    default: return pick.template operator()<8>();
  }
}

// pick<N>() for rows of 16, 32, 64 or 128 codes, the lengths kernels are specialised for; other
// lengths get null (the generic loops).
template <typename Pick>
auto for_length(int64_t n, Pick pick) -> decltype(pick.template operator()<16>()) {
  switch (n) {
    case 16: return pick.template operator()<16>();
    case 32: return pick.template operator()<32>();
    case 64: return pick.template operator()<64>();
    case 128: return pick.template operator()<128>();
    default: return nullptr;
  }
}

PlaneFn plane_for(int64_t n, int bits) {
  return for_length(n, [bits]<int N>() {
    return for_bits(bits, []<int B>() -> PlaneFn { return plane_scores<N, B>; });
  });
}

ValuesFn values_for(int64_t n, int bits) {
  return for_length(n, [bits]<int N>() {
    return for_bits(bits, []<int B>() -> ValuesFn { return group_values<N, B>; });
  });
}

DotsFn dots_for(int64_t n, int bits) {
  return for_length(n, [bits]<int N>() {
    return for_bits(bits, []<int B>() -> DotsFn { return group_dots<N, B>; });
  });
}

}  // namespace
