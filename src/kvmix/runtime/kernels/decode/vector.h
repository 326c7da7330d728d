// Small vector helpers with their portable fallbacks: dot, exp, float16 conversion.
#pragma once

namespace {

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

// The largest of n values (-inf for none): four independent 16-lane maxima, so that the loop is
// bound by loads, not by one chain of max latencies.
float largest(const float* x, int64_t n) {
  float m = NEG_INF;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 most[4];
  for (auto& v : most) v = _mm512_set1_ps(NEG_INF);
  for (; i + 64 <= n; i += 64)
    for (int k = 0; k < 4; ++k) most[k] = _mm512_max_ps(most[k], _mm512_loadu_ps(x + i + 16 * k));
  for (; i + 16 <= n; i += 16) most[0] = _mm512_max_ps(most[0], _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(most[0], most[1]),
                                         _mm512_max_ps(most[2], most[3])));
#endif
#pragma omp simd reduction(max : m)
  for (int64_t j = i; j < n; ++j) m = m > x[j] ? m : x[j];
  return m;
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
// 16 floats from float32, float16 or bfloat16 elements, widened in the register.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline __m512 load16(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

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

#ifdef __AVX512F__
// 16 floats stored as float32, float16 or bfloat16, each rounded to nearest even as c10's
// conversion rounds it (a bfloat16 NaN: c10's quiet NaN 0x7FC0).
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::Half* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// 16 floats rounded to bfloat16 (nearest even; NaN: a quiet NaN), each 16 bits in the low
// half of its 32-bit lane.
inline __m512i brain16(__m512 v) {
  const __m512i raw = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(raw, 16), _mm512_set1_epi32(1));
  const __m512i top = _mm512_srli_epi32(
      _mm512_add_epi32(raw, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}
inline void store16(at::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(brain16(v)));
}

// 16 floats rounded to T and back (T(v) of each, as torch's elementwise kernels in T round).
template <typename T>
inline __m512 in_dtype16(__m512 v) {
  if constexpr (std::is_same_v<T, at::Half>)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  else if constexpr (std::is_same_v<T, at::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(brain16(v), 16));
  else
    return v;
}
#endif

// n elements of S -> O, each rounded to nearest even as c10's conversion rounds it (through
// float32: exact for every pair of float32, float16 and bfloat16), sixteen at a time where
// the CPU has AVX-512.
template <typename S, typename O>
inline void convert(const S* x, O* y, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) store16(y + i, load16(x + i));
#endif
  for (; i < n; ++i) y[i] = O(float(x[i]));
}

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

// bfloat16 -> float32: the 16 bits are the float's upper half (exact).
void brain_halves(const at::BFloat16* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(uint32_t(in[i].x) << 16);
}

}  // namespace
