// host_group.h: a group of the world's processes that moves host buffers over MPI (the run's
// collectives on the GPU are NCCL's, common/comm.h), and on it the gather and scatter of one
// tensor's tensor-parallel slices (train/tp_layout.h): what a checkpoint of a tensor-parallel run
// uses between steps, never on the step path. Every call is collective over the group: each member
// calls it with the same tensor. Messages go in pieces of at most 1 GiB, so a tensor of any size
// fits MPI's int counts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/comm.h"
#include "train/tp_layout.h"

namespace replay::train {

class HostGroup {
 public:
  // One process alone: no MPI, every call a copy.
  HostGroup();
  // The world's ranks whose `color` equals this rank's, ordered by world rank (MPI_Comm_split:
  // collective over the whole world). A world without MPI gives a group of one.
  HostGroup(const comm::World& world, int color);
  ~HostGroup();
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Point to point (ranks of this group), in pieces of at most 1 GiB.
  void send(const void* data, size_t bytes, int to) const;
  void recv(void* data, size_t bytes, int from) const;
  // `root`'s `bytes` at `data` on every member.
  void broadcast(void* data, size_t bytes, int root) const;
  void barrier() const;

 private:
  struct Mpi;
  std::unique_ptr<Mpi> mpi_;  // null: a group of one
  int rank_ = 0, size_ = 1;
};

// Every member's slice of one tensor (whole shape `whole`, layout `layout`, degree group.size(),
// the member's rank its slice) put together on the group's rank 0 into `whole_data` (the whole
// tensor's bytes; ignored elsewhere). A kNone tensor is rank 0's own: the others send nothing.
// Rank 0 holds one other slice at a time besides the whole tensor.
void tp_gather(const HostGroup& group, const std::vector<int64_t>& whole, const TpLayout& layout,
               const void* slice, void* whole_data, size_t element_bytes);
// The reverse: rank 0's whole tensor (`whole_data`, ignored elsewhere) cut into each member's
// `slice`; a kNone tensor is broadcast whole.
void tp_scatter(const HostGroup& group, const std::vector<int64_t>& whole, const TpLayout& layout,
                const void* whole_data, void* slice, size_t element_bytes);

}  // namespace replay::train
