// h5.h: the small HDF5 toolkit behind replay's data files: an owning handle (H5Id) for every hid_t,
// a process-wide lock around HDF5 calls, and scalar attribute reads and writes.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "common/check.h"  // check_hdf5, the check behind REPLAY_HDF5_CHECK

namespace replay::data {

// Held around every sequence of HDF5 calls in replay. It takes a process-wide lock (HDF5 1.10 as
// distributions ship it is not always built thread-safe, and a BatchStream reads on its own thread;
// recursive, so handles can close under it) and turns off HDF5's own printing of its error stack on
// this thread (errors reach the user through replay::Error, whose message carries that stack).
class H5Guard {
 public:
  H5Guard();

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

// Owns one hid_t and closes it with the matching H5*close function.
class H5Id {
 public:
  using Close = herr_t (*)(hid_t);
  H5Id() = default;
  H5Id(hid_t id, Close close) : id_(id), close_(close) {}
  H5Id(H5Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  H5Id& operator=(H5Id&& o) noexcept;
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() { reset(); }

  hid_t get() const { return id_; }
  void reset() noexcept;

 private:
  hid_t id_ = H5I_INVALID_HID;
  Close close_ = nullptr;
};

// Checks a call that returns a new id exactly as REPLAY_HDF5_CHECK does, then owns the id.
H5Id h5_own(hid_t id, H5Id::Close close, const char* call, const char* file, int line);
#define REPLAY_H5_OWN(call, close) \
  ::replay::data::h5_own((call), (close), #call, __FILE__, __LINE__)

// Scalar attributes of an object (a file's root group or a dataset). A read returns nullopt when
// the attribute is missing, is not a single element, or has the wrong class (integer, float,
// string); integers and floats are converted by HDF5, strings may be fixed-length or
// variable-length.
std::optional<int64_t> read_int_attr(hid_t obj, const char* name);
std::optional<uint64_t> read_uint_attr(hid_t obj, const char* name);
std::optional<double> read_float_attr(hid_t obj, const char* name);
std::optional<std::string> read_string_attr(hid_t obj, const char* name);

// Writes create a scalar attribute; strings are variable-length UTF-8, as h5py writes a Python str.
void write_attr(hid_t obj, const char* name, int64_t value);
void write_attr(hid_t obj, const char* name, uint64_t value);
void write_attr(hid_t obj, const char* name, double value);
void write_attr(hid_t obj, const char* name, const std::string& value);

// The end of an atomic write: flushes and closes `file` (written at `temp_path`, every other handle
// into it closed already) and renames it to `path`, so a reader sees the whole file or none.
// Throws Error naming both paths when the rename fails.
void commit_file(H5Id& file, const std::string& temp_path, const std::string& path);

}  // namespace replay::data
