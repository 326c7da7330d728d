// Task: scores of per-channel key groups (KIVI, PN-Mix, Kitty, ChanMix): a bias per
// query row, then each plane's channel rows.
#pragma once

namespace {

// ---- per-channel key groups ----

// One bias per row (the value of code 0 against the query), then each plane's channels.
// The block kernels fill all G tokens; a cropped block's tail lands in work_ and is dropped.
void Task::channel_scores(int64_t n, float* out) {
  const Packed& pk = p_->packed;
  const int64_t P = p_->padded, D = p_->dim, G = pk.group, H = p_->kv_heads, L = total_;
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
      const int R = tile(r0);
      for_rows(R, [&]<int Rows>() {
        key_weights<Rows>(scale, minimum, offset, qrow(r0), &plane_queries_[0][r0 * D], D, bias,
                       weights_.data(), top, scale_.data());
      });
      for (int r = 0; r < R; ++r)
        std::fill(block + (r0 + r) * G, block + (r0 + r + 1) * G, bias[r]);
      integer_weights(weights_.data(), D, D, R, top);
      every.ints(rows, stride, D, hi_.data(), lo_.data(), padded_, R, alpha_, block + r0 * G, G);
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
  for (int64_t r = 0; r < p_->rows; ++r) std::copy(block + r * G, block + r * G + T, out + r * L);
}

void Task::plane(const Plane& plane, const std::vector<float>& queries, int64_t n, float* block) {
  const int64_t C = plane.channels, G = p_->packed.group;
  if (C == 0) return;
  const int64_t stride = row_bytes(G, plane.bits);
  const uint8_t* rows = plane.codes + page(n) * plane.block_bytes + h_ * C * stride;
  const float* factor = scale_.data();  // each plane channel's scale (multipliers: in queries)
  if (!in_order_[&plane - p_->packed.planes.data()]) {
    const int64_t* index = plane.index + h_ * C;
    factor_.resize(C);
    for (int64_t i = 0; i < C; ++i) factor_[i] = scale_[index[i]];
    factor = factor_.data();
  }
  weights_.resize(RB * C);
  for (int64_t r0 = 0; r0 < p_->padded; r0 += RB) {
    const float* q = &queries[r0 * C];
    for (int r = 0; r < RB; ++r)
#pragma omp simd
      for (int64_t i = 0; i < C; ++i) weights_[r * C + i] = q[r * C + i] * factor[i];
    float* dst = block + r0 * G;
    if (plane.ints) {
      const int R = tile(r0);
      integer_weights(weights_.data(), C, C, R);
      plane.ints(rows, stride, C, hi_.data(), lo_.data(), padded_, R, alpha_, dst, G);
    } else if (plane.kernel)
      plane.kernel(rows, stride, C, weights_.data(), dst);
    else
      plane_scores_any(rows, stride, C, weights_.data(), dst, plane.bits, G, floats_.data());
  }
}

}  // namespace
