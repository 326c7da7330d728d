// kvmix::plan_step — the vLLM plugin's plan of one step (kvmix.vllm.plan.plan_step, its
// reference, in numpy), computed on the host in one pass: where each new token goes, which
// groups the step seals, what each kernel row attends to. Not a part of decode.
#pragma once

namespace {

// A step's R rows as the plan reads them (kvmix.vllm.plan.Rows): starts [R + 1] (vLLM's
// query_start_loc), lengths [R] (tokens held after the step), the block table [R, W] (int32
// or int64, rows contiguous), the staging slot of each row's open group before and after the
// step (slot_before, slot_after [R], -1: none); G tokens a page, B tokens a vLLM block. Per
// row: its `fresh` tokens, the tokens held `past` the step, the group `opened` before it, the
// tokens `staged` before it, the groups `done` after it.
struct PlanRows {
  int64_t R, G, B, W, row_step;  // row_step: the block table's rows apart
  std::vector<int64_t> starts, lengths, slot_before, slot_after, fresh, past, opened, staged,
      done;
  const int32_t* table32 = nullptr;
  const int64_t* table64 = nullptr;

  // The page of group g of row r.
  int64_t page(int64_t r, int64_t g) const {
    const int64_t tokens = g * G, at = r * row_step + tokens / B;
    const int64_t block = table32 ? int64_t(table32[at]) : table64[at];
    return block * (B / G) + tokens % B / G;
  }
};

std::vector<int64_t> host_ints(const Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.numel() == n &&
                  (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt),
              "kvmix::plan_step: ", what, " must be int32 or int64 [", n, "] on the host");
  const Tensor x = t.to(at::kLong).contiguous();
  const int64_t* p = x.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}

// An array of the plan: its values, its columns (0: [n], c: [n / c, c]) and whether the step
// has it.
struct PlanPart {
  const std::vector<int64_t>* values;
  int64_t columns;
  bool present;
};

// Each part the step has as an int64 tensor (None for the others), all of them views of one
// new tensor.
std::vector<std::optional<Tensor>> views_of_one(const std::vector<PlanPart>& parts) {
  const at::AutoDispatchBelowADInplaceOrView plain;  // index arrays: no autograd view records
  int64_t total = 0;
  for (const PlanPart& part : parts) total += part.present ? int64_t(part.values->size()) : 0;
  Tensor flat = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* to = flat.data_ptr<int64_t>();
  std::vector<std::optional<Tensor>> views;
  int64_t at = 0;
  for (const PlanPart& part : parts) {
    if (!part.present) {
      views.emplace_back(std::nullopt);
      continue;
    }
    const int64_t n = int64_t(part.values->size());
    if (n) std::memcpy(to + at, part.values->data(), n * sizeof(int64_t));
    Tensor view = flat.narrow(0, at, n);
    views.emplace_back(part.columns ? view.view({n / part.columns, part.columns}) : view);
    at += n;
  }
  return views;
}

// The page-keyed staging book (kvmix.vllm.plan.PageSlots, its reference): per slot the page
// whose open group it holds (page_of, -1: free) and the last step that used it (used), and the
// step count. `assign` returns the step's slots before and after it [R] and changes the book
// to what it is once the step has run; `lost` > 0: that many running rows found their open
// group reclaimed; < 0: that many more open groups than slots.
struct SlotBook {
  std::vector<int64_t> page_of, used;
  int64_t step = 0;

  // The slot holding page p's open group (the lowest such), or -1.
  int64_t find(int64_t p) const {
    for (size_t s = 0; s < page_of.size(); ++s)
      if (page_of[s] == p) return int64_t(s);
    return -1;
  }

  int64_t assign(const PlanRows& r, std::vector<int64_t>& before, std::vector<int64_t>& after) {
    const int64_t R = r.R, G = r.G;
    before.assign(R, -1);
    after.assign(R, -1);
    int64_t lost = 0;
    for (int64_t i = 0; i < R; ++i)
      if (r.staged[i] > 0) {
        before[i] = find(r.page(i, r.opened[i]));
        lost += before[i] < 0;
      }
    if (lost) return lost;
    std::vector<int64_t> keep, opening, pages;  // slots read now; rows opening, their pages
    for (int64_t i = 0; i < R; ++i) {
      const bool sealing = r.done[i] > r.opened[i], tail = r.lengths[i] % G > 0;
      const bool continuing = tail && !sealing && r.staged[i] > 0;
      if (continuing) {
        after[i] = before[i];
        keep.push_back(before[i]);
      } else if (tail) {
        opening.push_back(i);
      }
    }
    // the slots of groups sealed now are free for groups opening now, stale slots go back
    for (int64_t i = 0; i < R; ++i)
      for (int64_t g = r.opened[i]; g < r.done[i]; ++g) {
        const int64_t s = find(r.page(i, g));
        if (s >= 0) page_of[s] = -1;
      }
    std::vector<int64_t> slots;
    int64_t need = 0;
    for (const int64_t i : opening) {
      pages.push_back(r.page(i, r.done[i]));
      slots.push_back(find(pages.back()));
      need += slots.back() < 0;
    }
    std::vector<int64_t> free;
    for (size_t s = 0; s < page_of.size(); ++s)
      if (page_of[s] < 0) free.push_back(int64_t(s));
    if (int64_t(free.size()) < need) {  // reclaim the slots used longest ago
      const int64_t count = need - int64_t(free.size());
      std::vector<int64_t> held;
      for (size_t s = 0; s < page_of.size(); ++s) {
        const auto in = [&](const std::vector<int64_t>& v) {
          return std::find(v.begin(), v.end(), int64_t(s)) != v.end();
        };
        if (page_of[s] >= 0 && !in(keep) && !in(slots)) held.push_back(int64_t(s));
      }
      if (int64_t(held.size()) < count) return -count;
      std::stable_sort(held.begin(), held.end(),
                       [&](int64_t a, int64_t b) { return used[a] < used[b]; });
      for (int64_t k = 0; k < count; ++k) {
        page_of[held[k]] = -1;
        free.push_back(held[k]);
      }
    }
    for (size_t k = 0, taken = 0; k < opening.size(); ++k) {
      if (slots[k] < 0) slots[k] = free[taken++];
      page_of[slots[k]] = pages[k];
      after[opening[k]] = slots[k];
    }
    ++step;
    for (const auto* side : {&before, &after})
      for (const int64_t s : *side)
        if (s >= 0) used[s] = step;
    return 0;
  }
};

// Who reads the plan (kvmix.vllm.plan.Readers) and what the step runs: `fused` prefill
// chunks' tokens are kernel rows, `exact` a prompt's first chunk attends in float (a chunk of
// the reference path), `by_op` the CPU op stages the tokens, `token_values` values go to pages
// as they come, `sums` the method keeps query sums of first groups, `selects` pages carry a
// selection.
struct PlanFlags {
  bool fused, exact, by_op, token_values, sums, selects;
};

// The plan's arrays, grouped by reader and named with their index space (N the step's tokens,
// E the groups it seals, F those that are their row's first, K the kernel rows), as the
// reference names them; a group that does not run is empty, and `has_*` says which ran.
struct PlanArrays {
  std::vector<int64_t> stage_at, staged, staged_at, value_at;  // writes
  std::vector<int64_t> pages, first_pages, tokens, tokens_at, carried, carried_at, firsts;
  std::vector<int64_t> restart, sum_tokens, into, sealed, sum_carried;  // sums
  std::vector<int64_t> row_tokens, table, held, counts, floats, own_pages, row_firsts;
  int64_t N = 0, E = 0, M = 1;
  bool has_seals = false, has_sums = false, has_rows = false, every_token = false,
       all_staged = false;
};

PlanArrays plan_arrays(const PlanRows& r, const PlanFlags& f) {
  PlanArrays a;
  const int64_t R = r.R, G = r.G;
  std::vector<int64_t> count(R), entry_start(R + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    count[i] = r.done[i] - r.opened[i];  // groups the row seals
    entry_start[i + 1] = entry_start[i] + count[i];
  }
  a.E = entry_start[R];
  // the step's tokens: row, group, offset in it, sealed now, seal entry
  std::vector<int64_t> row, g, offset, entry;
  std::vector<char> sealing, kernel(R);
  bool any_first = false, any_sealing = false, every = R > 0;
  for (int64_t i = 0; i < R; ++i) {
    kernel[i] = r.fresh[i] == 1 || (f.fused && !(f.exact && r.past[i] == 0));
    every = every && kernel[i];
    for (int64_t n = 0; n < r.fresh[i]; ++n) {
      const int64_t position = r.past[i] + n, gi = position / G;
      row.push_back(i);
      g.push_back(gi);
      offset.push_back(position % G);
      sealing.push_back(gi < r.done[i]);
      entry.push_back(entry_start[i] + gi - r.opened[i]);
      any_first = any_first || gi == 0;
      any_sealing = any_sealing || gi < r.done[i];
    }
  }
  const int64_t N = int64_t(row.size());
  a.N = N;
  a.every_token = every;
  a.all_staged = R > 0 && !any_sealing;
  // writes
  for (int64_t t = 0; t < N; ++t) {
    const int64_t staging = r.slot_after[row[t]] * G + offset[t];
    if (f.by_op) {
      a.stage_at.push_back(sealing[t] ? -1 : staging);
    } else if (!sealing[t]) {
      a.staged.push_back(t);
      a.staged_at.push_back(staging);
    }
    if (f.token_values) a.value_at.push_back(r.page(row[t], g[t]) * G + offset[t]);
  }
  // seals: each row's groups [opened, done), then its staged tokens carried into the first
  a.has_seals = a.E > 0;
  if (a.has_seals) {
    for (int64_t i = 0; i < R; ++i)
      for (int64_t k = 0; k < count[i]; ++k) {
        const int64_t gi = r.opened[i] + k;
        a.pages.push_back(r.page(i, gi));
        a.first_pages.push_back(r.page(i, 0));
        if (gi == 0) a.firsts.push_back(entry_start[i] + k);
      }
    for (int64_t t = 0; t < N; ++t)
      if (sealing[t]) {
        a.tokens.push_back(t);
        a.tokens_at.push_back(entry[t] * G + offset[t]);
      }
    for (int64_t i = 0; i < R; ++i)
      if (r.staged[i] > 0 && count[i] > 0)
        for (int64_t o = 0; o < r.staged[i]; ++o) {
          a.carried.push_back(r.slot_before[i] * G + o);
          a.carried_at.push_back(entry_start[i] * G + o);
        }
  }
  // query sums of first groups
  a.has_sums = f.sums && any_first;
  if (a.has_sums) {
    for (int64_t i = 0; i < R; ++i) {
      const bool continuing = count[i] == 0 && r.staged[i] > 0;
      if (r.lengths[i] % G > 0 && !continuing) a.restart.push_back(r.slot_after[i]);
      for (int64_t k = 0; k < count[i]; ++k)
        if (r.opened[i] + k == 0) a.sum_carried.push_back(r.staged[i] > 0 ? r.slot_before[i] : -1);
    }
    for (int64_t t = 0; t < N; ++t)
      if (g[t] == 0) {
        a.sum_tokens.push_back(t);
        a.into.push_back(sealing[t] ? entry[t] : r.slot_after[row[t]]);
        a.sealed.push_back(sealing[t]);
      }
  }
  // kernel rows: each token of a kernel row, over the pages before its own group
  for (int64_t t = 0; t < N; ++t)
    if (kernel[row[t]]) {
      a.row_tokens.push_back(t);
      a.M = std::max(a.M, g[t]);
    }
  a.has_rows = !a.row_tokens.empty();
  for (const int64_t t : a.row_tokens) {
    const int64_t i = row[t], gi = g[t], o = offset[t];
    const int64_t staged = gi == r.opened[i] ? r.staged[i] : 0;  // in the staging
    a.floats.insert(a.floats.end(), {staged > 0 ? r.slot_before[i] * G : 0, staged,
                                     t - (o - staged), o - staged + 1});
    for (int64_t j = 0; j < a.M; ++j) {
      a.table.push_back(j < gi ? r.page(i, j) : 0);
      a.held.push_back(j < gi ? G : 0);
    }
    a.counts.push_back(gi);
    if (f.token_values) a.own_pages.push_back(r.page(i, gi));
    if (f.selects) a.row_firsts.push_back(r.page(i, 0));
  }
  return a;
}

}  // namespace
