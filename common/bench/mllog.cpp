// mllog.cpp: MLPerf log lines, encoded as the Python reference logger writes them.
#include "common/bench/mllog.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace replay::bench {
namespace {

// Call sites are written relative to the repository root, found from this file's own path.
std::string_view repo_root() {
  constexpr std::string_view self = __FILE__, tail = "common/bench/mllog.cpp";
  if (self.size() >= tail.size() && self.substr(self.size() - tail.size()) == tail)
    return self.substr(0, self.size() - tail.size());
  return {};
}

std::string_view relative_to_root(std::string_view file) {
  const std::string_view root = repo_root();
  if (!root.empty() && file.substr(0, root.size()) == root) file.remove_prefix(root.size());
  return file;
}

// One JSON scalar; nlohmann writes doubles in the shortest form that reads back exactly, and a
// non-finite double as null. Invalid UTF-8 in a string (an odd error message) is replaced, not
// thrown.
std::string encode(const MlValue& value) {
  const nlohmann::json j = std::visit(
      [](const auto& v) -> nlohmann::json {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::monostate>)
          return nullptr;
        else
          return v;
      },
      value.get());
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string quote(std::string_view s) {
  return encode(MlValue(s));
}

// Python's json.dumps separators (", " and ": "), as the reference logger writes them.
void append_fields(std::string& out, const MlFields& fields) {
  for (const auto& [name, value] : fields) {
    out += ", ";
    out += quote(name);
    out += ": ";
    out += encode(value);
  }
}

std::string encode_object(const MlFields& fields) {
  std::string out = "{";
  append_fields(out, fields);
  if (!fields.empty()) out.erase(1, 2);  // the first field has no leading ", "
  return out + "}";
}

const MlValue* find(const MlFields& fields, std::string_view name) {
  for (const auto& [n, v] : fields)
    if (n == name) return &v;
  return nullptr;
}

int64_t system_clock_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

MlLogger::MlLogger(MlLogOptions options)
    : enabled_(options.rank == 0),
      echo_(options.echo),
      clock_(options.clock ? std::move(options.clock) : system_clock_ms) {
  if (!enabled_ || options.path.empty()) return;
  file_ = std::fopen(options.path.c_str(), "w");
  if (!file_)
    throw_error("replay", std::strerror(errno), "fopen", __FILE__, __LINE__,
                "cannot open the mllog file " + options.path);
}

MlLogger::~MlLogger() {
  // A run that logged something but never run_stop ended on an error path: close it as aborted.
  try {
    abort("the logger was closed before run_stop");
  } catch (...) {
  }
  if (file_) std::fclose(file_);
}

void MlLogger::event(std::string_view key, const MlValue& value, const MlFields& metadata,
                     MlSite site) {
  if (enabled_) write(mlkey::kPointInTime, key, encode(value), metadata, site);
}

void MlLogger::start(std::string_view key, const MlFields& metadata, MlSite site) {
  if (enabled_) write(mlkey::kIntervalStart, key, "null", metadata, site);
}

void MlLogger::end(std::string_view key, const MlFields& metadata, MlSite site) {
  if (enabled_) write(mlkey::kIntervalEnd, key, "null", metadata, site);
}

void MlLogger::tracked_stats(int64_t step, const MlFields& stats, MlSite site) {
  if (enabled_)
    write(mlkey::kPointInTime, mlkey::kTrackedStats, encode_object(stats), {{mlkey::kStep, step}},
          site);
}

void MlLogger::abort(std::string_view reason, MlSite site) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!enabled_ || !wrote_ || stopped_) return;
  }
  write(mlkey::kIntervalEnd, mlkey::kRunStop, "null",
        {{mlkey::kStatus, mlkey::kAborted}, {"error", reason}}, site);
}

void MlLogger::write(const char* event_type, std::string_view key, const std::string& value_json,
                     const MlFields& metadata, MlSite site) {
  REPLAY_REQUIRE(!find(metadata, "file") && !find(metadata, "lineno"),
                 "mllog metadata 'file' and 'lineno' are the call site's, set by the logger");
  const bool run_stop = key == mlkey::kRunStop;
  if (run_stop) {
    const MlValue* status = find(metadata, mlkey::kStatus);
    const auto* s = status ? std::get_if<std::string>(&status->get()) : nullptr;
    REPLAY_REQUIRE(s && (*s == mlkey::kSuccess || *s == mlkey::kAborted),
                   "run_stop needs metadata status \"success\" or \"aborted\"");
  }

  std::string line = ":::MLLOG {\"namespace\": \"\", \"time_ms\": ";
  line += std::to_string(clock_());
  line += ", \"event_type\": \"";
  line += event_type;
  line += "\", \"key\": " + quote(key);
  line += ", \"value\": " + value_json;
  line += ", \"metadata\": {\"file\": " + quote(relative_to_root(site.file));
  line += ", \"lineno\": " + std::to_string(site.line);
  append_fields(line, metadata);
  line += "}}\n";

  std::lock_guard<std::mutex> lock(mutex_);
  REPLAY_REQUIRE(!(run_stop && stopped_), "run_stop was already logged");
  // Flushed per line: a run killed at any point leaves every line before it intact.
  if (file_ && (std::fputs(line.c_str(), file_) == EOF || std::fflush(file_) != 0))
    throw_error("replay", std::strerror(errno), "fputs", __FILE__, __LINE__,
                "cannot write the mllog file");
  if (echo_) {
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
  }
  wrote_ = true;
  stopped_ = stopped_ || run_stop;
}

}  // namespace replay::bench
