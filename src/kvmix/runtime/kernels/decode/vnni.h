// Integer dot products over packed codes (AVX-512 VNNI + VBMI), and the stand-ins a
// build without them links against (never called there).
#pragma once

namespace {

// ---- integer dot products (AVX-512 VNNI and VBMI) ---------------------------------------------
//
// Σ_k w[r][k]·code_k[n] over K packed rows (key channels of a block, or tokens of a value group)
// for up to RB weight rows at once, N codes per packed row. The float weights of each row are
// rounded once to two int8 planes, w ≈ α·(hi + lo/256) with α = max|w|/127: each weight
// rounded to a step of 1/32512 of the row's largest (16-bit precision; the only error the
// integer path adds to float32 arithmetic), then dotted with the unsigned codes by vpdpbusd:
// a 32-bit lane sums 4 products, so a code vector holds, for 16 consecutive outputs n, the
// codes of 4 packed rows (one byte each). It is built from the packed rows with one byte
// permutation (vpermb) and a shift and mask per lane: code n of a row lies in byte n mod W at
// shift (n div W)·BITS.
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KVMIX_VNNI 1

constexpr float LO_STEP = 1.f / 256.f;

// The first min(n, 16) lanes.
inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Weights [R, ld] (the first K of each row) -> two int8 planes [R, Kp] (zero past K) and α:
// X = round(256·w/α) in [-32512, 32512], hi = round(X / 256), lo = X - 256·hi in [-128, 127].
// `top`: each row's largest |w| where the caller has it (null: found here).
void round_weights(const float* w, int64_t ld, int64_t K, int64_t Kp, int R, int8_t* hi,
                   int8_t* lo, float* alpha, const float* top = nullptr) {
  for (int r = 0; r < R; ++r) {
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

// One pass over a block's key statistics for R query rows (D % 16 == 0): each row's bias
// Σ_c q[c]·(m_c + s_c·off_c), the weights w[r][c] = qm[r][c]·s_c of a plane holding every
// channel in order (qm: the query times the plane's multipliers) with each row's largest |w|,
// and the scales as floats (other planes gather theirs). q, qm, w: rows D apart.
template <int R>
void key_weights(const at::Half* scale, const at::Half* minimum, const float* offset,
                 const float* q, const float* qm, int64_t D, float* bias, float* w, float* top,
                 float* scales) {
  __m512 sum[R], most[R];
  for (int r = 0; r < R; ++r) sum[r] = most[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 s =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + c)));
    const __m512 m = _mm512_fmadd_ps(s, _mm512_loadu_ps(offset + c), _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + c))));
    _mm512_storeu_ps(scales + c, s);
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + c), m, sum[r]);
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qm + r * D + c), s);
      _mm512_storeu_ps(w + r * D + c, x);
      most[r] = _mm512_max_ps(most[r], _mm512_abs_ps(x));
    }
  }
  for (int r = 0; r < R; ++r) {
    bias[r] = _mm512_reduce_add_ps(sum[r]);
    top[r] = _mm512_reduce_max_ps(most[r]);
  }
}

// One pass over a value group of a block for R rows of softmax weights p (rows `ld` apart)
// over T tokens: w[r][t] = p[r][t]·s[t] (rows T apart) with each row's largest |w|, and
// Σ_t p·m added lane by lane (token t into lane t mod 16) to bias[r·bias_ld, +16).
void value_weights(const float* p, int64_t ld, const float* s, const float* m, int64_t T, int R,
                   float* w, float* bias, int64_t bias_ld, float* top) {
  for (int r = 0; r < R; ++r) {
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

// out[r·ld + n] += Σ_k w[r][k]·code_k[n] for R rows, n < N, over K packed rows `stride` bytes
// apart; weights as round_weights left them ([R, Kp] int8 planes and α). Two code vectors
// (32 outputs) at a time: 2 × R × 2 accumulators.
template <int N, int BITS, int R>
void int_tile(const uint8_t* rows, int64_t stride, int64_t K, const int8_t* hi, const int8_t* lo,
              int64_t Kp, const float* alpha, float* out, int64_t ld) {
  static_assert(N % 32 == 0 || N == 16, "rows of 16 or a multiple of 32 codes");
  for (int m = 0; m < N / 16; m += 2) {
    constexpr int PAIR = N == 16 ? 1 : 2;
    __m512i acc_hi[PAIR][R], acc_lo[PAIR][R];
    for (int i = 0; i < PAIR; ++i)
      for (int r = 0; r < R; ++r) acc_hi[i][r] = acc_lo[i][r] = _mm512_setzero_si512();
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
      for (int r = 0; r < R; ++r) {
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
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_lo[i][r]),
                                           _mm512_set1_ps(LO_STEP),
                                           _mm512_cvtepi32_ps(acc_hi[i][r]));
        float* o = out + r * ld + 16 * (m + i);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o)));
      }
  }
}

// int_tile for the R real rows of a tile.
template <int N, int BITS>
void int_rows(const uint8_t* rows, int64_t stride, int64_t K, const int8_t* hi, const int8_t* lo,
              int64_t Kp, int R, const float* alpha, float* out, int64_t ld) {
  for_rows(R, [&]<int Rows>() {
    int_tile<N, BITS, Rows>(rows, stride, K, hi, lo, Kp, alpha, out, ld);
  });
}

using IntFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const int8_t*, int64_t,
                       int, const float*, float*, int64_t);

// The integer kernel for rows of n codes (16, 32, 64 or 128), else null (the float kernels).
IntFn int_for(int64_t n, int bits) {
  return for_length(n, [bits]<int N>() {
    return for_bits(bits, []<int B>() -> IntFn { return int_rows<N, B>; });
  });
}
#else
using IntFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const int8_t*, int64_t,
                       int, const float*, float*, int64_t);
IntFn int_for(int64_t, int) { return nullptr; }
// Never called: without the integer kernels no plane or value group has one.
void round_weights(const float*, int64_t, int64_t, int64_t, int, int8_t*, int8_t*, float*,
                   const float* = nullptr) {}
template <int R>
void key_weights(const at::Half*, const at::Half*, const float*, const float*, const float*,
                 int64_t, float*, float*, float*, float*) {}
void value_weights(const float*, int64_t, const float*, const float*, int64_t, int, float*,
                   float*, int64_t, float*) {}
#endif

}  // namespace
