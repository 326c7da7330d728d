// Where the op's time goes, by part (KVMIX_OP_TIMING=1 when the library loads; off, each part
// costs one branch): time-stamp counter ticks summed over the threads, read and reset by
// kvmix::op_timings() as microseconds.
#pragma once

#include <chrono>
#include <cstdlib>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace {

// The time-stamp counter where the CPU has one, else the steady clock's nanoseconds.
inline uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

// setup: validation and the rows' problems, before the threads start; start: a task's query
// and plane weights; keys_float / keys_packed: scores of float segments and packed blocks;
// softmax; values_float / values_packed; merge: a head's rows written to the output; stage:
// the step's tokens into the staging after attending; seal: kvmix::step's sealed groups
// gathered and encoded into their pages (before it attends); wall: the whole attending call,
// on the caller's thread; calls: how many.
enum Part { SETUP, START, KEYS_FLOAT, KEYS_PACKED, SOFTMAX, VALUES_FLOAT, VALUES_PACKED, MERGE,
            STAGE, SEAL, WALL, PARTS };
constexpr const char* PART_NAMES[PARTS] = {"setup", "start", "keys_float", "keys_packed",
                                           "softmax", "values_float", "values_packed", "merge",
                                           "stage", "seal", "wall"};

const bool TIMING = [] {
  const char* on = std::getenv("KVMIX_OP_TIMING");
  return on && *on && std::string(on) != "0";
}();
std::atomic<uint64_t> SPENT[PARTS] = {};
std::atomic<uint64_t> CALLS{0};

// Ticks of the time-stamp counter between construction and `lap` (or destruction), added to a
// part when timing is on.
class Stopwatch {
 public:
  Stopwatch() : last_(TIMING ? ticks() : 0) {}
  void lap(Part part) {
    if (!TIMING) return;
    const uint64_t now = ticks();
    if (now > last_)  // a thread moved to a core whose counter is behind: not counted
      SPENT[part].fetch_add(now - last_, std::memory_order_relaxed);
    last_ = now;
  }

 private:
  uint64_t last_;
};

// Ticks a microsecond, measured once against the steady clock (10 ms).
double ticks_per_us() {
  static const double rate = [] {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t c0 = ticks();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(10)) {}
    const double us = std::chrono::duration<double, std::micro>(
        std::chrono::steady_clock::now() - t0).count();
    return double(ticks() - c0) / us;
  }();
  return rate;
}

// kvmix::op_timings: [calls (of decode and decode_batch), then each part's µs summed over
// threads] since the last read (zeros when timing is off), and the counters reset.
at::Tensor op_timings() {
  at::Tensor out = at::zeros({PARTS + 1}, at::kDouble);
  if (!TIMING) return out;
  double* o = out.data_ptr<double>();
  o[0] = double(CALLS.exchange(0));
  for (int i = 0; i < PARTS; ++i) o[i + 1] = double(SPENT[i].exchange(0)) / ticks_per_us();
  return out;
}

std::string op_parts() {
  std::string names = "calls";
  for (const char* name : PART_NAMES) names += std::string(",") + name;
  return names;
}

}  // namespace
