// arena.cpp: lifetime-aware offset assignment and the single device allocation.
#include "common/arena.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <sstream>

namespace replay {

namespace {
size_t align_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

std::string human_bytes(size_t b) {
  char buf[32];
  const double d = static_cast<double>(b);
  if (b >= (size_t{1} << 30))
    std::snprintf(buf, sizeof(buf), "%.2f GiB", d / (1 << 30));
  else if (b >= (size_t{1} << 20))
    std::snprintf(buf, sizeof(buf), "%.2f MiB", d / (1 << 20));
  else if (b >= 1024)
    std::snprintf(buf, sizeof(buf), "%.2f KiB", d / 1024);
  else
    std::snprintf(buf, sizeof(buf), "%zu B", b);
  return buf;
}
}  // namespace

BufferId ArenaPlan::add(std::string name, size_t bytes, std::string group, Lifetime life,
                        size_t alignment) {
  REPLAY_REQUIRE(!planned_, "buffer '" + name + "' added after the arena was planned");
  REPLAY_REQUIRE(alignment > 0 && (alignment & (alignment - 1)) == 0,
                 "alignment of '" + name + "' must be a power of two");
  REPLAY_REQUIRE(life.begin <= life.end, "lifetime of '" + name + "' ends before it begins");
  entries_.push_back(Entry{std::move(name), std::move(group), bytes, alignment, life, 0});
  return static_cast<BufferId>(entries_.size() - 1);
}

BufferId ArenaPlan::add(std::string name, DType dtype, int64_t elements, std::string group,
                        Lifetime life) {
  REPLAY_REQUIRE(elements >= 0, "negative element count for '" + name + "'");
  return add(std::move(name), static_cast<size_t>(elements) * dtype_size(dtype), std::move(group),
             life);
}

void ArenaPlan::plan() {
  std::vector<size_t> order(entries_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return entries_[a].bytes > entries_[b].bytes; });

  std::vector<size_t> placed;
  placed.reserve(entries_.size());
  total_ = 0;
  for (size_t idx : order) {
    Entry& e = entries_[idx];
    // Intervals [offset, offset+bytes) of placed buffers alive at the same time, by offset.
    std::vector<std::pair<size_t, size_t>> busy;
    for (size_t p : placed) {
      const Entry& o = entries_[p];
      if (o.bytes > 0 && o.life.overlaps(e.life)) busy.emplace_back(o.offset, o.offset + o.bytes);
    }
    std::sort(busy.begin(), busy.end());
    size_t candidate = 0;
    for (const auto& [lo, hi] : busy) {
      if (candidate + e.bytes <= lo) break;  // fits in the gap before this interval
      candidate = std::max(candidate, align_up(hi, e.alignment));
    }
    e.offset = align_up(candidate, e.alignment);
    total_ = std::max(total_, e.offset + e.bytes);
    placed.push_back(idx);
  }
  total_ = align_up(total_, 256);
  planned_ = true;
}

size_t ArenaPlan::total_bytes() const {
  REPLAY_REQUIRE(planned_, "arena plan queried before plan()");
  return total_;
}

size_t ArenaPlan::sum_bytes() const {
  size_t s = 0;
  for (const Entry& e : entries_) s += e.bytes;
  return s;
}

void ArenaPlan::check_fits(size_t available, const std::string& device_name) const {
  const size_t need = total_bytes();
  if (need <= available) return;
  std::vector<const Entry*> big;
  for (const Entry& e : entries_) big.push_back(&e);
  std::sort(big.begin(), big.end(), [](auto* a, auto* b) { return a->bytes > b->bytes; });
  std::ostringstream os;
  os << "the run needs " << human_bytes(need) << " of device memory but " << device_name << " has "
     << human_bytes(available) << " free; largest consumers:";
  for (size_t i = 0; i < big.size() && i < 5; ++i)
    os << (i ? "," : "") << " " << big[i]->name << " (" << human_bytes(big[i]->bytes) << ")";
  os << ". Reduce --layers, the micro-batch or the sequence length.";
  throw Error("replay", "out of memory", os.str());
}

std::string ArenaPlan::table(int largest) const {
  std::map<std::string, std::pair<size_t, int>> groups;
  for (const Entry& e : entries_) {
    groups[e.group].first += e.bytes;
    groups[e.group].second += 1;
  }
  std::ostringstream os;
  char line[160];
  std::snprintf(line, sizeof(line), "%-24s %8s %14s\n", "arena group", "buffers", "bytes");
  os << line;
  for (const auto& [name, v] : groups) {
    std::snprintf(line, sizeof(line), "%-24s %8d %14s\n", name.c_str(), v.second,
                  human_bytes(v.first).c_str());
    os << line;
  }
  std::vector<const Entry*> big;
  for (const Entry& e : entries_) big.push_back(&e);
  std::sort(big.begin(), big.end(), [](auto* a, auto* b) { return a->bytes > b->bytes; });
  for (int i = 0; i < largest && i < static_cast<int>(big.size()); ++i) {
    std::snprintf(line, sizeof(line), "  %-38.38s %14s  @%zu\n", big[i]->name.c_str(),
                  human_bytes(big[i]->bytes).c_str(), big[i]->offset);
    os << line;
  }
  const size_t sum = sum_bytes();
  const size_t tot = planned_ ? total_ : sum;
  std::snprintf(line, sizeof(line),
                "%-24s %8zu %14s (sum of buffers %s; lifetime sharing saves %s)\n", "arena total",
                entries_.size(), human_bytes(tot).c_str(), human_bytes(sum).c_str(),
                human_bytes(sum > tot ? sum - tot : 0).c_str());
  os << line;
  return os.str();
}

Arena::Arena(ArenaPlan plan, int device) : plan_(std::move(plan)), device_(device) {
  if (!plan_.planned()) plan_.plan();
  REPLAY_CUDA_CHECK(cudaSetDevice(device_));
  size_t free_bytes = 0, total_bytes = 0;
  REPLAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  cudaDeviceProp prop{};
  REPLAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  plan_.check_fits(free_bytes, prop.name);
  const size_t n = std::max<size_t>(plan_.total_bytes(), 256);
  REPLAY_CUDA_CHECK(cudaMalloc(&base_, n));
  REPLAY_CUDA_CHECK(cudaMemset(base_, 0xFF, n));
  REPLAY_CUDA_CHECK(cudaDeviceSynchronize());
}

Arena::~Arena() {
  if (base_) cudaFree(base_);  // destructors do not throw; a failure here changes nothing
}

void* Arena::data(BufferId id) const {
  return base_ + plan_.entry(id).offset;
}

TensorView Arena::view(BufferId id, DType dtype, std::initializer_list<int64_t> shape) const {
  TensorView v(data(id), dtype, shape);
  REPLAY_REQUIRE(v.bytes() <= bytes(id),
                 "view " + v.describe() + " is larger than buffer '" + plan_.entry(id).name + "'");
  return v;
}

}  // namespace replay
