// comm.cpp: the world, communicators, the capture check and the watchdog (comm.h).
#include "common/comm.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <tuple>

#include "common/check.h"
#include "common/hash.h"

namespace replay::comm {

const char* dtype_name(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return "f32";
    case ncclFloat64:
      return "f64";
    case ncclFloat16:
      return "f16";
    case ncclBfloat16:
      return "bf16";
    case ncclInt32:
      return "i32";
    case ncclInt64:
      return "i64";
    default:
      return "other";
  }
}

namespace {

World g_world;
bool g_initialized = false;
bool g_we_initialized_mpi = false;

const char* op_name(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return "sum";
    case ncclAvg:
      return "avg";
    case ncclMax:
      return "max";
    case ncclMin:
      return "min";
    default:
      return "op";
  }
}

std::string host_name() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && *s != '\0') return std::strcmp(v, "SLURM_NTASKS") != 0 || std::atoi(s) > 1;
  }
  return false;
}

const World& init_world(int* argc, char*** argv) {
  if (g_initialized) return g_world;
  g_world.host = host_name();
  if (launched_by_mpi()) {
    int already = 0;
    REPLAY_MPI_CHECK(MPI_Initialized(&already));
    if (!already) {
      REPLAY_MPI_CHECK(MPI_Init(argc, argv));
      g_we_initialized_mpi = true;
    }
    g_world.mpi = true;
    REPLAY_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank));
    REPLAY_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &g_world.size));
    MPI_Comm local;
    REPLAY_MPI_CHECK(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local));
    REPLAY_MPI_CHECK(MPI_Comm_rank(local, &g_world.local_rank));
    REPLAY_MPI_CHECK(MPI_Comm_size(local, &g_world.local_size));
    REPLAY_MPI_CHECK(MPI_Comm_free(&local));
    if (g_world.size > 1) set_error_rank(g_world.rank);
  }
  g_initialized = true;
  return g_world;
}

const World& world() {
  return g_world;
}

void finalize_world() {
  if (g_we_initialized_mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
    g_we_initialized_mpi = false;
  }
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kAllToAll:
      return "all_to_all";
  }
  return "collective";
}

std::string CollectiveRecord::describe() const {
  std::ostringstream os;
  os << kind_name(kind) << "(" << dtype_name(dtype) << " x " << count;
  if (kind != Kind::kAllGather && kind != Kind::kAllToAll) os << ", " << op_name(op);
  os << ") on '" << comm << "'";
  return os.str();
}

void CollectiveLog::record(CollectiveRecord r, bool captured) {
  last_ = r.describe();
  if (captured) captured_.push_back(std::move(r));
}

uint64_t CollectiveLog::hash() const {
  Hasher h;
  for (const CollectiveRecord& r : captured_) {
    const std::string d = r.describe();
    h.update(d.data(), d.size());
    h.update("\n", 1);
  }
  return h.value();
}

// ---- Communicator ------------------------------------------------------------------------------

Communicator::Communicator(const World& w, std::string name, int color, CollectiveLog* log)
    : name_(std::move(name)), log_(log) {
  ncclUniqueId id{};
  if (w.size == 1) {
    REPLAY_NCCL_CHECK(ncclGetUniqueId(&id));
    REPLAY_NCCL_CHECK(ncclCommInitRank(&comm_, 1, id, 0));
    return;
  }
  MPI_Comm group;
  REPLAY_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, w.rank, &group));
  REPLAY_MPI_CHECK(MPI_Comm_rank(group, &rank_));
  REPLAY_MPI_CHECK(MPI_Comm_size(group, &size_));
  if (rank_ == 0) REPLAY_NCCL_CHECK(ncclGetUniqueId(&id));
  REPLAY_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, group));
  REPLAY_MPI_CHECK(MPI_Comm_free(&group));
  REPLAY_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
}

Communicator::~Communicator() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (comm_ != nullptr && !aborted_) ncclCommDestroy(comm_);
}

uint64_t collective_bytes(Kind k, size_t count, ncclDataType_t dtype, int ranks) {
  size_t element = 4;
  switch (dtype) {
    case ncclInt8:
    case ncclUint8:
      element = 1;
      break;
    case ncclFloat16:
    case ncclBfloat16:
      element = 2;
      break;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      element = 8;
      break;
    default:
      element = 4;
  }
  const uint64_t bytes = static_cast<uint64_t>(count) * element;
  return k == Kind::kAllReduce ? bytes : bytes * static_cast<uint64_t>(ranks);
}

bool Communicator::record(Kind k, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                          cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REPLAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  const bool captured = status == cudaStreamCaptureStatusActive;
  if (!captured) {
    eager_.calls += 1;
    eager_.bytes += collective_bytes(k, count, dtype, size_);
  }
  if (log_ != nullptr) log_->record({k, count, dtype, op, name_}, captured);
  return !captured;
}

void Communicator::begin_timing(int capacity, cudaStream_t main) {
  REPLAY_REQUIRE(capacity > 0, "Communicator::begin_timing: capacity must be positive");
  while (static_cast<int>(events_.size()) < 2 * capacity) {
    cudaEvent_t e = nullptr;
    REPLAY_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  timed_.clear();
  timing_ = true;
  timing_main_ = main;
}

int Communicator::time_start(bool eager, Kind k, uint64_t bytes, ncclDataType_t dtype,
                             cudaStream_t stream) {
  if (!timing_ || !eager || 2 * (timed_.size() + 1) > events_.size()) return -1;
  const int i = static_cast<int>(timed_.size());
  timed_.push_back({k, bytes, dtype, 0.0f, timing_main_ != nullptr && stream != timing_main_});
  REPLAY_CUDA_CHECK(cudaEventRecord(events_[2 * static_cast<size_t>(i)], stream));
  return i;
}

void Communicator::time_end(int index, cudaStream_t stream) {
  if (index >= 0)
    REPLAY_CUDA_CHECK(cudaEventRecord(events_[2 * static_cast<size_t>(index) + 1], stream));
}

std::vector<TimedCollective> Communicator::timed() const {
  std::vector<TimedCollective> out = timed_;
  for (size_t i = 0; i < out.size(); ++i) {
    REPLAY_CUDA_CHECK(cudaEventSynchronize(events_[2 * i + 1]));
    REPLAY_CUDA_CHECK(cudaEventElapsedTime(&out[i].ms, events_[2 * i], events_[2 * i + 1]));
  }
  return out;
}

double bus_bandwidth_factor(Kind k, int ranks) {
  const double n = ranks;
  return k == Kind::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

std::vector<CollectiveTiming> summarize_timings(const std::string& comm,
                                                const std::vector<TimedCollective>& calls,
                                                int ranks, int steps) {
  REPLAY_REQUIRE(steps > 0 && ranks > 0, "summarize_timings: steps and ranks must be positive");
  // (bytes, kind, dtype, overlapped)
  std::map<std::tuple<uint64_t, int, int, bool>, std::vector<float>> groups;
  for (const TimedCollective& c : calls)
    groups[{c.bytes, static_cast<int>(c.kind), static_cast<int>(c.dtype), c.overlapped}].push_back(
        c.ms);
  std::vector<CollectiveTiming> out;
  for (auto& [key, ms] : groups) {
    std::sort(ms.begin(), ms.end());
    const size_t n = ms.size();
    const double median = n % 2 ? ms[n / 2] : 0.5 * (double(ms[n / 2 - 1]) + double(ms[n / 2]));
    CollectiveTiming t;
    t.comm = comm;
    t.bytes = std::get<0>(key);
    t.kind = static_cast<Kind>(std::get<1>(key));
    t.dtype = static_cast<ncclDataType_t>(std::get<2>(key));
    t.overlapped = std::get<3>(key);
    t.calls_per_step = static_cast<double>(n) / steps;
    t.median_us = median * 1e3;
    t.busbw_gbps = median > 0 ? static_cast<double>(t.bytes) / (median * 1e-3) / 1e9 *
                                    bus_bandwidth_factor(t.kind, ranks)
                              : 0.0;
    out.push_back(t);
  }
  std::sort(out.begin(), out.end(),
            [](const CollectiveTiming& a, const CollectiveTiming& b) { return a.bytes > b.bytes; });
  return out;
}

void Communicator::all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                              ncclRedOp_t op, cudaStream_t stream) {
  const bool eager = record(Kind::kAllReduce, count, dtype, op, stream);
  const int t = time_start(eager, Kind::kAllReduce,
                           collective_bytes(Kind::kAllReduce, count, dtype, size_), dtype, stream);
  REPLAY_NCCL_CHECK(ncclAllReduce(send, recv, count, dtype, op, comm_, stream));
  time_end(t, stream);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                                  ncclRedOp_t op, cudaStream_t stream) {
  const bool eager = record(Kind::kReduceScatter, count, dtype, op, stream);
  const int t =
      time_start(eager, Kind::kReduceScatter,
                 collective_bytes(Kind::kReduceScatter, count, dtype, size_), dtype, stream);
  REPLAY_NCCL_CHECK(ncclReduceScatter(send, recv, count, dtype, op, comm_, stream));
  time_end(t, stream);
}

void Communicator::all_gather(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                              cudaStream_t stream) {
  const bool eager = record(Kind::kAllGather, count, dtype, ncclSum, stream);
  const int t = time_start(eager, Kind::kAllGather,
                           collective_bytes(Kind::kAllGather, count, dtype, size_), dtype, stream);
  REPLAY_NCCL_CHECK(ncclAllGather(send, recv, count, dtype, comm_, stream));
  time_end(t, stream);
}

void Communicator::all_reduce_group(const std::vector<std::pair<void*, size_t>>& buffers,
                                    ncclDataType_t dtype, ncclRedOp_t op, cudaStream_t stream) {
  bool eager = false;
  uint64_t bytes = 0;
  for (const auto& [ptr, count] : buffers) {
    eager = record(Kind::kAllReduce, count, dtype, op, stream);
    bytes += collective_bytes(Kind::kAllReduce, count, dtype, size_);
  }
  const int t = time_start(eager, Kind::kAllReduce, bytes, dtype, stream);
  REPLAY_NCCL_CHECK(ncclGroupStart());
  for (const auto& [ptr, count] : buffers)
    REPLAY_NCCL_CHECK(ncclAllReduce(ptr, ptr, count, dtype, op, comm_, stream));
  REPLAY_NCCL_CHECK(ncclGroupEnd());
  time_end(t, stream);
}

void Communicator::all_to_all(const void* send, void* recv, size_t count_per_peer,
                              ncclDataType_t dtype, cudaStream_t stream) {
  const bool eager = record(Kind::kAllToAll, count_per_peer, dtype, ncclSum, stream);
  const uint64_t bytes = collective_bytes(Kind::kAllToAll, count_per_peer, dtype, size_);
  const int t = time_start(eager, Kind::kAllToAll, bytes, dtype, stream);
  const size_t block = static_cast<size_t>(bytes) / static_cast<size_t>(size_);
  const auto* s = static_cast<const char*>(send);
  auto* r = static_cast<char*>(recv);
  REPLAY_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    REPLAY_NCCL_CHECK(
        ncclSend(s + static_cast<size_t>(p) * block, count_per_peer, dtype, p, comm_, stream));
    REPLAY_NCCL_CHECK(
        ncclRecv(r + static_cast<size_t>(p) * block, count_per_peer, dtype, p, comm_, stream));
  }
  REPLAY_NCCL_CHECK(ncclGroupEnd());
  time_end(t, stream);
}

std::string Communicator::async_error() const {
  if (comm_ == nullptr || aborted_) return "";
  ncclResult_t r = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) return "ncclCommGetAsyncError failed";
  return r == ncclSuccess || r == ncclInProgress ? "" : ncclGetErrorString(r);
}

void Communicator::abort() {
  if (comm_ != nullptr && !aborted_) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
}

// ---- The capture check -------------------------------------------------------------------------

void check_same_collectives(const World& w, const CollectiveLog& log) {
  if (w.size == 1) return;
  const uint64_t mine = log.hash();
  std::vector<uint64_t> hashes(static_cast<size_t>(w.size));
  REPLAY_MPI_CHECK(
      MPI_Allgather(&mine, 1, MPI_UINT64_T, hashes.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD));
  bool same = true;
  for (uint64_t h : hashes) same = same && h == hashes[0];
  if (same) return;
  // Every rank's list, to name what differs: one line per collective.
  std::string text;
  for (const CollectiveRecord& r : log.captured()) text += r.describe() + "\n";
  const int len = static_cast<int>(text.size());
  std::vector<int> lens(static_cast<size_t>(w.size)), offsets(static_cast<size_t>(w.size));
  REPLAY_MPI_CHECK(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD));
  int total = 0;
  for (int r = 0; r < w.size; ++r) {
    offsets[static_cast<size_t>(r)] = total;
    total += lens[static_cast<size_t>(r)];
  }
  std::string all(static_cast<size_t>(total), '\0');
  REPLAY_MPI_CHECK(MPI_Allgatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(),
                                  offsets.data(), MPI_CHAR, MPI_COMM_WORLD));
  auto lines_of = [&](int r) {
    std::vector<std::string> out;
    std::istringstream in(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                                     static_cast<size_t>(lens[static_cast<size_t>(r)])));
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  const std::vector<std::string> here = lines_of(w.rank);
  int other = 0;
  while (other < w.size && hashes[static_cast<size_t>(other)] == mine) ++other;
  const std::vector<std::string> there = lines_of(other);
  size_t i = 0;
  while (i < here.size() && i < there.size() && here[i] == there[i]) ++i;
  auto at = [](const std::vector<std::string>& v, size_t k) {
    return k < v.size() ? v[k] : std::string("nothing (the sequence ends)");
  };
  std::ostringstream os;
  os << "the ranks captured different collective sequences (a replay would hang): collective #" << i
     << " is " << at(here, i) << " on rank " << w.rank << " (" << here.size() << " captured) and "
     << at(there, i) << " on rank " << other << " (" << there.size() << " captured)";
  throw_error("replay", "collective mismatch", "check_same_collectives", __FILE__, __LINE__,
              os.str());
}

// ---- The watchdog ------------------------------------------------------------------------------

Watchdog::Watchdog(const World& w, std::vector<Communicator*> comms, const CollectiveLog* log,
                   double timeout_s)
    : world_(w), comms_(std::move(comms)), log_(log), timeout_s_(timeout_s) {}

namespace {

// The watchdog's end of a run: the message first, then the communicators aborted and the job
// ended without unwinding. Unwinding would free device memory and destroy graphs, which waits for
// the collective kernels still spinning on the stalled rank's data (cudaFree synchronizes), and
// ncclCommAbort itself may wait for them: it gets a few seconds on its own thread.
[[noreturn]] void give_up(const std::string& message, const std::vector<Communicator*>& comms) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([comms, done] {
    for (Communicator* c : comms) c->abort();
    done->store(true);
  }).detach();
  const auto t0 = std::chrono::steady_clock::now();
  while (!done->load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!done->load()) std::fprintf(stderr, "(ncclCommAbort did not return within 10 s)\n");
  abort_world(1);
}

}  // namespace

void Watchdog::poll(const char* what, std::chrono::steady_clock::time_point t0) {
  for (Communicator* c : comms_) {
    const std::string e = c->async_error();
    if (!e.empty())
      give_up("NCCL error: " + e + " while waiting for " + what + ": communicator '" + c->name() +
                  "' failed on rank " + std::to_string(world_.rank) + ", host " + world_.host +
                  "; last collective enqueued: " + (log_ ? log_->last() : std::string("?")),
              comms_);
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (waited > timeout_s_) {
    std::ostringstream os;
    os << "replay: collective timeout: rank " << world_.rank << " on host " << world_.host
       << " waited " << timeout_s_ << " s (--comm-timeout-s) for " << what
       << "; the communicators are aborted and the job ends. Last collective enqueued: "
       << (log_ && !log_->last().empty() ? log_->last() : "none")
       << ". Another rank is stalled or gone";
    give_up(os.str(), comms_);
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// ---- MPI helpers -------------------------------------------------------------------------------

void barrier(const World& w) {
  if (w.size > 1) REPLAY_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
}

uint64_t broadcast(const World& w, uint64_t value) {
  if (w.size > 1) REPLAY_MPI_CHECK(MPI_Bcast(&value, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  return value;
}

void abort_world(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

std::vector<double> all_gather_doubles(const World& w, double value) {
  std::vector<double> out(static_cast<size_t>(w.size), value);
  if (w.size > 1)
    REPLAY_MPI_CHECK(
        MPI_Allgather(&value, 1, MPI_DOUBLE, out.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD));
  return out;
}

}  // namespace replay::comm
