// checkpoint.cpp: what a checkpoint holds, saving and loading it (checkpoint.h).
#include "train/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "common/bench/harness.h"
#include "common/check.h"
#include "common/version.h"

namespace replay::train {

namespace {

using safetensors::TensorEntry;

constexpr const char* kFilePrefix = "step-";
constexpr const char* kFileSuffix = ".safetensors";

[[noreturn]] void usage(const std::string& message) {
  throw bench::UsageError(message);
}

// The host copies of what lives in small device structs: filled before a save, written back
// after a load.
struct HostState {
  StepScalars scalars{};
  std::vector<PhiloxSlot> slots;
  int64_t data_position = 0;
};

// One tensor of the file and where its bytes live: device memory or a field of HostState. A
// tensor of a distributed optimizer's state (shard >= 0) starts at flat element `flat` of the
// parameters' layout; this rank holds flat elements [shard, shard + share) of its bucket at
// `device` (share element share_at on): a load keeps the part that falls there.
struct Item {
  TensorEntry entry;
  void* device = nullptr;
  void* host = nullptr;
  int64_t flat = 0, shard = -1, share = 0, share_at = 0;
};

TensorEntry entry(std::string name, DType dtype, std::vector<int64_t> shape) {
  TensorEntry e;
  e.name = std::move(name);
  e.dtype = dtype;
  e.shape = std::move(shape);
  return e;
}

// The file's tensors in order, pointing into the trainer's buffers and `host`. The optimizer's
// state of a distributed optimizer comes from `gathered` when given (a save), else from the share
// (a load).
std::vector<Item> items(const Trainer& trainer, HostState* host,
                        const OptimizerStateHost* gathered = nullptr) {
  const Model& model = trainer.model();
  const ParamStore& ps = model.params();
  std::vector<Item> out;
  for (ParamId id = 0; id < ps.count(); ++id)
    out.push_back({entry(ps.spec(id).name, ps.weight_dtype(), ps.spec(id).shape), ps.weight(id)});
  const struct {
    const char* prefix;
    float* base;
    const std::vector<float>* whole;
  } fp32[] = {{"optimizer.master.", ps.masters().as<float>(DType::kFP32),
               gathered ? &gathered->master : nullptr},
              {"optimizer.exp_avg.", ps.exp_avg().as<float>(DType::kFP32),
               gathered ? &gathered->exp_avg : nullptr},
              {"optimizer.exp_avg_sq.", ps.exp_avg_sq().as<float>(DType::kFP32),
               gathered ? &gathered->exp_avg_sq : nullptr}};
  const bool sharded = ps.shard_count() > 1;
  for (const auto& kind : fp32)
    for (ParamId id = 0; id < ps.count(); ++id) {
      Item i{entry(kind.prefix + ps.spec(id).name, DType::kFP32, ps.spec(id).shape)};
      if (!sharded) {
        i.device = kind.base + ps.offset(id);
      } else if (kind.whole != nullptr) {
        REPLAY_REQUIRE(static_cast<int64_t>(kind.whole->size()) == ps.buffer_numel(),
                       "checkpoint: the gathered optimizer state is not whole");
        i.host = const_cast<float*>(kind.whole->data()) + ps.offset(id);
      } else {
        const ParamStore::Bucket part = ps.share_part(ps.offset(id));
        i.device = kind.base;
        i.flat = ps.offset(id);
        i.shard = part.begin;
        i.share = part.length;
        i.share_at = part.share_begin;
      }
      out.push_back(std::move(i));
    }

  StepScalars& s = host->scalars;
  out.push_back({entry("train.step", DType::kINT64, {}), nullptr, &s.step});
  out.push_back({entry("train.iteration", DType::kINT64, {}), nullptr, &s.iteration});
  out.push_back({entry("train.loss_scale", DType::kFP32, {}), nullptr, &s.loss_scale});
  out.push_back({entry("train.growth_tracker", DType::kINT32, {}), nullptr, &s.growth_tracker});
  out.push_back({entry("train.hysteresis_left", DType::kINT32, {}), nullptr, &s.hysteresis_left});
  out.push_back({entry("train.lr", DType::kFP32, {}), nullptr, &s.lr});
  out.push_back({entry("train.loss", DType::kFP32, {}), nullptr, &s.loss});

  const graphs::RngTracker& rng = trainer.rng();
  host->slots.resize(static_cast<size_t>(rng.stream_count()));
  static_assert(sizeof(PhiloxSlot) == 2 * sizeof(int64_t), "a slot is two 64-bit words");
  for (int i = 0; i < rng.stream_count(); ++i)
    out.push_back({entry("rng." + rng.stream_name(i), DType::kINT64, {2}), nullptr,
                   &host->slots[static_cast<size_t>(i)]});
  out.push_back({entry("data.position", DType::kINT64, {}), nullptr, &host->data_position});

  for (const Model::NamedTensor& t : model.checkpoint_state()) {
    REPLAY_REQUIRE(t.view.is_contiguous(), "checkpoint state '" + t.name + "' is not contiguous");
    std::vector<int64_t> shape(t.view.shape.begin(), t.view.shape.begin() + t.view.ndim);
    out.push_back({entry("state." + t.name, t.view.dtype, shape), t.view.data});
  }
  return out;
}

bool is_step_file(const std::string& name, int64_t* iteration) {
  const size_t p = std::strlen(kFilePrefix), x = std::strlen(kFileSuffix);
  if (name.size() <= p + x || name.compare(0, p, kFilePrefix) != 0 ||
      name.compare(name.size() - x, x, kFileSuffix) != 0)
    return false;
  const std::string digits = name.substr(p, name.size() - p - x);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return false;
  *iteration = std::stoll(digits);
  return true;
}

}  // namespace

std::string checkpoint_file_name(int64_t iteration) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%s%08" PRId64 "%s", kFilePrefix, iteration, kFileSuffix);
  return buf;
}

std::string find_checkpoint(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0)
    usage("--load: " + path + " does not exist (" + std::strerror(errno) + ")");
  if (S_ISREG(st.st_mode)) return path;
  if (!S_ISDIR(st.st_mode)) usage("--load: " + path + " is neither a file nor a directory");
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) usage("--load: cannot read the directory " + path);
  int64_t newest = -1;
  std::string name;
  while (const dirent* d = readdir(dir)) {
    int64_t it = 0;
    if (is_step_file(d->d_name, &it) && it > newest) {
      newest = it;
      name = d->d_name;
    }
  }
  closedir(dir);
  if (newest < 0) usage("--load: " + path + " holds no checkpoint (step-*.safetensors)");
  return path + "/" + name;
}

void prepare_save_directory(const std::string& dir) {
  REPLAY_REQUIRE(!dir.empty(), "prepare_save_directory: empty path");
  // mkdir -p, one component at a time.
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      usage("--save: cannot create " + part + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    usage("--save: " + dir + " is not a directory");
  // Writable: a probe file, created and removed.
  const std::string probe = dir + "/.replay-write-probe." + std::to_string(getpid());
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (f == nullptr) usage("--save: cannot write in " + dir + ": " + std::strerror(errno));
  std::fclose(f);
  std::remove(probe.c_str());
}

void check_output_file(const std::string& flag, const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    usage(flag + ": the directory " + dir + " does not exist");
  if (access(dir.c_str(), W_OK) != 0) usage(flag + ": cannot write in " + dir);
  if (stat(path.c_str(), &st) == 0 && (S_ISDIR(st.st_mode) || access(path.c_str(), W_OK) != 0))
    usage(flag + ": " + path + (S_ISDIR(st.st_mode) ? " is a directory" : " cannot be written"));
}

std::unique_ptr<safetensors::Reader> open_checkpoint(const std::string& path,
                                                     const CheckpointIdentity& id) {
  auto reader = std::make_unique<safetensors::Reader>(path);
  const safetensors::Reader& r = *reader;
  if (r.meta("format") != kCheckpointFormat)
    usage("--load: " + path + " is not a replay checkpoint (its metadata has no format '" +
          kCheckpointFormat + "')");
  if (r.meta("format_version") != std::to_string(kCheckpointVersion))
    usage("--load: " + path + " is format version " + r.meta("format_version") + ", this " +
          id.tool + " reads version " + std::to_string(kCheckpointVersion));
  const struct {
    const char* key;
    const std::string& mine;
  } same[] = {{"workload", id.workload}, {"preset", id.preset}, {"precision", id.precision}};
  for (const auto& s : same)
    if (r.meta(s.key) != s.mine)
      usage("--load: " + path + " is a checkpoint of " + s.key + " '" + r.meta(s.key) +
            "', this run is " + s.key + " '" + s.mine + "'");
  if (r.meta("seed") != std::to_string(id.seed))
    usage("--load: " + path + " was trained with seed " + r.meta("seed") +
          ", this run has --seed " + std::to_string(id.seed) +
          "; the data order follows the seed (leave --seed out to take "
          "the checkpoint's)");
  return reader;
}

uint64_t checkpoint_seed(const std::string& path) {
  const safetensors::Reader r(path);
  const std::string seed = r.meta("seed");
  if (seed.empty() || seed.find_first_not_of("0123456789") != std::string::npos)
    usage("--load: " + path + " records no seed (is it a replay checkpoint?)");
  return std::stoull(seed);
}

std::vector<TensorEntry> checkpoint_tensors(const Trainer& trainer) {
  HostState host;
  std::vector<TensorEntry> out;
  for (Item& i : items(trainer, &host)) out.push_back(std::move(i.entry));
  return out;
}

void check_tensors(const safetensors::Reader& r, const std::vector<TensorEntry>& expected) {
  using safetensors::shape_string;
  for (const TensorEntry& e : expected) {
    const TensorEntry* have = r.find(e.name);
    if (have == nullptr)
      usage("--load: " + r.path() + " has no tensor '" + e.name + "' (" +
            safetensors::dtype_tag(e.dtype) + " " + shape_string(e.shape) + " in this run)");
    if (have->shape != e.shape)
      usage("--load: tensor '" + e.name + "' is " + shape_string(have->shape) + " in " + r.path() +
            ", this run needs " + shape_string(e.shape));
    if (have->dtype != e.dtype)
      usage("--load: tensor '" + e.name + "' is " + safetensors::dtype_tag(have->dtype) + " in " +
            r.path() + ", this run needs " + safetensors::dtype_tag(e.dtype));
  }
  if (r.tensors().size() != expected.size())
    for (const TensorEntry& have : r.tensors()) {
      bool known = false;
      for (const TensorEntry& e : expected) known = known || e.name == have.name;
      if (!known)
        usage("--load: " + r.path() + " holds tensor '" + have.name + "' (" +
              safetensors::dtype_tag(have.dtype) + " " + shape_string(have.shape) +
              "), which this run does not have");
    }
}

SavedCheckpoint save_checkpoint(const std::string& dir, const Trainer& trainer,
                                const CheckpointIdentity& id, const nlohmann::ordered_json& config,
                                const OptimizerStateHost* gathered) {
  cudaStream_t stream = trainer.stream();
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  REPLAY_REQUIRE(gathered != nullptr || trainer.model().params().shard_count() == 1,
                 "save_checkpoint: a distributed optimizer's state must be gathered first");
  HostState host;
  std::vector<Item> list = items(trainer, &host, gathered);
  REPLAY_CUDA_CHECK(
      cudaMemcpy(&host.scalars, trainer.scalars(), sizeof(StepScalars), cudaMemcpyDeviceToHost));
  const graphs::RngTracker& rng = trainer.rng();
  REPLAY_CUDA_CHECK(
      cudaMemcpy(host.slots.data(), rng.slots(), rng.slots_bytes(), cudaMemcpyDeviceToHost));
  host.data_position = trainer.model().data_position();

  SavedCheckpoint saved;
  saved.iteration = host.scalars.iteration;
  saved.path = dir + "/" + checkpoint_file_name(saved.iteration);
  safetensors::Metadata meta{{"format", kCheckpointFormat},
                             {"format_version", std::to_string(kCheckpointVersion)},
                             {"replay_version", version()},
                             {"tool", id.tool},
                             {"workload", id.workload},
                             {"preset", id.preset},
                             {"precision", id.precision},
                             {"seed", std::to_string(id.seed)},
                             {"layout", trainer.model().describe()},
                             {"collectives", trainer.model().collectives()},
                             {"iteration", std::to_string(host.scalars.iteration)},
                             {"optimizer_step", std::to_string(host.scalars.step)},
                             {"config", config.dump()}};
  std::vector<TensorEntry> entries;
  for (const Item& i : list) entries.push_back(i.entry);
  safetensors::Writer w(saved.path, std::move(entries), std::move(meta));
  constexpr size_t kPiece = size_t{64} << 20;
  std::vector<unsigned char> buf;
  for (const Item& i : list) {
    const uint64_t bytes = i.entry.bytes();
    if (i.host != nullptr) {
      w.write(i.host, bytes);
      continue;
    }
    for (uint64_t off = 0; off < bytes; off += kPiece) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, bytes - off));
      buf.resize(n);
      REPLAY_CUDA_CHECK(cudaMemcpy(buf.data(), static_cast<const char*>(i.device) + off, n,
                                   cudaMemcpyDeviceToHost));
      w.write(buf.data(), n);
    }
  }
  w.commit();
  for (const Item& i : list) saved.bytes += i.entry.bytes();
  return saved;
}

int64_t load_checkpoint(const safetensors::Reader& r, Trainer& trainer) {
  cudaStream_t stream = trainer.stream();
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  HostState host;
  std::vector<Item> list = items(trainer, &host);
  // The fields the file does not hold (flags, the warm-up hold) start from the device's values.
  REPLAY_CUDA_CHECK(
      cudaMemcpy(&host.scalars, trainer.scalars(), sizeof(StepScalars), cudaMemcpyDeviceToHost));
  std::unordered_map<std::string, const Item*> by_name;
  for (const Item& i : list) by_name[i.entry.name] = &i;
  r.read_all([&](const TensorEntry& e, uint64_t off, const void* data, size_t n) {
    const auto it = by_name.find(e.name);
    REPLAY_REQUIRE(it != by_name.end(), "load_checkpoint: tensor '" + e.name + "' not checked");
    const Item& i = *it->second;
    if (i.host != nullptr) {
      std::memcpy(static_cast<char*>(i.host) + off, data, n);
    } else if (i.shard >= 0) {  // fp32 elements [first, first + count) of the flat layout
      const int64_t first = i.flat + static_cast<int64_t>(off / sizeof(float)),
                    count = static_cast<int64_t>(n / sizeof(float));
      const int64_t lo = std::max(first, i.shard), hi = std::min(first + count, i.shard + i.share);
      if (lo < hi)
        REPLAY_CUDA_CHECK(cudaMemcpy(static_cast<float*>(i.device) + i.share_at + (lo - i.shard),
                                     static_cast<const float*>(data) + (lo - first),
                                     static_cast<size_t>(hi - lo) * sizeof(float),
                                     cudaMemcpyHostToDevice));
    } else {
      REPLAY_CUDA_CHECK(
          cudaMemcpy(static_cast<char*>(i.device) + off, data, n, cudaMemcpyHostToDevice));
    }
  });
  StepScalars& s = host.scalars;
  s.found_inf = 0;
  s.noop = 0;
  s.hold = 0;
  REPLAY_CUDA_CHECK(cudaMemcpy(trainer.scalars(), &s, sizeof(StepScalars), cudaMemcpyHostToDevice));
  const graphs::RngTracker& rng = trainer.rng();
  REPLAY_CUDA_CHECK(
      cudaMemcpy(rng.slots(), host.slots.data(), rng.slots_bytes(), cudaMemcpyHostToDevice));
  trainer.model().seek_data(host.data_position);
  trainer.resume_at(s.iteration);
  return s.iteration;
}

void dump_step(const std::string& path, const Trainer& trainer, const CheckpointIdentity& id) {
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(trainer.stream()));
  StepScalars s{};
  REPLAY_CUDA_CHECK(cudaMemcpy(&s, trainer.scalars(), sizeof(StepScalars), cudaMemcpyDeviceToHost));
  const Model& model = trainer.model();
  const ParamStore& ps = model.params();
  std::vector<TensorEntry> entries{entry("loss", DType::kFP32, {})};
  for (ParamId i = 0; i < ps.count(); ++i)
    entries.push_back(entry("grad." + ps.spec(i).name, DType::kFP32, ps.spec(i).shape));
  const std::vector<Model::NamedTensor> batch = model.batch_tensors();
  for (const Model::NamedTensor& t : batch) {
    REPLAY_REQUIRE(t.view.is_contiguous(), "batch tensor '" + t.name + "' is not contiguous");
    entries.push_back(
        entry("batch." + t.name, t.view.dtype,
              std::vector<int64_t>(t.view.shape.begin(), t.view.shape.begin() + t.view.ndim)));
  }
  safetensors::Writer w(path, std::move(entries),
                        {{"format", "replay-step"},
                         {"tool", id.tool},
                         {"workload", id.workload},
                         {"preset", id.preset},
                         {"iteration", std::to_string(s.iteration)}});
  w.write(&s.loss, sizeof(float));
  std::vector<float> g;
  for (ParamId i = 0; i < ps.count(); ++i) {
    g.resize(static_cast<size_t>(ps.numel(i)));
    REPLAY_CUDA_CHECK(
        cudaMemcpy(g.data(), ps.grad(i), g.size() * sizeof(float), cudaMemcpyDeviceToHost));
    // The gradient buffer holds d(loss * scale) / dw with the scale the step ran under; end_step
    // may have changed s.loss_scale since, but only on an overflow step, whose gradients are Inf.
    for (float& v : g) v /= s.loss_scale;
    w.write(g.data(), g.size() * sizeof(float));
  }
  std::vector<unsigned char> bytes;
  for (const Model::NamedTensor& t : batch) {
    bytes.resize(t.view.bytes());
    REPLAY_CUDA_CHECK(cudaMemcpy(bytes.data(), t.view.data, bytes.size(), cudaMemcpyDeviceToHost));
    w.write(bytes.data(), bytes.size());
  }
  w.commit();
}

}  // namespace replay::train
