// Task: scores and values of float segments (sink, residual, new tokens, float pages).
#pragma once

namespace {

// ---- float segments ----

// One block's keys or values of this head, [t, D] floats: where they lie (float32), or widened
// into this task's buffer (float16, bfloat16).
const float* Task::segment_rows(const FloatSegment& seg, const void* base, int64_t block) {
  const int64_t at = segment_at(seg, block);
  if (seg.dtype == at::kFloat) return static_cast<const float*>(base) + at;
  widened_.resize(seg.tokens * p_->dim);
  if (seg.dtype == at::kHalf)
    halves(static_cast<const at::Half*>(base) + at, seg.tokens * p_->dim, widened_.data());
  else
    brain_halves(static_cast<const at::BFloat16*>(base) + at, seg.tokens * p_->dim,
                 widened_.data());
  return widened_.data();
}

// f(rows): this head's rows [t, D] of one block of a float segment, as they lie (const float*,
// const at::Half* or const at::BFloat16*).
template <typename F>
void with_segment_rows(const FloatSegment& seg, const void* base, int64_t at, F&& f) {
  switch (seg.dtype) {
    case at::kHalf: f(static_cast<const at::Half*>(base) + at); break;
    case at::kBFloat16: f(static_cast<const at::BFloat16*>(base) + at); break;
    default: f(static_cast<const float*>(base) + at);
  }
}

#ifdef __AVX512F__
// out[r·L + t] = q_r·k_t for R query rows of D (a multiple of 32) channels over T keys [T, D]
// (float32, float16 or bfloat16, widened as read): each key read once for the R rows; per row
// the sum dot() forms (even and odd 16 channels).
template <int D, int R, typename E>
void rows_dot_keys(const float* q, const E* keys, int64_t T, int64_t L, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const E* k = keys + t * D;
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
      const __m512 k0 = load16(k + d), k1 = load16(k + d + 16);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), k0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d + 16), k1, odd[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      out[r * L + t] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
  }
}

// acc[r, d..d+32) += Σ_t w[r·L + t]·v_t[d..d+32) for R rows over T values [T, D] (widened as
// read), with the R rows' 32 channels in registers over every token.
template <int R, typename E>
void rows_add_values(const float* weights, int64_t L, const E* values, int64_t T, int64_t D,
                     float* acc) {
  for (int64_t d = 0; d < D; d += 32) {
    __m512 sum[R][2];
    float* a = acc + d;
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 2; ++k) sum[r][k] = _mm512_loadu_ps(a + r * D + 16 * k);
    for (int64_t t = 0; t < T; ++t) {
      const __m512 v0 = load16(values + t * D + d), v1 = load16(values + t * D + d + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(weights[r * L + t]);
        sum[r][0] = _mm512_fmadd_ps(w, v0, sum[r][0]);
        sum[r][1] = _mm512_fmadd_ps(w, v1, sum[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 2; ++k) _mm512_storeu_ps(a + r * D + 16 * k, sum[r][k]);
  }
}
#endif

void Task::float_scores(const FloatSegment& seg, int64_t block, float* out) {
  const int64_t D = p_->dim, T = seg.tokens, L = total_;
#ifdef __AVX512F__
  if (!seg.causal && (D == 64 || D == 128)) {  // the real rows, RB at a time
    with_segment_rows(seg, seg.keys, segment_at(seg, block), [&]<typename E>(const E* keys) {
      for (int64_t r0 = 0; r0 < p_->rows; r0 += RB)
        for_rows(tile(r0), [&]<int R>() {
          (D == 64 ? rows_dot_keys<64, R, E> : rows_dot_keys<128, R, E>)(qrow(r0), keys, T, L,
                                                                         out + r0 * L);
        });
    });
    return;
  }
#endif
  const float* keys = segment_rows(seg, seg.keys, block);
  for (int64_t r = 0; r < p_->rows; ++r) {
    const int64_t i = r % p_->queries;  // this row's query token
    for (int64_t t = 0; t < T; ++t) {
      const bool hidden = seg.causal && t > i + (T - p_->queries);
      out[r * L + t] = hidden ? NEG_INF : dot(qrow(r), keys + t * D, D);
    }
  }
}

void Task::float_values(const FloatSegment& seg, int64_t block, const float* weights, float* acc) {
  const int64_t D = p_->dim, T = seg.tokens, L = total_;
#ifdef __AVX512F__
  if (D % 32 == 0) {  // the real rows, RB at a time
    with_segment_rows(seg, seg.values, segment_at(seg, block), [&]<typename E>(const E* values) {
      for (int64_t r0 = 0; r0 < p_->rows; r0 += RB)
        for_rows(tile(r0), [&]<int R>() {
          rows_add_values<R>(weights + r0 * L, L, values, T, D, acc + r0 * D);
        });
    });
    return;
  }
#endif
  const float* values = segment_rows(seg, seg.values, block);
  for (int64_t r = 0; r < p_->rows; ++r) {
    float* a = acc + r * D;
    for (int64_t t = 0; t < T; ++t) {
      const float w = weights[r * L + t];
      const float* v = values + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
    }
  }
}

}  // namespace
