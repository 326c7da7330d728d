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
// split over (sequence, KV head, range of blocks) with an online softmax per task, claimed by
// the threads one task at a time, and a log-sum-exp merge where a head spans several tasks.
// Built without -ffast-math: masked scores are -inf and must stay so.
//
// This file holds the op's entry points and their validation; its parts, in decode/:
//   common.h        shared constants;          vector.h     SIMD helpers, portable fallbacks;
//   timing.h        the op's time by part (KVMIX_OP_TIMING=1);
//   rows.h          packed rows -> floats and the float block kernels per width and length;
//   vnni.h          integer dot products (AVX-512 VNNI + VBMI) and their stand-ins;
//   problem.h       what a call attends;       task.h       one KV head over a range of units;
//   float_pages.h, channel_keys.h, token_keys.h   the task's work per layout;
//   quantize.h      kvmix::quantize, quantize_mixed and pack, the encoder of sealed groups
//                   (not a part of decode);
//   step_plan.h     kvmix::plan_step, the vLLM plugin's plan of a step (not a part of decode).

#include <ATen/Parallel.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "decode/common.h"
#include "decode/timing.h"
#include "decode/rows.h"
#include "decode/vnni.h"
#include "decode/vector.h"
#include "decode/problem.h"
#include "decode/task.h"
#include "decode/float_pages.h"
#include "decode/channel_keys.h"
#include "decode/token_keys.h"
#include "decode/quantize.h"
#include "decode/step_plan.h"

namespace {

// ---- the op -------------------------------------------------------------------------------------

void check(bool ok, const char* message) { TORCH_CHECK(ok, "kvmix: ", message); }

template <typename T>
const T* data(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "kvmix::decode: ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), "kvmix::decode: ", name, " is on ", t.device(),
              "; this op runs on CPU tensors (use backend='torch')");
  return t.data_ptr<T>();
}

// A float segment's elements: float32, float16 or bfloat16 (a 32-bit model's float slots, the
// vLLM plugin's staging).
bool floating(const Tensor& t) {
  const auto type = t.scalar_type();
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

const void* elements(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return data<at::Half>(t, name);
    case at::kBFloat16: return data<at::BFloat16>(t, name);
    default: return data<float>(t, name);
  }
}

bool valid_bits(int64_t bits) {
  return bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8;
}

}  // namespace

// The op's packed arguments, one structure per layout (TorchScript classes: Python builds them
// as torch.classes.kvmix.TokenGroups and torch.classes.kvmix.ChannelPlanes).
//
// Per-token groups of `group` channels (values; WUSH and rotated keys): codes [P, bytes per
// block] holding H × G tokens × J groups rows, scale (and min; none: symmetric) [P, H, G, J]
// float16, the codes' width.
struct TokenGroups : torch::CustomClassHolder {
  Tensor codes, scale;
  std::optional<Tensor> minimum;
  int64_t bits, group;
  TokenGroups(Tensor codes, Tensor scale, std::optional<Tensor> minimum, int64_t bits,
              int64_t group)
      : codes(std::move(codes)), scale(std::move(scale)), minimum(std::move(minimum)),
        bits(bits), group(group) {}
};

// Per-channel keys (KIVI, PN-Mix, Kitty, ChanMix): per plane its codes [P, bytes per block]
// holding H × C channel rows of G codes, its width, its channels and multipliers [H, C] or
// [1 or sequences, H, C]; the blocks' scale and min [P, H, D] float16 and the key offsets
// [1 or sequences, H, D] float32.
struct ChannelPlanes : torch::CustomClassHolder {
  std::vector<Tensor> codes;
  std::vector<int64_t> bits;
  std::vector<Tensor> index, mult;
  Tensor scale, minimum, offset;
  ChannelPlanes(std::vector<Tensor> codes, std::vector<int64_t> bits, std::vector<Tensor> index,
                std::vector<Tensor> mult, Tensor scale, Tensor minimum, Tensor offset)
      : codes(std::move(codes)), bits(std::move(bits)), index(std::move(index)),
        mult(std::move(mult)), scale(std::move(scale)), minimum(std::move(minimum)),
        offset(std::move(offset)) {}
};

using Groups = std::optional<c10::intrusive_ptr<TokenGroups>>;
using Planes = std::optional<c10::intrusive_ptr<ChannelPlanes>>;

// A layer's pages as the op reads them, built once per pool view: float pages [P, H, G, D]
// (keys and values, the `full` method) or packed ones (per-channel `planes` or per-token
// `token_keys`, and `value_groups`).
struct PagePool : torch::CustomClassHolder {
  std::optional<Tensor> page_keys, page_values;
  Planes planes;
  Groups token_keys, value_groups;
  PagePool(std::optional<Tensor> page_keys, std::optional<Tensor> page_values, Planes planes,
           Groups token_keys, Groups value_groups)
      : page_keys(std::move(page_keys)), page_values(std::move(page_values)),
        planes(std::move(planes)), token_keys(std::move(token_keys)),
        value_groups(std::move(value_groups)) {}
};

// How a method stores a sealed group in its pages (the Python PageEncoding): keys per channel
// over the group's tokens, the high channels at `high` bits and the others at `low`
// (bin-center where `center`), values per token at `value_bits` over `value_group` channels.
// Where high > low, a group's high channels come from its selection's bits (the Python
// SelectedChannels): each head's first `count` channels, selected ones first, of `units` a
// head (RoPE `pairs` [units, 2]: both channels of a selected pair; none: units are channels).
// Groups are encoded from their tokens in the layer's `dtype`, as its encode sees them.
struct PageEncoding : torch::CustomClassHolder {
  int64_t low, high, value_bits, value_group, units, count;
  bool center;
  std::optional<Tensor> pairs;
  at::ScalarType dtype;
  PageEncoding(int64_t low, int64_t high, bool center, int64_t value_bits, int64_t value_group,
               int64_t units, std::optional<Tensor> pairs, int64_t count, at::ScalarType dtype)
      : low(low), high(high), value_bits(value_bits), value_group(value_group), units(units),
        count(count), center(center), pairs(std::move(pairs)), dtype(dtype) {}
};

// A vLLM step as kvmix::step reads it, built once per step by the plugin's plan and passed by
// every layer (int64 tensors; `group` tokens a page). The K kernel rows: the pages before
// each row's own group (table, held [K, M], counts [K]) and its own group's floats (floats
// [K, 4]: start and count in the staging, then in the step's tokens); where each of the N new
// tokens is staged (stage_at [N], -1: its group is sealed now, or the caller stages the
// step's tokens itself: every entry -1); with values="token" each
// row's own page (own_pages [K]). The E groups the step seals, where it seals any: their pages
// (seal_pages [E]), their rows' first pages (first_pages [E]: the selection they copy) and
// their tokens, staged ones at staging positions `carried` [c] and the step's `tokens` [e], at
// token slots `carried_at` and `tokens_at` (entry · G + offset).
struct StepRows : torch::CustomClassHolder {
  Tensor table, held, counts, floats, stage_at;
  std::optional<Tensor> own_pages, seal_pages, first_pages, carried, carried_at, tokens,
      tokens_at;
  int64_t group;
  StepRows(Tensor table, Tensor held, Tensor counts, Tensor floats, Tensor stage_at,
           std::optional<Tensor> own_pages, std::optional<Tensor> seal_pages,
           std::optional<Tensor> first_pages, std::optional<Tensor> carried,
           std::optional<Tensor> carried_at, std::optional<Tensor> tokens,
           std::optional<Tensor> tokens_at, int64_t group)
      : table(std::move(table)), held(std::move(held)), counts(std::move(counts)),
        floats(std::move(floats)), stage_at(std::move(stage_at)), own_pages(std::move(own_pages)),
        seal_pages(std::move(seal_pages)), first_pages(std::move(first_pages)),
        carried(std::move(carried)), carried_at(std::move(carried_at)), tokens(std::move(tokens)),
        tokens_at(std::move(tokens_at)), group(group) {
    // shapes and types once a step; the values are checked where they are read
    const int64_t K = this->counts.numel();
    const auto ints = [](const Tensor& t) {
      return t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu();
    };
    const bool seals = this->seal_pages.has_value();
    TORCH_CHECK(group > 0 && ints(this->table) && ints(this->held) && ints(this->counts) &&
                    ints(this->floats) && ints(this->stage_at) && this->table.dim() == 2 &&
                    this->table.size(0) == K && this->held.sizes() == this->table.sizes() &&
                    this->floats.dim() == 2 && this->floats.size(0) == K &&
                    this->floats.size(1) == 4 && this->stage_at.dim() == 1 &&
                    (!this->own_pages || (ints(*this->own_pages) &&
                                          this->own_pages->numel() == K)),
                "kvmix: step rows must be int64 CPU tensors: table, held [K, M], counts [K], "
                "floats [K, 4], stage_at [N] (own_pages [K])");
    TORCH_CHECK(seals == this->first_pages.has_value() && seals == this->carried.has_value() &&
                    seals == this->carried_at.has_value() && seals == this->tokens.has_value() &&
                    seals == this->tokens_at.has_value(),
                "kvmix: a step's seals come with their pages, first pages, carried tokens and "
                "step tokens");
    TORCH_CHECK(!seals || (ints(*this->seal_pages) && ints(*this->first_pages) &&
                           this->first_pages->sizes() == this->seal_pages->sizes()),
                "kvmix: seal pages and first pages must be int64 [E]");
  }
};

namespace {

Stats token_groups(const TokenGroups& g, int64_t dim, int64_t heads, int64_t tokens,
                   const char* what) {
  TORCH_CHECK(valid_bits(g.bits), "kvmix::decode: ", what, " bits must be 1, 2, 3, 4 or 8");
  TORCH_CHECK(g.group > 0 && g.group % 8 == 0 && dim % g.group == 0, "kvmix::decode: ", what,
              " groups must be a positive multiple of 8 channels dividing the head dim");
  TORCH_CHECK(g.codes.dim() == 2, "kvmix::decode: ", what, " codes must be [pages, bytes]");
  const int64_t rows = heads * tokens * (dim / g.group), pages = g.codes.size(0);
  const int64_t need = rows * row_bytes(g.group, int(g.bits));
  TORCH_CHECK(g.codes.size(1) >= need, "kvmix::decode: ", what, " codes hold ", g.codes.size(1),
              " bytes per page; ", rows, " rows of ", g.group, " ", g.bits,
              "-bit codes need ", need);
  TORCH_CHECK(g.scale.numel() == pages * rows &&
                  (!g.minimum.has_value() || g.minimum->numel() == pages * rows),
              "kvmix::decode: ", what, " scale and min must hold ", rows, " values per page");
  return {data<uint8_t>(g.codes, "codes"), g.codes.size(-1), data<at::Half>(g.scale, "scale"),
          g.minimum.has_value() ? data<at::Half>(*g.minimum, "min") : nullptr, int(g.bits),
          g.group};
}

// The packed arguments both ops share: the pool of blocks (or one sequence's blocks).
struct PackedArgs {
  const ChannelPlanes* planes;  // per-channel keys, or
  const TokenGroups* keys;      // per-token keys
  const TokenGroups* values;
};

PackedArgs packed_args(const Planes& planes, const Groups& keys, const Groups& values) {
  return {planes ? planes->get() : nullptr, keys ? keys->get() : nullptr,
          values ? values->get() : nullptr};
}

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
  check(a.values != nullptr, "packed blocks need value codes");
  const TokenGroups& values = *a.values;
  pk.values = token_groups(values, dim, heads, group, "value");
  pk.value_kernel = values_for(values.group, int(values.bits));
  pk.value_ints = int_for(values.group, int(values.bits));
  const int64_t pages = values.codes.size(0);
  if (a.planes != nullptr) {
    const ChannelPlanes& k = *a.planes;
    pk.key_mode = 1;
    const size_t n = k.codes.size();
    check(n > 0 && k.bits.size() == n && k.index.size() == n && k.mult.size() == n,
          "plane codes, bits, index and mult must be lists of equal length");
    check(k.scale.numel() == pages * heads * dim && k.minimum.numel() == pages * heads * dim,
          "key scale and min must be [pages, H, D]");
    check(k.offset.numel() == heads * dim || k.offset.numel() == rows * heads * dim,
          "key offset must be [1 or sequences, H, D]");
    pk.key_scale = data<at::Half>(k.scale, "key scale");
    pk.key_min = data<at::Half>(k.minimum, "key min");
    pk.key_offset = data<float>(k.offset, "key offset");
    for (size_t i = 0; i < n; ++i)
      pk.planes.push_back(channel_plane(k.codes[i], k.bits[i], k.index[i], k.mult[i], group,
                                        heads, dim, pages, rows));
  } else {
    check(a.keys != nullptr, "packed keys are missing");
    check(a.keys->codes.size(0) == pages, "key and value codes must hold the same pages");
    pk.key_mode = 2;
    pk.keys = token_groups(*a.keys, dim, heads, group, "key");
    pk.key_dots = dots_for(a.keys->group, int(a.keys->bits));
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

// One KV head's partials -> its query rows of `out` [Hq, q, D] (rows no token reaches: zero).
void merge(const Problem& p, const Partial* parts, int64_t splits, int64_t h, float* out) {
  for (int64_t r = 0; r < p.rows; ++r) {
    float m = NEG_INF;
    for (int64_t s = 0; s < splits; ++s)
      if (!parts[s].max.empty()) m = std::max(m, parts[s].max[r]);
    float* dst = out + ((h * p.group_size + r / p.queries) * p.queries + r % p.queries) * p.dim;
    std::fill(dst, dst + p.dim, 0.f);
    if (m == NEG_INF) continue;
    float total = 0.f;
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
// keep every thread busy — claimed one at a time by each thread (rows differ in length), then
// a log-sum-exp merge per sequence -> o [S, Hq, q, D] (float32, contiguous). A task that is its
// head's only range writes its rows itself, on its thread.
void solve(const std::vector<Problem>& problems, float* o) {
  const int64_t S = int64_t(problems.size());
  const Problem& first = problems[0];
  const int64_t H = first.kv_heads, D = first.dim;
  std::vector<std::vector<Unit>> units(S);
  int64_t most = 1;
  for (int64_t s = 0; s < S; ++s) {
    units[s] = units_of(problems[s]);
    most = std::max<int64_t>(most, int64_t(units[s].size()));
  }
  const int64_t threads = at::get_num_threads(), tasks = S * H;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(most, (2 * threads + tasks - 1) /
                                                                          tasks));
  const int64_t each = first.heads * first.queries * D;  // one sequence's output
  std::vector<Partial> partials(splits > 1 ? tasks * splits : 0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, tasks * splits), 1, [&](int64_t, int64_t) {
    Task task;
    Partial own;
    for (int64_t t = next++; t < tasks * splits; t = next++) {
      const int64_t s = t / (H * splits), h = t / splits % H, split = t % splits;
      const int64_t n = int64_t(units[s].size());
      const int64_t lo = n * split / splits, hi = n * (split + 1) / splits;
      Partial& state = splits > 1 ? partials[t] : own;
      state.max.clear();  // a range without units leaves no partial
      if (hi > lo) {
        Stopwatch clock;
        task.start(problems[s], h, units[s].data() + lo, hi - lo);
        clock.lap(START);
        task.run(state);
      }
      Stopwatch clock;
      if (splits == 1) merge(problems[s], &state, 1, h, o + s * each);
      clock.lap(MERGE);
    }
  });
  Stopwatch clock;
  for (int64_t s = 0; splits > 1 && s < S; ++s)
    for (int64_t h = 0; h < H; ++h)
      merge(problems[s], &partials[(s * H + h) * splits], splits, h, o + s * each);
  clock.lap(MERGE);
}

Tensor decode(const Tensor& query, double scale, at::TensorList float_keys,
              at::TensorList float_values, int64_t causal_last, int64_t group,
              at::IntArrayRef lengths, const Planes& planes, const Groups& token_keys,
              const Groups& value_groups) {
  Stopwatch whole, clock;
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
              floating(k) && k.scalar_type() == float_values[s].scalar_type() &&
              k.sizes() == float_values[s].sizes(),
          "float segments must be [n, H, t, D] float32, float16 or bfloat16 keys and values of "
          "equal shape and dtype");
    const bool causal = causal_last && s + 1 == float_keys.size();
    check(!causal || (k.size(0) == 1 && k.size(2) == p.queries),
          "the causal segment must hold exactly the new tokens");
    p.segments.push_back({elements(k, "float keys"), elements(float_values[s], "float values"),
                          k.size(0), k.size(2), causal, k.size(2) * p.dim, k.scalar_type()});
  }
  if (!lengths.empty()) {
    p.packed = packed_layout(packed_args(planes, token_keys, value_groups), group, p.kv_heads,
                             p.dim, 1);
    p.packed.blocks = int64_t(lengths.size());
    check(p.packed.blocks <= (*value_groups)->codes.size(0), "more lengths than packed blocks");
    for (const int64_t length : lengths)
      check(length >= 0 && length <= group, "each block holds 0 to group tokens");
    p.packed.lengths = lengths.data();
  }
  clock.lap(SETUP);
  Tensor out = at::empty({p.heads, p.queries, p.dim}, query.options());
  solve({p}, out.data_ptr<float>());
  whole.lap(WALL);
  if (TIMING) CALLS.fetch_add(1, std::memory_order_relaxed);
  return out;
}

// The step's tokens [1, H, N, D] (`keys`/`values` of the step) into the slot arena [1, H, T, D]
// at `stage_at` [N] (-1: a token not staged), after every row has read the arena (keys only
// where `step_v` is null: the values live in pages).
void stage(const Tensor& stage_at, const char* step_k, const char* step_v, int64_t N,
           const Tensor& slot_keys, const Tensor& slot_values, int64_t T, int64_t H, int64_t D,
           size_t width) {
  const int64_t* at = stage_at.data_ptr<int64_t>();  // checked before the call's work
  char* keys = static_cast<char*>(slot_keys.data_ptr());
  char* values = static_cast<char*>(slot_values.data_ptr());
  const size_t bytes = D * width;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < N; ++i) {
      if (at[i] < 0) continue;
      const size_t from = (h * N + i) * bytes, to = (h * T + at[i]) * bytes;
      std::memcpy(keys + to, step_k + from, bytes);
      if (step_v) std::memcpy(values + to, step_v + from, bytes);
    }
}

std::tuple<Tensor, Tensor, Tensor> quantize(const Tensor& x, int64_t bits, int64_t dim,
                                            bool center, bool packed);

// kvmix::put_values: the step's new values [N, H, D] (any float dtype), rounded to the
// staging's dtype (`staging`) as staging them would, quantized token by token in min-max groups
// of `value_group` channels at `bits` (kvmix::quantize, as Method.token_values encodes them)
// into pool position `value_at` [N] (page · G + offset; -1: none) of the pool's value pages
// (declared written): codes [P, page bytes], scale and minimum [P, H, G, D / value_group]
// float16. The vLLM plugin's values="token".
void put_values(const Tensor& codes, const Tensor& scale, const Tensor& minimum,
                const Tensor& values, at::ScalarType staging, const Tensor& value_at,
                int64_t bits, int64_t value_group, int64_t group) {
  check(values.dim() == 3, "values must be [N, H, D]");
  const int64_t N = values.size(0), H = values.size(1), D = values.size(2), G = group;
  check(valid_bits(bits) && value_group > 0 && D % value_group == 0 && G > 0,
        "value groups must divide the head dimension, at 1, 2, 3, 4 or 8 bits");
  const int64_t J = D / value_group, rb = row_bytes(value_group, int(bits));
  check(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
            codes.size(1) >= H * G * J * rb,
        "value codes must be contiguous uint8 [P, page bytes]");
  const int64_t P = codes.size(0), page_bytes = codes.size(1);
  for (const Tensor* t : {&scale, &minimum})
    check(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == P * H * G * J,
          "value scale and minimum must be contiguous float16 [P, H, G, J]");
  check(value_at.dim() == 1 && value_at.size(0) == N, "value_at must be [N]");
  const int64_t* at = data<int64_t>(value_at, "value_at");
  for (int64_t i = 0; i < N; ++i)
    check(at[i] >= -1 && at[i] < P * G, "value_at names a position outside the pool");
  if (N == 0) return;
  const Tensor x = values.to(staging).to(values.scalar_type()).reshape({N, H * J, value_group});
  const auto [q, s, m] = quantize(x, bits, -1, false, true);  // [N, H·J·rb], [N, H·J, 1]
  const uint8_t* c = q.data_ptr<uint8_t>();
  const at::Half* step_scale = s.data_ptr<at::Half>();
  const at::Half* step_min = m.data_ptr<at::Half>();
  uint8_t* pool = codes.data_ptr<uint8_t>();
  at::Half* pool_scale = scale.data_ptr<at::Half>();
  at::Half* pool_min = minimum.data_ptr<at::Half>();
  for (int64_t i = 0; i < N; ++i) {
    if (at[i] < 0) continue;
    const int64_t page = at[i] / G, t = at[i] % G;
    for (int64_t h = 0; h < H; ++h) {  // the page's rows (h, t, j) <- the token's (h, j)
      const int64_t row = h * G + t, from = i * H + h;
      std::memcpy(pool + page * page_bytes + row * J * rb, c + from * J * rb, J * rb);
      std::memcpy(pool_scale + (page * H * G + row) * J, step_scale + from * J,
                  J * sizeof(at::Half));
      std::memcpy(pool_min + (page * H * G + row) * J, step_min + from * J,
                  J * sizeof(at::Half));
    }
  }
}

// f(T*) with T the C++ type of a float32, float16 or bfloat16 tensor's elements.
template <typename F>
void with_float_type(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<at::BFloat16*>(nullptr)); break;
    default: check(false, "float32, float16 or bfloat16 tensors expected");
  }
}

// The step's new keys and values [N, H, D] (float32, float16 or bfloat16, any strides) ->
// [2, 1, H, N, D] in the slots' dtype (`options`), each element rounded to nearest even as
// torch's copy rounds it, as the plugin would lay them out.
Tensor lay_out(const Tensor& keys, const Tensor& values, int64_t H, int64_t D,
               const at::TensorOptions& options) {
  check(keys.dim() == 3 && keys.size(1) == H && keys.size(2) == D &&
            values.sizes() == keys.sizes() && keys.device().is_cpu() &&
            values.device().is_cpu(),
        "new keys and values must be [N, H, D] CPU tensors");
  const int64_t N = keys.size(0);
  Tensor laid = at::empty({2, 1, H, N, D}, options);
  for (int i = 0; i < 2; ++i) {
    const Tensor& x = i == 0 ? keys : values;
    with_float_type(options.dtype().toScalarType(), [&]<typename O>(O*) {
      with_float_type(x.scalar_type(), [&]<typename M>(M*) {
        const M* from = x.const_data_ptr<M>();
        O* to = laid.data_ptr<O>() + i * H * N * D;
        const int64_t sn = x.stride(0), sh = x.stride(1), sd = x.stride(2);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n) {
            const M* row = from + n * sn + h * sh;
            O* into = to + (h * N + n) * D;
            if (sd == 1) {
              convert(row, into, D);
              continue;
            }
            for (int64_t d = 0; d < D; ++d) into[d] = O(float(row[d * sd]));
          }
      });
    });
  }
  return laid;
}

// A decode step of a whole batch of rows: query [S, Hq, D], one query token a row (in kvmix's own
// runtime a sequence's new token; in the vLLM plugin a kernel row: a decode token, or a prompt
// token attending as a decode at its position). A row attends to two float spans and then its
// pages. The spans (spans [S, 4]: start and length of each, in the row's slot) lie in float
// slots [S, H, T, D] or one arena [1, H, T, D] all rows share: kvmix's own cache's sink and
// residual, or the plugin's staged open group and the step's new tokens — with step keys and
// values [1, H, N, D] the second span lies in them (given as they are, or as new keys and values
// [N, H, D] the op lays out, which `stage_at` then writes into the arena). Pages of one pool are
// read through the block table (pages, held [S, M], counts [S]): float pages [P, H, G, D] (the
// `full` method), or packed ones with per-row plane indices, multipliers and key offsets [S or 1,
// H, ...]. With `value_pages` [S] (packed pools only) the values of a row's two spans are not
// floats but the first tokens of its page there, packed per token (the plugin's values="token";
// the slots then hold keys only: the slot values are not read, and staging writes keys only;
// kvmix::put_values puts the step's values there first). The query's rows may lie apart (a
// view of vLLM's fused qkv: each row's heads contiguous). The output [S, Hq, D] float32 is
// returned, or written into `out` where it is given (vLLM's output: no allocation and no copy;
// an empty tensor is returned).
Tensor decode_batch(const Tensor& query, double scale, const Tensor& slot_keys,
                    const Tensor& slot_values, const Tensor& spans, int64_t group,
                    const Tensor& pages, const Tensor& held, const Tensor& counts,
                    const std::optional<Tensor>& page_keys,
                    const std::optional<Tensor>& page_values, const Planes& planes,
                    const Groups& token_keys, const Groups& value_groups,
                    const std::optional<Tensor>& skip,
                    const std::optional<Tensor>& given_step_keys,
                    const std::optional<Tensor>& given_step_values,
                    const std::optional<Tensor>& stage_at,
                    const std::optional<Tensor>& new_keys,
                    const std::optional<Tensor>& new_values,
                    const std::optional<Tensor>& value_pages,
                    const std::optional<Tensor>& into) {
  Stopwatch whole, clock;
  check(query.dim() == 3 && query.scalar_type() == at::kFloat && query.device().is_cpu() &&
            query.stride(2) == 1 && (query.size(1) == 1 || query.stride(1) == query.size(2)),
        "query must be [S, Hq, D] float32 on the CPU, each row's heads contiguous");
  const int64_t S = query.size(0), H = slot_keys.size(1), T = slot_keys.size(2);
  const int64_t D = query.size(2);
  check(S > 0, "the batch is empty");
  check(!into || (into->scalar_type() == at::kFloat && into->is_contiguous() &&
                  into->device().is_cpu() && into->numel() == S * query.size(1) * D),
        "out must be contiguous float32 on the CPU, of the query's [S, Hq, D] elements");
  check(slot_keys.dim() == 4, "slots must be [S or 1, H, T, D]");
  check(slot_keys.dim() == 4 && (slot_keys.size(0) == S || slot_keys.size(0) == 1) &&
            slot_keys.size(3) == D &&
            floating(slot_keys) && slot_keys.scalar_type() == slot_values.scalar_type() &&
            slot_keys.sizes() == slot_values.sizes(),
        "slots must be [S or 1, H, T, D] float32, float16 or bfloat16 keys and values of equal "
        "shape and dtype");
  check(spans.dim() == 2 && spans.size(0) == S && spans.size(1) == 4, "spans must be [S, 4]");
  check(pages.dim() == 2 && pages.size(0) == S && held.sizes() == pages.sizes() &&
            counts.numel() == S, "the block table must be pages, held [S, M] and counts [S]");
  const int64_t* span = data<int64_t>(spans, "spans");
  const int64_t* count = data<int64_t>(counts, "counts");
  check(!skip.has_value() || (skip->dim() == 1 && skip->size(0) == S), "skip must be [S]");
  const int64_t* hidden = skip.has_value() ? data<int64_t>(*skip, "skip") : nullptr;
  const int64_t M = pages.size(1);
  const int64_t row_step = slot_keys.size(0) == 1 ? 0 : H * T;  // an arena: spans place rows
  const size_t width = slot_keys.element_size();  // bytes per element
  const char* keys = static_cast<const char*>(elements(slot_keys, "slot keys"));
  const char* values = static_cast<const char*>(elements(slot_values, "slot values"));
  // the second span in the step's own tokens [1, H, N, D] where they are given (or laid out
  // here from new keys and values [N, H, D], rounded to the slots' dtype as torch's copy
  // rounds, as the caller would), else in the slots
  std::optional<Tensor> step_keys = given_step_keys, step_values = given_step_values;
  check(new_keys.has_value() == new_values.has_value() && !(new_keys && step_keys),
        "new keys and values pair up, and replace step keys and values");
  if (new_keys) {
    const Tensor laid = lay_out(*new_keys, *new_values, H, D, slot_keys.options());
    step_keys = laid.select(0, 0);
    step_values = laid.select(0, 1);
  }
  check(step_keys.has_value() == step_values.has_value(), "step keys and values must pair up");
  const bool step = step_keys.has_value();
  if (step)
    check(step_keys->dim() == 4 && step_keys->size(0) == 1 && step_keys->size(1) == H &&
              step_keys->size(3) == D && step_keys->scalar_type() == slot_keys.scalar_type() &&
              step_values->sizes() == step_keys->sizes() &&
              step_values->scalar_type() == slot_keys.scalar_type(),
          "step keys and values must be [1, H, N, D] of the slots' dtype");
  const int64_t N = step ? step_keys->size(2) : T;
  check(!stage_at.has_value() ||
            (step && slot_keys.size(0) == 1 && stage_at->dim() == 1 && stage_at->size(0) == N &&
             stage_at->scalar_type() == at::kLong),
        "stage_at must be [N] int64 with step keys and values and one slot arena");
  if (stage_at.has_value()) {
    const int64_t* at = data<int64_t>(*stage_at, "stage_at");
    for (int64_t i = 0; i < N; ++i)
      check(at[i] >= -1 && at[i] < T, "stage_at names a position outside the slots");
  }
  const char* step_k = step ? static_cast<const char*>(elements(*step_keys, "step keys")) : keys;
  const char* step_v =
      step ? static_cast<const char*>(elements(*step_values, "step values")) : values;
  Packed pool;
  const bool packed = value_groups.has_value();
  const bool floats = page_keys.has_value();
  if (floats)
    check(page_keys->dim() == 4 && page_keys->size(1) == H && page_keys->size(2) == group &&
              page_keys->size(3) == D && page_keys->scalar_type() == at::kFloat &&
              page_values.has_value() && page_values->sizes() == page_keys->sizes(),
          "float pages must be [P, H, G, D] float32 keys and values");
  if (packed) pool = packed_layout(packed_args(planes, token_keys, value_groups), group, H, D, S);
  const int64_t* own_page = nullptr;
  if (value_pages.has_value()) {
    check(packed && value_pages->dim() == 1 && value_pages->size(0) == S,
          "value_pages must be [S], with packed pages");
    own_page = data<int64_t>(*value_pages, "value_pages");
    for (int64_t s = 0; s < S; ++s)
      check(own_page[s] >= 0 && own_page[s] < (*value_groups)->codes.size(0) &&
                span[s * 4 + 1] + span[s * 4 + 3] <= group,
            "value_pages names a page outside the pool, or spans hold more than a group");
  }
  std::vector<Problem> problems(S);
  for (int64_t s = 0; s < S; ++s) {
    Problem& p = problems[s];
    set_heads(p, query.size(1), H, 1, D, query.const_data_ptr<float>() + s * query.stride(0),
              scale);
    for (int64_t which = 0, first = 0; which < 2; ++which) {
      const int64_t start = span[s * 4 + 2 * which], length = span[s * 4 + 2 * which + 1];
      const bool own = step && which == 1;  // in the step's tokens
      const int64_t extent = own ? N : T;
      check(start >= 0 && length >= 0 && start + length <= extent,
            "spans must lie in the slots (the second in the step's tokens where given)");
      const int64_t at = ((own ? 0 : s * row_step) + start) * D;
      if (length)
        p.segments.push_back({(own ? step_k : keys) + at * width,
                              (own ? step_v : values) + at * width, 1, length, false,
                              extent * D, slot_keys.scalar_type(), own_page ? own_page[s] : -1,
                              first});
      first += length;
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
    if (own_page) p.packed = pool;  // the page values of its spans (blocks: none yet)
    if (!packed || count[s] == 0) continue;
    for (int64_t n = 0; n < count[s]; ++n)
      check(ids[n] >= 0 && ids[n] < (*value_groups)->codes.size(0) && tokens[n] >= 0 &&
                tokens[n] <= group,
            "the block table names a page outside the pool, or more tokens than a group");
    p.packed = pool;
    p.packed.blocks = count[s];
    p.packed.lengths = tokens;
    p.packed.pages = ids;
    p.packed.skip = front;
    for (size_t i = 0; i < p.packed.planes.size(); ++i) {
      Plane& plane = p.packed.planes[i];
      const int64_t each = (*planes)->index[i].size(0) == S ? H * plane.channels : 0;
      plane.index += s * each;
      plane.mult += s * each;
    }
    if (p.packed.key_offset && (*planes)->offset.size(0) == S) p.packed.key_offset += s * H * D;
  }
  Tensor out = into ? at::empty({0}, query.options()) : at::empty({S, query.size(1), D},
                                                                 query.options());
  clock.lap(SETUP);
  solve(problems, into ? into->data_ptr<float>() : out.data_ptr<float>());
  Stopwatch staging;
  if (stage_at.has_value())
    stage(*stage_at, step_k, own_page ? nullptr : step_v, N, slot_keys, slot_values, T, H, D,
          width);
  staging.lap(STAGE);
  whole.lap(WALL);
  if (TIMING) CALLS.fetch_add(1, std::memory_order_relaxed);
  return out;
}

// kvmix::seal_tokens: the tokens of the E groups a vLLM step seals -> [k, E, H, G, D] in `dtype`
// (a view of a token-major buffer, every token of it written; k = 2: keys and values, 1: keys
// only where the staging holds keys only): the staged ones, keys [1, H, T, D] (values likewise,
// or none) at staging positions `carried` [c], go to token slots `carried_at` [c] (entry · G +
// offset); the step's own, keys and values [N, H, D] of any float dtype, rounded to the
// staging's dtype first (as staging them would round them), tokens `tokens` [e] to `tokens_at`.
Tensor seal_tokens(const Tensor& staged_keys, const std::optional<Tensor>& staged_values,
                   const Tensor& keys, const Tensor& values, const Tensor& carried,
                   const Tensor& carried_at, const Tensor& tokens, const Tensor& tokens_at,
                   int64_t groups, int64_t group, at::ScalarType dtype) {
  check(staged_keys.dim() == 4 && staged_keys.size(0) == 1 && staged_keys.is_contiguous() &&
            (!staged_values || (staged_values->sizes() == staged_keys.sizes() &&
                                staged_values->scalar_type() == staged_keys.scalar_type() &&
                                staged_values->is_contiguous())),
        "the staging must be contiguous keys (and values) [1, H, T, D] of one dtype");
  const int64_t H = staged_keys.size(1), T = staged_keys.size(2), D = staged_keys.size(3);
  check(keys.dim() == 3 && keys.size(1) == H && keys.size(2) == D && keys.stride(2) == 1 &&
            values.sizes() == keys.sizes() && values.stride(2) == 1 &&
            values.scalar_type() == keys.scalar_type(),
        "the step's keys and values must be [N, H, D] of one dtype, channels contiguous");
  const int64_t slots = groups * group, c = carried.numel(), e = tokens.numel();
  check(carried_at.numel() == c && tokens_at.numel() == e && c + e == slots,
        "every token of the sealed groups must come from the staging or the step");
  const int64_t* from_staging = data<int64_t>(carried, "carried");
  const int64_t* to_staged = data<int64_t>(carried_at, "carried_at");
  const int64_t* from_step = data<int64_t>(tokens, "tokens");
  const int64_t* to_step = data<int64_t>(tokens_at, "tokens_at");
  for (int64_t j = 0; j < c; ++j)
    check(from_staging[j] >= 0 && from_staging[j] < T && to_staged[j] >= 0 &&
              to_staged[j] < slots, "carried tokens lie outside the staging or the groups");
  for (int64_t j = 0; j < e; ++j)
    check(from_step[j] >= 0 && from_step[j] < keys.size(0) && to_step[j] >= 0 &&
              to_step[j] < slots, "the step's tokens lie outside the step or the groups");
  std::vector<bool> written(slots, false);  // each token slot exactly once
  for (int64_t j = 0; j < c; ++j) written[to_staged[j]] = true;
  for (int64_t j = 0; j < e; ++j) written[to_step[j]] = true;
  check(std::find(written.begin(), written.end(), false) == written.end(),
        "every token of the sealed groups must be written once");
  const int64_t k = staged_values ? 2 : 1;
  Tensor out = at::empty({k, slots, H, D}, keys.options().dtype(dtype));  // token-major
  with_float_type(dtype, [&]<typename O>(O*) {
    with_float_type(staged_keys.scalar_type(), [&]<typename S>(S*) {
      with_float_type(keys.scalar_type(), [&]<typename M>(M*) {
        for (int64_t i = 0; i < k; ++i) {
          O* to = out.data_ptr<O>() + i * slots * H * D;
          const S* held = (i == 0 ? staged_keys : *staged_values).data_ptr<S>();
          const Tensor& own = i == 0 ? keys : values;
          const M* step = own.data_ptr<M>();
          for (int64_t j = 0; j < c; ++j)
            for (int64_t h = 0; h < H; ++h)
              convert(held + (h * T + from_staging[j]) * D, to + (to_staged[j] * H + h) * D, D);
          std::vector<S> staged(D);
          for (int64_t j = 0; j < e; ++j)  // rounded to the staging's dtype, as staged
            for (int64_t h = 0; h < H; ++h) {
              convert(step + from_step[j] * own.stride(0) + h * own.stride(1), staged.data(), D);
              convert(staged.data(), to + (to_step[j] * H + h) * D, D);
            }
        }
      });
    });
  });
  return out.view({k, groups, group, H, D}).permute({0, 1, 3, 2, 4});
}

// kvmix::write_pages: each of `states` [E, ...] into entries `pages` [E] of its field in
// `fields` [P, ...] (contiguous; cast to the field's dtype): sealed groups into a layer's
// pages, field by field, in one call.
void write_pages(at::TensorList fields, at::TensorList states, const Tensor& pages) {
  check(fields.size() == states.size(), "every page field needs its state");
  const int64_t E = pages.numel();
  const int64_t* at = data<int64_t>(pages, "pages");
  std::vector<Tensor> sources;  // every argument checked before the first write
  for (size_t i = 0; i < fields.size(); ++i) {
    const Tensor& field = fields[i];
    check(field.is_contiguous() && field.dim() >= 1 && field.size(0) > 0,
          "a page field must be contiguous [P, ...]");
    sources.push_back(states[i].to(field.scalar_type()).contiguous());
    check(sources.back().numel() == E * (field.numel() / field.size(0)),
          "a state must be [E, ...] of a page's size");
    for (int64_t e = 0; e < E; ++e)
      check(at[e] >= 0 && at[e] < field.size(0), "pages name a page outside the pool");
  }
  for (size_t i = 0; i < fields.size(); ++i) {
    const size_t bytes = fields[i].numel() / fields[i].size(0) * fields[i].element_size();
    char* to = static_cast<char*>(fields[i].data_ptr());
    const char* from = static_cast<const char*>(sources[i].data_ptr());
    for (int64_t e = 0; e < E; ++e) std::memcpy(to + at[e] * bytes, from + e * bytes, bytes);
  }
}

// kvmix::quantize: x [B, ...] (float32, float16 or bfloat16, any strides) quantized in groups
// along `dim` (a power of two of 8 to 256 elements) -> codes (uint8 shaped like x, contiguous,
// or packed [B, bytes] when `packed`: the groups in order, a row each), scale and minimum
// (float16, x's shape with `dim` kept as 1).
std::tuple<Tensor, Tensor, Tensor> quantize(const Tensor& x, int64_t bits, int64_t dim,
                                            bool center, bool packed) {
  check(valid_bits(bits), "bits must be 1, 2, 3, 4 or 8");
  check(x.dim() >= 1, "x must have a dimension");
  dim = dim < 0 ? dim + x.dim() : dim;
  check(dim >= 0 && dim < x.dim(), "dim is outside x's dimensions");
  const int64_t n = x.size(dim);
  check(n >= 8 && n <= MAX_GROUP && (n & (n - 1)) == 0,
        "groups must be a power of two of 8 to 256 elements");
  check(x.size(0) > 0 && (!packed || (x.dim() >= 2 && dim == x.dim() - 1)),
        "x must be non-empty, and packed groups must lie along the last of two or more "
        "dimensions");
  check(x.device().is_cpu(), "x must be a CPU tensor");
  const int64_t groups = x.numel() / n;
  std::vector<int64_t> stat_shape = x.sizes().vec();
  stat_shape[dim] = 1;
  const GroupIndex index(x, dim);
  const auto half = x.options().dtype(at::kHalf);
  Tensor scale = at::empty(stat_shape, half), minimum = at::empty(stat_shape, half);
  Tensor codes = packed ? at::empty({x.size(0), groups / x.size(0) * row_bytes(n, int(bits))},
                                    x.options().dtype(at::kByte))
                        : at::empty(x.sizes(), x.options().dtype(at::kByte));
  uint8_t* out = codes.data_ptr<uint8_t>();
  at::Half* s = scale.data_ptr<at::Half>();
  at::Half* m = minimum.data_ptr<at::Half>();
  const auto run = [&](const auto* data) {
    quantize_groups(data, index, groups, n, x.stride(dim), int(bits), center, packed, out, s, m);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kHalf: run(x.data_ptr<at::Half>()); break;
    case at::kBFloat16: run(x.data_ptr<at::BFloat16>()); break;
    default: check(false, "x must be float32, float16 or bfloat16");
  }
  return {codes, scale, minimum};
}

// A page field's first entry as T*, after checking it holds `per_page` elements of T a page.
template <typename T>
T* entries(const Tensor& field, int64_t per_page, const char* what) {
  check(field.is_contiguous() && field.scalar_type() == c10::CppTypeToScalarType<T>::value &&
            field.dim() >= 1 && field.numel() == field.size(0) * per_page,
        what);
  return field.data_ptr<T>();
}

// kvmix::encode_pages: the sealed groups' tokens [k, E, H, G, D] (k = 2: keys and values, 1:
// keys only; float32, float16 or bfloat16, any strides) encoded straight into entries `pages`
// [E] of the page fields (distinct), bit for bit what the method's encode stores and
// write_pages would copy there: key_fields [codes (the low plane), scale, minimum, and where
// high > low the high channels' refinement codes] per channel over the G tokens
// (quantize_mixed: channels `index` [E, H, k] at `high` bits, the others at `low`, bin-center
// where `center`; high = low: no index, one width); value_fields [codes, scale, minimum] (none
// for keys only) per token in groups of `value_group` channels at `value_bits`.
void encode_pages(const std::vector<Tensor>& key_fields, const std::vector<Tensor>& value_fields,
                  const Tensor& tokens, const Tensor& pages, const std::optional<Tensor>& index,
                  int64_t low, int64_t high, bool center, int64_t value_bits,
                  int64_t value_group) {
  const bool mixed = high > low;
  check(tokens.dim() == 5 && (tokens.size(0) == 1 || tokens.size(0) == 2) &&
            tokens.device().is_cpu(),
        "tokens must be a CPU tensor [1 or 2, E, H, G, D]");
  const bool values = tokens.size(0) == 2;
  check(low >= 1 && high >= low && high <= 8 && valid_bits(low) &&
            (!mixed || valid_bits(high - low)) && (!values || valid_bits(value_bits)),
        "bits must be 1 <= low <= high <= 8 with low, high - low and value bits each 1, 2, 3, "
        "4 or 8");
  const int64_t E = tokens.size(1), H = tokens.size(2), G = tokens.size(3), D = tokens.size(4);
  check(G >= 8 && G <= MAX_GROUP && (G & (G - 1)) == 0 && D > 0,
        "groups must be a power of two of 8 to 256 tokens, of one channel or more");
  check(key_fields.size() == (mixed ? 4u : 3u) && value_fields.size() == (values ? 3u : 0u),
        "key fields must be codes, scale, minimum (and refinement codes where high > low); "
        "value fields codes, scale, minimum, or none for keys only");
  check(!values || (value_group >= 8 && value_group <= MAX_GROUP &&
                     (value_group & (value_group - 1)) == 0 && D % value_group == 0),
        "value groups must be a power of two of 8 to 256 channels dividing the head");
  check(pages.dim() == 1 && pages.size(0) == E && pages.scalar_type() == at::kLong &&
            pages.is_contiguous(),
        "pages must be int64 [E]");
  int64_t k = 0;
  const int64_t* chosen = nullptr;
  if (mixed) {
    check(index && index->dim() == 3 && index->size(0) == E && index->size(1) == H &&
              index->scalar_type() == at::kLong && index->is_contiguous() &&
              index->size(2) <= D,
          "index must be int64 [E, H, k] where high > low");
    k = index->size(2);
    chosen = index->data_ptr<int64_t>();
    for (int64_t i = 0; i < index->numel(); ++i)
      check(chosen[i] >= 0 && chosen[i] < D, "index names a channel outside [0, D)");
  } else {
    check(!index, "an index is for high > low only");
  }
  const int64_t P = key_fields[0].size(0);
  const int64_t* at = pages.data_ptr<int64_t>();
  std::vector<bool> taken(P, false);  // distinct pages: the threads write apart
  for (int64_t e = 0; e < E; ++e) {
    check(at[e] >= 0 && at[e] < P, "pages name a page outside the pool");
    check(!taken[at[e]], "pages must be distinct");
    taken[at[e]] = true;
  }
  for (const auto& field : key_fields) check(field.size(0) == P, "fields of one pool of pages");
  for (const auto& field : value_fields) check(field.size(0) == P, "fields of one pool of pages");
  const int64_t low_width = D * row_bytes(G, int(low));
  const int64_t refine_width = mixed ? k * row_bytes(G, int(high - low)) : 0;
  const int64_t J = values ? D / value_group : 0;
  const int64_t value_width = values ? G * J * row_bytes(value_group, int(value_bits)) : 0;
  const char* key_shape = "key fields must hold a page's codes (uint8) and scale, minimum "
                          "(float16, [H, D] a page)";
  const char* value_shape = "value fields must hold a page's codes (uint8) and scale, minimum "
                            "(float16, [H, G, D / value_group] a page)";
  uint8_t* codes = entries<uint8_t>(key_fields[0], H * low_width, key_shape);
  at::Half* scale = entries<at::Half>(key_fields[1], H * D, key_shape);
  at::Half* minimum = entries<at::Half>(key_fields[2], H * D, key_shape);
  uint8_t* refine = mixed ? entries<uint8_t>(key_fields[3], H * refine_width, key_shape) : nullptr;
  uint8_t* value_codes = nullptr;
  at::Half *value_scale = nullptr, *value_minimum = nullptr;
  if (values) {
    value_codes = entries<uint8_t>(value_fields[0], H * value_width, value_shape);
    value_scale = entries<at::Half>(value_fields[1], H * G * J, value_shape);
    value_minimum = entries<at::Half>(value_fields[2], H * G * J, value_shape);
  }
  with_float_type(tokens.scalar_type(), [&]<typename T>(T*) {
    const T* x = tokens.const_data_ptr<T>();
    const int64_t s0 = tokens.stride(0), s1 = tokens.stride(1), s2 = tokens.stride(2);
    const int64_t token = tokens.stride(3), channel = tokens.stride(4);
    const int64_t grain = std::max<int64_t>(1, 16384 / (G * D));  // heads a thread takes
    at::parallel_for(0, E * H, grain, [&](int64_t begin, int64_t end) {
      for (int64_t eh = begin; eh < end; ++eh) {
        const int64_t e = eh / H, h = eh % H;
        const int64_t head = at[e] * H + h;  // the head's entry in the pages
        quantize_mixed_head(x + e * s1 + h * s2, G, D, token, channel,
                            chosen + (e * H + h) * k, k, int(high), int(low), center,
                            codes + head * low_width, refine + head * refine_width,
                            scale + head * D, minimum + head * D);
        if (!values) continue;
        for_bits(int(value_bits), [&]<int B>() {
          quantize_token_values<T, B>(x + s0 + e * s1 + h * s2, G, D, token, channel,
                                      value_group, value_codes + head * value_width,
                                      value_scale + head * G * J, value_minimum + head * G * J);
        });
      }
    });
  });
}

// kvmix::quantize_mixed: keys [B, H, G, D] (float32, float16 or bfloat16, any strides; G a
// power of two of 8 to 256), index [B, H, k] int64 (each head's high channels) -> the low plane
// [B, H·D·row(G, low)], the refinement plane [B, H·k·row(G, high - low)] (uint8, rows packed
// as packing.pack packs them), scale and minimum [B, H, 1, D] float16: bit for bit
// quantizers.quantize_mixed. encode_pages' keys, into B pages of their own.
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_mixed(const Tensor& keys, const Tensor& index,
                                                          int64_t high, int64_t low,
                                                          bool center) {
  check(high > low && keys.dim() == 4 && index.dim() == 3,
        "quantize_mixed takes keys [B, H, G, D], index [B, H, k] and high > low");
  const int64_t B = keys.size(0), H = keys.size(1), G = keys.size(2), D = keys.size(3);
  const int64_t k = index.size(2);
  check(G > 0 && D > 0 && valid_bits(low) && valid_bits(high - low),
        "keys need tokens and channels, and low and high - low bits each 1, 2, 3, 4 or 8");
  const auto bytes = keys.options().dtype(at::kByte), half = keys.options().dtype(at::kHalf);
  Tensor low_plane = at::empty({B, H * D * row_bytes(G, int(low))}, bytes);
  Tensor refine = at::empty({B, H * k * row_bytes(G, int(high - low))}, bytes);
  Tensor scale = at::empty({B, H, 1, D}, half), minimum = at::empty({B, H, 1, D}, half);
  encode_pages({low_plane, scale, minimum, refine}, {}, keys.unsqueeze(0),
               at::arange(B, keys.options().dtype(at::kLong)), index, low, high, center, 0, 0);
  return {low_plane, refine, scale, minimum};
}

// One head's row of a selection (`units` bits, packed as packing.pack packs them; `pair`
// [units, 2]: both channels of a selected pair, or none: units are channels) -> its first
// `count` channels, selected ones first, ascending, into `at` [count].
void head_channels(const uint8_t* row, int64_t units, const int64_t* pair, int64_t count,
                   int64_t* at) {
  const int64_t W = units / 8, D = pair ? 2 * units : units;
  std::vector<uint8_t> chosen(D, 0);  // a head's channels
  for (int64_t i = 0; i < units; ++i) {
    if (!((row[i % W] >> (i / W)) & 1)) continue;
    if (pair) chosen[pair[2 * i]] = chosen[pair[2 * i + 1]] = 1;
    else chosen[i] = 1;
  }
  int64_t n = 0;
  for (int want = 1; want >= 0 && n < count; --want)  // selected first, then the others
    for (int64_t d = 0; d < D && n < count; ++d)
      if (chosen[d] == want) at[n++] = d;
  std::sort(at, at + n);
}

// `pairs` [units, 2] int64 (none: the units are channels) checked, with a `count` of channels
// a head; its first element, or null.
const int64_t* checked_pairs(const std::optional<Tensor>& pairs, int64_t units, int64_t count) {
  const int64_t* pair = nullptr;
  int64_t D = units;
  if (pairs) {
    check(pairs->dim() == 2 && pairs->size(0) == units && pairs->size(1) == 2 &&
              pairs->scalar_type() == at::kLong && pairs->is_contiguous(),
          "pairs must be int64 [units, 2]");
    pair = pairs->data_ptr<int64_t>();
    D = 2 * units;
    for (int64_t i = 0; i < 2 * units; ++i)
      check(pair[i] >= 0 && pair[i] < D, "pairs name a channel outside [0, 2·units)");
  }
  check(count >= 0 && count <= D, "count must be in [0, channels]");
  return pair;
}

// kvmix::selected_channels: a selection of one bit per (head, unit), packed [B, H·units/8]
// (rows of `units` bits as packing.pack packs them), units either channels or RoPE pairs
// (`pairs` [units, 2] int64: both channels of a selected pair) -> each head's first `count`
// channels, selected ones first, ascending [B, H, count] int64: importance.mask_index of the
// channel mask.
Tensor selected_channels(const Tensor& bits, int64_t heads, int64_t units,
                         const std::optional<Tensor>& pairs, int64_t count) {
  check(units > 0 && units % 8 == 0 && heads > 0, "units must be a positive multiple of 8");
  check(bits.dim() == 2 && bits.scalar_type() == at::kByte && bits.is_contiguous() &&
            bits.size(1) == heads * units / 8,
        "bits must be uint8 [B, heads·units/8]");
  const int64_t* pair = checked_pairs(pairs, units, count);
  const int64_t B = bits.size(0);
  Tensor out = at::empty({B, heads, count}, bits.options().dtype(at::kLong));
  const uint8_t* in = bits.data_ptr<uint8_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t bh = 0; bh < B * heads; ++bh)
    head_channels(in + bh * (units / 8), units, pair, count, o + bh * count);
  return out;
}

// kvmix::pack: codes [M, n] uint8 (< 2^bits, n a multiple of 8) -> [M, row bytes], every row
// packed as packing.pack packs it.
Tensor pack(const Tensor& codes, int64_t bits) {
  check(valid_bits(bits), "bits must be 1, 2, 3, 4 or 8");
  check(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) % 8 == 0 &&
            codes.size(1) <= MAX_GROUP,
        "codes must be [M, n] uint8 with n a multiple of 8 up to 256");
  const int64_t M = codes.size(0), n = codes.size(1), width = row_bytes(n, int(bits));
  Tensor out = at::empty({M, width}, codes.options());
  const uint8_t* in = data<uint8_t>(codes, "codes");
  uint8_t* o = out.data_ptr<uint8_t>();
  for_bits(int(bits), [&]<int B>() {
    at::parallel_for(0, M, 256, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) pack_row<B>(in + m * n, n, o + m * width);
    });
  });
  return out;
}

}  // namespace

// The selections of the E groups a step seals: each of the pages' selection fields [P, ...]
// (none: the method keeps none) copied from the group's row's first page to its page (pages
// describe themselves), and where the encoding mixes widths each group's high channels
// [E, H, count], from the first page's bits (selection[0], [P, H·units/8] uint8).
namespace {

std::optional<Tensor> copy_selections(const std::vector<Tensor>& selection, const Tensor& pages,
                                      const Tensor& first_pages, const PageEncoding& how,
                                      int64_t H) {
  const int64_t E = pages.numel();
  if (E == 0) return std::nullopt;
  const int64_t* to = data<int64_t>(pages, "seal pages");
  const int64_t* from = data<int64_t>(first_pages, "first pages");
  const bool mixed = how.high > how.low;
  const int64_t W = how.units / 8;
  const int64_t* pair = nullptr;
  if (mixed) {  // every argument checked before the first write
    check(!selection.empty() && how.units > 0 && how.units % 8 == 0 &&
              selection[0].scalar_type() == at::kByte && selection[0].dim() == 2 &&
              selection[0].size(1) == H * W,
          "mixed widths need the pages' selection bits, uint8 [P, H·units/8]");
    pair = checked_pairs(how.pairs, how.units, how.count);
  }
  for (const Tensor& field : selection) {
    check(field.is_contiguous() && field.dim() >= 1 && field.device().is_cpu(),
          "a selection field must be contiguous [P, ...] on the CPU");
    for (int64_t e = 0; e < E; ++e)
      check(to[e] >= 0 && to[e] < field.size(0) && from[e] >= 0 && from[e] < field.size(0),
            "seal pages and first pages must lie in the pool");
  }
  for (const Tensor& field : selection) {
    const size_t bytes = field.numel() / field.size(0) * field.element_size();
    char* base = static_cast<char*>(field.data_ptr());
    for (int64_t e = 0; e < E; ++e)
      if (to[e] != from[e]) std::memcpy(base + to[e] * bytes, base + from[e] * bytes, bytes);
  }
  if (!mixed) return std::nullopt;
  Tensor index = at::empty({E, H, how.count}, first_pages.options());
  const uint8_t* bits = selection[0].data_ptr<uint8_t>();
  int64_t* at = index.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      head_channels(bits + (from[e] * H + h) * W, how.units, pair, how.count,
                    at + (e * H + h) * how.count);
  return index;
}

}  // namespace

// kvmix::step: one layer's whole vLLM step on the CPU, in one call (`rows` the step's
// StepRows, built once for every layer): where `encoding` is given (else the caller sealed them
// before), the groups the step seals copy their row's selection into their pages' `selection`
// fields (copy_selections: the high channels where the encoding mixes widths), are gathered
// from the staging [1, H, T, D] (keys, and values unless `value_fields` is empty:
// values="token") and the step's keys, values [N, H, D] (seal_tokens) and encoded straight
// into their pages (encode_pages into `key_fields` and `value_fields`); then every kernel row
// attends to its pages and its own group's floats, and the new tokens still open are staged
// (decode_batch: query [K, Hq, D] -> [K, Hq, D] float32, or into `out`).
Tensor step(const Tensor& query, double scale, const Tensor& staging_keys,
            const Tensor& staging_values, const c10::intrusive_ptr<StepRows>& rows,
            const Tensor& keys, const Tensor& values, const c10::intrusive_ptr<PagePool>& pool,
            const std::vector<Tensor>& key_fields, const std::vector<Tensor>& value_fields,
            const std::vector<Tensor>& selection,
            const std::optional<c10::intrusive_ptr<PageEncoding>>& encoding,
            const std::optional<Tensor>& out) {
  const StepRows& r = *rows;
  if (encoding && r.seal_pages) {
    Stopwatch clock;
    const PageEncoding& how = **encoding;
    const int64_t E = r.seal_pages->numel();
    const std::optional<Tensor> index =
        copy_selections(selection, *r.seal_pages, *r.first_pages, how, staging_keys.size(1));
    const std::optional<Tensor> staged_values =
        value_fields.empty() ? std::nullopt : std::optional<Tensor>(staging_values);
    const Tensor groups = seal_tokens(staging_keys, staged_values, keys, values, *r.carried,
                                      *r.carried_at, *r.tokens, *r.tokens_at, E, r.group,
                                      how.dtype);  // [k, E, H, G, D]
    encode_pages(key_fields, value_fields, groups, *r.seal_pages, index, how.low, how.high,
                 how.center, how.value_bits, how.value_group);
    clock.lap(SEAL);
  }
  const PagePool& p = *pool;
  return decode_batch(query, scale, staging_keys, staging_values, r.floats, r.group, r.table,
                      r.held, r.counts, p.page_keys, p.page_values, p.planes, p.token_keys,
                      p.value_groups, std::nullopt, std::nullopt, std::nullopt, r.stage_at, keys,
                      values, r.own_pages, out);
}

// A step's rows (PlanRows, without their slots) from vLLM's description of the step.
PlanRows read_rows(const Tensor& starts, const Tensor& lengths, const Tensor& block_table,
                   int64_t group, int64_t block_size) {
  PlanRows r;
  r.R = lengths.numel();
  r.G = group;
  r.B = block_size;
  check(group > 0 && block_size > 0 && block_size % group == 0,
        "plan_step: a block must hold whole groups");
  check(block_table.dim() == 2 && block_table.size(0) == r.R && block_table.device().is_cpu() &&
            (block_table.numel() == 0 || block_table.size(1) == 1 ||
             block_table.stride(1) == 1) &&
            (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
        "plan_step: the block table must be int32 or int64 [R, W] on the host, rows contiguous");
  r.W = block_table.size(1);
  r.row_step = block_table.stride(0);
  if (block_table.scalar_type() == at::kInt) r.table32 = block_table.const_data_ptr<int32_t>();
  else r.table64 = block_table.const_data_ptr<int64_t>();
  r.starts = host_ints(starts, r.R + 1, "starts");
  r.lengths = host_ints(lengths, r.R, "lengths");
  check(r.starts[0] == 0, "plan_step: the step's tokens must start at 0");
  for (int64_t i = 0; i < r.R; ++i) {
    const int64_t fresh = r.starts[i + 1] - r.starts[i], past = r.lengths[i] - fresh;
    check(fresh >= 0 && past >= 0 && r.lengths[i] <= r.W * r.B,
          "plan_step: rows must lie in order, within their block table");
    r.fresh.push_back(fresh);
    r.past.push_back(past);
    r.opened.push_back(past / group);
    r.staged.push_back(past % group);
    r.done.push_back(r.lengths[i] / group);
  }
  return r;
}

// kvmix::assign_slots: the staging slots of a step's rows on a runner that gives no request
// identity (SlotBook; kvmix.vllm.plan.PageSlots.assign, its reference): the slot of each row's
// open group before and after the step [R], the book once the step has run (page_of, used
// [slots]; the step count is step + 1) and `lost` (0, or see SlotBook::assign).
std::tuple<Tensor, Tensor, Tensor, Tensor, int64_t> assign_slots(
    const Tensor& starts, const Tensor& lengths, const Tensor& block_table, const Tensor& page_of,
    const Tensor& used, int64_t step, int64_t group, int64_t block_size) {
  const PlanRows r = read_rows(starts, lengths, block_table, group, block_size);
  SlotBook book;
  book.page_of = host_ints(page_of, page_of.numel(), "page_of");
  book.used = host_ints(used, page_of.numel(), "used");
  book.step = step;
  std::vector<int64_t> before, after;
  const int64_t lost = book.assign(r, before, after);
  const auto tensor = [](const std::vector<int64_t>& v) {
    Tensor t = at::empty({int64_t(v.size())}, at::TensorOptions().dtype(at::kLong));
    if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
    return t;
  };
  return {tensor(before), tensor(after), tensor(book.page_of), tensor(book.used), lost};
}

// kvmix::plan_step: the plan of one vLLM step (kvmix.vllm.plan.reference_plan, its reference)
// from its rows (PlanRows) and what reads it (PlanFlags): the plan's arrays in the reference's
// order, views of one tensor (writes: stage_at, staged, staged_at, value_at; seals: pages,
// first_pages, tokens, tokens_at, carried, carried_at, firsts; sums: restart, tokens, into,
// sealed, carried; kernel rows: tokens, table, held, counts, floats, own_pages), None where the
// step has none; its facts [N, E, has_seals, has_sums, has_rows, every_token, all_staged, F,
// then where `selects` each kernel row's first page] and, where it has kernel rows, the rows
// as kvmix::step reads them.
std::tuple<std::vector<std::optional<Tensor>>, std::vector<int64_t>,
           std::optional<c10::intrusive_ptr<StepRows>>>
plan_step(const Tensor& starts, const Tensor& lengths, const Tensor& block_table,
          const Tensor& slot_before, const Tensor& slot_after, int64_t group, int64_t block_size,
          bool fused, bool exact, bool by_op, bool token_values, bool sums, bool selects) {
  PlanRows r = read_rows(starts, lengths, block_table, group, block_size);
  r.slot_before = host_ints(slot_before, r.R, "slot_before");
  r.slot_after = host_ints(slot_after, r.R, "slot_after");
  const PlanArrays a = plan_arrays(r, {fused, exact, by_op, token_values, sums, selects});
  // the parts the step has (None: a group that does not run, or an array its readers skip)
  const bool writes_by_op = by_op, staged_here = !by_op;
  const std::vector<PlanPart> parts = {
      {&a.stage_at, 0, writes_by_op}, {&a.staged, 0, staged_here},
      {&a.staged_at, 0, staged_here}, {&a.value_at, 0, token_values},
      {&a.pages, 0, a.has_seals}, {&a.first_pages, 0, a.has_seals}, {&a.tokens, 0, a.has_seals},
      {&a.tokens_at, 0, a.has_seals}, {&a.carried, 0, a.has_seals},
      {&a.carried_at, 0, a.has_seals}, {&a.firsts, 0, a.has_seals},
      {&a.restart, 0, a.has_sums}, {&a.sum_tokens, 0, a.has_sums}, {&a.into, 0, a.has_sums},
      {&a.sealed, 0, a.has_sums}, {&a.sum_carried, 0, a.has_sums},
      {&a.row_tokens, 0, a.has_rows}, {&a.table, a.M, a.has_rows}, {&a.held, a.M, a.has_rows},
      {&a.counts, 0, a.has_rows}, {&a.floats, 4, a.has_rows},
      {&a.own_pages, 0, a.has_rows && token_values}};
  const std::vector<std::optional<Tensor>> arrays = views_of_one(parts);  // its own storage
  std::optional<c10::intrusive_ptr<StepRows>> rows;
  if (a.has_rows) {
    const Tensor stage_at = by_op ? *arrays[0] : at::full({a.N}, -1, at::kLong);
    rows = c10::make_intrusive<StepRows>(*arrays[17], *arrays[18], *arrays[19], *arrays[20],
                                         stage_at, arrays[21], arrays[4], arrays[5], arrays[8],
                                         arrays[9], arrays[6], arrays[7], group);
  }
  std::vector<int64_t> facts = {a.N, a.E, a.has_seals, a.has_sums, a.has_rows, a.every_token,
                                a.all_staged, int64_t(a.firsts.size())};
  facts.insert(facts.end(), a.row_firsts.begin(), a.row_firsts.end());
  return {arrays, facts, rows};
}

// The kernels this build holds: "avx512-vnni" (integer dot products) or "float".
std::string simd() {
#ifdef KVMIX_VNNI
  return "avx512-vnni";
#else
  return "float";
#endif
}

TORCH_LIBRARY(kvmix, m) {
  m.class_<TokenGroups>("TokenGroups")
      .def(torch::init<Tensor, Tensor, std::optional<Tensor>, int64_t, int64_t>());
  m.class_<ChannelPlanes>("ChannelPlanes")
      .def(torch::init<std::vector<Tensor>, std::vector<int64_t>, std::vector<Tensor>,
                       std::vector<Tensor>, Tensor, Tensor, Tensor>());
  m.class_<PagePool>("PagePool")
      .def(torch::init<std::optional<Tensor>, std::optional<Tensor>, Planes, Groups, Groups>());
  m.class_<PageEncoding>("PageEncoding")
      .def(torch::init<int64_t, int64_t, bool, int64_t, int64_t, int64_t, std::optional<Tensor>,
                       int64_t, at::ScalarType>());
  m.class_<StepRows>("StepRows")
      .def(torch::init<Tensor, Tensor, Tensor, Tensor, Tensor, std::optional<Tensor>,
                       std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>,
                       std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>,
                       int64_t>());
  m.def("simd() -> str", &simd);
  m.def("op_timings() -> Tensor", &op_timings);
  m.def("op_parts() -> str", &op_parts);
  m.def("quantize(Tensor x, int bits, int dim, bool center, bool packed) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("quantize_mixed(Tensor keys, Tensor index, int high, int low, bool center) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("encode_pages(Tensor(a!)[] key_fields, Tensor(b!)[] value_fields, Tensor tokens, "
        "Tensor pages, Tensor? index, int low, int high, bool center, int value_bits, "
        "int value_group) -> ()");
  m.def("selected_channels(Tensor bits, int heads, int units, Tensor? pairs, int count) -> "
        "Tensor");
  m.def("pack(Tensor codes, int bits) -> Tensor");
  m.def("seal_tokens(Tensor staged_keys, Tensor? staged_values, Tensor keys, Tensor values, "
        "Tensor carried, Tensor carried_at, Tensor tokens, Tensor tokens_at, int groups, "
        "int group, ScalarType dtype) -> Tensor");
  m.def("write_pages(Tensor(a!)[] fields, Tensor[] states, Tensor pages) -> ()");
  m.def(
      "decode(Tensor query, float scale, Tensor[] float_keys, Tensor[] float_values, "
      "int causal_last, int group, int[] lengths, "
      "__torch__.torch.classes.kvmix.ChannelPlanes? planes, "
      "__torch__.torch.classes.kvmix.TokenGroups? token_keys, "
      "__torch__.torch.classes.kvmix.TokenGroups? value_groups) -> Tensor");
  m.def(
      "decode_batch(Tensor query, float scale, Tensor(a!) slot_keys, Tensor(b!) slot_values, "
      "Tensor spans, int group, Tensor pages, Tensor held, Tensor counts, Tensor? page_keys, "
      "Tensor? page_values, __torch__.torch.classes.kvmix.ChannelPlanes? planes, "
      "__torch__.torch.classes.kvmix.TokenGroups? token_keys, "
      "__torch__.torch.classes.kvmix.TokenGroups? value_groups, Tensor? skip=None, "
      "Tensor? step_keys=None, Tensor? step_values=None, Tensor? stage_at=None, "
      // value_pages: the rows' own values from pages (the slots then hold keys only: slot
      // values are neither read nor written)
      "Tensor? new_keys=None, Tensor? new_values=None, Tensor? value_pages=None, "
      "Tensor(d!)? out=None) -> Tensor");
  m.def(
      "assign_slots(Tensor starts, Tensor lengths, Tensor block_table, Tensor page_of, "
      "Tensor used, int step, int group, int block_size) -> (Tensor, Tensor, Tensor, Tensor, "
      "int)");
  m.def(
      "plan_step(Tensor starts, Tensor lengths, Tensor block_table, Tensor slot_before, "
      "Tensor slot_after, int group, int block_size, bool fused, bool exact, bool by_op, "
      "bool token_values, bool sums, bool selects) -> "
      "(Tensor?[], int[], __torch__.torch.classes.kvmix.StepRows?)");
  m.def(
      "step(Tensor query, float scale, Tensor(a!) staging_keys, Tensor(b!) staging_values, "
      "__torch__.torch.classes.kvmix.StepRows rows, Tensor keys, Tensor values, "
      "__torch__.torch.classes.kvmix.PagePool pool, Tensor(c!)[] key_fields, "
      "Tensor(d!)[] value_fields, Tensor(e!)[] selection, "
      "__torch__.torch.classes.kvmix.PageEncoding? encoding, Tensor(f!)? out=None) -> Tensor");
  m.def("put_values(Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) minimum, Tensor values, "
        "ScalarType staging, Tensor value_at, int bits, int value_group, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvmix, CPU, m) {
  m.impl("decode", &decode);
  m.impl("decode_batch", &decode_batch);
  m.impl("step", &step);
  m.impl("plan_step", &plan_step);
  m.impl("assign_slots", &assign_slots);
  m.impl("quantize", &quantize);
  m.impl("quantize_mixed", &quantize_mixed);
  m.impl("encode_pages", &encode_pages);
  m.impl("selected_channels", &selected_channels);
  m.impl("pack", &pack);
  m.impl("seal_tokens", &seal_tokens);
  m.impl("write_pages", &write_pages);
  m.impl("put_values", &put_values);
}
