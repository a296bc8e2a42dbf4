// h5.cpp: HDF5 handles, the HDF5 lock, scalar attributes.
#include "common/data/h5.h"

#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

namespace replay::data {

namespace {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex m;
  return m;
}

// Opens attribute `name` of `obj` when it exists and holds one element of class `cls`.
std::optional<H5Id> open_scalar_attr(hid_t obj, const char* name, H5T_class_t cls, H5Id* type_out) {
  const htri_t exists = H5Aexists(obj, name);
  REPLAY_HDF5_CHECK(exists);
  if (exists == 0) return std::nullopt;
  H5Id attr = REPLAY_H5_OWN(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  H5Id space = REPLAY_H5_OWN(H5Aget_space(attr.get()), H5Sclose);
  const hssize_t points = H5Sget_simple_extent_npoints(space.get());
  REPLAY_HDF5_CHECK(points);
  H5Id type = REPLAY_H5_OWN(H5Aget_type(attr.get()), H5Tclose);
  const H5T_class_t type_class = H5Tget_class(type.get());
  REPLAY_HDF5_CHECK(type_class);
  if (points != 1 || type_class != cls) return std::nullopt;
  if (type_out) *type_out = std::move(type);
  return attr;
}

template <typename T>
std::optional<T> read_number(hid_t obj, const char* name, H5T_class_t cls, hid_t mem_type) {
  H5Guard guard;
  std::optional<H5Id> attr = open_scalar_attr(obj, name, cls, nullptr);
  if (!attr) return std::nullopt;
  T value{};
  REPLAY_HDF5_CHECK(H5Aread(attr->get(), mem_type, &value));
  return value;
}

void write_scalar(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value) {
  H5Guard guard;
  H5Id space = REPLAY_H5_OWN(H5Screate(H5S_SCALAR), H5Sclose);
  H5Id attr = REPLAY_H5_OWN(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                            H5Aclose);
  REPLAY_HDF5_CHECK(H5Awrite(attr.get(), mem_type, value));
}

}  // namespace

H5Guard::H5Guard() : lock_(hdf5_mutex()) {
  // Thread-safe builds keep the error-printing setting per thread, so set it on each thread once.
  thread_local bool quiet = false;
  if (!quiet) {
    REPLAY_HDF5_CHECK(H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr));
    quiet = true;
  }
}

H5Id& H5Id::operator=(H5Id&& o) noexcept {
  if (this != &o) {
    reset();
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

void H5Id::reset() noexcept {
  if (id_ < 0) return;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  close_(id_);  // a failed close cannot be reported from a destructor; HDF5 keeps no state for it
  id_ = H5I_INVALID_HID;
}

H5Id h5_own(hid_t id, H5Id::Close close, const char* call, const char* file, int line) {
  detail::check_hdf5(static_cast<int64_t>(id), call, file, line);
  return H5Id(id, close);
}

std::optional<int64_t> read_int_attr(hid_t obj, const char* name) {
  return read_number<int64_t>(obj, name, H5T_INTEGER, H5T_NATIVE_INT64);
}

std::optional<uint64_t> read_uint_attr(hid_t obj, const char* name) {
  return read_number<uint64_t>(obj, name, H5T_INTEGER, H5T_NATIVE_UINT64);
}

std::optional<double> read_float_attr(hid_t obj, const char* name) {
  return read_number<double>(obj, name, H5T_FLOAT, H5T_NATIVE_DOUBLE);
}

std::optional<std::string> read_string_attr(hid_t obj, const char* name) {
  H5Guard guard;
  H5Id type;
  std::optional<H5Id> attr = open_scalar_attr(obj, name, H5T_STRING, &type);
  if (!attr) return std::nullopt;
  // Reading with a copy of the file's own type keeps its character set (ASCII or UTF-8): HDF5 does
  // not convert between the two.
  H5Id mem_type = REPLAY_H5_OWN(H5Tcopy(type.get()), H5Tclose);
  const htri_t variable = H5Tis_variable_str(type.get());
  REPLAY_HDF5_CHECK(variable);
  if (variable > 0) {
    char* text = nullptr;
    REPLAY_HDF5_CHECK(H5Aread(attr->get(), mem_type.get(), &text));
    std::string value = text ? text : "";
    REPLAY_HDF5_CHECK(H5free_memory(text));
    return value;
  }
  const size_t size = H5Tget_size(type.get());  // 0 only on failure
  if (size == 0) throw_error("HDF5", "failure", "H5Tget_size", __FILE__, __LINE__, name);
  std::vector<char> text(size + 1, '\0');
  REPLAY_HDF5_CHECK(H5Aread(attr->get(), mem_type.get(), text.data()));
  return std::string(text.data(), strnlen(text.data(), size));
}

void write_attr(hid_t obj, const char* name, int64_t value) {
  write_scalar(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void write_attr(hid_t obj, const char* name, uint64_t value) {
  write_scalar(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}

void write_attr(hid_t obj, const char* name, double value) {
  write_scalar(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

void write_attr(hid_t obj, const char* name, const std::string& value) {
  H5Guard guard;
  H5Id type = REPLAY_H5_OWN(H5Tcopy(H5T_C_S1), H5Tclose);
  REPLAY_HDF5_CHECK(H5Tset_size(type.get(), H5T_VARIABLE));
  REPLAY_HDF5_CHECK(H5Tset_cset(type.get(), H5T_CSET_UTF8));
  const char* text = value.c_str();
  write_scalar(obj, name, type.get(), type.get(), &text);
}

void commit_file(H5Id& file, const std::string& temp_path, const std::string& path) {
  REPLAY_HDF5_CHECK(H5Fflush(file.get(), H5F_SCOPE_GLOBAL));
  file.reset();
  std::error_code ec;
  std::filesystem::rename(temp_path, path, ec);
  if (ec)
    throw_error("replay", "write failed", "rename", __FILE__, __LINE__,
                "'" + temp_path + "' -> '" + path + "': " + ec.message());
}

}  // namespace replay::data
