// comm.h: the processes of a run and their collectives. MPI only bootstraps (the ranks, the NCCL
// unique id, the capture check); every collective on the step path is NCCL, enqueued on the step's
// stream, eagerly or inside a captured graph.
//
// World: one process per GPU, launched by mpiexec or srun (a single process runs without MPI). The
// local rank picks the device.
//
// Communicator: one NCCL communicator over a group of ranks (data-parallel, tensor-parallel, ...),
// created before any capture and warmed with one eager call of each collective it will run (the
// first call of a communicator inside a capture fails: exercises/CATALOGUE.md). Its owner destroys
// it after every graph that holds it (NCCL 2.26+ waits for them).
//
// CollectiveLog: every collective a communicator enqueues while its stream is capturing is recorded
// (kind, count, dtype, communicator, order). Before the first replay the ranks compare what they
// captured (check_same_collectives): ranks that captured different sequences would hang at replay;
// here they fail at once, each naming the first collective that differs. The last collective
// enqueued, captured or not, is kept for the watchdog's message.
//
// Watchdog: a wait on the step path polls the communicators' asynchronous errors and gives up after
// a timeout with a message naming the rank, the host and the last collective, ncclCommAbort and
// the end of the job.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace replay::comm {

struct World {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  bool mpi = false;  // launched by mpiexec or srun (MPI initialized)
  std::string host;
};

// True when a launcher started this process as one rank of several (Open MPI, PMI, PMIx or Slurm
// environment variables).
bool launched_by_mpi();
// Initializes MPI when launched by a launcher, and returns the process's place; a world of one
// otherwise. Idempotent.
const World& init_world(int* argc, char*** argv);
const World& world();
// MPI_Finalize when init_world initialized MPI (at exit of main).
void finalize_world();

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kAllToAll };
const char* kind_name(Kind k);
// A collective's size as nccl-tests counts it: the buffer reduced (all-reduce), or the whole
// buffer gathered or scattered, count x ranks elements (all-gather, reduce-scatter), or the whole
// send buffer of an all-to-all (count per peer x ranks, this rank's own block included).
uint64_t collective_bytes(Kind k, size_t count, ncclDataType_t dtype, int ranks);

// What a communicator enqueued eagerly (outside any capture): calls and bytes (collective_bytes).
struct Traffic {
  uint64_t calls = 0;
  uint64_t bytes = 0;
};

struct CollectiveRecord {
  Kind kind;
  size_t count;  // elements each rank receives (all-gather, reduce-scatter), reduces (all-reduce),
                 // or sends to each peer (all-to-all)
  ncclDataType_t dtype;
  ncclRedOp_t op;
  std::string comm;  // the communicator's name
  std::string describe() const;
};

// One eager collective timed by its communicator (Communicator::begin_timing): what it was and how
// long the stream spent in it, from the event before the NCCL call to the event after.
struct TimedCollective {
  Kind kind;
  uint64_t bytes;  // collective_bytes (a grouped all-reduce: the sum of its buffers)
  ncclDataType_t dtype;
  float ms;
  // Enqueued on a stream other than begin_timing's main stream: it ran beside the step's other
  // work (a gradient bucket overlapping the backward), sharing the SMs and memory with it.
  bool overlapped = false;
};

// The timed collectives of a communicator of `ranks`, grouped by kind, dtype, size and whether they
// overlapped other work: calls per
// step (the group's calls / `steps`), the median time and the bus bandwidth at that median as
// nccl-tests computes it (algorithm bandwidth bytes / time, x 2(n-1)/n for an all-reduce, x (n-1)/n
// for a reduce-scatter, an all-gather or an all-to-all). Largest first.
struct CollectiveTiming {
  std::string comm;
  Kind kind;
  ncclDataType_t dtype;
  uint64_t bytes = 0;
  double calls_per_step = 0;
  double median_us = 0;
  double busbw_gbps = 0;    // 1e9 bytes a second
  bool overlapped = false;  // TimedCollective::overlapped
};
std::vector<CollectiveTiming> summarize_timings(const std::string& comm,
                                                const std::vector<TimedCollective>& calls,
                                                int ranks, int steps);
double bus_bandwidth_factor(Kind k, int ranks);
const char* dtype_name(ncclDataType_t dtype);  // "bf16", "f32", ...

class CollectiveLog {
 public:
  void record(CollectiveRecord r, bool captured);
  const std::vector<CollectiveRecord>& captured() const { return captured_; }
  // The last collective enqueued (eagerly or captured), "" before any.
  const std::string& last() const { return last_; }
  uint64_t hash() const;
  void clear_captured() { captured_.clear(); }

 private:
  std::vector<CollectiveRecord> captured_;
  std::string last_;
};

class Communicator {
 public:
  // Collective over every rank of the world whose `color` matches this rank's (MPI_Comm_split
  // semantics, ranks ordered by world rank). `log` (shared by a run's communicators) may be null.
  Communicator(const World& w, std::string name, int color, CollectiveLog* log);
  ~Communicator();  // ncclCommDestroy, unless aborted
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t handle() const { return comm_; }

  // In place where NCCL allows it: all_gather with send = recv + rank * count, reduce_scatter
  // with recv = send + rank * count.
  void all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                  cudaStream_t stream);
  void reduce_scatter(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                      ncclRedOp_t op, cudaStream_t stream);
  void all_gather(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                  cudaStream_t stream);
  // In-place all-reduces of several buffers (pointer, count) of one dtype as one NCCL group: small
  // tensors that would each pay a collective's latency go out as one launch.
  void all_reduce_group(const std::vector<std::pair<void*, size_t>>& buffers, ncclDataType_t dtype,
                        ncclRedOp_t op, cudaStream_t stream);
  // All-to-all of fixed-size blocks: block p of `send` (elements [p count, p count + count)) goes
  // to rank p, and rank p's block for this rank lands in block p of `recv` (this rank's own block
  // is copied too). One NCCL group of ncclSend/ncclRecv per peer in rank order: the same launches
  // every call, so a graph replays them. send and recv must not overlap.
  void all_to_all(const void* send, void* recv, size_t count_per_peer, ncclDataType_t dtype,
                  cudaStream_t stream);

  // Collectives enqueued outside a capture so far (the trainer counts a warm-up step's: the
  // communication volume of a step, which graphs replay unchanged).
  const Traffic& eager_traffic() const { return eager_; }

  // Timing of the eager collectives enqueued between begin_timing() and end_timing() (a step's
  // warm-up, outside any capture and any timed step): an event before and after each, at most
  // `capacity` of them (created here, before the step runs). timed() synchronizes on the events
  // and returns what they measured; captured collectives are not timed. `main`: the step's own
  // stream; a collective on another stream is marked overlapped (nullptr: none is).
  void begin_timing(int capacity, cudaStream_t main = nullptr);
  void end_timing() { timing_ = false; }
  std::vector<TimedCollective> timed() const;

  // nccl's asynchronous error ("" when none); abort() tears the communicator down at once.
  std::string async_error() const;
  void abort();
  bool aborted() const { return aborted_; }

 private:
  // Logs the collective; returns whether it is eager (not captured).
  bool record(Kind k, size_t count, ncclDataType_t dtype, ncclRedOp_t op, cudaStream_t stream);
  // begin_timing: the event before an eager collective (its index, or -1 when not timing), and
  // the one after it.
  int time_start(bool eager, Kind k, uint64_t bytes, ncclDataType_t dtype, cudaStream_t stream);
  void time_end(int index, cudaStream_t stream);

  std::string name_;
  int rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  CollectiveLog* log_ = nullptr;
  Traffic eager_;
  bool aborted_ = false;
  bool timing_ = false;
  cudaStream_t timing_main_ = nullptr;
  std::vector<cudaEvent_t> events_;     // begin_timing's pairs: [2i] before, [2i + 1] after call i
  std::vector<TimedCollective> timed_;  // the calls timed so far (ms filled by timed())
};

// Every rank's captured sequence against every other's, over MPI (a no-op in a world of one).
// Throws Error on every rank when they differ, naming the first differing collective on each side.
void check_same_collectives(const World& w, const CollectiveLog& log);

// Polls `done` until it returns true; in between, each communicator's asynchronous error. After
// `timeout` (or on an asynchronous error) it prints a message naming this rank, its host, what it
// waited for and the last collective enqueued, aborts the communicators and ends the job
// (abort_world) without unwinding: freeing device memory or destroying graphs would wait for the
// collective kernels that are still spinning. A world of one just calls `done` until true.
class Watchdog {
 public:
  Watchdog(const World& w, std::vector<Communicator*> comms, const CollectiveLog* log,
           double timeout_s);
  template <typename Done>
  void wait(const char* what, Done&& done) {
    if (done()) return;
    const auto t0 = std::chrono::steady_clock::now();
    while (!done()) poll(what, t0);
  }
  double timeout_s() const { return timeout_s_; }

 private:
  void poll(const char* what, std::chrono::steady_clock::time_point t0);
  const World& world_;
  std::vector<Communicator*> comms_;
  const CollectiveLog* log_;
  double timeout_s_;
};

// MPI helpers for the driver (no-ops or identities in a world of one).
void barrier(const World& w);
// Rank 0's value on every rank.
uint64_t broadcast(const World& w, uint64_t value);
// A rank that failed ends the job (MPI_Abort): the others may be waiting in a collective.
[[noreturn]] void abort_world(int code);
// Each rank's value, in rank order, on every rank.
std::vector<double> all_gather_doubles(const World& w, double value);

}  // namespace replay::comm
