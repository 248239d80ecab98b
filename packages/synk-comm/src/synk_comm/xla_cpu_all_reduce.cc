// synk_comm.xla_cpu's all-reduce: an XLA FFI handler (a custom call of XLA:CPU) that all-reduces
// one array over the ranks of a group through a shared-memory segment, so that a rank's whole
// step -- compute, this all-reduce, more compute -- is ONE XLA program.
//
// The segment (synk_comm.xla_cpu.Segment lays it out; MAX_RANKS ranks at most):
//   page 0   posted[r]: the last call rank r has copied in (uint64, a cache line per rank)
//   page 1   done[r]:   the last call rank r has finished reading (uint64, a cache line per rank)
//   page 2   a cache line per rank: its next weight (double) and process id (int64), written by
//            the rank before its program runs (the weight of its value: 0 contributes the op's
//            identity, avg weighs by it; peers check that the process is alive while they wait),
//            then the weight of its last two calls (doubles, by parity), which the handler copies
//            from the next weight before it posts a call: peers read those, never the next weight.
//            A next weight of NaN: the rank is not in a call of the group; its all-reduce is then
//            the identity (a copy), with no exchange
//   page 3+  two buffers of `capacity` bytes per rank, used by turns (a call's parity)
// Call g of rank r (g = posted[r] + 1; an array larger than a buffer takes one call per chunk):
// wait until every rank is done with call g - 2 (whose buffers g reuses), copy the chunk in, post
// g, wait until every rank has posted g, reduce every active rank's chunk in rank order into the
// output, mark g done.  Waits spin, then yield the core; they give up with an error when the
// group's abort word (set when any rank fails a command) is set or a peer's process is gone.
#include <errno.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kLine = 64;
constexpr int64_t kSpins = 4000;
enum Op : int64_t { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

struct Segment {
  char* base;
  int64_t rank, size, capacity;
  const std::atomic<int64_t>* abort;

  std::atomic<uint64_t>* counter(int64_t page, int64_t r) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + page * kPage + r * kLine);
  }
  double next_weight(int64_t r) const {
    return *reinterpret_cast<const double*>(base + 2 * kPage + r * kLine);
  }
  int64_t pid(int64_t r) const { return *reinterpret_cast<const int64_t*>(base + 2 * kPage + r * kLine + 8); }
  double* weight(uint64_t call, int64_t r) const {
    return reinterpret_cast<double*>(base + 2 * kPage + r * kLine + 16 + 8 * static_cast<int64_t>(call & 1));
  }
  char* buffer(uint64_t call, int64_t r) const {
    return base + 3 * kPage + (static_cast<int64_t>(call & 1) * size + r) * capacity;
  }
};

double Seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Wait until counter `page` of every rank reaches `target`; an error message, or empty.
std::string WaitForAll(const Segment& s, int64_t page, uint64_t target) {
  double next_check = 0.0;
  for (int64_t r = 0; r < s.size; ++r) {
    std::atomic<uint64_t>* c = s.counter(page, r);
    for (int64_t i = 0; c->load(std::memory_order_acquire) < target; ++i) {
      if (i < kSpins) {
        _mm_pause();
        continue;
      }
      sched_yield();
      double now = Seconds();
      if (now < next_check) continue;
      next_check = now + 0.01;
      if (s.abort != nullptr && s.abort->load(std::memory_order_relaxed) != 0) {
        return "another rank failed during this command: the all-reduce stopped";
      }
      if (kill(static_cast<pid_t>(s.pid(r)), 0) != 0 && errno == ESRCH) {
        return "rank " + std::to_string(r) + " (process " + std::to_string(s.pid(r)) + ") is gone";
      }
    }
  }
  return "";
}

template <typename T>
T Identity(int64_t op) {
  switch (op) {
    case kProd: return T(1);
    case kMax: return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity()
                                                           : std::numeric_limits<T>::lowest();
    case kMin: return std::numeric_limits<T>::has_infinity ? std::numeric_limits<T>::infinity()
                                                           : std::numeric_limits<T>::max();
    default: return T(0);
  }
}

// out[0:n] := op over the active ranks' chunks of call g, in rank order.
template <typename T>
void Reduce(const Segment& s, uint64_t g, int64_t op, T* out, size_t n) {
  bool first = true;
  double total = 0.0;
  for (int64_t r = 0; r < s.size; ++r) {
    double w = *s.weight(g, r);
    if (w == 0.0) continue;
    const T* in = reinterpret_cast<const T*>(s.buffer(g, r));
    if (op == kAvg) {
      total += w;
      T tw = static_cast<T>(w);
      if (first) for (size_t i = 0; i < n; ++i) out[i] = in[i] * tw;
      else for (size_t i = 0; i < n; ++i) out[i] += in[i] * tw;
    } else if (first) {
      std::memcpy(out, in, n * sizeof(T));
    } else {
      switch (op) {
        case kSum: for (size_t i = 0; i < n; ++i) out[i] += in[i]; break;
        case kProd: for (size_t i = 0; i < n; ++i) out[i] *= in[i]; break;
        case kMax: for (size_t i = 0; i < n; ++i) out[i] = std::max(out[i], in[i]); break;
        case kMin: for (size_t i = 0; i < n; ++i) out[i] = std::min(out[i], in[i]); break;
      }
    }
    first = false;
  }
  if (op == kAvg) {
    T inv = total > 0.0 ? static_cast<T>(1.0 / total) : std::numeric_limits<T>::quiet_NaN();
    if (first) std::fill(out, out + n, std::numeric_limits<T>::quiet_NaN());
    else for (size_t i = 0; i < n; ++i) out[i] *= inv;
  } else if (first) {
    std::fill(out, out + n, Identity<T>(op));
  }
}

template <typename T>
ffi::Error Run(const Segment& s, int64_t op, const T* src, T* dst, size_t n) {
  size_t per_call = static_cast<size_t>(s.capacity) / sizeof(T);
  for (size_t lo = 0; lo < n || (n == 0 && lo == 0); lo += per_call) {
    size_t m = std::min(per_call, n - lo);
    uint64_t g = s.counter(0, s.rank)->load(std::memory_order_relaxed) + 1;
    std::string err = g > 2 ? WaitForAll(s, 1, g - 2) : "";
    if (err.empty()) {
      *s.weight(g, s.rank) = s.next_weight(s.rank);
      std::memcpy(s.buffer(g, s.rank), src + lo, m * sizeof(T));
      s.counter(0, s.rank)->store(g, std::memory_order_release);
      err = WaitForAll(s, 0, g);
    }
    if (!err.empty()) return ffi::Error(ffi::ErrorCode::kAborted, "synk_comm all-reduce: " + err);
    Reduce<T>(s, g, op, dst + lo, m);
    s.counter(1, s.rank)->store(g, std::memory_order_release);
    if (n == 0) break;
  }
  return ffi::Error::Success();
}

ffi::Error AllReduce(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t segment, int64_t abort,
                     int64_t rank, int64_t size, int64_t capacity, int64_t op) {
  Segment s{reinterpret_cast<char*>(segment), rank, size, capacity,
            reinterpret_cast<const std::atomic<int64_t>*>(abort)};
  size_t n = x.element_count();
  if (std::isnan(s.next_weight(rank))) {  // not in a call of the group (a plain call of the program): one rank
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
    return ffi::Error::Success();
  }
  switch (x.element_type()) {
    case ffi::DataType::F32: return Run<float>(s, op, x.typed_data<float>(), y->typed_data<float>(), n);
    case ffi::DataType::F64: return Run<double>(s, op, x.typed_data<double>(), y->typed_data<double>(), n);
    case ffi::DataType::S32: return Run<int32_t>(s, op, x.typed_data<int32_t>(), y->typed_data<int32_t>(), n);
    case ffi::DataType::S64: return Run<int64_t>(s, op, x.typed_data<int64_t>(), y->typed_data<int64_t>(), n);
    default: return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                               "synk_comm all-reduce: float32, float64, int32 and int64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SynkCommAllReduce, AllReduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("segment")
                                  .Attr<int64_t>("abort")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("op"));
