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

TensorEntry entry(std::string name, DType dtype, std::vector<int64_t> shape) {
  TensorEntry e;
  e.name = std::move(name);
  e.dtype = dtype;
  e.shape = std::move(shape);
  return e;
}

// This process's place in its tensor-parallel group (one process: rank 0 of 1).
struct TpPlace {
  int rank = 0, size = 1;
};
TpPlace tp_place(const Trainer& trainer) {
  const comm::Communicator* c = trainer.options().tensor_parallel;
  return c == nullptr ? TpPlace{} : TpPlace{c->rank(), c->size()};
}

// Bytes of this rank's slice of `t`.
size_t slice_bytes(const CheckpointTensor& t, int tp) {
  return static_cast<size_t>(tp_slice_numel(t.entry.shape, t.layout, tp)) *
         dtype_size(t.entry.dtype);
}

// The file's tensors in order, whole, each with its layout and the copies of this rank's slice
// between host memory and the trainer's buffers (device memory, or a field of `host`). The
// optimizer's state of a distributed optimizer comes from `gathered` when given (a save); a load
// keeps the part of each tensor that falls in this rank's share.
std::vector<CheckpointTensor> items(const Trainer& trainer, HostState* host,
                                    const OptimizerStateHost* gathered = nullptr) {
  const Model& model = trainer.model();
  const ParamStore& ps = model.params();
  const int tp = tp_place(trainer).size;
  check_tensor_parallel_params(ps, tp);
  std::vector<CheckpointTensor> out;
  // Device memory, the slice whole at `device`.
  auto on_device = [&out, tp](TensorEntry e, TpLayout layout, void* device) {
    CheckpointTensor t{std::move(e), std::move(layout), {}, {}};
    const size_t bytes = slice_bytes(t, tp);
    t.fetch = [device, bytes](void* slice) {
      REPLAY_CUDA_CHECK(cudaMemcpy(slice, device, bytes, cudaMemcpyDeviceToHost));
    };
    t.store = [device, bytes](const void* slice) {
      REPLAY_CUDA_CHECK(cudaMemcpy(device, slice, bytes, cudaMemcpyHostToDevice));
    };
    out.push_back(std::move(t));
  };
  // Host memory (replicated: the group's rank 0 saves its own).
  auto on_host = [&out](TensorEntry e, void* at) {
    CheckpointTensor t{std::move(e), {}, {}, {}};
    const size_t bytes = t.entry.bytes();
    t.fetch = [at, bytes](void* slice) { std::memcpy(slice, at, bytes); };
    t.store = [at, bytes](const void* slice) { std::memcpy(at, slice, bytes); };
    out.push_back(std::move(t));
  };
  for (ParamId id = 0; id < ps.count(); ++id)
    on_device(entry(ps.spec(id).name, ps.weight_dtype(), tp_whole_shape(ps.spec(id), tp)),
              tp_layout(ps.spec(id), tp), ps.weight(id));
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
      TensorEntry e =
          entry(kind.prefix + ps.spec(id).name, DType::kFP32, tp_whole_shape(ps.spec(id), tp));
      TpLayout layout = tp_layout(ps.spec(id), tp);
      if (!sharded) {
        on_device(std::move(e), std::move(layout), kind.base + ps.offset(id));
        continue;
      }
      // A distributed optimizer: the tensor's elements are flat elements [flat, flat + n); this
      // rank's share of their bucket starts at flat element part.begin, share element
      // part.share_begin.
      const int64_t flat = ps.offset(id), n = ps.numel(id);
      CheckpointTensor t{std::move(e), std::move(layout), {}, {}};
      REPLAY_REQUIRE(static_cast<int64_t>(slice_bytes(t, tp)) == n * 4,
                     "checkpoint: " + t.entry.name + "'s slice is not the parameter");
      if (kind.whole != nullptr) {
        REPLAY_REQUIRE(static_cast<int64_t>(kind.whole->size()) == ps.buffer_numel(),
                       "checkpoint: the gathered optimizer state is not whole");
        const float* from = kind.whole->data() + flat;
        t.fetch = [from, n](void* slice) {
          std::memcpy(slice, from, static_cast<size_t>(n) * sizeof(float));
        };
      }
      const ParamStore::Bucket part = ps.share_part(flat);
      float* base = kind.base;
      t.store = [base, part, flat, n](const void* slice) {
        const int64_t lo = std::max(flat, part.begin),
                      hi = std::min(flat + n, part.begin + part.length);
        if (lo < hi)
          REPLAY_CUDA_CHECK(cudaMemcpy(base + part.share_begin + (lo - part.begin),
                                       static_cast<const float*>(slice) + (lo - flat),
                                       static_cast<size_t>(hi - lo) * sizeof(float),
                                       cudaMemcpyHostToDevice));
      };
      out.push_back(std::move(t));
    }

  StepScalars& s = host->scalars;
  on_host(entry("train.step", DType::kINT64, {}), &s.step);
  on_host(entry("train.iteration", DType::kINT64, {}), &s.iteration);
  on_host(entry("train.loss_scale", DType::kFP32, {}), &s.loss_scale);
  on_host(entry("train.growth_tracker", DType::kINT32, {}), &s.growth_tracker);
  on_host(entry("train.hysteresis_left", DType::kINT32, {}), &s.hysteresis_left);
  on_host(entry("train.lr", DType::kFP32, {}), &s.lr);
  on_host(entry("train.loss", DType::kFP32, {}), &s.loss);

  const graphs::RngTracker& rng = trainer.rng();
  host->slots.resize(static_cast<size_t>(rng.stream_count()));
  static_assert(sizeof(PhiloxSlot) == 2 * sizeof(int64_t), "a slot is two 64-bit words");
  for (int i = 0; i < rng.stream_count(); ++i)
    on_host(entry("rng." + rng.stream_name(i), DType::kINT64, {2}),
            &host->slots[static_cast<size_t>(i)]);
  on_host(entry("data.position", DType::kINT64, {}), &host->data_position);

  for (const Model::NamedTensor& t : model.checkpoint_state()) {
    REPLAY_REQUIRE(t.view.is_contiguous(), "checkpoint state '" + t.name + "' is not contiguous");
    std::vector<int64_t> shape(t.view.shape.begin(), t.view.shape.begin() + t.view.ndim);
    on_device(entry("state." + t.name, t.view.dtype, shape), {}, t.view.data);
  }
  return out;
}

// The split tensors' layouts as the metadata's JSON object.
std::string layout_metadata(const std::vector<CheckpointTensor>& tensors) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const CheckpointTensor& t : tensors)
    if (t.layout.split != TpSplit::kNone && t.entry.name.rfind("optimizer.", 0) != 0)
      j[t.entry.name] = tp_layout_string(t.layout);
  return j.dump();
}

// The file's layouts by tensor name (the optimizer's tensors under their parameter's name).
std::unordered_map<std::string, TpLayout> file_layouts(const safetensors::Reader& r) {
  std::unordered_map<std::string, TpLayout> out;
  const std::string text = r.meta(kTpLayoutKey);
  if (text.empty()) return out;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
    for (const auto& [name, layout] : j.items())
      out[name] = parse_tp_layout(layout.get<std::string>());
  } catch (const std::exception& e) {
    usage("--load: " + r.path() + "'s metadata '" + kTpLayoutKey + "' is not a layout table (" +
          e.what() + ")");
  }
  return out;
}

// The parameter a file tensor belongs to: "optimizer.master.x" -> "x".
std::string param_name(const std::string& name) {
  for (const char* p : {"optimizer.master.", "optimizer.exp_avg_sq.", "optimizer.exp_avg."})
    if (name.rfind(p, 0) == 0) return name.substr(std::strlen(p));
  return name;
}

const HostGroup& alone() {
  static const HostGroup group;
  return group;
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
  for (CheckpointTensor& t : items(trainer, &host)) out.push_back(std::move(t.entry));
  return out;
}

int checkpoint_tp(const safetensors::Reader& r) {
  const std::string tp = r.meta(kTpDegreeKey);
  if (tp.empty()) return 1;
  if (tp.size() > 6 || tp.find_first_not_of("0123456789") != std::string::npos || std::stoi(tp) < 1)
    usage("--load: " + r.path() + "'s metadata '" + kTpDegreeKey + "' is '" + tp +
          "', not a tensor-parallel degree");
  return std::stoi(tp);
}

void check_tensor_parallel(const safetensors::Reader& r, int tp) {
  const int written = checkpoint_tp(r);
  const auto layouts = file_layouts(r);
  for (const auto& [name, layout] : layouts)
    if (r.find(name) == nullptr)
      usage("--load: " + r.path() + " records the layout of '" + name +
            "', which it does not hold");
  for (const TensorEntry& e : r.tensors()) {  // in file order: the first that fails is named
    const auto it = layouts.find(param_name(e.name));
    if (it == layouts.end()) continue;
    const std::string why = tp_divides(e.shape, it->second, tp);
    if (!why.empty())
      usage("--load: " + r.path() + " was written at --tp " + std::to_string(written) +
            "; this run's --tp " + std::to_string(tp) + " cannot split tensor '" + e.name + "' " +
            safetensors::shape_string(e.shape) + " (" + tp_layout_string(it->second) + "): " + why);
  }
}

void check_tensor_parallel_params(const ParamStore& ps, int tp) {
  if (tp == 1) return;
  for (ParamId id = 0; id < ps.count(); ++id) {
    const ParamSpec& s = ps.spec(id);
    if (!s.tp_replicated && s.tp_split == TpSplit::kNone)
      usage("--save/--load: parameter '" + s.name +
            "' differs on every tensor-parallel rank without a TpSplit saying where its slice "
            "sits, so a checkpoint cannot hold it whole");
  }
}

void check_layouts(const safetensors::Reader& r, const std::vector<CheckpointTensor>& tensors) {
  const auto file = file_layouts(r);
  if (file.empty()) return;  // an older file: whole tensors, laid out as the model says
  for (const CheckpointTensor& t : tensors) {
    const auto it = file.find(param_name(t.entry.name));
    const TpLayout theirs = it == file.end() ? TpLayout{} : it->second;
    if (theirs != t.layout)
      usage("--load: tensor '" + t.entry.name + "' is split as '" + tp_layout_string(theirs) +
            "' in " + r.path() + ", this run splits it as '" + tp_layout_string(t.layout) + "'");
  }
}

uint64_t write_checkpoint_tensors(const std::string& path,
                                  const std::vector<CheckpointTensor>& tensors,
                                  safetensors::Metadata meta, const HostGroup* group) {
  const HostGroup& g = group != nullptr ? *group : alone();
  const int tp = g.size();
  const bool root = g.rank() == 0;
  std::unique_ptr<safetensors::Writer> w;
  if (root) {
    meta[kTpDegreeKey] = std::to_string(tp);
    meta[kTpLayoutKey] = layout_metadata(tensors);
    std::vector<TensorEntry> entries;
    for (const CheckpointTensor& t : tensors) entries.push_back(t.entry);
    w = std::make_unique<safetensors::Writer>(path, std::move(entries), std::move(meta));
  }
  // One tensor at a time: this rank's slice, and on rank 0 the whole tensor put together.
  std::vector<unsigned char> slice, whole;
  uint64_t bytes = 0;
  for (const CheckpointTensor& t : tensors) {
    const bool split = t.layout.split != TpSplit::kNone;
    if (!root && !split) continue;  // rank 0's own
    slice.resize(slice_bytes(t, tp));
    t.fetch(slice.data());
    if (split && tp > 1) {
      whole.resize(root ? t.entry.bytes() : 0);
      tp_gather(g, t.entry.shape, t.layout, slice.data(), whole.data(), dtype_size(t.entry.dtype));
    }
    if (!root) continue;
    const std::vector<unsigned char>& data = split && tp > 1 ? whole : slice;
    REPLAY_REQUIRE(data.size() == t.entry.bytes(), "checkpoint: " + t.entry.name + " is not whole");
    w->write(data.data(), data.size());
    bytes += data.size();
  }
  if (root) w->commit();
  return bytes;
}

void read_checkpoint_tensors(const safetensors::Reader* reader,
                             const std::vector<CheckpointTensor>& tensors, const HostGroup* group) {
  const HostGroup& g = group != nullptr ? *group : alone();
  const int tp = g.size();
  const bool root = g.rank() == 0;
  // The file's order, as indices into `tensors`, from rank 0 to the others.
  std::vector<int32_t> order(tensors.size());
  std::unordered_map<std::string, int32_t> index;
  if (root) {
    REPLAY_REQUIRE(reader != nullptr, "read_checkpoint_tensors: rank 0 has no file");
    for (size_t i = 0; i < tensors.size(); ++i)
      index[tensors[i].entry.name] = static_cast<int32_t>(i);
    REPLAY_REQUIRE(reader->tensors().size() == tensors.size(),
                   "read_checkpoint_tensors: " + reader->path() + " holds " +
                       std::to_string(reader->tensors().size()) + " tensors, " +
                       std::to_string(tensors.size()) + " expected (check_tensors first)");
    for (size_t k = 0; k < order.size(); ++k) {
      const TensorEntry& e = reader->tensors()[k];
      const auto it = index.find(e.name);
      REPLAY_REQUIRE(
          it != index.end() && tensors[static_cast<size_t>(it->second)].entry.shape == e.shape,
          "read_checkpoint_tensors: tensor '" + e.name + "' not checked");
      order[k] = it->second;
    }
  }
  g.broadcast(order.data(), order.size() * sizeof(int32_t), 0);
  std::vector<unsigned char> whole, slice;
  // Rank 0 has tensor t whole at `data`: each rank's slice to its store.
  auto deliver = [&](const CheckpointTensor& t, const void* data) {
    if (tp == 1) {
      t.store(data);
      return;
    }
    slice.resize(slice_bytes(t, tp));
    tp_scatter(g, t.entry.shape, t.layout, data, slice.data(), dtype_size(t.entry.dtype));
    t.store(slice.data());
  };
  if (root) {
    reader->read_all([&](const TensorEntry& e, uint64_t off, const void* data, size_t n) {
      const CheckpointTensor& t = tensors[static_cast<size_t>(index.at(e.name))];
      if (off == 0 && n == e.bytes()) {  // in one piece
        deliver(t, data);
        return;
      }
      whole.resize(e.bytes());
      std::memcpy(whole.data() + off, data, n);
      if (off + n == e.bytes()) deliver(t, whole.data());
    });
  } else {
    for (const int32_t i : order) deliver(tensors[static_cast<size_t>(i)], nullptr);
  }
  // The content hash is checked after the last piece: the others wait for rank 0's verdict (a
  // failed check ends the job there).
  unsigned char verified = 1;
  g.broadcast(&verified, 1, 0);
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
                                const OptimizerStateHost* gathered, const HostGroup* tp_group) {
  cudaStream_t stream = trainer.stream();
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  REPLAY_REQUIRE(gathered != nullptr || trainer.model().params().shard_count() == 1,
                 "save_checkpoint: a distributed optimizer's state must be gathered first");
  const TpPlace place = tp_place(trainer);
  const HostGroup& g = tp_group != nullptr ? *tp_group : alone();
  REPLAY_REQUIRE(g.size() == place.size && g.rank() == place.rank,
                 "save_checkpoint: the host group is not the tensor-parallel group");
  HostState host;
  std::vector<CheckpointTensor> list = items(trainer, &host, gathered);
  REPLAY_CUDA_CHECK(
      cudaMemcpy(&host.scalars, trainer.scalars(), sizeof(StepScalars), cudaMemcpyDeviceToHost));
  const graphs::RngTracker& rng = trainer.rng();
  REPLAY_CUDA_CHECK(
      cudaMemcpy(host.slots.data(), rng.slots(), rng.slots_bytes(), cudaMemcpyDeviceToHost));
  host.data_position = trainer.model().data_position();

  SavedCheckpoint saved;
  saved.iteration = host.scalars.iteration;
  if (g.rank() == 0) saved.path = dir + "/" + checkpoint_file_name(saved.iteration);
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
  saved.bytes = write_checkpoint_tensors(saved.path, list, std::move(meta), &g);
  return saved;
}

int64_t load_checkpoint(const safetensors::Reader& r, Trainer& trainer, const HostGroup* tp_group) {
  cudaStream_t stream = trainer.stream();
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  const TpPlace place = tp_place(trainer);
  const HostGroup& g = tp_group != nullptr ? *tp_group : alone();
  REPLAY_REQUIRE(g.size() == place.size && g.rank() == place.rank,
                 "load_checkpoint: the host group is not the tensor-parallel group");
  HostState host;
  std::vector<CheckpointTensor> list = items(trainer, &host);
  check_layouts(r, list);
  // The fields the file does not hold (flags, the warm-up hold) start from the device's values.
  REPLAY_CUDA_CHECK(
      cudaMemcpy(&host.scalars, trainer.scalars(), sizeof(StepScalars), cudaMemcpyDeviceToHost));
  read_checkpoint_tensors(&r, list, &g);
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
