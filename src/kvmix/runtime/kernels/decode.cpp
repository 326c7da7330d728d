// kvmix::decode — attention of a few new queries over one sequence's packed KV cache, on CPU.
//
// The cache is read where it lies: float segments (sink, residual, the new tokens, or the
// blocks of the `full` method) and packed blocks whose codes are never turned into a float
// history. Packed keys come in two layouts:
//   * per-channel groups (KIVI, PN-Mix, Kitty, ChanMix): one (scale, min) per channel and block,
//     codes in "planes" (a plane is a set of channels at one width; mixed precision is several
//     planes). q·k = Σ_planes Σ_i (q[c_i]·s[c_i]·mult_i)·code_i + Σ_c q[c]·(m[c] + s[c]·off[c]),
//     so the query is pre-scaled once per block and the codes enter a plain dot product;
//   * per-token groups (WUSH): q·k = Σ_j s[t,j]·(q_j·code_j) + m[t,j]·Σ q_j.
// Values are per-token groups: out = Σ_t p_t·s[t,j]·code + Σ_t p_t·m[t,j].
// Codes use kvmix's packing (low bits first; 3 bits = a 2-bit plane then a 1-bit plane).
// Work is split over (KV head, range of blocks) with an online softmax per task and a
// log-sum-exp merge; the query heads of a GQA group share every row they read.
// Built without -ffast-math: masked scores are -inf and must stay so.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

struct Tables {
  uint64_t one[256];
  uint32_t two[256];
  uint16_t four[256];
  Tables() {
    for (int v = 0; v < 256; ++v) {
      one[v] = 0;
      two[v] = 0;
      four[v] = 0;
      for (int j = 0; j < 8; ++j) one[v] |= uint64_t((v >> j) & 1) << (8 * j);
      for (int j = 0; j < 4; ++j) two[v] |= uint32_t((v >> (2 * j)) & 3) << (8 * j);
      for (int j = 0; j < 2; ++j) four[v] |= uint16_t((v >> (4 * j)) & 15) << (8 * j);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// `count` codes of width 1, 2, 4 or 8 starting at byte `data` -> one uint8 each.
void unpack_plane(const uint8_t* data, int bits, int64_t count, uint8_t* out) {
  const Tables& t = tables();
  const int64_t per = 8 / bits, bytes = count / per;
  switch (bits) {
    case 1:
      for (int64_t i = 0; i < bytes; ++i) std::memcpy(out + 8 * i, &t.one[data[i]], 8);
      break;
    case 2:
      for (int64_t i = 0; i < bytes; ++i) std::memcpy(out + 4 * i, &t.two[data[i]], 4);
      break;
    case 4:
      for (int64_t i = 0; i < bytes; ++i) std::memcpy(out + 2 * i, &t.four[data[i]], 2);
      break;
    default:
      std::memcpy(out, data, count);
  }
}

// Codes [offset, offset + count) of a stream of `total` codes at `bits` (3 = 2-bit plane then
// 1-bit plane); offset and count keep every plane byte-aligned (checked by the caller).
void unpack(const uint8_t* stream, int bits, int64_t total, int64_t offset, int64_t count,
            uint8_t* out, uint8_t* scratch) {
  if (bits != 3) {
    unpack_plane(stream + offset * bits / 8, bits, count, out);
    return;
  }
  unpack_plane(stream + offset / 4, 2, count, out);
  unpack_plane(stream + total / 4 + offset / 8, 1, count, scratch);
  for (int64_t i = 0; i < count; ++i) out[i] |= uint8_t(scratch[i] << 2);
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void to_float(const uint8_t* codes, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]);
}

float half(const at::Half* p, int64_t i) { return float(p[i]); }

// One segment of float keys/values: [n, H, t, D].
struct FloatSegment {
  const float* keys;
  const float* values;
  int64_t blocks, tokens;
  bool causal;  // the new tokens themselves: query i sees token j <= i
};

struct Plane {
  const uint8_t* codes;  // [n, bytes per block]
  int64_t block_bytes, channels;
  int bits;
  const int64_t* index;  // [H, channels]
  const float* mult;     // [H, channels]
};

struct Stats {  // per-token (scale, min) [n, H, G, J] float16; min null = symmetric levels
  const at::Half* scale = nullptr;
  const at::Half* minimum = nullptr;
  int bits = 0, group = 0;
};

struct Packed {
  int64_t blocks = 0, group = 0;
  const int64_t* lengths = nullptr;  // tokens held per block
  int key_mode = 0;                  // 0 none, 1 channel planes, 2 per-token
  std::vector<Plane> planes;
  const at::Half* key_scale = nullptr;  // mode 1: [n, H, D]
  const at::Half* key_min = nullptr;
  const float* key_offset = nullptr;  // [H, D]
  const uint8_t* key_codes = nullptr;  // mode 2: [n, bytes]
  int64_t key_bytes = 0;
  Stats key_stats;
  const uint8_t* value_codes = nullptr;  // [n, bytes]
  int64_t value_bytes = 0;
  Stats value_stats;
};

struct Problem {
  int64_t heads, kv_heads, group_size, queries, dim, rows;  // rows = group_size * queries
  const float* query;  // [Hq, q, D]
  float scale;         // the attention scale, folded into the query
  std::vector<FloatSegment> segments;
  Packed packed;
};

// One unit of work: a block of a float segment, or a packed block.
struct Unit {
  int segment;  // -1 = packed
  int64_t block;
};

struct Partial {  // online-softmax state of one task: per row max, sum, acc[D]
  std::vector<float> max, sum, acc;
};

class Task {
 public:
  Task(const Problem& p, int64_t head) : p_(p), h_(head) {
    const int64_t R = p.rows, D = p.dim, G = std::max<int64_t>(p.packed.group, 1);
    q_.resize(R * D);
    for (int64_t g = 0; g < p.group_size; ++g)
      for (int64_t i = 0; i < p.queries; ++i) {
        const float* src = p.query + ((h_ * p.group_size + g) * p.queries + i) * D;
        float* dst = &q_[(g * p.queries + i) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
      }
    codes_.resize(G * D * 2);
    scratch_.resize(G * D * 2);
    row_.resize(D);
    scores_.resize(R * std::max<int64_t>(G, max_segment_tokens()));
    state_.max.assign(R, -std::numeric_limits<float>::infinity());
    state_.sum.assign(R, 0.f);
    state_.acc.assign(R * D, 0.f);
  }

  void run(const Unit& unit) {
    if (unit.segment >= 0)
      float_unit(p_.segments[unit.segment], unit.block);
    else
      packed_unit(unit.block);
  }

  Partial& state() { return state_; }

 private:
  int64_t max_segment_tokens() const {
    int64_t m = 0;
    for (const auto& s : p_.segments) m = std::max(m, s.tokens);
    return m;
  }

  const float* qrow(int64_t r) const { return &q_[r * p_.dim]; }

  // Fold scores [R, T] into the running state; values(r, t, weight) adds weight·v_t to acc.
  template <typename AddValues>
  void absorb(int64_t T, AddValues add_values) {
    const int64_t R = p_.rows, D = p_.dim;
    for (int64_t r = 0; r < R; ++r) {
      float* s = &scores_[r * T];
      float m = state_.max[r];
      for (int64_t t = 0; t < T; ++t) m = std::max(m, s[t]);
      if (m == -std::numeric_limits<float>::infinity()) continue;  // nothing visible yet
      const float rescale = std::exp(state_.max[r] - m);
      float* acc = &state_.acc[r * D];
      if (rescale != 1.f) {
        for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
      }
      float total = state_.sum[r] * rescale;
      for (int64_t t = 0; t < T; ++t) {
        s[t] = std::exp(s[t] - m);
        total += s[t];
      }
      state_.max[r] = m;
      state_.sum[r] = total;
    }
    add_values(T);
  }

  void float_unit(const FloatSegment& seg, int64_t block) {
    const int64_t R = p_.rows, D = p_.dim, T = seg.tokens;
    const int64_t base = (block * p_.kv_heads + h_) * T * D;
    const float* keys = seg.keys + base;
    const float* values = seg.values + base;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = r % p_.queries;  // this row's query token
      for (int64_t t = 0; t < T; ++t) {
        const bool hidden = seg.causal && t > i + (T - p_.queries);
        scores_[r * T + t] = hidden ? -std::numeric_limits<float>::infinity()
                                    : dot(qrow(r), keys + t * D, D);
      }
    }
    absorb(T, [&](int64_t) {
      for (int64_t r = 0; r < R; ++r) {
        float* acc = &state_.acc[r * D];
        for (int64_t t = 0; t < T; ++t) {
          const float w = scores_[r * T + t];
          if (w == 0.f) continue;
          const float* v = values + t * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
        }
      }
    });
  }

  void packed_unit(int64_t n) {
    const Packed& pk = p_.packed;
    const int64_t T = pk.lengths[n];
    if (T == 0) return;
    if (pk.key_mode == 1)
      channel_scores(n, T);
    else
      token_scores(n, T);
    absorb(T, [&](int64_t) { packed_values(n, T); });
  }

  // Per-channel groups: pre-scaled query per plane, one bias per row.
  void channel_scores(int64_t n, int64_t T) {
    const Packed& pk = p_.packed;
    const int64_t R = p_.rows, D = p_.dim, G = pk.group, H = p_.kv_heads;
    const at::Half* scale16 = pk.key_scale + (n * H + h_) * D;
    const at::Half* minimum16 = pk.key_min + (n * H + h_) * D;
    const float* offset = pk.key_offset + h_ * D;
    scale_.resize(D);
    base_.resize(D);
    for (int64_t c = 0; c < D; ++c) {
      scale_[c] = half(scale16, c);
      base_[c] = half(minimum16, c) + scale_[c] * offset[c];  // the value of code 0
    }
    for (int64_t r = 0; r < R; ++r) {
      const float bias = dot(qrow(r), base_.data(), D);
      for (int64_t t = 0; t < T; ++t) scores_[r * T + t] = bias;
    }
    std::vector<float>& qs = prescaled_;
    for (const Plane& plane : pk.planes) {
      const int64_t C = plane.channels;
      if (C == 0) continue;
      const int64_t total = H * G * C;
      unpack(plane.codes + n * plane.block_bytes, plane.bits, total, h_ * G * C, G * C,
             codes_.data(), scratch_.data());
      const int64_t* index = plane.index + h_ * C;
      const float* mult = plane.mult + h_ * C;
      qs.resize(R * C);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < C; ++i)
          qs[r * C + i] = qrow(r)[index[i]] * scale_[index[i]] * mult[i];
      for (int64_t t = 0; t < T; ++t) {
        to_float(&codes_[t * C], C, row_.data());
        for (int64_t r = 0; r < R; ++r) scores_[r * T + t] += dot(&qs[r * C], row_.data(), C);
      }
    }
  }

  // Per-token groups of `group` channels: s·(q·code) + m·Σq per group.
  void token_scores(int64_t n, int64_t T) {
    const Packed& pk = p_.packed;
    const Stats& st = pk.key_stats;
    const int64_t R = p_.rows, D = p_.dim, G = pk.group, H = p_.kv_heads;
    const int64_t J = D / st.group, gs = st.group;
    unpack(pk.key_codes + n * pk.key_bytes, st.bits, H * G * D, h_ * G * D, G * D,
           codes_.data(), scratch_.data());
    const float symmetric = -(float(1 << (st.bits - 1)) - 0.5f);
    const int64_t stat0 = (n * H + h_) * G * J;
    qsums_.resize(R * J);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < J; ++j) {
        float total = 0.f;
        for (int64_t c = 0; c < gs; ++c) total += qrow(r)[j * gs + c];
        qsums_[r * J + j] = total;
      }
    for (int64_t t = 0; t < T; ++t) {
      to_float(&codes_[t * D], D, row_.data());
      for (int64_t r = 0; r < R; ++r) {
        float score = 0.f;
        for (int64_t j = 0; j < J; ++j) {
          const float s = half(st.scale, stat0 + t * J + j);
          const float m = st.minimum ? half(st.minimum, stat0 + t * J + j) : symmetric * s;
          const float* q = qrow(r) + j * gs;
          score += s * dot(q, row_.data() + j * gs, gs) + m * qsums_[r * J + j];
        }
        scores_[r * T + t] = score;
      }
    }
  }

  void packed_values(int64_t n, int64_t T) {
    const Packed& pk = p_.packed;
    const Stats& st = pk.value_stats;
    const int64_t R = p_.rows, D = p_.dim, G = pk.group, H = p_.kv_heads;
    const int64_t J = D / st.group, gs = st.group;
    unpack(pk.value_codes + n * pk.value_bytes, st.bits, H * G * D, h_ * G * D, G * D,
           codes_.data(), scratch_.data());
    const float symmetric = -(float(1 << (st.bits - 1)) - 0.5f);
    const int64_t stat0 = (n * H + h_) * G * J;
    for (int64_t t = 0; t < T; ++t) {
      to_float(&codes_[t * D], D, row_.data());
      for (int64_t r = 0; r < R; ++r) {
        const float p = scores_[r * T + t];
        if (p == 0.f) continue;
        float* acc = &state_.acc[r * D];
        for (int64_t j = 0; j < J; ++j) {
          const float s = half(st.scale, stat0 + t * J + j);
          const float m = st.minimum ? half(st.minimum, stat0 + t * J + j) : symmetric * s;
          const float ws = p * s, wm = p * m;
          const float* code = row_.data() + j * gs;
          float* out = acc + j * gs;
          for (int64_t c = 0; c < gs; ++c) out[c] += ws * code[c] + wm;
        }
      }
    }
  }

  const Problem& p_;
  int64_t h_;
  std::vector<float> q_, row_, scores_, prescaled_, scale_, base_, qsums_;
  std::vector<uint8_t> codes_, scratch_;
  Partial state_;
};

void check(bool ok, const char* message) { TORCH_CHECK(ok, "kvmix::decode: ", message); }

template <typename T>
const T* data(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "kvmix::decode: ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), "kvmix::decode: ", name,
              " is on ", t.device(), "; this op runs on CPU tensors (use backend='torch')");
  return t.data_ptr<T>();
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
  Problem p;
  p.heads = query.size(0);
  p.queries = query.size(1);
  p.dim = query.size(2);
  p.kv_heads = float_keys[0].size(1);
  check(p.heads % p.kv_heads == 0, "query heads must be a multiple of KV heads");
  p.group_size = p.heads / p.kv_heads;
  p.rows = p.group_size * p.queries;
  p.query = data<float>(query, "query");
  p.scale = float(scale);
  for (size_t s = 0; s < float_keys.size(); ++s) {
    const Tensor& k = float_keys[s];
    check(k.dim() == 4 && k.size(1) == p.kv_heads && k.size(3) == p.dim &&
              k.scalar_type() == at::kFloat && k.sizes() == float_values[s].sizes(),
          "float segments must be [n, H, t, D] float32 keys and values of equal shape");
    const bool causal = causal_last && s + 1 == float_keys.size();
    check(!causal || (k.size(0) == 1 && k.size(2) == p.queries),
          "the causal segment must hold exactly the new tokens");
    p.segments.push_back({data<float>(k, "float keys"), data<float>(float_values[s], "float values"),
                          k.size(0), k.size(2), causal});
  }
  Packed& pk = p.packed;
  pk.blocks = int64_t(lengths.size());
  pk.group = group;
  pk.lengths = lengths.data();
  if (pk.blocks) {
    check(value_codes.has_value() && value_scale.has_value(), "packed blocks need value codes");
    check(value_bits == 1 || value_bits == 2 || value_bits == 3 || value_bits == 4 ||
              value_bits == 8, "value bits must be 1, 2, 3, 4 or 8");
    check(p.dim % value_group == 0 && (group * p.dim * (value_bits == 3 ? 1 : value_bits)) % 8 == 0,
          "value rows must be byte-aligned per head");
    pk.value_codes = data<uint8_t>(*value_codes, "value codes");
    pk.value_bytes = value_codes->size(-1);
    pk.value_stats = {data<at::Half>(*value_scale, "value scale"),
                      value_min.has_value() ? data<at::Half>(*value_min, "value min") : nullptr,
                      int(value_bits), int(value_group)};
    if (!plane_codes.empty()) {
      pk.key_mode = 1;
      check(key_scale.has_value() && key_min.has_value() && key_offset.has_value(),
            "channel planes need key scale, min and offset");
      pk.key_scale = data<at::Half>(*key_scale, "key scale");
      pk.key_min = data<at::Half>(*key_min, "key min");
      pk.key_offset = data<float>(*key_offset, "key offset");
      for (size_t i = 0; i < plane_codes.size(); ++i) {
        const int bits = int(plane_bits[i]);
        check(bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8,
              "plane bits must be 1, 2, 3, 4 or 8");
        const int64_t C = plane_index[i].size(-1);
        check((group * C * (bits == 3 ? 1 : bits)) % 8 == 0, "plane rows must be byte-aligned");
        pk.planes.push_back({data<uint8_t>(plane_codes[i], "plane codes"),
                             plane_codes[i].size(-1), C, bits,
                             data<int64_t>(plane_index[i], "plane index"),
                             data<float>(plane_mult[i], "plane mult")});
      }
    } else {
      check(key_codes.has_value() && key_scale.has_value(), "packed keys are missing");
      check(p.dim % key_group == 0 && (group * p.dim * (key_bits == 3 ? 1 : key_bits)) % 8 == 0,
            "key rows must be byte-aligned per head");
      pk.key_mode = 2;
      pk.key_codes = data<uint8_t>(*key_codes, "key codes");
      pk.key_bytes = key_codes->size(-1);
      pk.key_stats = {data<at::Half>(*key_scale, "key scale"),
                      key_min.has_value() ? data<at::Half>(*key_min, "key min") : nullptr,
                      int(key_bits), int(key_group)};
    }
  }

  std::vector<Unit> units;
  for (size_t s = 0; s < p.segments.size(); ++s)
    for (int64_t b = 0; b < p.segments[s].blocks; ++b) units.push_back({int(s), b});
  for (int64_t b = 0; b < pk.blocks; ++b) units.push_back({-1, b});

  // Tasks: (KV head, contiguous range of units); enough ranges to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(
      1, std::min<int64_t>(int64_t(units.size()), (2 * threads + p.kv_heads - 1) / p.kv_heads));
  const int64_t tasks = p.kv_heads * splits;
  std::vector<Partial> partials(tasks);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / splits, split = task % splits;
      const int64_t lo = int64_t(units.size()) * split / splits;
      const int64_t hi = int64_t(units.size()) * (split + 1) / splits;
      Task work(p, h);
      for (int64_t u = lo; u < hi; ++u) work.run(units[u]);
      partials[task] = std::move(work.state());
    }
  });

  Tensor out = at::zeros({p.heads, p.queries, p.dim}, query.options());
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    for (int64_t r = 0; r < p.rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) m = std::max(m, partials[h * splits + s].max[r]);
      float total = 0.f;
      float* dst = o + ((h * p.group_size + r / p.queries) * p.queries + r % p.queries) * p.dim;
      if (m == -std::numeric_limits<float>::infinity()) continue;
      for (int64_t s = 0; s < splits; ++s) {
        const Partial& part = partials[h * splits + s];
        if (part.max[r] == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(part.max[r] - m);
        total += w * part.sum[r];
        for (int64_t d = 0; d < p.dim; ++d) dst[d] += w * part.acc[r * p.dim + d];
      }
      for (int64_t d = 0; d < p.dim; ++d) dst[d] /= total;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvmix, m) {
  m.def(
      "decode(Tensor query, float scale, Tensor[] float_keys, Tensor[] float_values, "
      "int causal_last, int group, int[] lengths, Tensor[] plane_codes, int[] plane_bits, "
      "Tensor[] plane_index, Tensor[] plane_mult, Tensor? key_scale, Tensor? key_min, "
      "Tensor? key_offset, Tensor? key_codes, int key_bits, int key_group, Tensor? value_codes, "
      "int value_bits, int value_group, Tensor? value_scale, Tensor? value_min) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmix, CPU, m) { m.impl("decode", &decode); }
