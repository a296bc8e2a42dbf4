// probe.cpp: sizes, collectives, types and bandwidth formulas of replay-comm-probe (probe.h).
#include "workloads/comm/probe.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "common/bench/harness.h"

namespace replay::probe {

namespace {

constexpr uint64_t kMaxBytes = uint64_t{64} << 30;

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(trim(item));
  if (!s.empty() && s.back() == sep) out.push_back("");
  return out;
}

[[noreturn]] void bad_size(const std::string& text, const std::string& why) {
  throw bench::UsageError("--sizes: '" + text + "' " + why +
                          " (a size is bytes with an optional K, M or G: 8K, 48M, 1G; a list "
                          "is comma-separated; A:B doubles from A to B, A:B:F multiplies by F)");
}

}  // namespace

const char* dtype_name(DType t) {
  return t == DType::kBF16 ? "bf16" : "fp32";
}

int dtype_bytes(DType t) {
  return t == DType::kBF16 ? 2 : 4;
}

uint64_t parse_size(const std::string& raw) {
  const std::string text = trim(raw);
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) bad_size(raw, "is not a size");
  if (digits > 12) bad_size(raw, "is more than 64 GiB");
  const uint64_t value = std::stoull(text.substr(0, digits));
  const std::string unit = lower(text.substr(digits));
  uint64_t scale = 0;
  if (unit.empty() || unit == "b")
    scale = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib")
    scale = uint64_t{1} << 10;
  else if (unit == "m" || unit == "mb" || unit == "mib")
    scale = uint64_t{1} << 20;
  else if (unit == "g" || unit == "gb" || unit == "gib")
    scale = uint64_t{1} << 30;
  else
    bad_size(raw, "has an unknown unit '" + text.substr(digits) + "'");
  if (value == 0) bad_size(raw, "is zero");
  if (value > kMaxBytes / scale) bad_size(raw, "is more than 64 GiB");
  return value * scale;
}

std::vector<uint64_t> parse_sizes(const std::string& text) {
  if (trim(text).empty()) bad_size(text, "is empty");
  std::vector<uint64_t> sizes;
  for (const std::string& item : split(text, ',')) {
    if (item.empty()) bad_size(text, "has an empty item");
    const std::vector<std::string> parts = split(item, ':');
    if (parts.size() == 1) {
      sizes.push_back(parse_size(parts[0]));
      continue;
    }
    if (parts.size() > 3) bad_size(item, "has more than two ':'");
    const uint64_t lo = parse_size(parts[0]), hi = parse_size(parts[1]);
    if (lo > hi) bad_size(item, "runs backwards (the first size is larger than the last)");
    uint64_t factor = 2;
    if (parts.size() == 3) {
      const std::string& f = parts[2];
      const bool digits =
          !f.empty() && f.size() <= 6 &&
          std::all_of(f.begin(), f.end(), [](char c) { return std::isdigit((unsigned char)c); });
      if (!digits || std::stoull(f) < 2) bad_size(item, "needs an integer factor of 2 or more");
      factor = std::stoull(f);
    }
    for (uint64_t s = lo; s <= hi; s *= factor) {
      sizes.push_back(s);
      if (s > hi / factor) break;
    }
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

std::vector<uint64_t> default_sizes() {
  return parse_sizes("8K:1G");
}

std::string format_size(uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  uint64_t v = bytes;
  while (u < 3 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++u;
  }
  return std::to_string(v) + " " + units[u];
}

std::vector<comm::Kind> parse_collectives(const std::string& text) {
  std::vector<comm::Kind> out;
  for (const std::string& raw : split(text, ',')) {
    const std::string s = lower(raw);
    comm::Kind k;
    if (s == "all_reduce" || s == "allreduce" || s == "all-reduce" || s == "ar")
      k = comm::Kind::kAllReduce;
    else if (s == "reduce_scatter" || s == "reducescatter" || s == "reduce-scatter" || s == "rs")
      k = comm::Kind::kReduceScatter;
    else if (s == "all_gather" || s == "allgather" || s == "all-gather" || s == "ag")
      k = comm::Kind::kAllGather;
    else
      throw bench::UsageError("--collectives: unknown collective '" + raw +
                              "' (all_reduce, reduce_scatter, all_gather)");
    if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  if (out.empty()) throw bench::UsageError("--collectives: give at least one collective");
  return out;
}

std::vector<DType> parse_dtypes(const std::string& text) {
  std::vector<DType> out;
  for (const std::string& raw : split(text, ',')) {
    const std::string s = lower(raw);
    DType t;
    if (s == "bf16" || s == "bfloat16")
      t = DType::kBF16;
    else if (s == "fp32" || s == "float32" || s == "float" || s == "f32")
      t = DType::kFP32;
    else
      throw bench::UsageError("--dtypes: unknown type '" + raw + "' (bf16, fp32)");
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  if (out.empty()) throw bench::UsageError("--dtypes: give at least one type");
  return out;
}

Message message(comm::Kind k, uint64_t bytes, DType t, int ranks) {
  const uint64_t elem = static_cast<uint64_t>(dtype_bytes(t));
  const uint64_t n = static_cast<uint64_t>(std::max(ranks, 1));
  Message m;
  if (k == comm::Kind::kAllReduce) {
    m.count = bytes / elem;
    m.bytes = m.count * elem;
  } else {
    m.count = bytes / elem / n;
    m.bytes = m.count * n * elem;
  }
  return m;
}

double bus_factor(comm::Kind k, int ranks) {
  const double n = ranks;
  return k == comm::Kind::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

double algbw_gbps(uint64_t bytes, double time_us) {
  return time_us > 0 ? static_cast<double>(bytes) / (time_us * 1e-6) / 1e9 : 0.0;
}

double busbw_gbps(comm::Kind k, int ranks, uint64_t bytes, double time_us) {
  return algbw_gbps(bytes, time_us) * bus_factor(k, ranks);
}

}  // namespace replay::probe
