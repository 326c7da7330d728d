// One task: one KV head of one sequence over a range of units (float segments and packed
// blocks), with an online softmax over the whole range. The layouts' own member functions
// live in float_pages.h, channel_keys.h and token_keys.h.
#pragma once

namespace {

// ---- one task: one KV head over a range of units, softmax over the whole range ---------------

class Task {
 public:
  // One task after another on the same thread: the buffers keep their capacity.
  void start(const Problem& p, int64_t head, const Unit* units, int64_t count) {
    p_ = &p;
    h_ = head;
    units_ = units;
    count_ = count;
    const int64_t P = p.padded, D = p.dim, G = std::max<int64_t>(p.packed.group, 1);
    q_.assign(P * D, 0.f);  // rows beyond p.rows stay zero
    for (int64_t g = 0; g < p.group_size; ++g)
      for (int64_t i = 0; i < p.queries; ++i) {
        const float* src = p.query + ((h_ * p.group_size + g) * p.queries + i) * D;
        float* dst = &q_[(g * p.queries + i) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
      }
    const std::vector<Plane>& planes = p.packed.planes;
    plane_queries_.resize(planes.size());
    in_order_.assign(planes.size(), false);
    for (size_t k = 0; k < planes.size(); ++k) {  // each plane's channels of every query row
      const int64_t C = planes[k].channels;         // times their multipliers
      const int64_t* index = planes[k].index + h_ * C;
      const float* mult = planes[k].mult + h_ * C;
      std::vector<float>& gathered = plane_queries_[k];
      gathered.resize(P * C);
      bool in_order = true;
      for (int64_t i = 0; i < C; ++i) in_order = in_order && index[i] == i;
      for (int64_t r = 0; r < P; ++r) {
        const float* q = &q_[r * D];
        float* g = &gathered[r * C];
        if (in_order)  // channels 0..C-1: a vector multiply, no gather
#pragma omp simd
          for (int64_t i = 0; i < C; ++i) g[i] = q[i] * mult[i];
        else
          for (int64_t i = 0; i < C; ++i) g[i] = q[index[i]] * mult[i];
      }
      in_order_[k] = in_order;
    }
    fused_keys_ = !planes.empty() && planes[0].ints && in_order_[0] && planes[0].channels == D &&
                  D % 16 == 0;
    offsets_.clear();
    total_ = 0;
    for (int64_t u = 0; u < count_; ++u) {
      offsets_.push_back(total_);
      total_ += tokens(units_[u]);
    }
    work_.resize(P * std::max(G, D));
    floats_.resize(std::max(G, D));
    value_bias_.clear();  // sums from zero (packed_values)
  }

  // Scores of every unit, one softmax over them all, then the weighted values -> state.
  void run(Partial& state) {
    Stopwatch clock;
    const Problem& p = *p_;
    const int64_t R = p.rows, P = p.padded, D = p.dim, L = total_;
    const size_t n = size_t(count_);
    scores_.resize(P * std::max<int64_t>(L, 1));  // every unit writes its own scores
    for (size_t u = 0; u < std::min(n, AHEAD); ++u) prefetch(units_[u], true);
    for (size_t u = 0; u < n; ++u) {
      if (u + AHEAD < n) prefetch(units_[u + AHEAD], true);
      scores(units_[u], &scores_[offsets_[u]]);
      clock.lap(units_[u].segment >= 0 ? KEYS_FLOAT : KEYS_PACKED);
    }
    state.max.assign(R, NEG_INF);
    state.sum.assign(R, 0.f);
    state.acc.assign(P * D, 0.f);  // padding rows: never read
    for (int64_t r = 0; r < R; ++r) {
      float* s = &scores_[r * L];
      const float m = largest(s, L);
      state.max[r] = m;
      if (m == NEG_INF) {
        std::fill(s, s + L, 0.f);
        continue;
      }
      state.sum[r] = exp_sum(s, L, m);
    }
    std::fill(scores_.begin() + R * L, scores_.end(), 0.f);  // padding rows weigh nothing
    for (size_t u = 0; u < std::min(n, AHEAD); ++u) prefetch(units_[u], false);
    clock.lap(SOFTMAX);
    for (size_t u = 0; u < n; ++u) {
      if (u + AHEAD < n) prefetch(units_[u + AHEAD], false);
      values(units_[u], &scores_[offsets_[u]], state.acc.data());
      const int s = units_[u].segment;
      clock.lap(s >= 0 && p.segments[s].value_page < 0 ? VALUES_FLOAT : VALUES_PACKED);
    }
    add_value_bias(state.acc.data());
    clock.lap(VALUES_PACKED);
  }

 private:
  int64_t tokens(const Unit& u) const {
    return u.segment >= 0 ? p_->segments[u.segment].tokens : p_->packed.lengths[u.block];
  }

  const float* qrow(int64_t r) const { return &q_[r * p_->dim]; }

  // This head's first element of a float segment's block (its rows [t, D] follow).
  int64_t segment_at(const FloatSegment& seg, int64_t block) const {
    return (block * p_->kv_heads + h_) * seg.head_stride;
  }

  int64_t page(int64_t n) const { return p_->packed.pages ? p_->packed.pages[n] : n; }

  // A later unit's key (or value) codes and statistics of this head into the cache while this
  // one is computed (and a pass's first units before it starts): the pages of a pool are
  // scattered, so the hardware prefetcher cannot see them coming. A float segment: its rows.
  void prefetch(const Unit& u, bool keys) const {
    if (u.segment >= 0) {
      const FloatSegment& seg = p_->segments[u.segment];
      if (!keys && seg.value_page >= 0) return;
      const int64_t size = int64_t(c10::elementSize(seg.dtype));
      const char* base = static_cast<const char*>(keys ? seg.keys : seg.values);
      ahead(base + segment_at(seg, u.block) * size, seg.tokens * p_->dim * size);
      return;
    }
    const Packed& pk = p_->packed;
    const int64_t n = page(u.block), H = p_->kv_heads, D = p_->dim, G = pk.group;
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
      float_scores(p_->segments[u.segment], u.block, out);
    else if (p_->packed.key_mode == 1)
      channel_scores(u.block, out);
    else
      token_scores(u.block, out);
    if (u.segment < 0 && u.block == 0)
      for (int64_t r = 0; r < p_->rows; ++r)
        std::fill(out + r * total_, out + r * total_ + p_->packed.skip, NEG_INF);
  }

  void values(const Unit& u, const float* weights, float* acc) {
    if (u.segment < 0) {
      packed_values(page(u.block), 0, p_->packed.lengths[u.block], weights, acc, true);
      return;
    }
    const FloatSegment& seg = p_->segments[u.segment];
    if (seg.value_page >= 0)  // the portable path: the same arithmetic on every CPU
      packed_values(seg.value_page, seg.value_first, seg.tokens, weights, acc, false);
    else
      float_values(seg, u.block, weights, acc);
  }

  // ---- float segments and float pages (decode/float_pages.h) ----

  const float* segment_rows(const FloatSegment& seg, const void* base, int64_t block);
  void float_scores(const FloatSegment& seg, int64_t block, float* out);
  void float_values(const FloatSegment& seg, int64_t block, const float* weights, float* acc);

  // ---- per-channel key groups (decode/channel_keys.h) ----

  void channel_scores(int64_t n, float* out);
  void plane(const Plane& plane, const std::vector<float>& queries, int64_t n, float* block);

  // ---- per-token groups: WUSH keys, every layout's values (decode/token_keys.h) ----

  void token_scores(int64_t n, float* out);
  void packed_values(int64_t at, int64_t first, int64_t T, const float* p, float* acc,
                     bool ints);
  void add_value_bias(float* acc);
  void token_stats(const Stats& st, int64_t at, int64_t first, int64_t T, int64_t J);

  // R rows of K float weights (`ld` apart; `top`: their largest magnitudes, if known)
  // -> hi_, lo_ [R, padded_] and alpha_.
  void integer_weights(const float* w, int64_t ld, int64_t K, int R, const float* top = nullptr) {
    padded_ = (K + 3) / 4 * 4;
    hi_.resize(RB * padded_);
    lo_.resize(RB * padded_);
    round_weights(w, ld, K, padded_, R, hi_.data(), lo_.data(), alpha_, top);
  }

  // The real rows of the tile of RB rows from r0 (the integer kernels and the AVX-512 float
  // segments compute only these; the portable float kernels compute all RB, padding too).
  int tile(int64_t r0) const { return int(std::min<int64_t>(RB, p_->rows - r0)); }

  const Problem* p_ = nullptr;
  int64_t h_ = 0;
  const Unit* units_ = nullptr;
  int64_t count_ = 0;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  std::vector<float> q_, scores_, work_, weights_, scale_, base_, floats_, factor_, stats_;
  std::vector<float> widened_;  // a float16 segment's block of this head, as floats
  std::vector<std::vector<float>> plane_queries_;
  std::vector<bool> in_order_;  // plane i holds channels 0, 1, ..., C-1: its scales need no gather
  bool fused_keys_ = false;     // integer path, plane 0 every channel in order: key_weights
  std::vector<float> value_bias_;  // [P, J, 16]: Σ p·min of packed values, lane-wise
  std::vector<int8_t> hi_, lo_;
  int64_t padded_ = 0;
  float alpha_[RB] = {};
};

}  // namespace
