// Task: per-token groups (WUSH keys; the values of every layout): scores, p·V, the
// value bias, statistics as floats.
#pragma once

namespace {

// ---- per-token groups ----

// Keys: s·(q·code) + m·Σq per group of `group` channels.
void Task::token_scores(int64_t n, float* out) {
  const Packed& pk = p_->packed;
  const Stats& st = pk.keys;
  const int64_t P = p_->padded, D = p_->dim, G = pk.group, gs = st.group, J = D / gs, L = total_;
  const int64_t T = pk.lengths[n], stride = row_bytes(gs, st.bits);
  const uint8_t* rows = st.codes + page(n) * st.block_bytes + h_ * G * J * stride;
  token_stats(st, page(n), 0, T, J);
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

// acc[r] += Σ_t p[r][t]·(s[t,j]·code + m[t,j]) over tokens [first, first + T) of pool page
// `at`, group by group (`ints`: through the integer kernel where there is one).
void Task::packed_values(int64_t at, int64_t first, int64_t T, const float* p, float* acc,
                         bool ints) {
  const Packed& pk = p_->packed;
  const Stats& st = pk.values;
  const int64_t P = p_->padded, D = p_->dim, G = pk.group, gs = st.group, J = D / gs, L = total_;
  const int64_t stride = row_bytes(gs, st.bits);
  const uint8_t* rows = st.codes + at * st.block_bytes + (h_ * G + first) * J * stride;
  token_stats(st, at, first, T, J);
  weights_.resize(RB * T);
  value_bias_.resize(P * J * 16);
  for (int64_t j = 0; j < J; ++j)
    for (int64_t r0 = 0; r0 < P; r0 += RB) {
      const float* scale = &scale_[j * T];
      if (ints && pk.value_ints) {  // the integer path: weights, bias and largest weights at once
        float top[RB];
        const int R = tile(r0);
        value_weights(p + r0 * L, L, scale, &base_[j * T], T, R, weights_.data(),
                      &value_bias_[(r0 * J + j) * 16], J * 16, top);
        integer_weights(weights_.data(), T, T, R, top);
        pk.value_ints(rows + j * stride, J * stride, T, hi_.data(), lo_.data(), padded_, R,
                      alpha_, acc + r0 * D + j * gs, D);
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
      for (int r = 0; r < RB && r0 + r < p_->rows; ++r) {
        float* a = acc + (r0 + r) * D + j * gs;
        const float* o = out + r * gs;
#pragma omp simd
        for (int64_t c = 0; c < gs; ++c) a[c] += o[c];
      }
    }
}

// acc[r][c] += Σ p·min of group j(c), gathered lane-wise over every packed block.
void Task::add_value_bias(float* acc) {
  if (value_bias_.empty()) return;
  const int64_t D = p_->dim, gs = p_->packed.values.group, J = D / gs;
  for (int64_t r = 0; r < p_->rows; ++r)
    for (int64_t j = 0; j < J; ++j) {
      const float* lanes = &value_bias_[(r * J + j) * 16];
      float b = 0.f;
      for (int l = 0; l < 16; ++l) b += lanes[l];
      for (int64_t c = 0; c < gs; ++c) acc[r * D + j * gs + c] += b;
    }
}

// Per-token statistics of tokens [first, first + T) of pool page `at` as floats, group-major
// [J, T]: scale, and min (or the symmetric levels' offset).
void Task::token_stats(const Stats& st, int64_t at, int64_t first, int64_t T, int64_t J) {
  const int64_t stat0 = ((at * p_->kv_heads + h_) * p_->packed.group + first) * J;
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

}  // namespace
