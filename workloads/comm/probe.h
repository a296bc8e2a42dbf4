// probe.h: the host side of replay-comm-probe, the collective bandwidth probe: message sizes (the
// default sweep, a --sizes list or range), the collectives and types it times, and nccl-tests'
// bandwidth formulas. No CUDA here: tests/workloads/comm checks it on the CPU.
//
// Sizes are counted as nccl-tests counts them (common/comm.h collective_bytes): the buffer reduced
// (all-reduce), or the whole buffer gathered or scattered over the ranks (all-gather,
// reduce-scatter), so that an all-gather of S bytes receives S bytes on every rank from S/n bytes
// sent by each.
//
// Bandwidths (nccl-tests, doc/PERFORMANCE.md): the algorithm bandwidth is bytes / time; the bus
// bandwidth, comparable across rank counts and with the links' speed, is the algorithm bandwidth
// times 2(n-1)/n for an all-reduce and (n-1)/n for a reduce-scatter or an all-gather.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/comm.h"

namespace replay::probe {

enum class DType { kBF16, kFP32 };
const char* dtype_name(DType t);  // "bf16", "fp32"
int dtype_bytes(DType t);

// "8K", "8KiB", "48M", "1G", "1GiB", "50331648": binary multiples (K = 1024). Throws
// bench::UsageError naming the text on anything else, zero, or more than 64 GiB.
uint64_t parse_size(const std::string& text);
// "A:B" (every power-of-two multiple of A up to B), "A:B:F" (factor F, an integer >= 2), or a comma
// list of sizes, ranges included ("8K,48M,64M:256M"). Sorted and without duplicates.
std::vector<uint64_t> parse_sizes(const std::string& text);
// The default sweep: 8 KiB to 1 GiB, doubling (18 sizes).
std::vector<uint64_t> default_sizes();
// "8 KiB", "48 MiB", "1 GiB", "50331650 B": for tables.
std::string format_size(uint64_t bytes);

// "all_reduce", "reduce_scatter", "all_gather" (comm.h kind_name), also "allreduce", "ar", "rs",
// "ag"; a comma list, in the order given, without duplicates.
std::vector<comm::Kind> parse_collectives(const std::string& text);
// "bf16", "fp32" (also "float32", "float"); a comma list.
std::vector<DType> parse_dtypes(const std::string& text);

// What one size means for one collective over `ranks` ranks: the per-rank element count the NCCL
// call takes (the reduced count, or the count each rank sends or receives), and the bytes measured,
// rounded down to whole elements and, for reduce-scatter and all-gather, to a multiple of the ranks
// (nccl-tests rounds the same way). count 0: the size is too small for this collective.
struct Message {
  uint64_t bytes = 0;  // as counted above, after rounding
  uint64_t count = 0;  // the NCCL call's count argument
};
Message message(comm::Kind k, uint64_t bytes, DType t, int ranks);

// nccl-tests' factor from algorithm to bus bandwidth.
double bus_factor(comm::Kind k, int ranks);
// Bytes per second in GB/s (1e9) from bytes and a time in microseconds.
double algbw_gbps(uint64_t bytes, double time_us);
double busbw_gbps(comm::Kind k, int ranks, uint64_t bytes, double time_us);

}  // namespace replay::probe
