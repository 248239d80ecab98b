// synk_comm.xla_cpu's all-reduce: an XLA FFI handler (a custom call of XLA:CPU) that all-reduces
// one array over the ranks of a group through a shared-memory segment, so that a rank's whole
// step -- compute, this all-reduce, more compute -- is ONE XLA program.
//
// The segment (synk_comm.xla_cpu.Segment lays it out; MAX_RANKS ranks at most):
//   page 0   posted[r]:  the last call rank r has copied in (uint64, a cache line per rank)
//   page 1   done[r]:    the last call rank r has finished reading (uint64, a cache line per rank)
//   page 2   reduced[r]: the last call whose slice rank r has reduced (split calls only, below)
//   page 3   a cache line per rank: its next weight (double) and process id (int64), written by
//            the rank before its program runs (the weight of its value: 0 contributes the op's
//            identity, avg weighs by it; peers check that the process is alive while they wait),
//            then the weight of its last two calls (doubles, by parity), which the handler copies
//            from the next weight before it posts a call: peers read those, never the next weight.
//            A next weight of NaN: the rank is not in a call of the group; its all-reduce is then
//            the identity (a copy), with no exchange
//   page 4+  two buffers of `capacity` bytes per rank, used by turns (a call's parity), then two
//            result buffers of `capacity` bytes (split calls)
// Call g of rank r (g = posted[r] + 1; an array larger than a buffer takes one call per chunk):
// wait until every rank is done with call g - 2 (whose buffers g reuses), copy the chunk in, post
// g, wait until every rank has posted g, then reduce the active ranks' chunks in rank order:
//   - direct (small chunks, or 2 ranks): every rank reduces the whole chunk into its output;
//   - split (a chunk of kSplitBytes or more, 3 ranks or more): rank r reduces its 1/size slice of
//     the chunk into the result buffer, posts reduced g, waits until every rank has, and copies
//     the whole result into its output.  A rank then reads each value once and the result once,
//     not every rank's chunk: (size + 1) chunks of memory traffic become about 2.
// and mark g done.  Waits spin, then yield the core; they give up with an error when the group's
// abort word (set when any rank fails a command) is set or a peer's process is gone.
//
// A rank's copies and reductions of a chunk of kTeamBytes or more are shared by a team of threads,
// one per core of the process's affinity (the rank's cores: XLA's own threads are idle while the
// program waits in this call); the calling thread is member 0 and alone waits on the peers.
#include <errno.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kLine = 64;
constexpr int64_t kSpins = 4000;
constexpr int64_t kSplitBytes = 1 << 18;  // a chunk this large, over 3 ranks or more, is reduced split
constexpr int64_t kTeamBytes = 1 << 18;   // a chunk this large is copied and reduced by the team
constexpr int kMaxTeam = 16;
constexpr int64_t kIdleSpins = 400;  // a helper's spins after a job before it sleeps: the rank's
                                     // program goes on computing on these cores meanwhile
enum Op : int64_t { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };
enum Page : int64_t { kPosted = 0, kDone = 1, kReduced = 2, kWeights = 3, kBuffers = 4 };

struct Segment {
  char* base;
  int64_t rank, size, capacity;
  const std::atomic<int64_t>* abort;

  std::atomic<uint64_t>* counter(int64_t page, int64_t r) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + page * kPage + r * kLine);
  }
  double next_weight(int64_t r) const {
    return *reinterpret_cast<const double*>(base + kWeights * kPage + r * kLine);
  }
  int64_t pid(int64_t r) const {
    return *reinterpret_cast<const int64_t*>(base + kWeights * kPage + r * kLine + 8);
  }
  double* weight(uint64_t call, int64_t r) const {
    return reinterpret_cast<double*>(base + kWeights * kPage + r * kLine + 16 + 8 * static_cast<int64_t>(call & 1));
  }
  char* buffer(uint64_t call, int64_t r) const {
    return base + kBuffers * kPage + (static_cast<int64_t>(call & 1) * size + r) * capacity;
  }
  char* result(uint64_t call) const {
    return base + kBuffers * kPage + (2 * size + static_cast<int64_t>(call & 1)) * capacity;
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

// Part `i` of `parts` of the range [0, n): [lo, hi), bounds on whole cache lines of `T`.
template <typename T>
void Part(size_t n, int64_t i, int64_t parts, size_t* lo, size_t* hi) {
  constexpr size_t line = kLine / sizeof(T);
  auto bound = [&](int64_t k) { return k >= parts ? n : std::min(n, n * k / parts / line * line); };
  *lo = bound(i);
  *hi = bound(i + 1);
}

// The threads that share a rank's copies and reductions: one member per core of the calling
// thread's affinity, looked up at each call (at most kMaxTeam; the caller is member 0), none where
// it may run on every core of the machine (not pinned: a team per rank would oversubscribe);
// $SYNK_ALL_REDUCE_THREADS, when set, gives the number of members.  Helper threads are started
// when a call first needs them and live as long as the process (pinned with it: threads started
// later inherit the mask), spinning briefly after each job, then sleeping.
class Team {
 public:
  static Team& Get() {
    static Team* team = new Team();  // never destroyed: its helpers outlive static destruction
    return *team;
  }

  // How many members a call here has (1: the caller alone).
  static int64_t Members() {
    if (const char* given = getenv("SYNK_ALL_REDUCE_THREADS"); given != nullptr && atoi(given) > 0) {
      return std::min<int64_t>(atoi(given), kMaxTeam);
    }
    static const int64_t online = sysconf(_SC_NPROCESSORS_ONLN);  // glibc reads a file in /sys for it
    cpu_set_t set;
    int64_t cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    return cores < online ? std::min<int64_t>(cores, kMaxTeam) : 1;
  }

  // job(member) on members 0 .. members - 1, the caller being member 0; returns once all have.
  void Run(int64_t members, const std::function<void(int64_t)>& job) {
    uint64_t posted = generation_.load(std::memory_order_relaxed);  // the job before this one
    while (helpers_ < members - 1) {
      int64_t m = ++helpers_;
      std::thread([this, m, posted] { Serve(m, posted); }).detach();
    }
    job_ = &job;
    members_ = members;
    finished_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job(0);
    // every helper reports, those without a part too: none is still reading job_ or members_
    Await([&] { return finished_.load(std::memory_order_acquire) == helpers_; });
  }

  // Inside a job: wait until every member has come here.
  void Sync() {
    if (members_ == 1) return;
    uint64_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == members_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
    } else {
      Await([&] { return phase_.load(std::memory_order_acquire) != phase; });
    }
  }

 private:
  // A helper, started while job `seen` was the last one posted.
  void Serve(int64_t member, uint64_t seen) {
    for (;;) {
      for (int64_t i = 0; generation_.load(std::memory_order_acquire) == seen; ++i) {
        if (i < kIdleSpins) {
          _mm_pause();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (member < members_) (*job_)(member);
      finished_.fetch_add(1, std::memory_order_release);
    }
  }

  // Spin until done(), then yield the core between looks (a team larger than its cores).
  template <typename Done>
  static void Await(Done&& done) {
    for (int64_t i = 0; !done(); ++i) {
      if (i < kSpins) _mm_pause();
      else sched_yield();
    }
  }

  int64_t helpers_ = 0;  // changed by Run only (one at a time)
  int64_t members_ = 1;
  const std::function<void(int64_t)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0}, phase_{0};
  std::atomic<int64_t> finished_{0}, arrived_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
};

std::mutex team_busy;  // one team job at a time (two programs of one process all-reducing at once)

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

// out[0:n] := op over the active ranks' values [lo, lo + n) of call g, in rank order.
template <typename T>
void Reduce(const Segment& s, uint64_t g, int64_t op, size_t lo, T* out, size_t n) {
  bool first = true;
  double total = 0.0;
  for (int64_t r = 0; r < s.size; ++r) {
    double w = *s.weight(g, r);
    if (w == 0.0) continue;
    const T* in = reinterpret_cast<const T*>(s.buffer(g, r)) + lo;
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

// Member `member` of a team of `members` runs every call of the array (see the top of the file);
// member 0 alone waits on the peers and posts, with a team barrier on each side; the others copy
// and reduce their part of each range.  The first error stops every member.
template <typename T>
void RunMember(const Segment& s, int64_t op, const T* src, T* dst, size_t n, int64_t member, int64_t members,
               Team* team, std::string* err) {
  auto sync = [&] { if (team != nullptr) team->Sync(); };
  auto part = [&](size_t count, size_t* lo, size_t* hi) { Part<T>(count, member, members, lo, hi); };
  size_t per_call = static_cast<size_t>(s.capacity) / sizeof(T);
  for (size_t lo = 0; lo < n || (n == 0 && lo == 0); lo += per_call) {
    size_t m = std::min(per_call, n - lo), a, b;
    bool split = s.size >= 3 && static_cast<int64_t>(m * sizeof(T)) >= kSplitBytes;
    uint64_t g = s.counter(kPosted, s.rank)->load(std::memory_order_relaxed) + 1;
    if (member == 0) {
      *err = g > 2 ? WaitForAll(s, kDone, g - 2) : "";
      if (err->empty()) *s.weight(g, s.rank) = s.next_weight(s.rank);
    }
    sync();
    if (!err->empty()) return;
    part(m, &a, &b);
    std::memcpy(reinterpret_cast<T*>(s.buffer(g, s.rank)) + a, src + lo + a, (b - a) * sizeof(T));
    sync();
    if (member == 0) {
      s.counter(kPosted, s.rank)->store(g, std::memory_order_release);
      *err = WaitForAll(s, kPosted, g);
    }
    sync();
    if (!err->empty()) return;
    if (split) {
      size_t slo, shi;
      Part<T>(m, s.rank, s.size, &slo, &shi);
      part(shi - slo, &a, &b);
      T* result = reinterpret_cast<T*>(s.result(g));
      Reduce<T>(s, g, op, slo + a, result + slo + a, b - a);
      sync();
      if (member == 0) {
        s.counter(kReduced, s.rank)->store(g, std::memory_order_release);
        *err = WaitForAll(s, kReduced, g);
      }
      sync();
      if (!err->empty()) return;
      part(m, &a, &b);
      std::memcpy(dst + lo + a, result + a, (b - a) * sizeof(T));
    } else {
      part(m, &a, &b);
      Reduce<T>(s, g, op, a, dst + lo + a, b - a);
    }
    sync();
    if (member == 0) s.counter(kDone, s.rank)->store(g, std::memory_order_release);
    if (n == 0) break;
  }
}

template <typename T>
ffi::Error Run(const Segment& s, int64_t op, const T* src, T* dst, size_t n) {
  std::string err;
  size_t chunk = std::min(n, static_cast<size_t>(s.capacity) / sizeof(T));
  int64_t members = static_cast<int64_t>(chunk * sizeof(T)) >= kTeamBytes ? Team::Members() : 1;
  std::unique_lock<std::mutex> lock(team_busy, std::defer_lock);
  if (members > 1 && lock.try_lock()) {
    Team& team = Team::Get();
    team.Run(members, [&](int64_t member) { RunMember<T>(s, op, src, dst, n, member, members, &team, &err); });
  } else {
    RunMember<T>(s, op, src, dst, n, 0, 1, nullptr, &err);
  }
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kAborted, "synk_comm all-reduce: " + err);
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
