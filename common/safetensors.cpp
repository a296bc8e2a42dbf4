// safetensors.cpp: the format's reader and writer (safetensors.h).
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace replay::safetensors {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error("safetensors", "invalid file", path + ": " + what);
}

std::string errno_text() {
  return std::strerror(errno);
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

std::string base_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

uint64_t read_le64(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

void write_le64(uint64_t v, unsigned char* b) {
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
}

// A non-negative integer from the header, or an error naming the tensor and the field.
uint64_t header_uint(const std::string& path, const std::string& tensor, const char* field,
                     const nlohmann::json& v) {
  if (!v.is_number_unsigned())  // the parser makes every non-negative integer unsigned
    fail(path, "tensor '" + tensor + "': " + field + " holds " + v.dump() +
                   ", not a non-negative integer");
  return v.get<uint64_t>();
}

}  // namespace

const char* dtype_tag(DType t) {
  switch (t) {
    case DType::kBF16:
      return "BF16";
    case DType::kFP16:
      return "F16";
    case DType::kFP32:
      return "F32";
    case DType::kFP8E4M3:
      return "F8_E4M3";
    case DType::kFP8E5M2:
      return "F8_E5M2";
    case DType::kINT32:
      return "I32";
    case DType::kINT64:
      return "I64";
    case DType::kUINT8:
      return "U8";
  }
  throw Error("safetensors", "dtype", "a dtype safetensors has no name for");
}

DType dtype_from_tag(const std::string& name) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2,
                  DType::kINT32, DType::kINT64, DType::kUINT8})
    if (name == dtype_tag(t)) return t;
  throw Error("safetensors", "dtype",
              "dtype '" + name + "' (replay reads BF16, F16, F32, F8_E4M3, F8_E5M2, I32, I64, U8)");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- Reader ------------------------------------------------------------------------------------

Reader::Reader(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "rb");
  if (file_ == nullptr)
    throw Error("safetensors", "open", path_ + ": cannot open: " + errno_text());
  struct stat st {};
  if (fstat(fileno(file_), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::fclose(file_);
    file_ = nullptr;
    throw Error("safetensors", "open", path_ + ": not a regular file");
  }
  try {
    const auto size = static_cast<uint64_t>(st.st_size);
    unsigned char len[8];
    if (size < 8 || std::fread(len, 1, 8, file_) != 8)
      fail(path_, "truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte length");
    const uint64_t n = read_le64(len);
    if (n == 0 || n > kMaxHeaderBytes)
      fail(path_, "a header of " + std::to_string(n) + " bytes (at most " +
                      std::to_string(kMaxHeaderBytes) + ")");
    if (8 + n > size)
      fail(path_, "truncated: the header claims " + std::to_string(n) + " bytes, the file has " +
                      std::to_string(size - 8) + " after the length");
    std::string text(n, '\0');
    if (std::fread(text.data(), 1, n, file_) != n) fail(path_, "cannot read the header");
    data_start_ = 8 + n;
    data_bytes_ = size - data_start_;

    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(path_, std::string("the header is not JSON: ") + e.what());
    }
    if (!header.is_object()) fail(path_, "the header is not a JSON object");
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) fail(path_, "__metadata__ is not an object");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string()) fail(path_, "__metadata__ '" + m.key() + "' is not a string");
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
          !v.contains("data_offsets"))
        fail(path_, "tensor '" + name + "' lacks dtype, shape or data_offsets");
      TensorEntry e;
      e.name = name;
      if (!v["dtype"].is_string()) fail(path_, "tensor '" + name + "': dtype is not a string");
      try {
        e.dtype = dtype_from_tag(v["dtype"].get<std::string>());
      } catch (const Error& err) {
        fail(path_, "tensor '" + name + "': " + err.what());
      }
      if (!v["shape"].is_array()) fail(path_, "tensor '" + name + "': shape is not a list");
      for (const nlohmann::json& d : v["shape"]) {
        const uint64_t dim = header_uint(path_, name, "shape", d);
        if (dim > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) * 1024)
          fail(path_, "tensor '" + name + "': dimension " + std::to_string(dim) + " is too large");
        e.shape.push_back(static_cast<int64_t>(dim));
      }
      const nlohmann::json& off = v["data_offsets"];
      if (!off.is_array() || off.size() != 2)
        fail(path_, "tensor '" + name + "': data_offsets is not [begin, end]");
      e.begin = header_uint(path_, name, "data_offsets", off[0]);
      e.end = header_uint(path_, name, "data_offsets", off[1]);
      if (e.end < e.begin || e.end - e.begin != e.bytes())
        fail(path_, "tensor '" + name + "': data_offsets [" + std::to_string(e.begin) + ", " +
                        std::to_string(e.end) + ") hold " +
                        std::to_string(e.end >= e.begin ? e.end - e.begin : 0) + " bytes, its " +
                        safetensors::dtype_tag(e.dtype) + " " + shape_string(e.shape) + " needs " +
                        std::to_string(e.bytes()));
      tensors_.push_back(std::move(e));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin; });
    uint64_t at = 0;
    for (const TensorEntry& e : tensors_) {
      if (e.begin != at)
        fail(path_, "tensor '" + e.name + "' begins at byte " + std::to_string(e.begin) +
                        " of the data, the previous tensor ends at " + std::to_string(at) +
                        (e.begin < at ? " (overlap)" : " (a gap)"));
      at = e.end;
    }
    if (at != data_bytes_)
      fail(path_, at > data_bytes_
                      ? "truncated: the header describes " + std::to_string(at) +
                            " bytes of data, the file holds " + std::to_string(data_bytes_)
                      : "the file holds " + std::to_string(data_bytes_ - at) +
                            " bytes past the last tensor");
  } catch (...) {
    std::fclose(file_);
    file_ = nullptr;
    throw;
  }
}

Reader::~Reader() {
  if (file_ != nullptr) std::fclose(file_);
}

const TensorEntry* Reader::find(const std::string& name) const {
  for (const TensorEntry& e : tensors_)
    if (e.name == name) return &e;
  return nullptr;
}

std::string Reader::meta(const std::string& key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? std::string() : it->second;
}

void Reader::read(const TensorEntry& e, void* host) const {
  if (e.bytes() == 0) return;
  if (fseeko(file_, static_cast<off_t>(data_start_ + e.begin), SEEK_SET) != 0 ||
      std::fread(host, 1, e.bytes(), file_) != e.bytes())
    fail(path_, "cannot read tensor '" + e.name + "'");
}

void Reader::read_all(
    const std::function<void(const TensorEntry&, uint64_t, const void*, size_t)>& fn,
    size_t piece) const {
  REPLAY_REQUIRE(piece > 0, "read_all: piece must be positive");
  const std::string expected = meta(kDataHashKey);
  Hasher h;
  std::vector<unsigned char> buf(
      static_cast<size_t>(std::min<uint64_t>(piece, std::max<uint64_t>(data_bytes_, 1))));
  if (fseeko(file_, static_cast<off_t>(data_start_), SEEK_SET) != 0)
    fail(path_, "cannot seek to the data");
  for (const TensorEntry& e : tensors_) {
    for (uint64_t off = 0; off < e.bytes();) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), e.bytes() - off));
      if (std::fread(buf.data(), 1, n, file_) != n)
        fail(path_, "cannot read tensor '" + e.name + "'");
      if (!expected.empty()) h.update(buf.data(), n);
      fn(e, off, buf.data(), n);
      off += n;
    }
  }
  if (!expected.empty() && h.hex() != expected)
    fail(path_, std::string("corrupt: the data hash to ") + h.hex() + ", the header records " +
                    expected + " (" + kDataHashKey + ")");
}

// ---- Writer ------------------------------------------------------------------------------------

Writer::Writer(std::string path, std::vector<TensorEntry> tensors, Metadata metadata, bool hash)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  const std::string dir = directory_of(path_);
  tmp_path_ = dir + "/." + base_of(path_) + ".tmp." + std::to_string(getpid());
  nlohmann::ordered_json header;
  uint64_t at = 0;
  for (TensorEntry& e : tensors_) {
    REPLAY_REQUIRE(!e.name.empty() && e.name != "__metadata__", "a tensor needs a name");
    e.begin = at;
    e.end = at + e.bytes();
    at = e.end;
  }
  data_bytes_ = at;
  static constexpr const char* kPlaceholder = "0000000000000000";
  if (hash) metadata[kDataHashKey] = kPlaceholder;
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  for (const TensorEntry& e : tensors_) {
    if (header.contains(e.name))
      throw Error("safetensors", "write", "tensor '" + e.name + "' twice");
    nlohmann::ordered_json t;
    t["dtype"] = dtype_tag(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {e.begin, e.end};
    header[e.name] = std::move(t);
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // the data section starts 8-byte aligned
  if (hash) {
    const std::string key = std::string("\"") + kDataHashKey + "\":\"" + kPlaceholder + "\"";
    const size_t at_key = text.find(key);
    REPLAY_REQUIRE(at_key != std::string::npos, "safetensors: the hash placeholder is missing");
    hash_at_ = static_cast<long>(8 + at_key + key.size() - 1 - 16);
  }

  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (file_ == nullptr)
    throw Error("safetensors", "write", "cannot write in " + dir + ": " + errno_text());
  unsigned char len[8];
  write_le64(text.size(), len);
  data_start_ = 8 + text.size();
  if (std::fwrite(len, 1, 8, file_) != 8 ||
      std::fwrite(text.data(), 1, text.size(), file_) != text.size()) {
    const std::string err = errno_text();
    std::fclose(file_);
    file_ = nullptr;
    std::remove(tmp_path_.c_str());
    throw Error("safetensors", "write", tmp_path_ + ": " + err);
  }
}

Writer::~Writer() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) std::remove(tmp_path_.c_str());
}

void Writer::write(const void* data, size_t bytes) {
  REPLAY_REQUIRE(file_ != nullptr && !committed_, "safetensors: write after commit");
  if (written_ + bytes > data_bytes_)
    throw Error("safetensors", "write",
                path_ + ": " + std::to_string(written_ + bytes) +
                    " bytes of data, the tensors need " + std::to_string(data_bytes_));
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, file_) != bytes)
    throw Error("safetensors", "write", tmp_path_ + ": " + errno_text());
  if (hash_at_ >= 0) hasher_.update(data, bytes);
  written_ += bytes;
}

void Writer::commit() {
  REPLAY_REQUIRE(file_ != nullptr && !committed_, "safetensors: commit twice");
  if (written_ != data_bytes_)
    throw Error("safetensors", "write",
                path_ + ": " + std::to_string(written_) +
                    " bytes of data written, the tensors need " + std::to_string(data_bytes_));
  if (hash_at_ >= 0) {
    const std::string hex = hasher_.hex();
    if (std::fseek(file_, hash_at_, SEEK_SET) != 0 ||
        std::fwrite(hex.data(), 1, hex.size(), file_) != hex.size())
      throw Error("safetensors", "write", tmp_path_ + ": " + errno_text());
  }
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0)
    throw Error("safetensors", "write", tmp_path_ + ": " + errno_text());
  const int rc = std::fclose(file_);
  file_ = nullptr;
  if (rc != 0) throw Error("safetensors", "write", tmp_path_ + ": " + errno_text());
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    throw Error("safetensors", "write", "cannot rename to " + path_ + ": " + errno_text());
  committed_ = true;
  // The rename itself is durable once the directory is synced.
  const int dir = open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    fsync(dir);
    close(dir);
  }
}

}  // namespace replay::safetensors
