// probe_coupled_ranks.py's all-reduce: a sum of float32 vectors over shared memory, as an XLA FFI
// handler (a custom call of XLA:CPU), so that a rank's whole step -- gradient, this all-reduce,
// update -- is ONE XLA program.  A probe of a design (issue 18), not a part of Synkhronos.
//
// The shared segment: a page of "posted" counters and a page of "read" counters (one cache line per
// rank), then two buffers per rank used by turns (the call's generation's parity).  Call g of a rank:
// wait until every rank has read call g-2 (whose buffers g reuses), copy the input into its buffer,
// post g, wait until every rank has posted g, sum the buffers in rank order, mark g read.  A wait
// spins `spin` times, then yields its core; after 30 s it fails the program (a peer gone).
#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPage = 4096;
uint64_t generation = 0;  // calls made by this process (every rank makes the same calls)

std::atomic<uint64_t>* Counter(char* base, int64_t page, int64_t rank) {
  return reinterpret_cast<std::atomic<uint64_t>*>(base + page * kPage + rank * 64);
}

bool WaitForAll(char* base, int64_t page, int64_t size, uint64_t target, int64_t spin) {
  timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int64_t r = 0; r < size; ++r) {
    std::atomic<uint64_t>* counter = Counter(base, page, r);
    for (int64_t i = 0; counter->load(std::memory_order_acquire) < target; ++i) {
      if (i < spin) {
        _mm_pause();
        continue;
      }
      sched_yield();
      if ((i & 1023) == 0) {
        timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec > 30) return false;
      }
    }
  }
  return true;
}

ffi::Error AllReduceSum(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t base_address,
                        int64_t rank, int64_t size, int64_t capacity, int64_t spin) {
  char* base = reinterpret_cast<char*>(base_address);
  size_t n = x.element_count();
  if (static_cast<int64_t>(n * sizeof(float)) > capacity) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "the vector is larger than a rank's buffer");
  }
  uint64_t g = ++generation;
  auto buffer = [&](int64_t r) {
    return reinterpret_cast<float*>(base + 2 * kPage + ((g & 1) * size + r) * capacity);
  };
  if (g > 2 && !WaitForAll(base, 1, size, g - 2, spin)) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, "a peer did not read its last call's buffers in 30 s");
  }
  std::memcpy(buffer(rank), x.typed_data(), n * sizeof(float));
  Counter(base, 0, rank)->store(g, std::memory_order_release);
  if (!WaitForAll(base, 0, size, g, spin)) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, "a peer did not post its vector in 30 s");
  }
  float* out = y->typed_data();
  std::memcpy(out, buffer(0), n * sizeof(float));
  for (int64_t r = 1; r < size; ++r) {
    const float* in = buffer(r);
    for (size_t i = 0; i < n; ++i) out[i] += in[i];
  }
  Counter(base, 1, rank)->store(g, std::memory_order_release);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SynkProbeAllReduceSum, AllReduceSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("base")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("spin"));
