// host_group.cpp: host buffers between the processes of a group, over MPI (host_group.h).
#include "train/host_group.h"

#include <mpi.h>

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace replay::train {

namespace {

constexpr size_t kPiece = size_t{1} << 30;  // MPI counts are ints

}  // namespace

struct HostGroup::Mpi {
  MPI_Comm comm = MPI_COMM_NULL;
};

HostGroup::HostGroup() = default;

HostGroup::HostGroup(const comm::World& world, int color) {
  if (!world.mpi || world.size == 1) return;
  REPLAY_REQUIRE(color >= 0, "HostGroup: the color must not be negative");
  mpi_ = std::make_unique<Mpi>();
  REPLAY_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, world.rank, &mpi_->comm));
  REPLAY_MPI_CHECK(MPI_Comm_rank(mpi_->comm, &rank_));
  REPLAY_MPI_CHECK(MPI_Comm_size(mpi_->comm, &size_));
}

HostGroup::~HostGroup() {
  if (mpi_ && mpi_->comm != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&mpi_->comm);
  }
}

void HostGroup::send(const void* data, size_t bytes, int to) const {
  REPLAY_REQUIRE(to >= 0 && to < size_ && to != rank_, "HostGroup::send: bad rank");
  const auto* p = static_cast<const char*>(data);
  for (size_t off = 0; off < bytes; off += kPiece)
    REPLAY_MPI_CHECK(MPI_Send(p + off, static_cast<int>(std::min(kPiece, bytes - off)), MPI_BYTE,
                              to, 0, mpi_->comm));
}

void HostGroup::recv(void* data, size_t bytes, int from) const {
  REPLAY_REQUIRE(from >= 0 && from < size_ && from != rank_, "HostGroup::recv: bad rank");
  auto* p = static_cast<char*>(data);
  for (size_t off = 0; off < bytes; off += kPiece) {
    const int n = static_cast<int>(std::min(kPiece, bytes - off));
    MPI_Status status;
    REPLAY_MPI_CHECK(MPI_Recv(p + off, n, MPI_BYTE, from, 0, mpi_->comm, &status));
    int got = 0;
    REPLAY_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
    REPLAY_REQUIRE(got == n, "HostGroup::recv: rank " + std::to_string(from) + " sent " +
                                 std::to_string(got) + " bytes, " + std::to_string(n) +
                                 " expected");
  }
}

void HostGroup::broadcast(void* data, size_t bytes, int root) const {
  if (size_ == 1) return;
  auto* p = static_cast<char*>(data);
  for (size_t off = 0; off < bytes; off += kPiece)
    REPLAY_MPI_CHECK(MPI_Bcast(p + off, static_cast<int>(std::min(kPiece, bytes - off)), MPI_BYTE,
                               root, mpi_->comm));
}

void HostGroup::barrier() const {
  if (size_ > 1) REPLAY_MPI_CHECK(MPI_Barrier(mpi_->comm));
}

void tp_gather(const HostGroup& group, const std::vector<int64_t>& whole, const TpLayout& layout,
               const void* slice, void* whole_data, size_t element_bytes) {
  const int tp = group.size();
  if (layout.split == TpSplit::kNone) {
    if (group.rank() == 0 && whole_data != slice)
      std::memcpy(whole_data, slice,
                  static_cast<size_t>(tp_slice_numel(whole, layout, tp)) * element_bytes);
    return;
  }
  const size_t bytes = static_cast<size_t>(tp_slice_numel(whole, layout, tp)) * element_bytes;
  if (group.rank() != 0) {
    group.send(slice, bytes, 0);
    return;
  }
  tp_insert(whole, layout, tp, 0, slice, whole_data, element_bytes);
  std::vector<char> other(tp > 1 ? bytes : 0);
  for (int r = 1; r < tp; ++r) {
    group.recv(other.data(), bytes, r);
    tp_insert(whole, layout, tp, r, other.data(), whole_data, element_bytes);
  }
}

void tp_scatter(const HostGroup& group, const std::vector<int64_t>& whole, const TpLayout& layout,
                const void* whole_data, void* slice, size_t element_bytes) {
  const int tp = group.size();
  const size_t bytes = static_cast<size_t>(tp_slice_numel(whole, layout, tp)) * element_bytes;
  if (layout.split == TpSplit::kNone) {
    if (group.rank() == 0 && whole_data != slice) std::memcpy(slice, whole_data, bytes);
    group.broadcast(slice, bytes, 0);
    return;
  }
  if (group.rank() != 0) {
    group.recv(slice, bytes, 0);
    return;
  }
  std::vector<char> other(tp > 1 ? bytes : 0);
  for (int r = 1; r < tp; ++r) {
    tp_extract(whole, layout, tp, r, whole_data, other.data(), element_bytes);
    group.send(other.data(), bytes, r);
  }
  tp_extract(whole, layout, tp, 0, whole_data, slice, element_bytes);
}

}  // namespace replay::train
