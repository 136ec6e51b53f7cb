// fdp's shared-memory sum across the processes of one host (CPU only).
//
// Each process maps one region per peer (set up from Python, fdp/collectives/_shm.py)
// laid out as: a 64-byte header (the epoch this process has reached, its call's size
// and dtype, a failed flag, its bucket's split into buffers), then for each
// call parity (0, 1) an input slot of `capacity` bytes and a result slot of
// `capacity / world` (rounded up) bytes. A call sums one bucket: its gradients, passed
// as separate buffers (no packing into a flat buffer) and read as one flat buffer of n
// elements in argument order, each element times `scale` (DDP's 1 / world size). With
// rank r of P and chunk c = n / P:
//   1. copy every chunk of x * scale but r's own into this process's input slot;
//   2. barrier: every process has published its input;
//   3. sum chunk r over ranks 0..P-1 in that order (r's own from x * scale), into the
//      output and into this process's result slot;
//   4. barrier: every chunk is summed;
//   5. copy each peer's chunk from its result slot into the output.
// Slots alternate by call parity, so a slot is rewritten only after every process
// has passed the next call's first barrier, i.e. has finished reading it: two
// barriers per call. The sum of every element is formed once, by its owner, in rank
// order, so every process gets the same bits; x * scale rounds as XLA's division by
// the world size does (XLA turns it into a multiplication by the reciprocal), so with
// two processes the bits are those of XLA's gloo all-reduce of the same (unpacked)
// gradients. A peer that does not arrive within the timeout turns into an error naming
// it, and so does a peer whose bucket has another size, dtype or split into buffers.
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Group {
  int rank = -1;
  int world = 0;
  int64_t capacity = 0;  // bytes of one input slot
  int64_t chunk_capacity = 0;
  std::vector<char*> bases;
  uint64_t calls = 0;
};

Group g_group;
std::mutex g_mutex;  // one call at a time per process (calls are also chained in the program)
constexpr int64_t kHeader = 64;

std::atomic<uint64_t>* epoch_of(int rank) {
  return reinterpret_cast<std::atomic<uint64_t>*>(g_group.bases[rank]);
}

// The call a rank is in: its byte size * 256 + XLA's element type (written before the
// first barrier), so that ranks in different calls never sum each other's data.
std::atomic<int64_t>* call_of(int rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(g_group.bases[rank] + 8);
}

// Nonzero once a rank's call failed: the group is unusable from then on (a late peer
// could otherwise pass a barrier and read a stale slot).
std::atomic<uint64_t>* failed_of(int rank) {
  return reinterpret_cast<std::atomic<uint64_t>*>(g_group.bases[rank] + 16);
}

// The split of a rank's current bucket into buffers (a hash of their sizes), written
// with call_of: ranks whose buckets have the same bytes but other buffers must not sum.
std::atomic<uint64_t>* split_of(int rank) {
  return reinterpret_cast<std::atomic<uint64_t>*>(g_group.bases[rank] + 24);
}

char* input_slot(int rank, int parity) {
  return g_group.bases[rank] + kHeader + parity * (g_group.capacity + g_group.chunk_capacity);
}

char* result_slot(int rank, int parity) { return input_slot(rank, parity) + g_group.capacity; }

// Publishes `epoch` and waits until every peer has published it too. Returns the
// ranks still missing at the timeout (empty on success).
std::vector<int> barrier(uint64_t epoch, double timeout_s) {
  epoch_of(g_group.rank)->store(epoch, std::memory_order_release);
  auto start = std::chrono::steady_clock::now();
  uint64_t spins = 0;
  for (;;) {
    bool all = true;
    for (int q = 0; q < g_group.world && all; ++q) {
      all = epoch_of(q)->load(std::memory_order_acquire) >= epoch;
    }
    if (all) return {};
    for (int q = 0; q < g_group.world; ++q) {
      if (failed_of(q)->load(std::memory_order_acquire) != 0) return {-1 - q};
    }
    ++spins;
    if (spins < 4096) {
      continue;
    } else if (spins < 8192) {
      sched_yield();
    } else {
      timespec ts{0, 20000};
      nanosleep(&ts, nullptr);
    }
    if ((spins & 255) == 0) {
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s) {
        std::vector<int> missing;
        for (int q = 0; q < g_group.world; ++q) {
          if (epoch_of(q)->load(std::memory_order_acquire) < epoch) missing.push_back(q);
        }
        return missing;
      }
    }
  }
}

// Marks this process's group failed (seen by every peer's next barrier) and returns `e`.
ffi::Error fail(ffi::Error e) {
  failed_of(g_group.rank)->store(1, std::memory_order_release);
  return e;
}

ffi::Error missing_error(const std::vector<int>& missing, uint64_t call, double timeout_s) {
  if (missing.size() == 1 && missing[0] < 0) {
    return fail(ffi::Error(ffi::ErrorCode::kAborted,
                           "fdp shared-memory all-reduce: rank " + std::to_string(-1 - missing[0]) +
                               " failed an earlier sum, so this group is unusable: restart "
                               "the processes"));
  }
  char waited[32];
  std::snprintf(waited, sizeof waited, "%g", timeout_s);
  std::string ranks;
  for (int q : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
  return fail(ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    "fdp shared-memory all-reduce: rank " + std::to_string(g_group.rank) +
                        " waited " + waited + " s at call " +
                        std::to_string(call) + " for rank(s) " + ranks +
                        ", which did not arrive (a peer that exited, hangs, or runs a "
                        "different program)"));
}

// One bucket as seen by a call: its buffers in order, as one flat buffer.
template <typename T>
struct Bucket {
  std::vector<const T*> in;
  std::vector<T*> out;
  std::vector<int64_t> begin;  // flat offset of each buffer; begin.back() == n
  T scale;

  // FNV-1a over the buffers' sizes: equal on every rank that sums the same split.
  uint64_t split() const {
    uint64_t h = 1469598103934665603ull;
    for (size_t b = 1; b < begin.size(); ++b) {
      h = (h ^ static_cast<uint64_t>(begin[b] - begin[b - 1])) * 1099511628211ull;
    }
    return h;
  }

  // Calls f(in, out, flat offset, count) for each piece of flat elements [lo, hi).
  template <typename F>
  void pieces(int64_t lo, int64_t hi, F f) const {
    for (size_t b = 0; b < in.size(); ++b) {
      int64_t a = std::max(lo, begin[b]), e = std::min(hi, begin[b + 1]);
      if (e > a) f(in[b] + (a - begin[b]), out[b] + (a - begin[b]), a, e - a);
    }
  }
};

// Copies x * s into `to` (memcpy when s is 1).
template <typename T>
void scaled_copy(const T* x, T s, int64_t n, T* to) {
  if (s == T(1)) {
    std::memcpy(to, x, n * sizeof(T));
    return;
  }
  for (int64_t i = 0; i < n; ++i) to[i] = x[i] * s;
}

// Sums flat elements [lo, hi) over ranks 0..P-1 in that order (this rank's own
// from its buffers, times the scale; the peers' from their input slots, already
// scaled) into `result` (read by the peers) and the output; the last pass writes both.
template <typename T>
void sum_chunk(const Bucket<T>& bucket, int parity, int64_t lo, int64_t hi, T* result) {
  const int rank = g_group.rank, world = g_group.world;
  bucket.pieces(lo, hi, [&](const T* x, T* o, int64_t at, int64_t n) {
    // Rank q's values and the factor that scales them (the peers' are scaled).
    auto src = [&](int q) {
      return q == rank ? x : reinterpret_cast<const T*>(input_slot(q, parity)) + at;
    };
    auto mul = [&](int q) { return q == rank ? bucket.scale : T(1); };
    T* r = result + (at - lo);
    const T* a = src(0);
    const T* b = src(1);
    const T ma = mul(0), mb = mul(1);
    if (world == 2) {
      for (int64_t i = 0; i < n; ++i) o[i] = r[i] = a[i] * ma + b[i] * mb;
      return;
    }
    for (int64_t i = 0; i < n; ++i) r[i] = a[i] * ma + b[i] * mb;
    for (int q = 2; q < world - 1; ++q) {
      const T* c = src(q);
      const T mc = mul(q);
      for (int64_t i = 0; i < n; ++i) r[i] += c[i] * mc;
    }
    const T* last = src(world - 1);
    const T ml = mul(world - 1);
    for (int64_t i = 0; i < n; ++i) o[i] = r[i] = r[i] + last[i] * ml;
  });
}

template <typename T>
ffi::Error run(const Bucket<T>& bucket, int64_t dtype, double timeout_s) {
  if (g_group.world == 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "fdp shared-memory all-reduce: no group in this process (the step "
                      "sets one up when it is traced)");
  }
  const int64_t n = bucket.begin.back();
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  if (bytes > g_group.capacity) {
    return fail(ffi::Error(ffi::ErrorCode::kOutOfRange,
                      "fdp shared-memory all-reduce: a buffer of " + std::to_string(bytes) +
                          " bytes exceeds the group's capacity of " +
                          std::to_string(g_group.capacity) + " bytes"));
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failed_of(g_group.rank)->load(std::memory_order_relaxed) != 0) {
    return ffi::Error(ffi::ErrorCode::kAborted,
                      "fdp shared-memory all-reduce: an earlier sum of this process failed, "
                      "so this group is unusable: restart the processes");
  }
  const uint64_t call = g_group.calls++;
  const int parity = static_cast<int>(call & 1);
  const int world = g_group.world, rank = g_group.rank;
  const int64_t chunk = (n + world - 1) / world;
  T* slot = reinterpret_cast<T*>(input_slot(rank, parity));
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    bucket.pieces(q * chunk, std::min(n, q * chunk + chunk),
                  [&](const T* x, T*, int64_t at, int64_t m) {
                    scaled_copy(x, bucket.scale, m, slot + at);
                  });
  }
  const int64_t mine_call = bytes * 256 + dtype;
  const uint64_t mine_split = bucket.split();
  call_of(rank)->store(mine_call, std::memory_order_relaxed);
  split_of(rank)->store(mine_split, std::memory_order_relaxed);
  auto missing = barrier(2 * call + 1, timeout_s);
  if (!missing.empty()) return missing_error(missing, call, timeout_s);
  for (int q = 0; q < world; ++q) {
    int64_t theirs = call_of(q)->load(std::memory_order_relaxed);
    if (theirs != mine_call) {
      return fail(ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          "fdp shared-memory all-reduce: at call " + std::to_string(call) + " rank " +
              std::to_string(rank) + " sums " + std::to_string(bytes) + " bytes of type " +
              std::to_string(dtype) + " but rank " + std::to_string(q) + " sums " +
              std::to_string(theirs / 256) + " bytes of type " + std::to_string(theirs % 256) +
              " (the processes run different programs or buckets)"));
    }
    if (split_of(q)->load(std::memory_order_relaxed) != mine_split) {
      return fail(ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          "fdp shared-memory all-reduce: at call " + std::to_string(call) + " rank " +
              std::to_string(rank) + " and rank " + std::to_string(q) + " sum buckets of " +
              std::to_string(bytes) + " bytes split into different buffers (the processes "
              "run different programs or buckets)"));
    }
  }
  int64_t lo = rank * chunk, hi = std::min(n, lo + chunk);
  if (hi > lo) sum_chunk<T>(bucket, parity, lo, hi, reinterpret_cast<T*>(result_slot(rank, parity)));
  missing = barrier(2 * call + 2, timeout_s);
  if (!missing.empty()) return missing_error(missing, call, timeout_s);
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    const int64_t a = q * chunk;
    const T* theirs = reinterpret_cast<const T*>(result_slot(q, parity));
    bucket.pieces(a, std::min(n, a + chunk), [&](const T*, T* o, int64_t at, int64_t m) {
      std::memcpy(o, theirs + (at - a), m * sizeof(T));
    });
  }
  return ffi::Error::Success();
}

// An argument error: marks the group failed (when there is one), so that peers stop
// at their next barrier with an error naming this rank rather than wait out the timeout.
ffi::Error bad_call(const std::string& what) {
  ffi::Error e(ffi::ErrorCode::kInvalidArgument, "fdp shared-memory all-reduce: " + what);
  return g_group.world == 0 ? e : fail(e);
}

template <typename T>
ffi::Error run_typed(ffi::RemainingArgs xs, ffi::RemainingRets outs, ffi::DataType type,
                     double scale, double timeout_s) {
  Bucket<T> bucket;
  bucket.scale = static_cast<T>(scale);
  bucket.begin.push_back(0);
  for (size_t b = 0; b < xs.size(); ++b) {
    auto x = xs.get<ffi::AnyBuffer>(b);
    auto out = outs.get<ffi::AnyBuffer>(b);
    if (!x.has_value() || !out.has_value()) {
      return bad_call("buffer " + std::to_string(b) + " could not be read");
    }
    if (x->element_type() != type || (*out)->element_type() != type ||
        (*out)->element_count() != x->element_count()) {
      return bad_call("the buffers of one bucket must share one dtype, each output the "
                      "size of its input");
    }
    bucket.in.push_back(reinterpret_cast<const T*>(x->untyped_data()));
    bucket.out.push_back(reinterpret_cast<T*>((*out)->untyped_data()));
    bucket.begin.push_back(bucket.begin.back() + static_cast<int64_t>(x->element_count()));
  }
  return run<T>(bucket, static_cast<int64_t>(type), timeout_s);
}

// `after` is not read: the program passes the previous call's output there, so
// XLA runs the calls in program order on every process. The bucket's buffers follow.
ffi::Error ShmSumImpl(ffi::AnyBuffer after, ffi::RemainingArgs xs, ffi::RemainingRets outs,
                      double scale, double timeout_s) {
  (void)after;
  if (xs.size() == 0 || xs.size() != outs.size()) {
    return bad_call("expected one output per input buffer");
  }
  auto first = xs.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return bad_call("buffer 0 could not be read");
  switch (first->element_type()) {
    case ffi::DataType::F32:
      return run_typed<float>(xs, outs, ffi::DataType::F32, scale, timeout_s);
    case ffi::DataType::F64:
      return run_typed<double>(xs, outs, ffi::DataType::F64, scale, timeout_s);
    default:
      return bad_call("sums float32 and float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FdpShmSum, ShmSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<double>("scale")
                                  .Attr<double>("timeout_s"));

extern "C" {

// Installs a group: `bases[q]` is rank q's mapped region, the same size for every
// rank. Called by every process at the same point (a collective), between calls.
void fdp_shm_install(int rank, int world, char** bases, int64_t capacity,
                     int64_t chunk_capacity) {
  g_group.rank = rank;
  g_group.world = world;
  g_group.capacity = capacity;
  g_group.chunk_capacity = chunk_capacity;
  g_group.bases.assign(bases, bases + world);
  g_group.calls = 0;
}

int64_t fdp_shm_header_bytes() { return kHeader; }

}  // extern "C"
