// kvmix::decode — attention of a few new queries over one sequence's packed KV cache, on CPU.
//
// The cache is read where it lies: float segments (sink, residual, the new tokens, or the
// blocks of the `full` method) and packed blocks whose codes are never turned into a float
// history. Packed keys come in two layouts:
//   * per-channel groups (KIVI, PN-Mix, Kitty, ChanMix): one (scale, min) per channel and block,
//     codes channel-major in "planes" (a plane is a set of channels at one width; mixed
//     precision is several planes). q·k = Σ_planes Σ_i (q[c_i]·s[c_i]·mult_i)·code_i[t]
//     + Σ_c q[c]·(m[c] + s[c]·off[c]): the query is pre-scaled once per block and each channel's
//     row of token codes is one broadcast multiply-add into the block's scores;
//   * per-token groups (WUSH): q·k = Σ_j s[t,j]·(q_j·code_j) + m[t,j]·Σ q_j.
// Values are per-token groups: out = Σ_t p_t·s[t,j]·code + Σ_t p_t·m[t,j].
// Codes use kvmix's packing: every row (a key channel's tokens in a block, or a token's group of
// value channels) fills whole bytes; byte w of a W-byte row holds codes w, w+W, ... at shifts
// 0, b, ..., so shifting the row by i·b and masking gives codes [i·W, (i+1)·W) in order; 3 bits
// are the row's 2-bit plane followed by its 1-bit plane.
// Query rows (GQA heads × new tokens) are processed RB at a time with their accumulators in
// registers; row lengths and widths are compile-time constants for the common sizes. Work is
// split over (KV head, range of blocks) with an online softmax per task and a log-sum-exp
// merge. Built without -ffast-math: masked scores are -inf and must stay so.

#include <ATen/Parallel.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using at::Tensor;
constexpr int RB = 4;  // query rows computed together
constexpr size_t AHEAD = 4;  // blocks ahead of the one computed whose codes are prefetched
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

int64_t row_bytes(int64_t n, int bits) { return bits == 3 ? n / 4 + n / 8 : n * bits / 8; }

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

// ---- integer dot products (AVX-512 VNNI and VBMI) ---------------------------------------------
//
// Σ_k w[r][k]·code_k[n] over K packed rows (key channels of a block, or tokens of a value group)
// for RB weight rows at once, N codes per packed row. The float weights of each row are rounded
// once to two int8 planes, w ≈ α·(hi + lo/256) with α = max|w|/127: each weight rounded to a
// step of 1/32512 of the row's largest (16-bit precision; the only error the integer path adds
// to float32 arithmetic), then dotted with the unsigned codes by vpdpbusd: a 32-bit lane sums
// 4 products, so a code vector holds, for 16 consecutive outputs n, the codes of 4 rows (one
// byte each). It is built from the packed rows with one byte permutation (vpermb) and a shift
// and mask per lane: code n of a row lies in byte n mod W at shift (n div W)·BITS.
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KVMIX_VNNI 1

constexpr float LO_STEP = 1.f / 256.f;

// The first min(n, 16) lanes.
inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Weights [RB, ld] (the first K of each row) -> two int8 planes [RB, Kp] (zero past K) and α:
// X = round(256·w/α) in [-32512, 32512], hi = round(X / 256), lo = X - 256·hi in [-128, 127].
// `top`: each row's largest |w| where the caller has it (null: found here).
void round_weights(const float* w, int64_t ld, int64_t K, int64_t Kp, int8_t* hi, int8_t* lo,
                   float* alpha, const float* top = nullptr) {
  for (int r = 0; r < RB; ++r) {
    const float* row = w + r * ld;
    float largest;
    if (top) {
      largest = top[r];
    } else {
      __m512 most = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16)
        most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_maskz_loadu_ps(first(K - k), row + k)));
      largest = _mm512_reduce_max_ps(most);
    }
    alpha[r] = largest / 127.f;
    const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 256.f * 127.f / largest : 0.f);
    const __m512i half = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < Kp; k += 16) {
      const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(
          _mm512_maskz_loadu_ps(first(std::max<int64_t>(K - k, 0)), row + k), inverse));
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(x, half), 8);
      const __m512i l = _mm512_sub_epi32(x, _mm512_slli_epi32(h, 8));
      const __m128i h8 = _mm512_cvtepi32_epi8(h), l8 = _mm512_cvtepi32_epi8(l);
      _mm_mask_storeu_epi8(hi + r * Kp + k, first(Kp - k), h8);
      _mm_mask_storeu_epi8(lo + r * Kp + k, first(Kp - k), l8);
    }
  }
}

// One pass over a block's key statistics for RB query rows (D % 16 == 0): each row's bias
// Σ_c q[c]·(m_c + s_c·off_c), the weights w[r][c] = qm[r][c]·s_c of a plane holding every
// channel in order (qm: the query times the plane's multipliers) with each row's largest |w|,
// and the scales as floats (other planes gather theirs). q, qm, w: rows D apart.
void key_weights(const at::Half* scale, const at::Half* minimum, const float* offset,
                 const float* q, const float* qm, int64_t D, float* bias, float* w, float* top,
                 float* scales) {
  __m512 sum[RB], most[RB];
  for (int r = 0; r < RB; ++r) sum[r] = most[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 s =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + c)));
    const __m512 m = _mm512_fmadd_ps(s, _mm512_loadu_ps(offset + c), _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + c))));
    _mm512_storeu_ps(scales + c, s);
    for (int r = 0; r < RB; ++r) {
      sum[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + c), m, sum[r]);
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qm + r * D + c), s);
      _mm512_storeu_ps(w + r * D + c, x);
      most[r] = _mm512_max_ps(most[r], _mm512_abs_ps(x));
    }
  }
  for (int r = 0; r < RB; ++r) {
    bias[r] = _mm512_reduce_add_ps(sum[r]);
    top[r] = _mm512_reduce_max_ps(most[r]);
  }
}

// One pass over a value group of a block for RB rows of softmax weights p (rows `ld` apart)
// over T tokens: w[r][t] = p[r][t]·s[t] (rows T apart) with each row's largest |w|, and
// Σ_t p·m added lane by lane (token t into lane t mod 16) to bias[r·bias_ld, +16).
void value_weights(const float* p, int64_t ld, const float* s, const float* m, int64_t T,
                   float* w, float* bias, int64_t bias_ld, float* top) {
  for (int r = 0; r < RB; ++r) {
    const float* pr = p + r * ld;
    __m512 most = _mm512_setzero_ps(), lanes = _mm512_loadu_ps(bias + r * bias_ld);
    for (int64_t t = 0; t < T; t += 16) {
      const __mmask16 valid = first(T - t);
      const __m512 pv = _mm512_maskz_loadu_ps(valid, pr + t);
      const __m512 x = _mm512_mul_ps(pv, _mm512_maskz_loadu_ps(valid, s + t));
      _mm512_mask_storeu_ps(w + r * T + t, valid, x);
      most = _mm512_max_ps(most, _mm512_abs_ps(x));
      lanes = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(valid, m + t), lanes);
    }
    _mm512_storeu_ps(bias + r * bias_ld, lanes);
    top[r] = _mm512_reduce_max_ps(most);
  }
}

// Per (N, BITS): the vpermb indices that put byte p mod P (P = min(W, 16)) of each of 4 rows
// laid P bytes apart into lane p, and for each code vector m the lane shifts (16-bit counts)
// that bring code 16m+p of a row, at shift ((16m+p) div W)·BITS in its byte, to the bottom.
template <int N, int BITS>
struct Layout {
  static constexpr int W = N * BITS / 8, P = W < 16 ? W : 16, M = N / 16;
  alignas(64) uint8_t index[64];
  alignas(64) uint8_t spread[33][64];  // vpermt2b indices for 4 rows `stride` <= 32 bytes apart
  alignas(64) uint16_t shift[M][32];
  constexpr Layout() : index{}, spread{}, shift{} {
    for (int p = 0; p < 16; ++p) {
      for (int k = 0; k < 4; ++k) index[p * 4 + k] = uint8_t(k * P + p % P);
      for (int stride = W; stride <= 32; ++stride)
        for (int k = 0; k < 4; ++k) spread[stride][p * 4 + k] = uint8_t(k * stride + p % P);
      for (int m = 0; m < M; ++m)
        shift[m][2 * p] = shift[m][2 * p + 1] = uint16_t((16 * m + p) / W * BITS);
    }
  }
};
template <int N, int BITS>
constexpr Layout<N, BITS> LAYOUT{};

// The bytes of 4 packed rows (W bytes each, `stride` apart; rows at and past `valid` read as
// zero) that hold codes [16m, 16m+16), interleaved: lane p holds byte p mod P of rows 0..3.
template <int N, int BITS>
inline __m512i gather_rows(const uint8_t* rows, int64_t stride, int valid, int m) {
  constexpr int W = N * BITS / 8;
  __m512i src;
  if constexpr (W <= 16) {  // 4 rows of W bytes side by side
    if (stride == W) {
      src = _mm512_maskz_loadu_epi8(valid >= 4 ? ~0ull >> (64 - 4 * W)
                                               : (1ull << (valid * W)) - 1, rows);
    } else if (stride <= 32) {  // the 4 rows lie in 128 bytes: two loads, one vpermt2b
      const int64_t span = (valid - 1) * stride + W;  // bytes read: rows past `valid` are zero
      const __m512i first = _mm512_maskz_loadu_epi8(span >= 64 ? ~0ull : (1ull << span) - 1, rows);
      const __m512i second = span > 64 ? _mm512_maskz_loadu_epi8(
          span >= 128 ? ~0ull : (1ull << (span - 64)) - 1, rows + 64) : _mm512_setzero_si512();
      return _mm512_permutex2var_epi8(first, _mm512_load_si512(LAYOUT<N, BITS>.spread[stride]),
                                      second);
    } else {
      src = _mm512_setzero_si512();
      for (int k = 0; k < valid && k < 4; ++k)  // masked: only row k's W bytes are read
        src = _mm512_mask_loadu_epi8(src, ((1ull << W) - 1) << (k * W), rows + k * (stride - W));
    }
  } else {  // 16 bytes of each row: the slice holding codes [16m, 16m+16)
    const int64_t at = (m % (W / 16)) * 16;
    __m128i part[4];
    for (int k = 0; k < 4; ++k) {
      const auto* slice = reinterpret_cast<const __m128i*>(rows + k * stride + at);
      part[k] = k < valid ? _mm_loadu_si128(slice) : _mm_setzero_si128();
    }
    src = _mm512_inserti32x4(_mm512_castsi128_si512(part[0]), part[1], 1);
    src = _mm512_inserti32x4(src, part[2], 2);
    src = _mm512_inserti32x4(src, part[3], 3);
  }
  return _mm512_permutexvar_epi8(_mm512_load_si512(LAYOUT<N, BITS>.index), src);
}

// Interleaved bytes -> codes [16m, 16m+16): lane p holds code 16m+p of rows 0..3, one byte each.
template <int N, int BITS>
inline __m512i codes_of(const __m512i& bytes, int m) {
  if constexpr (BITS == 8) return bytes;
  const __m512i shift = _mm512_load_si512(LAYOUT<N, BITS>.shift[m]);
  return _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi8(char((1 << BITS) - 1)));
}

// Code vectors m and m + 1 of 4 rows (3 bits: each row's 2-bit codes, then its 1-bit codes).
template <int N, int BITS>
inline void code_pair(const uint8_t* rows, int64_t stride, int valid, int m, __m512i* out) {
  constexpr int LOW = BITS == 3 ? 2 : BITS;
  constexpr bool shared = N * LOW / 8 <= 16;  // one gather holds every code of the rows
  const __m512i low = gather_rows<N, LOW>(rows, stride, valid, m);
  out[0] = codes_of<N, LOW>(low, m);
  out[1] = codes_of<N, LOW>(shared ? low : gather_rows<N, LOW>(rows, stride, valid, m + 1), m + 1);
  if constexpr (BITS == 3) {
    const __m512i top = gather_rows<N, 1>(rows + N / 4, stride, valid, m);  // N/8 <= 16 bytes
    for (int i = 0; i < 2; ++i)
      out[i] = _mm512_or_si512(out[i], _mm512_slli_epi16(codes_of<N, 1>(top, m + i), 2));
  }
}

// out[r·ld + n] += Σ_k w[r][k]·code_k[n] for RB rows, n < N, over K packed rows `stride` bytes
// apart; weights as round_weights left them ([RB, Kp] int8 planes and α). Two code vectors
// (32 outputs) at a time: 2 × RB × 2 accumulators.
template <int N, int BITS>
void int_rows(const uint8_t* rows, int64_t stride, int64_t K, const int8_t* hi, const int8_t* lo,
              int64_t Kp, const float* alpha, float* out, int64_t ld) {
  static_assert(N % 32 == 0 || N == 16, "rows of 16 or a multiple of 32 codes");
  for (int m = 0; m < N / 16; m += 2) {
    constexpr int PAIR = N == 16 ? 1 : 2;
    __m512i acc_hi[PAIR][RB], acc_lo[PAIR][RB];
    for (int i = 0; i < PAIR; ++i)
      for (int r = 0; r < RB; ++r) acc_hi[i][r] = acc_lo[i][r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
      const int valid = int(std::min<int64_t>(K - k, 4));
      __m512i codes[2];
      if constexpr (N == 16) {
        constexpr int LOW = BITS == 3 ? 2 : BITS;
        codes[0] = codes_of<N, LOW>(gather_rows<N, LOW>(rows + k * stride, stride, valid, 0), 0);
        if constexpr (BITS == 3)
          codes[0] = _mm512_or_si512(codes[0], _mm512_slli_epi16(codes_of<N, 1>(
              gather_rows<N, 1>(rows + N / 4 + k * stride, stride, valid, 0), 0), 2));
      } else {
        code_pair<N, BITS>(rows + k * stride, stride, valid, m, codes);
      }
      for (int r = 0; r < RB; ++r) {
        int32_t h, l;
        std::memcpy(&h, hi + r * Kp + k, 4);
        std::memcpy(&l, lo + r * Kp + k, 4);
        const __m512i wh = _mm512_set1_epi32(h), wl = _mm512_set1_epi32(l);
        for (int i = 0; i < PAIR; ++i) {
          acc_hi[i][r] = _mm512_dpbusd_epi32(acc_hi[i][r], codes[i], wh);
          acc_lo[i][r] = _mm512_dpbusd_epi32(acc_lo[i][r], codes[i], wl);
        }
      }
    }
    for (int i = 0; i < PAIR; ++i)
      for (int r = 0; r < RB; ++r) {
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_lo[i][r]),
                                           _mm512_set1_ps(LO_STEP),
                                           _mm512_cvtepi32_ps(acc_hi[i][r]));
        float* o = out + r * ld + 16 * (m + i);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o)));
      }
  }
}

using IntFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const int8_t*, int64_t,
                       const float*, float*, int64_t);

// The integer kernel for rows of n codes (16, 32, 64 or 128), else null (the float kernels).
IntFn int_for(int64_t n, int bits) {
  return for_length(n, [bits]<int N>() {
    return for_bits(bits, []<int B>() -> IntFn { return int_rows<N, B>; });
  });
}
#else
using IntFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const int8_t*, int64_t,
                       const float*, float*, int64_t);
IntFn int_for(int64_t, int) { return nullptr; }
// Never called: without the integer kernels no plane or value group has one.
void round_weights(const float*, int64_t, int64_t, int64_t, int8_t*, int8_t*, float*,
                   const float* = nullptr) {}
void key_weights(const at::Half*, const at::Half*, const float*, const float*, const float*,
                 int64_t, float*, float*, float*, float*) {}
void value_weights(const float*, int64_t, const float*, const float*, int64_t, float*, float*,
                   int64_t, float*) {}
#endif

// ---- small vector helpers ---------------------------------------------------------------------

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
    odd = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), odd);
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
#endif
#pragma omp simd reduction(+ : s)
  for (int64_t j = i; j < n; ++j) s += a[j] * b[j];
  return s;
}

// exp(x) = 2^k·p(f) with a degree-7 polynomial on |f| <= ln2/2 (relative error about 1e-7);
// x < -87 (including -inf, a masked score) gives 0.
inline float exp_one(float x) {
  const float v = std::min(std::max(x, -87.f), 88.f);
  const float k = std::floor(v * 1.44269504088896341f + 0.5f);
  const float f = v - k * 0.69314718055994531f;
  float p = 1.f / 5040.f;
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = p * f + c;
  return x < -87.f ? 0.f : p * std::bit_cast<float>((int32_t(k) + 127) << 23);
}

// x <- exp(x - shift) over n values, returning their sum: 16 (AVX-512) or 8 (AVX2) at a time
// (std::exp would be one call per score).
float exp_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#ifdef __AVX512F__
  {
    const __m512 lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f), by = _mm512_set1_ps(shift);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2 = _mm512_set1_ps(0.69314718055994531f);
    const float coefficients[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 in = _mm512_sub_ps(_mm512_loadu_ps(x + i), by);
      const __m512 v = _mm512_min_ps(_mm512_max_ps(in, lo), hi);
      const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT);
      const __m512 f = _mm512_fnmadd_ps(k, ln2, v);
      __m512 p = _mm512_set1_ps(1.f / 5040.f);
      for (float c : coefficients) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
      const __m512 out = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(in, lo, _CMP_GE_OQ),
                                             _mm512_scalef_ps(p, k));
      _mm512_storeu_ps(x + i, out);
      sum = _mm512_add_ps(sum, out);
    }
    total = _mm512_reduce_add_ps(sum);
  }
#elif defined(__AVX2__)
  {
    const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f), by = _mm256_set1_ps(shift);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
    const __m256 ln2 = _mm256_set1_ps(0.69314718055994531f);
    const float coefficients[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 in = _mm256_sub_ps(_mm256_loadu_ps(x + i), by);
      const __m256 v = _mm256_min_ps(_mm256_max_ps(in, lo), hi);
      const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(v, log2e, half));
      const __m256 f = _mm256_fnmadd_ps(k, ln2, v);
      __m256 p = _mm256_set1_ps(1.f / 5040.f);
      for (float c : coefficients) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
      const __m256i exponent = _mm256_slli_epi32(
          _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
      const __m256 out = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(exponent)),
                                       _mm256_cmp_ps(in, lo, _CMP_GE_OQ));
      _mm256_storeu_ps(x + i, out);
      sum = _mm256_add_ps(sum, out);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    for (float lane : lanes) total += lane;
  }
#endif
  for (; i < n; ++i) {
    x[i] = exp_one(x[i] - shift);
    total += x[i];
  }
  return total;
}

#ifdef __AVX512F__
// Group j of 16 tokens' statistics stored token-major ([16, J] floats, 32 % J == 0) -> 16 floats:
// each pair of vectors (32 / J tokens) through one two-source permutation, blended into place.
inline __m512 token_lanes(const float* stats, int64_t J, int64_t j) {
  if (J == 1) return _mm512_loadu_ps(stats);
  const int per = int(32 / J);  // tokens a pair of vectors holds
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i index = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(per - 1)),
                         _mm512_set1_epi32(int(J))), _mm512_set1_epi32(int(j)));
  __m512 out = _mm512_setzero_ps();
  for (int pair = 0; pair < J / 2; ++pair)
    out = _mm512_mask_mov_ps(out, __mmask16(((1u << per) - 1) << (pair * per)),
                             _mm512_permutex2var_ps(_mm512_loadu_ps(stats + 32 * pair), index,
                                                    _mm512_loadu_ps(stats + 32 * pair + 16)));
  return out;
}
#endif

// n float16 values -> floats (F16C, 8 at a time, where the CPU has it).
void halves(const at::Half* in, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < n; ++i) out[i] = float(in[i]);
}

// ---- the problem -------------------------------------------------------------------------------

struct FloatSegment {  // float keys/values [n, H, t, D]; heads `head_stride` floats apart
  const float* keys;
  const float* values;
  int64_t blocks, tokens;
  bool causal;  // the new tokens themselves: query i sees token j <= i
  int64_t head_stride;
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

// ---- one task: one KV head over a range of units, softmax over the whole range ---------------

class Task {
 public:
  Task(const Problem& p, int64_t head, const Unit* units, int64_t count)
      : p_(p), h_(head), units_(units, units + count) {
    const int64_t P = p.padded, D = p.dim, G = std::max<int64_t>(p.packed.group, 1);
    q_.assign(P * D, 0.f);  // rows beyond p.rows stay zero
    for (int64_t g = 0; g < p.group_size; ++g)
      for (int64_t i = 0; i < p.queries; ++i) {
        const float* src = p.query + ((h_ * p.group_size + g) * p.queries + i) * D;
        float* dst = &q_[(g * p.queries + i) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
      }
    for (const Plane& plane : p.packed.planes) {  // each plane's channels of every query row
      const int64_t C = plane.channels;            // times their multipliers
      const int64_t* index = plane.index + h_ * C;
      const float* mult = plane.mult + h_ * C;
      std::vector<float> gathered(P * C);
      bool in_order = true;
      for (int64_t i = 0; i < C; ++i) in_order = in_order && index[i] == i;
      for (int64_t r = 0; r < P; ++r)
        for (int64_t i = 0; i < C; ++i) gathered[r * C + i] = q_[r * D + index[i]] * mult[i];
      plane_queries_.push_back(std::move(gathered));
      in_order_.push_back(in_order);
    }
    const std::vector<Plane>& planes = p.packed.planes;
    fused_keys_ = !planes.empty() && planes[0].ints && in_order_[0] && planes[0].channels == D &&
                  D % 16 == 0;
    for (const Unit& u : units_) {
      offsets_.push_back(total_);
      total_ += tokens(u);
    }
    work_.resize(P * std::max(G, D));
    floats_.resize(std::max(G, D));
  }

  // Scores of every unit, one softmax over them all, then the weighted values.
  Partial run() {
    const int64_t R = p_.rows, P = p_.padded, D = p_.dim, L = total_;
    scores_.resize(P * std::max<int64_t>(L, 1));  // every unit writes its own scores
    for (size_t u = 0; u < units_.size(); ++u) {
      if (u + AHEAD < units_.size()) prefetch(units_[u + AHEAD], true);
      scores(units_[u], &scores_[offsets_[u]]);
    }
    Partial state{std::vector<float>(R, NEG_INF), std::vector<float>(R, 0.f),
                  std::vector<float>(P * D, 0.f)};  // padding rows: written, never read
    for (int64_t r = 0; r < R; ++r) {
      float* s = &scores_[r * L];
      float m = NEG_INF;
#pragma omp simd reduction(max : m)
      for (int64_t t = 0; t < L; ++t) m = m > s[t] ? m : s[t];
      state.max[r] = m;
      if (m == NEG_INF) {
        std::fill(s, s + L, 0.f);
        continue;
      }
      state.sum[r] = exp_sum(s, L, m);
    }
    std::fill(scores_.begin() + R * L, scores_.end(), 0.f);  // padding rows weigh nothing
    for (size_t u = 0; u < units_.size(); ++u) {
      if (u + AHEAD < units_.size()) prefetch(units_[u + AHEAD], false);
      values(units_[u], &scores_[offsets_[u]], state.acc.data());
    }
    add_value_bias(state.acc.data());
    return state;
  }

 private:
  int64_t tokens(const Unit& u) const {
    return u.segment >= 0 ? p_.segments[u.segment].tokens : p_.packed.lengths[u.block];
  }

  const float* qrow(int64_t r) const { return &q_[r * p_.dim]; }

  int64_t page(int64_t n) const { return p_.packed.pages ? p_.packed.pages[n] : n; }

  // The next packed block's key (or value) codes and statistics of this head into the cache
  // while this one is computed: the pages of a pool are scattered, so the hardware prefetcher
  // cannot see them coming.
  void prefetch(const Unit& u, bool keys) const {
    if (u.segment >= 0) return;
    const Packed& pk = p_.packed;
    const int64_t n = page(u.block), H = p_.kv_heads, D = p_.dim, G = pk.group;
    if (keys && pk.key_mode == 1) {
      ahead(pk.key_scale + (n * H + h_) * D, D * 2);
      ahead(pk.key_min + (n * H + h_) * D, D * 2);
      for (const Plane& plane : pk.planes) {
        const int64_t bytes = plane.channels * row_bytes(G, plane.bits);
        ahead(plane.codes + n * plane.block_bytes + h_ * bytes, bytes);
      }
      return;
    }
    const Stats& st = keys ? pk.keys : pk.values;
    if (!st.codes) return;
    const int64_t rows = G * (D / st.group), bytes = rows * row_bytes(st.group, st.bits);
    ahead(st.codes + n * st.block_bytes + h_ * bytes, bytes);
    ahead(st.scale + (n * H + h_) * rows, rows * 2);
    if (st.minimum) ahead(st.minimum + (n * H + h_) * rows, rows * 2);
  }

  static void ahead(const void* start, int64_t bytes) {
    const char* at = static_cast<const char*>(start);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(at + i);
  }

  void scores(const Unit& u, float* out) {
    if (u.segment >= 0)
      float_scores(p_.segments[u.segment], u.block, out);
    else if (p_.packed.key_mode == 1)
      channel_scores(u.block, out);
    else
      token_scores(u.block, out);
    if (u.segment < 0 && u.block == 0)
      for (int64_t r = 0; r < p_.rows; ++r)
        std::fill(out + r * total_, out + r * total_ + p_.packed.skip, NEG_INF);
  }

  void values(const Unit& u, const float* weights, float* acc) {
    if (u.segment >= 0)
      float_values(p_.segments[u.segment], u.block, weights, acc);
    else
      packed_values(u.block, weights, acc);
  }

  // ---- float segments ----

  void float_scores(const FloatSegment& seg, int64_t block, float* out) {
    const int64_t D = p_.dim, T = seg.tokens, L = total_;
    const float* keys = seg.keys + (block * p_.kv_heads + h_) * seg.head_stride;
    for (int64_t r = 0; r < p_.rows; ++r) {
      const int64_t i = r % p_.queries;  // this row's query token
      for (int64_t t = 0; t < T; ++t) {
        const bool hidden = seg.causal && t > i + (T - p_.queries);
        out[r * L + t] = hidden ? NEG_INF : dot(qrow(r), keys + t * D, D);
      }
    }
  }

  void float_values(const FloatSegment& seg, int64_t block, const float* weights, float* acc) {
    const int64_t D = p_.dim, T = seg.tokens, L = total_;
    const float* values = seg.values + (block * p_.kv_heads + h_) * seg.head_stride;
#ifdef __AVX512F__
    if (D % 32 == 0) {  // RB rows × 32 channels in registers over every token
      for (int64_t r0 = 0; r0 < p_.padded; r0 += RB)
        for (int64_t d = 0; d < D; d += 32) {
          __m512 sum[RB][2];
          float* a = acc + r0 * D + d;
          for (int r = 0; r < RB; ++r)
            for (int k = 0; k < 2; ++k) sum[r][k] = _mm512_loadu_ps(a + r * D + 16 * k);
          for (int64_t t = 0; t < T; ++t) {
            const __m512 v0 = _mm512_loadu_ps(values + t * D + d);
            const __m512 v1 = _mm512_loadu_ps(values + t * D + d + 16);
            for (int r = 0; r < RB; ++r) {
              const __m512 w = _mm512_set1_ps(weights[(r0 + r) * L + t]);
              sum[r][0] = _mm512_fmadd_ps(w, v0, sum[r][0]);
              sum[r][1] = _mm512_fmadd_ps(w, v1, sum[r][1]);
            }
          }
          for (int r = 0; r < RB; ++r)
            for (int k = 0; k < 2; ++k) _mm512_storeu_ps(a + r * D + 16 * k, sum[r][k]);
        }
      return;
    }
#endif
    for (int64_t r = 0; r < p_.rows; ++r) {
      float* a = acc + r * D;
      for (int64_t t = 0; t < T; ++t) {
        const float w = weights[r * L + t];
        const float* v = values + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
      }
    }
  }

  // ---- per-channel key groups ----

  // One bias per row (the value of code 0 against the query), then each plane's channels.
  // The block kernels fill all G tokens; a cropped block's tail lands in work_ and is dropped.
  void channel_scores(int64_t n, float* out) {
    const Packed& pk = p_.packed;
    const int64_t P = p_.padded, D = p_.dim, G = pk.group, H = p_.kv_heads, L = total_;
    const int64_t T = pk.lengths[n];
    const at::Half* scale = pk.key_scale + (page(n) * H + h_) * D;
    const at::Half* minimum = pk.key_min + (page(n) * H + h_) * D;
    const float* offset = pk.key_offset + h_ * D;
    float* block = work_.data();  // [P, G]
    scale_.resize(D);
    if (fused_keys_) {  // the integer path with a plane of every channel: one pass (key_weights)
      const Plane& every = pk.planes[0];
      const int64_t stride = row_bytes(G, every.bits);
      const uint8_t* rows = every.codes + page(n) * every.block_bytes + h_ * D * stride;
      weights_.resize(RB * D);
      for (int64_t r0 = 0; r0 < P; r0 += RB) {
        float bias[RB], top[RB];
        key_weights(scale, minimum, offset, qrow(r0), &plane_queries_[0][r0 * D], D, bias,
                    weights_.data(), top, scale_.data());
        for (int r = 0; r < RB; ++r)
          std::fill(block + (r0 + r) * G, block + (r0 + r + 1) * G, bias[r]);
        integer_weights(weights_.data(), D, D, top);
        every.ints(rows, stride, D, hi_.data(), lo_.data(), padded_, alpha_, block + r0 * G, G);
      }
    } else {
      base_.resize(D);
      halves(scale, D, scale_.data());
      halves(minimum, D, base_.data());
      for (int64_t c = 0; c < D; ++c) base_[c] += scale_[c] * offset[c];
      for (int64_t r = 0; r < P; ++r) {
        const float bias = dot(qrow(r), base_.data(), D);
        std::fill(block + r * G, block + (r + 1) * G, bias);
      }
    }
    for (size_t which = fused_keys_ ? 1 : 0; which < pk.planes.size(); ++which)
      plane(pk.planes[which], plane_queries_[which], n, block);
    for (int64_t r = 0; r < P; ++r) std::copy(block + r * G, block + r * G + T, out + r * L);
  }

  void plane(const Plane& plane, const std::vector<float>& queries, int64_t n, float* block) {
    const int64_t C = plane.channels, G = p_.packed.group;
    if (C == 0) return;
    const int64_t stride = row_bytes(G, plane.bits);
    const uint8_t* rows = plane.codes + page(n) * plane.block_bytes + h_ * C * stride;
    const float* factor = scale_.data();  // each plane channel's scale (multipliers: in queries)
    if (!in_order_[&plane - p_.packed.planes.data()]) {
      const int64_t* index = plane.index + h_ * C;
      factor_.resize(C);
      for (int64_t i = 0; i < C; ++i) factor_[i] = scale_[index[i]];
      factor = factor_.data();
    }
    weights_.resize(RB * C);
    for (int64_t r0 = 0; r0 < p_.padded; r0 += RB) {
      const float* q = &queries[r0 * C];
      for (int r = 0; r < RB; ++r)
#pragma omp simd
        for (int64_t i = 0; i < C; ++i) weights_[r * C + i] = q[r * C + i] * factor[i];
      float* dst = block + r0 * G;
      if (plane.ints) {
        integer_weights(weights_.data(), C, C);
        plane.ints(rows, stride, C, hi_.data(), lo_.data(), padded_, alpha_, dst, G);
      } else if (plane.kernel)
        plane.kernel(rows, stride, C, weights_.data(), dst);
      else
        plane_scores_any(rows, stride, C, weights_.data(), dst, plane.bits, G, floats_.data());
    }
  }

  // ---- per-token groups ----

  // Keys: s·(q·code) + m·Σq per group of `group` channels.
  void token_scores(int64_t n, float* out) {
    const Packed& pk = p_.packed;
    const Stats& st = pk.keys;
    const int64_t P = p_.padded, D = p_.dim, G = pk.group, gs = st.group, J = D / gs, L = total_;
    const int64_t T = pk.lengths[n], stride = row_bytes(gs, st.bits);
    const uint8_t* rows = st.codes + page(n) * st.block_bytes + h_ * G * J * stride;
    token_stats(st, n, T, J);
    for (int64_t r = 0; r < P; ++r) std::fill(out + r * L, out + r * L + T, 0.f);
    float* dots = work_.data();  // [RB, T]
    weights_.resize(RB * gs);
    for (int64_t j = 0; j < J; ++j)
      for (int64_t r0 = 0; r0 < P; r0 += RB) {
        float qsum[RB];
        for (int r = 0; r < RB; ++r) {
          const float* q = qrow(r0 + r) + j * gs;
          std::copy(q, q + gs, &weights_[r * gs]);
          qsum[r] = 0.f;
          for (int64_t c = 0; c < gs; ++c) qsum[r] += q[c];
        }
        if (pk.key_dots)
          pk.key_dots(rows, stride, J, j, T, weights_.data(), dots);
        else
          group_dots_any(rows, stride, J, j, T, weights_.data(), dots, st.bits, gs,
                         floats_.data());
        const float* scale = &scale_[j * T];
        const float* base = &base_[j * T];
        for (int r = 0; r < RB; ++r) {
          float* score = out + (r0 + r) * L;
          const float* d = dots + r * T;
#pragma omp simd
          for (int64_t t = 0; t < T; ++t) score[t] += scale[t] * d[t] + base[t] * qsum[r];
        }
      }
  }

  // acc[r] += Σ_t p[r][t]·(s[t,j]·code + m[t,j]) over the block's tokens, group by group.
  void packed_values(int64_t n, const float* p, float* acc) {
    const Packed& pk = p_.packed;
    const Stats& st = pk.values;
    const int64_t P = p_.padded, D = p_.dim, G = pk.group, gs = st.group, J = D / gs, L = total_;
    const int64_t T = pk.lengths[n], stride = row_bytes(gs, st.bits);
    const uint8_t* rows = st.codes + page(n) * st.block_bytes + h_ * G * J * stride;
    token_stats(st, n, T, J);
    weights_.resize(RB * T);
    value_bias_.resize(P * J * 16);
    for (int64_t j = 0; j < J; ++j)
      for (int64_t r0 = 0; r0 < P; r0 += RB) {
        const float* scale = &scale_[j * T];
        if (pk.value_ints) {  // the integer path: weights, bias and largest weights in one pass
          float top[RB];
          value_weights(p + r0 * L, L, scale, &base_[j * T], T, weights_.data(),
                        &value_bias_[(r0 * J + j) * 16], J * 16, top);
          integer_weights(weights_.data(), T, T, top);
          pk.value_ints(rows + j * stride, J * stride, T, hi_.data(), lo_.data(), padded_, alpha_,
                        acc + r0 * D + j * gs, D);
          continue;
        }
        for (int r = 0; r < RB; ++r) {
          const float* pr = p + (r0 + r) * L;
          float* bias = &value_bias_[((r0 + r) * J + j) * 16];
          for (int64_t t0 = 0; t0 < T; t0 += 16)
#pragma omp simd
            for (int64_t l = 0; l < std::min<int64_t>(16, T - t0); ++l)
              bias[l] += pr[t0 + l] * base_[j * T + t0 + l];
#pragma omp simd
          for (int64_t t = 0; t < T; ++t) weights_[r * T + t] = pr[t] * scale[t];
        }
        float* out = work_.data();  // [RB, gs]
        std::fill(out, out + RB * gs, 0.f);
        if (pk.value_kernel)
          pk.value_kernel(rows, stride, J, j, T, weights_.data(), out);
        else
          group_values_any(rows, stride, J, j, T, weights_.data(), out, st.bits, gs,
                           floats_.data());
        for (int r = 0; r < RB && r0 + r < p_.rows; ++r) {
          float* a = acc + (r0 + r) * D + j * gs;
          const float* o = out + r * gs;
#pragma omp simd
          for (int64_t c = 0; c < gs; ++c) a[c] += o[c];
        }
      }
  }

  // acc[r][c] += Σ p·min of group j(c), gathered lane-wise over every packed block.
  void add_value_bias(float* acc) {
    if (value_bias_.empty()) return;
    const int64_t D = p_.dim, gs = p_.packed.values.group, J = D / gs;
    for (int64_t r = 0; r < p_.rows; ++r)
      for (int64_t j = 0; j < J; ++j) {
        const float* lanes = &value_bias_[(r * J + j) * 16];
        float b = 0.f;
        for (int l = 0; l < 16; ++l) b += lanes[l];
        for (int64_t c = 0; c < gs; ++c) acc[r * D + j * gs + c] += b;
      }
  }

  // Per-token statistics of one block as floats, group-major [J, T]: scale, and min (or the
  // symmetric levels' offset).
  void token_stats(const Stats& st, int64_t n, int64_t T, int64_t J) {
    const int64_t stat0 = (page(n) * p_.kv_heads + h_) * p_.packed.group * J;
    const float symmetric = -(float(1 << (st.bits - 1)) - 0.5f);
    stats_.resize(2 * T * J);
    halves(st.scale + stat0, T * J, stats_.data());
    if (st.minimum) halves(st.minimum + stat0, T * J, stats_.data() + T * J);
    scale_.resize(T * J);
    base_.resize(T * J);
    const float* scale = stats_.data();
    const float* minimum = st.minimum ? scale + T * J : nullptr;
    int64_t t0 = 0;
#ifdef __AVX512F__
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                              5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(int(J)));
    const __m512 offset = _mm512_set1_ps(symmetric);
    const bool permuted = 32 % J == 0;  // transposed by permutations, else by gathers
    for (; t0 + 16 <= T; t0 += 16)  // 16 tokens of a group at a time
      for (int64_t j = 0; j < J; ++j) {
        const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(int(t0 * J + j)));
        const __m512 s = permuted ? token_lanes(scale + t0 * J, J, j)
                                  : _mm512_i32gather_ps(at, scale, 4);
        _mm512_storeu_ps(&scale_[j * T + t0], s);
        _mm512_storeu_ps(&base_[j * T + t0],
                         !minimum  ? _mm512_mul_ps(s, offset)
                         : permuted ? token_lanes(minimum + t0 * J, J, j)
                                    : _mm512_i32gather_ps(at, minimum, 4));
      }
#endif
    for (int64_t j = 0; j < J; ++j)
      for (int64_t t = t0; t < T; ++t) {
        scale_[j * T + t] = scale[t * J + j];
        base_[j * T + t] = minimum ? minimum[t * J + j] : symmetric * scale[t * J + j];
      }
  }

  // RB rows of K float weights (`ld` apart; `top`: their largest magnitudes, if known)
  // -> hi_, lo_ [RB, padded_] and alpha_.
  void integer_weights(const float* w, int64_t ld, int64_t K, const float* top = nullptr) {
    padded_ = (K + 3) / 4 * 4;
    hi_.resize(RB * padded_);
    lo_.resize(RB * padded_);
    round_weights(w, ld, K, padded_, hi_.data(), lo_.data(), alpha_, top);
  }

  const Problem& p_;
  int64_t h_;
  std::vector<Unit> units_;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  std::vector<float> q_, scores_, work_, weights_, scale_, base_, floats_, factor_, stats_;
  std::vector<std::vector<float>> plane_queries_;
  std::vector<bool> in_order_;  // plane i holds channels 0, 1, ..., C-1: its scales need no gather
  bool fused_keys_ = false;     // integer path, plane 0 every channel in order: key_weights
  std::vector<float> value_bias_;  // [P, J, 16]: Σ p·min of packed values, lane-wise
  std::vector<int8_t> hi_, lo_;
  int64_t padded_ = 0;
  float alpha_[RB] = {};
};

// ---- the op -------------------------------------------------------------------------------------

void check(bool ok, const char* message) { TORCH_CHECK(ok, "kvmix::decode: ", message); }

template <typename T>
const T* data(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "kvmix::decode: ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), "kvmix::decode: ", name, " is on ", t.device(),
              "; this op runs on CPU tensors (use backend='torch')");
  return t.data_ptr<T>();
}

bool valid_bits(int64_t bits) {
  return bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8;
}

// Per-token groups of `group` channels: codes [P, bytes per block] holding H × G tokens × J
// groups rows, scale (and min) [P, H, G, J] float16.
Stats token_groups(const Tensor& codes, const Tensor& scale, const std::optional<Tensor>& minimum,
                   int64_t bits, int64_t group, int64_t dim, int64_t heads, int64_t tokens,
                   const char* what) {
  TORCH_CHECK(valid_bits(bits), "kvmix::decode: ", what, " bits must be 1, 2, 3, 4 or 8");
  TORCH_CHECK(group > 0 && group % 8 == 0 && dim % group == 0, "kvmix::decode: ", what,
              " groups must be a positive multiple of 8 channels dividing the head dim");
  TORCH_CHECK(codes.dim() == 2, "kvmix::decode: ", what, " codes must be [pages, bytes]");
  const int64_t rows = heads * tokens * (dim / group), pages = codes.size(0);
  TORCH_CHECK(codes.size(1) >= rows * row_bytes(group, int(bits)), "kvmix::decode: ", what,
              " codes hold ", codes.size(1), " bytes per page; ", rows, " rows of ", group,
              " ", bits, "-bit codes need ", rows * row_bytes(group, int(bits)));
  TORCH_CHECK(scale.numel() == pages * rows &&
                  (!minimum.has_value() || minimum->numel() == pages * rows),
              "kvmix::decode: ", what, " scale and min must hold ", rows, " values per page");
  return {data<uint8_t>(codes, "codes"), codes.size(-1), data<at::Half>(scale, "scale"),
          minimum.has_value() ? data<at::Half>(*minimum, "min") : nullptr, int(bits), group};
}

// The packed arguments both ops share: the pool of blocks (or one sequence's blocks).
struct PackedArgs {
  at::TensorList plane_codes;
  at::IntArrayRef plane_bits;
  at::TensorList plane_index, plane_mult;
  const std::optional<Tensor>&key_scale, &key_min, &key_offset, &key_codes;
  int64_t key_bits, key_group;
  const std::optional<Tensor>& value_codes;
  int64_t value_bits, value_group;
  const std::optional<Tensor>&value_scale, &value_min;
};

// Channel planes: codes [P, bytes per block] holding H × C channel rows of G codes; index and
// multiplier [H, C] or [1 or sequences, H, C], index in [0, D).
Plane channel_plane(const Tensor& codes, int64_t bits, const Tensor& index, const Tensor& mult,
                    int64_t group, int64_t heads, int64_t dim, int64_t pages, int64_t rows) {
  check(valid_bits(bits), "plane bits must be 1, 2, 3, 4 or 8");
  check((index.dim() == 2 || (index.dim() == 3 && (index.size(0) == 1 || index.size(0) == rows))) &&
            index.size(-2) == heads && mult.sizes() == index.sizes(),
        "plane index and mult must be [H, C] or [1 or sequences, H, C] of equal shape");
  const int64_t C = index.size(-1);
  check(codes.dim() == 2 && codes.size(0) == pages, "plane codes must be [pages, bytes]");
  check(codes.size(1) >= heads * C * row_bytes(group, int(bits)),
        "plane codes hold fewer bytes per page than H x C rows of a group's codes");
  const int64_t* channels = data<int64_t>(index, "plane index");
  for (int64_t i = 0; i < index.numel(); ++i)
    check(channels[i] >= 0 && channels[i] < dim, "plane index names a channel outside [0, D)");
  return {data<uint8_t>(codes, "plane codes"), codes.size(-1), C, int(bits), channels,
          data<float>(mult, "plane mult"), plane_for(group, int(bits)), int_for(group, int(bits))};
}

// The pool's (or one sequence's) packed blocks, checked against H KV heads of D channels and
// `rows` sequences of per-sequence tensors; every packed tensor holds the same pages.
Packed packed_layout(const PackedArgs& a, int64_t group, int64_t heads, int64_t dim,
                     int64_t rows) {
  Packed pk;
  pk.group = group;
  check(group > 0 && group % 8 == 0, "groups must be a positive multiple of 8 tokens");
  check(a.value_codes.has_value() && a.value_scale.has_value(), "packed blocks need value codes");
  pk.values = token_groups(*a.value_codes, *a.value_scale, a.value_min, a.value_bits,
                           a.value_group, dim, heads, group, "value");
  pk.value_kernel = values_for(a.value_group, int(a.value_bits));
  pk.value_ints = int_for(a.value_group, int(a.value_bits));
  const int64_t pages = a.value_codes->size(0);
  if (!a.plane_codes.empty()) {
    pk.key_mode = 1;
    const size_t n = a.plane_codes.size();
    check(a.plane_bits.size() == n && a.plane_index.size() == n && a.plane_mult.size() == n,
          "plane codes, bits, index and mult must be lists of equal length");
    check(a.key_scale.has_value() && a.key_min.has_value() && a.key_offset.has_value(),
          "channel planes need key scale, min and offset");
    check(a.key_scale->numel() == pages * heads * dim && a.key_min->numel() == pages * heads * dim,
          "key scale and min must be [pages, H, D]");
    check(a.key_offset->numel() == heads * dim || a.key_offset->numel() == rows * heads * dim,
          "key offset must be [1 or sequences, H, D]");
    pk.key_scale = data<at::Half>(*a.key_scale, "key scale");
    pk.key_min = data<at::Half>(*a.key_min, "key min");
    pk.key_offset = data<float>(*a.key_offset, "key offset");
    for (size_t i = 0; i < n; ++i)
      pk.planes.push_back(channel_plane(a.plane_codes[i], a.plane_bits[i], a.plane_index[i],
                                        a.plane_mult[i], group, heads, dim, pages, rows));
  } else {
    check(a.key_codes.has_value() && a.key_scale.has_value(), "packed keys are missing");
    check(a.key_codes->size(0) == pages, "key and value codes must hold the same pages");
    pk.key_mode = 2;
    pk.keys = token_groups(*a.key_codes, *a.key_scale, a.key_min, a.key_bits, a.key_group, dim,
                           heads, group, "key");
    pk.key_dots = dots_for(a.key_group, int(a.key_bits));
  }
  return pk;
}

void set_heads(Problem& p, int64_t heads, int64_t kv_heads, int64_t queries, int64_t dim,
               const float* query, double scale) {
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.queries = queries;
  p.dim = dim;
  check(heads > 0 && kv_heads > 0 && dim > 0 && queries > 0,
        "heads, KV heads, head dim and queries must be positive");
  check(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  p.group_size = heads / kv_heads;
  p.rows = p.group_size * queries;
  p.padded = (p.rows + RB - 1) / RB * RB;
  p.query = query;
  p.scale = float(scale);
}

std::vector<Unit> units_of(const Problem& p) {
  std::vector<Unit> units;
  for (size_t s = 0; s < p.segments.size(); ++s)
    for (int64_t b = 0; b < p.segments[s].blocks; ++b) units.push_back({int(s), b});
  for (int64_t b = 0; b < p.packed.blocks; ++b) units.push_back({-1, b});
  return units;
}

// One KV head's partials -> its query rows of `out` [Hq, q, D].
void merge(const Problem& p, const Partial* parts, int64_t splits, int64_t h, float* out) {
  for (int64_t r = 0; r < p.rows; ++r) {
    float m = NEG_INF;
    for (int64_t s = 0; s < splits; ++s)
      if (!parts[s].max.empty()) m = std::max(m, parts[s].max[r]);
    if (m == NEG_INF) continue;
    float total = 0.f;
    float* dst = out + ((h * p.group_size + r / p.queries) * p.queries + r % p.queries) * p.dim;
    for (int64_t s = 0; s < splits; ++s) {
      const Partial& part = parts[s];
      if (part.max.empty() || part.max[r] == NEG_INF) continue;
      const float w = std::exp(part.max[r] - m);
      total += w * part.sum[r];
      for (int64_t d = 0; d < p.dim; ++d) dst[d] += w * part.acc[r * p.dim + d];
    }
    for (int64_t d = 0; d < p.dim; ++d) dst[d] /= total;
  }
}

// Every sequence's tasks — (sequence, KV head, contiguous range of units), enough ranges to
// keep every thread busy — in one parallel loop, then a log-sum-exp merge per sequence
// -> out [S, Hq, q, D].
Tensor solve(const std::vector<Problem>& problems, const at::TensorOptions& options) {
  const int64_t S = int64_t(problems.size());
  const Problem& first = problems[0];
  const int64_t H = first.kv_heads, D = first.dim;
  std::vector<std::vector<Unit>> units(S);
  int64_t most = 1;
  for (int64_t s = 0; s < S; ++s) {
    units[s] = units_of(problems[s]);
    most = std::max<int64_t>(most, int64_t(units[s].size()));
  }
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(most, (2 * threads + S * H - 1) /
                                                                          (S * H)));
  std::vector<Partial> partials(S * H * splits);
  at::parallel_for(0, S * H * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (H * splits), h = task / splits % H, split = task % splits;
      const int64_t n = int64_t(units[s].size());
      const int64_t lo = n * split / splits, hi = n * (split + 1) / splits;
      if (hi > lo) partials[task] = Task(problems[s], h, units[s].data() + lo, hi - lo).run();
    }
  });
  Tensor out = at::zeros({S, first.heads, first.queries, D}, options);
  for (int64_t s = 0; s < S; ++s) {
    const Problem& p = problems[s];
    float* o = out.data_ptr<float>() + s * p.heads * p.queries * D;
    for (int64_t h = 0; h < H; ++h)
      merge(p, &partials[(s * H + h) * splits], splits, h, o);
  }
  return out;
}

Tensor decode(const Tensor& query, double scale, at::TensorList float_keys,
              at::TensorList float_values, int64_t causal_last, int64_t group,
              at::IntArrayRef lengths, at::TensorList plane_codes, at::IntArrayRef plane_bits,
              at::TensorList plane_index, at::TensorList plane_mult,
              const std::optional<Tensor>& key_scale, const std::optional<Tensor>& key_min,
              const std::optional<Tensor>& key_offset, const std::optional<Tensor>& key_codes,
              int64_t key_bits, int64_t key_group, const std::optional<Tensor>& value_codes,
              int64_t value_bits, int64_t value_group, const std::optional<Tensor>& value_scale,
              const std::optional<Tensor>& value_min) {
  check(query.dim() == 3 && query.scalar_type() == at::kFloat, "query must be [Hq, q, D] float32");
  check(float_keys.size() == float_values.size() && !float_keys.empty(),
        "float keys and values must pair up");
  check(float_keys[0].dim() == 4, "float segments must be [n, H, t, D]");
  Problem p;
  set_heads(p, query.size(0), float_keys[0].size(1), query.size(1), query.size(2),
            data<float>(query, "query"), scale);
  for (size_t s = 0; s < float_keys.size(); ++s) {
    const Tensor& k = float_keys[s];
    check(k.dim() == 4 && k.size(1) == p.kv_heads && k.size(3) == p.dim &&
              k.scalar_type() == at::kFloat && k.sizes() == float_values[s].sizes(),
          "float segments must be [n, H, t, D] float32 keys and values of equal shape");
    const bool causal = causal_last && s + 1 == float_keys.size();
    check(!causal || (k.size(0) == 1 && k.size(2) == p.queries),
          "the causal segment must hold exactly the new tokens");
    p.segments.push_back({data<float>(k, "float keys"), data<float>(float_values[s], "float values"),
                          k.size(0), k.size(2), causal, k.size(2) * p.dim});
  }
  if (!lengths.empty()) {
    const PackedArgs args{plane_codes, plane_bits, plane_index, plane_mult, key_scale, key_min,
                          key_offset, key_codes, key_bits, key_group, value_codes, value_bits,
                          value_group, value_scale, value_min};
    p.packed = packed_layout(args, group, p.kv_heads, p.dim, 1);
    p.packed.blocks = int64_t(lengths.size());
    check(p.packed.blocks <= value_codes->size(0), "more lengths than packed blocks");
    for (const int64_t length : lengths)
      check(length >= 0 && length <= group, "each block holds 0 to group tokens");
    p.packed.lengths = lengths.data();
  }
  return solve({p}, query.options())[0];
}

// A decode step of a whole batch: query [S, Hq, D] (one new token per sequence, already in its
// float slot) over float slots [S, H, T, D] (spans [S, 4]: sink start and length, residual
// start and length) and pages of one pool read through the block table (pages, held [S, M],
// counts [S]): float pages [P, H, G, D] (the `full` method), or packed ones with per-sequence
// plane indices, multipliers and key offsets [S or 1, H, ...].
Tensor decode_batch(const Tensor& query, double scale, const Tensor& slot_keys,
                    const Tensor& slot_values, const Tensor& spans, int64_t group,
                    const Tensor& pages, const Tensor& held, const Tensor& counts,
                    const std::optional<Tensor>& page_keys,
                    const std::optional<Tensor>& page_values, at::TensorList plane_codes, at::IntArrayRef plane_bits,
                    at::TensorList plane_index, at::TensorList plane_mult,
                    const std::optional<Tensor>& key_scale, const std::optional<Tensor>& key_min,
                    const std::optional<Tensor>& key_offset,
                    const std::optional<Tensor>& key_codes, int64_t key_bits, int64_t key_group,
                    const std::optional<Tensor>& value_codes, int64_t value_bits,
                    int64_t value_group, const std::optional<Tensor>& value_scale,
                    const std::optional<Tensor>& value_min, const std::optional<Tensor>& skip) {
  check(query.dim() == 3 && query.scalar_type() == at::kFloat, "query must be [S, Hq, D] float32");
  const int64_t S = query.size(0), H = slot_keys.size(1), T = slot_keys.size(2);
  const int64_t D = query.size(2);
  check(S > 0, "the batch is empty");
  check(slot_keys.dim() == 4, "slots must be [S, H, T, D]");
  check(slot_keys.dim() == 4 && slot_keys.size(0) == S && slot_keys.size(3) == D &&
            slot_keys.scalar_type() == at::kFloat && slot_keys.sizes() == slot_values.sizes(),
        "slots must be [S, H, T, D] float32 keys and values of equal shape");
  check(spans.dim() == 2 && spans.size(0) == S && spans.size(1) == 4, "spans must be [S, 4]");
  check(pages.dim() == 2 && pages.size(0) == S && held.sizes() == pages.sizes() &&
            counts.numel() == S, "the block table must be pages, held [S, M] and counts [S]");
  const int64_t* span = data<int64_t>(spans, "spans");
  const int64_t* count = data<int64_t>(counts, "counts");
  check(!skip.has_value() || (skip->dim() == 1 && skip->size(0) == S), "skip must be [S]");
  const int64_t* hidden = skip.has_value() ? data<int64_t>(*skip, "skip") : nullptr;
  const int64_t M = pages.size(1);
  const float* keys = data<float>(slot_keys, "slot keys");
  const float* values = data<float>(slot_values, "slot values");
  Packed pool;
  const bool packed = value_codes.has_value();
  const bool floats = page_keys.has_value();
  if (floats)
    check(page_keys->dim() == 4 && page_keys->size(1) == H && page_keys->size(2) == group &&
              page_keys->size(3) == D && page_keys->scalar_type() == at::kFloat &&
              page_values.has_value() && page_values->sizes() == page_keys->sizes(),
          "float pages must be [P, H, G, D] float32 keys and values");
  if (packed) {
    const PackedArgs args{plane_codes, plane_bits, plane_index, plane_mult, key_scale, key_min,
                          key_offset, key_codes, key_bits, key_group, value_codes, value_bits,
                          value_group, value_scale, value_min};
    pool = packed_layout(args, group, H, D, S);
  }
  std::vector<Problem> problems(S);
  for (int64_t s = 0; s < S; ++s) {
    Problem& p = problems[s];
    set_heads(p, query.size(1), H, 1, D, data<float>(query, "query") + s * query.size(1) * D,
              scale);
    for (int which = 0; which < 2; ++which) {
      const int64_t start = span[s * 4 + 2 * which], length = span[s * 4 + 2 * which + 1];
      check(start >= 0 && length >= 0 && start + length <= T, "spans must lie in the slots");
      const int64_t at = (s * H * T + start) * D;
      if (length) p.segments.push_back({keys + at, values + at, 1, length, false, T * D});
    }
    check(count[s] >= 0 && count[s] <= M, "counts must be within the table's width");
    const int64_t* ids = data<int64_t>(pages, "pages") + s * M;
    const int64_t* tokens = data<int64_t>(held, "held") + s * M;
    const int64_t front = hidden ? hidden[s] : 0;
    check(front == 0 || (count[s] > 0 && front > 0 && front <= tokens[0]),
          "skip must lie in the sequence's first page");
    for (int64_t n = 0; floats && n < count[s]; ++n) {  // a float page is a float segment
      check(ids[n] >= 0 && ids[n] < page_keys->size(0) && tokens[n] >= 0 && tokens[n] <= group,
            "the block table names a page outside the pool, or more tokens than a group");
      const int64_t cut = n == 0 ? front : 0, at = (ids[n] * H * group + cut) * D;
      if (tokens[n] > cut)
        p.segments.push_back({data<float>(*page_keys, "page keys") + at,
                              data<float>(*page_values, "page values") + at, 1, tokens[n] - cut,
                              false, group * D});
    }
    if (!packed || count[s] == 0) continue;
    for (int64_t n = 0; n < count[s]; ++n)
      check(ids[n] >= 0 && ids[n] < value_codes->size(0) && tokens[n] >= 0 &&
                tokens[n] <= group,
            "the block table names a page outside the pool, or more tokens than a group");
    p.packed = pool;
    p.packed.blocks = count[s];
    p.packed.lengths = tokens;
    p.packed.pages = ids;
    p.packed.skip = front;
    for (size_t i = 0; i < p.packed.planes.size(); ++i) {
      Plane& plane = p.packed.planes[i];
      const int64_t each = plane_index[i].size(0) == S ? H * plane.channels : 0;
      plane.index += s * each;
      plane.mult += s * each;
    }
    if (p.packed.key_offset && key_offset->size(0) == S) p.packed.key_offset += s * H * D;
  }
  return solve(problems, query.options()).squeeze(2);
}

}  // namespace

// The kernels this build holds: "avx512-vnni" (integer dot products) or "float".
std::string simd() {
#ifdef KVMIX_VNNI
  return "avx512-vnni";
#else
  return "float";
#endif
}

TORCH_LIBRARY(kvmix, m) {
  m.def("simd() -> str", &simd);
  m.def(
      "decode(Tensor query, float scale, Tensor[] float_keys, Tensor[] float_values, "
      "int causal_last, int group, int[] lengths, Tensor[] plane_codes, int[] plane_bits, "
      "Tensor[] plane_index, Tensor[] plane_mult, Tensor? key_scale, Tensor? key_min, "
      "Tensor? key_offset, Tensor? key_codes, int key_bits, int key_group, Tensor? value_codes, "
      "int value_bits, int value_group, Tensor? value_scale, Tensor? value_min) -> Tensor");
  m.def(
      "decode_batch(Tensor query, float scale, Tensor slot_keys, Tensor slot_values, "
      "Tensor spans, int group, Tensor pages, Tensor held, Tensor counts, Tensor? page_keys, "
      "Tensor? page_values, Tensor[] plane_codes, "
      "int[] plane_bits, Tensor[] plane_index, Tensor[] plane_mult, Tensor? key_scale, "
      "Tensor? key_min, Tensor? key_offset, Tensor? key_codes, int key_bits, int key_group, "
      "Tensor? value_codes, int value_bits, int value_group, Tensor? value_scale, "
      "Tensor? value_min, Tensor? skip=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmix, CPU, m) {
  m.impl("decode", &decode);
  m.impl("decode_batch", &decode_batch);
}
