// speech_file.cpp: validation and reading of speech files, the atomic writer, fp16/bf16 bits.
#include "workloads/rnnt/speech_file.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

namespace replay::rnnt {

using data::H5Guard;
using data::H5Id;

namespace {

// A problem with the user's file: an Error that names the file.
[[noreturn]] void bad_file(const std::string& path, const std::string& problem, int line) {
  throw_error("replay", "invalid data file", "SpeechFile", __FILE__, line,
              "speech data file '" + path + "': " + problem);
}
#define REPLAY_BAD_SPEECH(path, problem) bad_file((path), (problem), __LINE__)

const std::string kSeeLayout = " (the layout is documented in datasets/rnnt.md)";

constexpr const char* kFeatures = "features";           // [total_frames, feature_dim] fp16|fp32
constexpr const char* kFrameOffsets = "frame_offsets";  // [N + 1] int64
constexpr const char* kLabels = "labels";               // [total_labels] int32
constexpr const char* kLabelOffsets = "label_offsets";  // [N + 1] int64

std::string str(int64_t v) {
  return std::to_string(v);
}

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

bool fp16_finite(uint16_t h) {
  return (h & 0x7C00u) != 0x7C00u;
}

// IEEE binary16 as an HDF5 type in the byte order of `base` (a 4-byte IEEE float type), built as
// h5py builds its float16, so that files written by either read as a plain copy in the other.
H5Id make_fp16_type(hid_t base) {
  H5Id type = REPLAY_H5_OWN(H5Tcopy(base), H5Tclose);
  REPLAY_HDF5_CHECK(H5Tset_fields(type.get(), 15, 10, 5, 0, 10));
  REPLAY_HDF5_CHECK(H5Tset_size(type.get(), 2));
  REPLAY_HDF5_CHECK(H5Tset_ebias(type.get(), 15));
  return type;
}

// The feature type a file's float type is, if it is IEEE fp16 or fp32 (either byte order).
std::optional<FeatureType> stored_feature_type(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  REPLAY_HDF5_CHECK(cls);
  if (cls != H5T_FLOAT) return std::nullopt;
  size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
  REPLAY_HDF5_CHECK(H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize));
  const size_t ebias = H5Tget_ebias(type);
  const size_t size = H5Tget_size(type);
  if (size == 2 && spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10 &&
      ebias == 15)
    return FeatureType::kFP16;
  if (size == 4 && spos == 31 && epos == 23 && esize == 8 && mpos == 0 && msize == 23 &&
      ebias == 127)
    return FeatureType::kFP32;
  return std::nullopt;
}

// "int64", "uint32", "a 2-byte float with 8 exponent bits", ...: what a rejected type is.
std::string describe_type(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const size_t size = H5Tget_size(type);
  if (cls == H5T_INTEGER)
    return std::string(H5Tget_sign(type) == H5T_SGN_2 ? "int" : "uint") + str(8 * size);
  if (cls == H5T_FLOAT) {
    size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
    H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize);
    return "a float of " + str(size) + " bytes (" + str(esize) + " exponent, " + str(msize) +
           " mantissa bits)";
  }
  if (cls == H5T_STRING) return "a string type";
  return "a non-numeric type (HDF5 class " + str(cls) + ")";
}

bool is_signed_int(hid_t type, size_t bytes) {
  const H5T_class_t cls = H5Tget_class(type);
  REPLAY_HDF5_CHECK(cls);
  return cls == H5T_INTEGER && H5Tget_size(type) == bytes && H5Tget_sign(type) == H5T_SGN_2;
}

// Opens dataset /name of the file, or fails naming it.
H5Id open_dataset(const std::string& path, hid_t root, const char* name) {
  const htri_t exists = H5Lexists(root, name, H5P_DEFAULT);
  REPLAY_HDF5_CHECK(exists);
  if (exists == 0) REPLAY_BAD_SPEECH(path, "no dataset '/" + std::string(name) + "'" + kSeeLayout);
  H5Id object = REPLAY_H5_OWN(H5Oopen(root, name, H5P_DEFAULT), H5Oclose);
  const H5I_type_t object_type = H5Iget_type(object.get());
  REPLAY_HDF5_CHECK(object_type);
  if (object_type != H5I_DATASET)
    REPLAY_BAD_SPEECH(path, "'/" + std::string(name) + "' is not a dataset" + kSeeLayout);
  return object;
}

std::vector<hsize_t> dataset_dims(hid_t dataset) {
  H5Id space = REPLAY_H5_OWN(H5Dget_space(dataset), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  REPLAY_HDF5_CHECK(rank);
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) REPLAY_HDF5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  return dims;
}

// Checks a dataset's rank and element type; `what` names the expected type in the message.
std::vector<hsize_t> check_dataset(const std::string& path, hid_t dataset, const char* name,
                                   int rank, const char* shape, bool type_ok, hid_t type,
                                   const char* what) {
  const std::vector<hsize_t> dims = dataset_dims(dataset);
  if (static_cast<int>(dims.size()) != rank)
    REPLAY_BAD_SPEECH(path, "'/" + std::string(name) + "' has rank " + str(dims.size()) +
                                ", expected " + str(rank) + ": " + shape);
  if (!type_ok)
    REPLAY_BAD_SPEECH(path, "'/" + std::string(name) + "' holds " + describe_type(type) +
                                "; it must hold " + what + kSeeLayout);
  return dims;
}

// Reads all of 1-D dataset /name, n elements, as `mem_type`; a failed read (a checksum mismatch)
// names the file and the dataset.
template <typename T>
std::vector<T> read_all(const std::string& path, hid_t dataset, const char* name, int64_t n,
                        hid_t mem_type) {
  std::vector<T> values(static_cast<size_t>(n));
  try {
    if (n > 0)
      REPLAY_HDF5_CHECK(H5Dread(dataset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  } catch (const Error& e) {
    REPLAY_BAD_SPEECH(path, "reading '/" + std::string(name) + "' failed (" + e.what() + ")");
  }
  return values;
}

// Checks one offsets dataset: starts at 0, never decreases, ends at the total.
void check_offsets(const std::string& path, const char* name, const std::vector<int64_t>& offsets,
                   int64_t total, const char* total_name) {
  const std::string where = "'/" + std::string(name) + "'";
  if (offsets.front() != 0)
    REPLAY_BAD_SPEECH(path, where + " must start at 0 but starts at " + str(offsets.front()));
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    if (offsets[i + 1] < offsets[i])
      REPLAY_BAD_SPEECH(path, where + " is not monotonic: utterance " + str(i) + " runs from " +
                                  str(offsets[i]) + " to " + str(offsets[i + 1]));
  }
  if (offsets.back() != total)
    REPLAY_BAD_SPEECH(path, where + " ends at " + str(offsets.back()) + " but " + total_name +
                                " is " + str(total));
}

// Converts n features from the file's type to the requested one, checking each value (finite, and
// within fp16's range when fp16 is asked for). Returns the first bad element, or -1.
int64_t convert_features(const void* src, FeatureType from, void* dst, FeatureType to, int64_t n) {
  if (from == FeatureType::kFP16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t k = 0; k < n; ++k)
      if (!fp16_finite(s[k])) return k;
    if (to == FeatureType::kFP16) {
      if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * 2);
    } else if (to == FeatureType::kFP32) {
      float* d = static_cast<float*>(dst);
      for (int64_t k = 0; k < n; ++k) d[k] = float_from_fp16(s[k]);
    } else {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t k = 0; k < n; ++k) d[k] = bf16_from_float(float_from_fp16(s[k]));
    }
    return -1;
  }
  const float* s = static_cast<const float*>(src);
  for (int64_t k = 0; k < n; ++k)
    if (!std::isfinite(s[k])) return k;
  if (to == FeatureType::kFP32) {
    if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (to == FeatureType::kFP16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t k = 0; k < n; ++k) {
      d[k] = fp16_from_float(s[k]);
      if (!fp16_finite(d[k])) return k;
    }
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t k = 0; k < n; ++k) d[k] = bf16_from_float(s[k]);
  }
  return -1;
}

// Elements per chunk: about 64 KiB, at least one row, at most the dataset.
hsize_t chunk_rows(int64_t rows, int64_t row_bytes) {
  return static_cast<hsize_t>(std::clamp<int64_t>((64 << 10) / row_bytes, 1, rows));
}

// A chunked, Fletcher32-checksummed dataset (contiguous when empty: HDF5 cannot chunk a fixed
// extent of 0).
H5Id create_dataset(hid_t file, const char* name, hid_t type, std::vector<hsize_t> dims,
                    size_t element_bytes) {
  H5Id space = REPLAY_H5_OWN(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                             H5Sclose);
  H5Id create = REPLAY_H5_OWN(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (dims[0] > 0) {
    std::vector<hsize_t> chunk = dims;
    int64_t row_bytes = static_cast<int64_t>(element_bytes);
    for (size_t d = 1; d < dims.size(); ++d) row_bytes *= static_cast<int64_t>(dims[d]);
    chunk[0] = chunk_rows(static_cast<int64_t>(dims[0]), row_bytes);
    REPLAY_HDF5_CHECK(H5Pset_chunk(create.get(), static_cast<int>(chunk.size()), chunk.data()));
    REPLAY_HDF5_CHECK(H5Pset_fletcher32(create.get()));  // verified on every read
  }
  return REPLAY_H5_OWN(
      H5Dcreate2(file, name, type, space.get(), H5P_DEFAULT, create.get(), H5P_DEFAULT), H5Dclose);
}

// Writes elements [first, first + count) of a 1-D dataset.
void write_range(hid_t dataset, hid_t mem_type, int64_t first, int64_t count, const void* values) {
  if (count == 0) return;
  const hsize_t start[1] = {static_cast<hsize_t>(first)};
  const hsize_t extent[1] = {static_cast<hsize_t>(count)};
  H5Id file_space = REPLAY_H5_OWN(H5Dget_space(dataset), H5Sclose);
  REPLAY_HDF5_CHECK(
      H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, extent, nullptr));
  H5Id mem_space = REPLAY_H5_OWN(H5Screate_simple(1, extent, nullptr), H5Sclose);
  REPLAY_HDF5_CHECK(
      H5Dwrite(dataset, mem_type, mem_space.get(), file_space.get(), H5P_DEFAULT, values));
}

std::vector<int64_t> prefix_sums(const std::vector<int32_t>& lengths) {
  std::vector<int64_t> offsets(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) offsets[i + 1] = offsets[i] + lengths[i];
  return offsets;
}

}  // namespace

size_t feature_bytes(FeatureType type) {
  return type == FeatureType::kFP32 ? 4 : 2;
}

const char* feature_type_name(FeatureType type) {
  switch (type) {
    case FeatureType::kFP32:
      return "fp32";
    case FeatureType::kFP16:
      return "fp16";
    default:
      return "bf16";
  }
}

uint16_t fp16_from_float(float x) {
  const uint32_t f = float_bits(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: rounds to inf
  if (a >= 0x38800000u) {  // a normal half (>= 2^-14): re-bias the exponent, round at bit 13
    const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
  }
  // A subnormal half: round(|x| * 2^24) to an integer, ties to even (1024 is the smallest normal).
  const int shift = 126 - static_cast<int>(a >> 23);   // |x| * 2^24 = m * 2^-shift
  if (shift > 24) return static_cast<uint16_t>(sign);  // below 2^-25 (or float subnormal): 0
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

float float_from_fp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exponent == 31) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t bf16_from_float(float x) {
  const uint32_t f = float_bits(x);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((f >> 16) | 0x0040u);  // NaN
  return static_cast<uint16_t>((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

float float_from_bf16(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

// ---- The reader ---------------------------------------------------------------------------------

SpeechFile::SpeechFile(const std::string& path, const SpeechShape& shape) : shape_(shape) {
  REPLAY_REQUIRE(shape.feature_dim > 0 && shape.vocab_size > 0 && shape.max_frames >= 0 &&
                     shape.max_labels >= 0,
                 "SpeechShape needs a positive feature size and vocabulary, and limits >= 0");
  info_.path = path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) REPLAY_BAD_SPEECH(path, "no such file");
  if (!std::filesystem::is_regular_file(path, ec)) REPLAY_BAD_SPEECH(path, "not a regular file");

  H5Guard guard;
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  if (is_hdf5 == 0) REPLAY_BAD_SPEECH(path, "not an HDF5 file" + kSeeLayout);
  try {
    REPLAY_HDF5_CHECK(is_hdf5);
    file_ = REPLAY_H5_OWN(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  } catch (const Error& e) {
    // HDF5 finds the signature but not the rest: most often a copy or a write cut short.
    REPLAY_BAD_SPEECH(path, std::string("HDF5 cannot open it: the file is truncated or damaged (") +
                                e.what() + ")");
  }
  H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);

  if (data::read_string_attr(root.get(), "format") != kSpeechFormatName)
    REPLAY_BAD_SPEECH(path, std::string("the root attribute 'format' is missing or not '") +
                                kSpeechFormatName + "'" + kSeeLayout);
  const std::optional<int64_t> version = data::read_int_attr(root.get(), "format_version");
  if (version != kSpeechFormatVersion)
    REPLAY_BAD_SPEECH(path, "format_version is " + (version ? str(*version) : "missing") +
                                "; this build reads version " + str(kSpeechFormatVersion));

  // The datasets, their ranks and types.
  features_ = open_dataset(path, root.get(), kFeatures);
  H5Id frame_offsets = open_dataset(path, root.get(), kFrameOffsets);
  H5Id labels = open_dataset(path, root.get(), kLabels);
  H5Id label_offsets = open_dataset(path, root.get(), kLabelOffsets);
  H5Id feature_type = REPLAY_H5_OWN(H5Dget_type(features_.get()), H5Tclose);
  const std::optional<FeatureType> stored = stored_feature_type(feature_type.get());
  const std::vector<hsize_t> feature_dims =
      check_dataset(path, features_.get(), kFeatures, 2, "[total_frames, feature_dim]",
                    stored.has_value(), feature_type.get(), "IEEE fp16 or fp32");
  info_.stored = *stored;
  std::vector<hsize_t> dims[3];
  const char* offsets_shape = "[num_utterances + 1]";
  H5Id types[3];
  const char* names[3] = {kFrameOffsets, kLabels, kLabelOffsets};
  const hid_t datasets[3] = {frame_offsets.get(), labels.get(), label_offsets.get()};
  for (int d = 0; d < 3; ++d) {
    types[d] = REPLAY_H5_OWN(H5Dget_type(datasets[d]), H5Tclose);
    const bool is_labels = d == 1;
    dims[d] = check_dataset(
        path, datasets[d], names[d], 1, is_labels ? "[total_labels]" : offsets_shape,
        is_signed_int(types[d].get(), is_labels ? 4 : 8), types[d].get(),
        is_labels ? "32-bit signed integers (int32)" : "64-bit signed integers (int64)");
  }

  // The attributes, and the shapes they imply.
  struct Required {
    const char* name;
    int64_t* value;
    int64_t min;
  };
  const Required required[] = {
      {"feature_dim", &info_.feature_dim, 1},       {"vocab_size", &info_.vocab_size, 1},
      {"num_utterances", &info_.num_utterances, 1}, {"num_eval", &info_.num_eval, 0},
      {"total_frames", &info_.total_frames, 1},     {"total_labels", &info_.total_labels, 0}};
  for (const Required& r : required) {
    const std::optional<int64_t> v = data::read_int_attr(root.get(), r.name);
    if (!v || *v < r.min)
      REPLAY_BAD_SPEECH(path, std::string("the root attribute '") + r.name +
                                  "' is missing or not an integer >= " + str(r.min) + kSeeLayout);
    *r.value = *v;
  }
  const int64_t n = info_.num_utterances;
  if (info_.num_eval > n)
    REPLAY_BAD_SPEECH(
        path, "num_eval " + str(info_.num_eval) + " is more than the " + str(n) + " utterances");
  const int64_t have_frames = static_cast<int64_t>(feature_dims[0]);
  if (have_frames < info_.total_frames)
    REPLAY_BAD_SPEECH(path, "'/features' holds " + str(have_frames) +
                                " frames but total_frames is " + str(info_.total_frames) +
                                ": the file is truncated or was not written to the end");
  if (have_frames != info_.total_frames ||
      static_cast<int64_t>(feature_dims[1]) != info_.feature_dim)
    REPLAY_BAD_SPEECH(path, "'/features' has shape [" + str(feature_dims[0]) + ", " +
                                str(feature_dims[1]) + "] but the attributes say [total_frames " +
                                str(info_.total_frames) + ", feature_dim " +
                                str(info_.feature_dim) + "]");
  const int64_t have_labels = static_cast<int64_t>(dims[1][0]);
  if (have_labels < info_.total_labels)
    REPLAY_BAD_SPEECH(path, "'/labels' holds " + str(have_labels) + " labels but total_labels is " +
                                str(info_.total_labels) +
                                ": the file is truncated or was not written to the end");
  if (have_labels != info_.total_labels)
    REPLAY_BAD_SPEECH(path, "'/labels' has shape [" + str(have_labels) + "] but total_labels is " +
                                str(info_.total_labels));
  for (int d : {0, 2}) {
    if (static_cast<int64_t>(dims[d][0]) != n + 1)
      REPLAY_BAD_SPEECH(path, "'/" + std::string(names[d]) + "' has shape [" + str(dims[d][0]) +
                                  "] but num_utterances + 1 is " + str(n + 1));
  }

  // Against the model, before the long reads.
  if (info_.feature_dim != shape.feature_dim)
    REPLAY_BAD_SPEECH(path, "feature_dim " + str(info_.feature_dim) +
                                " does not match the model's " + str(shape.feature_dim));
  if (info_.vocab_size > shape.vocab_size)
    REPLAY_BAD_SPEECH(path, "vocabulary of " + str(info_.vocab_size) +
                                " labels does not fit the model's " + str(shape.vocab_size) +
                                " (blank excluded)");
  if (info_.num_train() < 1)
    REPLAY_BAD_SPEECH(path, "num_eval " + str(info_.num_eval) + " holds out all " + str(n) +
                                " utterances: none is left to train on");

  // Offsets and lengths.
  frame_offsets_ =
      read_all<int64_t>(path, frame_offsets.get(), kFrameOffsets, n + 1, H5T_NATIVE_INT64);
  label_offsets_ =
      read_all<int64_t>(path, label_offsets.get(), kLabelOffsets, n + 1, H5T_NATIVE_INT64);
  check_offsets(path, kFrameOffsets, frame_offsets_, info_.total_frames, "total_frames");
  check_offsets(path, kLabelOffsets, label_offsets_, info_.total_labels, "total_labels");
  frame_lengths_.resize(static_cast<size_t>(n));
  label_lengths_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = frame_offsets_[i + 1] - frame_offsets_[i];
    const int64_t u = label_offsets_[i + 1] - label_offsets_[i];
    const std::string utterance = "utterance " + str(i) + " has ";
    if (t == 0) REPLAY_BAD_SPEECH(path, utterance + "no frames ('/frame_offsets')");
    if ((shape.max_frames > 0 && t > shape.max_frames) || t > INT32_MAX)
      REPLAY_BAD_SPEECH(path, utterance + str(t) + " frames, more than the model's limit of " +
                                  str(shape.max_frames > 0 ? shape.max_frames : INT32_MAX));
    if ((shape.max_labels > 0 && u > shape.max_labels) || u > INT32_MAX)
      REPLAY_BAD_SPEECH(path, utterance + str(u) + " labels, more than the model's limit of " +
                                  str(shape.max_labels > 0 ? shape.max_labels : INT32_MAX));
    frame_lengths_[i] = static_cast<int32_t>(t);
    label_lengths_[i] = static_cast<int32_t>(u);
  }
  const auto [min_t, max_t] = std::minmax_element(frame_lengths_.begin(), frame_lengths_.end());
  const auto [min_u, max_u] = std::minmax_element(label_lengths_.begin(), label_lengths_.end());
  info_.min_frames = *min_t;
  info_.max_frames = *max_t;
  info_.min_labels = *min_u;
  info_.max_labels = *max_u;

  // Every label, checked against the file's vocabulary (at most the model's).
  labels_ = read_all<int32_t>(path, labels.get(), kLabels, info_.total_labels, H5T_NATIVE_INT32);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = label_offsets_[i]; k < label_offsets_[i + 1]; ++k) {
      if (labels_[k] < 0 || labels_[k] >= info_.vocab_size)
        REPLAY_BAD_SPEECH(path, "utterance " + str(i) + ", label " + str(k - label_offsets_[i]) +
                                    " ('/labels' element " + str(k) + ") is id " + str(labels_[k]) +
                                    ", outside the vocabulary [0, " + str(info_.vocab_size) + ")");
    }
  }

  SpeechProvenance& p = info_.provenance;
  p.seed = data::read_uint_attr(root.get(), "seed");
  p.generator = data::read_string_attr(root.get(), "generator").value_or("");
  p.frame_ms = data::read_float_attr(root.get(), "frame_ms").value_or(p.frame_ms);
  p.noise = data::read_float_attr(root.get(), "noise").value_or(p.noise);
}

int32_t SpeechFile::frame_length(int64_t i) const {
  REPLAY_REQUIRE(i >= 0 && i < size(), "utterance index outside the speech file");
  return frame_lengths_[i];
}

int32_t SpeechFile::label_length(int64_t i) const {
  REPLAY_REQUIRE(i >= 0 && i < size(), "utterance index outside the speech file");
  return label_lengths_[i];
}

const int32_t* SpeechFile::labels(int64_t i) const {
  REPLAY_REQUIRE(i >= 0 && i < size(), "utterance index outside the speech file");
  return labels_.data() + label_offsets_[i];
}

void SpeechFile::read_features(int64_t i, FeatureType type, void* dst) const {
  const int64_t frames = frame_length(i), dim = info_.feature_dim;
  const int64_t count = frames * dim;
  // Same type: read straight into dst and check in place; otherwise through a scratch buffer.
  std::vector<uint8_t> scratch;
  void* raw = dst;
  if (type != info_.stored) {
    scratch.resize(static_cast<size_t>(count) * feature_bytes(info_.stored));
    raw = scratch.data();
  }
  {
    H5Guard guard;
    H5Id mem_type = info_.stored == FeatureType::kFP16
                        ? make_fp16_type(H5T_NATIVE_FLOAT)
                        : REPLAY_H5_OWN(H5Tcopy(H5T_NATIVE_FLOAT), H5Tclose);
    const hsize_t start[2] = {static_cast<hsize_t>(frame_offsets_[i]), 0};
    const hsize_t extent[2] = {static_cast<hsize_t>(frames), static_cast<hsize_t>(dim)};
    H5Id file_space = REPLAY_H5_OWN(H5Dget_space(features_.get()), H5Sclose);
    REPLAY_HDF5_CHECK(
        H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, extent, nullptr));
    H5Id mem_space = REPLAY_H5_OWN(H5Screate_simple(2, extent, nullptr), H5Sclose);
    try {
      REPLAY_HDF5_CHECK(H5Dread(features_.get(), mem_type.get(), mem_space.get(), file_space.get(),
                                H5P_DEFAULT, raw));
    } catch (const Error& e) {
      REPLAY_BAD_SPEECH(
          info_.path, "reading '/features' of utterance " + str(i) + " failed (" + e.what() + ")");
    }
  }
  const int64_t bad = convert_features(raw, info_.stored, dst, type, count);
  if (bad >= 0) {
    const float value = info_.stored == FeatureType::kFP16
                            ? float_from_fp16(static_cast<const uint16_t*>(raw)[bad])
                            : static_cast<const float*>(raw)[bad];
    REPLAY_BAD_SPEECH(info_.path,
                      "utterance " + str(i) + ", frame " + str(bad / dim) + ", feature " +
                          str(bad % dim) + " is " + std::to_string(value) +
                          (std::isfinite(value) ? ", beyond fp16's range" : "") +
                          " ('/features' row " + str(frame_offsets_[i] + bad / dim) + ")");
  }
}

void SpeechFile::read_batch(const int64_t* indices, int64_t slots, int64_t max_frames,
                            int64_t max_labels, FeatureType type, const PaddedBatchRef& out) const {
  REPLAY_REQUIRE(slots > 0 && max_frames > 0 && max_labels >= 0,
                 "a batch needs slots and a positive frame count");
  REPLAY_REQUIRE(
      out.features && out.frame_lengths && out.label_lengths && (out.labels || max_labels == 0),
      "read_batch: every output buffer is needed");
  const int64_t dim = info_.feature_dim;
  const size_t frame_bytes = static_cast<size_t>(dim) * feature_bytes(type);
  for (int64_t b = 0; b < slots; ++b) {
    const int64_t i = indices[b];
    REPLAY_REQUIRE(i >= -1 && i < size(),
                   "batch slot " + str(b) + " names utterance " + str(i) + " of " + str(size()));
    const int64_t t = i < 0 ? 0 : frame_lengths_[i];
    const int64_t u = i < 0 ? 0 : label_lengths_[i];
    if (t > max_frames || u > max_labels)
      REPLAY_BAD_SPEECH(info_.path, "utterance " + str(i) + " (" + str(t) + " frames, " + str(u) +
                                        " labels) does not fit the batch's shape of " +
                                        str(max_frames) + " frames and " + str(max_labels) +
                                        " labels");
    uint8_t* features =
        static_cast<uint8_t*>(out.features) + static_cast<size_t>(b * max_frames) * frame_bytes;
    if (t > 0) read_features(i, type, features);
    std::memset(features + static_cast<size_t>(t) * frame_bytes, 0,
                static_cast<size_t>(max_frames - t) * frame_bytes);
    out.frame_lengths[b] = static_cast<int32_t>(t);
    out.label_lengths[b] = static_cast<int32_t>(u);
    if (max_labels == 0) continue;
    int32_t* row = out.labels + b * max_labels;
    if (u > 0) std::memcpy(row, labels(i), static_cast<size_t>(u) * sizeof(int32_t));
    std::fill(row + u, row + max_labels, 0);
  }
}

// ---- The writer ---------------------------------------------------------------------------------

SpeechFileWriter::SpeechFileWriter(std::string path, const SpeechFileHeader& header,
                                   std::vector<int32_t> frame_lengths,
                                   std::vector<int32_t> label_lengths)
    : path_(std::move(path)),
      temp_path_(path_ + ".tmp." + std::to_string(getpid())),
      header_(header) {
  const int64_t n = static_cast<int64_t>(frame_lengths.size());
  REPLAY_REQUIRE(header.feature_dim > 0 && header.vocab_size > 0,
                 "a speech file needs a positive feature size and vocabulary");
  REPLAY_REQUIRE(header.stored != FeatureType::kBF16, "a speech file stores fp16 or fp32");
  REPLAY_REQUIRE(n > 0 && label_lengths.size() == frame_lengths.size(),
                 "a speech file needs utterances, with one label length per frame length");
  REPLAY_REQUIRE(header.num_eval >= 0 && header.num_eval < n,
                 "num_eval must leave at least one training utterance");
  for (int64_t i = 0; i < n; ++i)
    REPLAY_REQUIRE(frame_lengths[i] > 0 && label_lengths[i] >= 0,
                   "utterance " + str(i) + ": every utterance needs frames, and labels >= 0");
  frame_offsets_ = prefix_sums(frame_lengths);
  label_offsets_ = prefix_sums(label_lengths);
  written_.assign(static_cast<size_t>(n), 0);

  H5Guard guard;
  file_ = REPLAY_H5_OWN(H5Fcreate(temp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                        H5Fclose);
  const bool fp16 = header.stored == FeatureType::kFP16;
  H5Id file_type =
      fp16 ? make_fp16_type(H5T_IEEE_F32LE) : REPLAY_H5_OWN(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  features_ = create_dataset(
      file_.get(), kFeatures, file_type.get(),
      {static_cast<hsize_t>(total_frames()), static_cast<hsize_t>(header.feature_dim)},
      feature_bytes(header.stored));
  labels_ = create_dataset(file_.get(), kLabels, H5T_STD_I32LE,
                           {static_cast<hsize_t>(total_labels())}, 4);
  for (const auto& [name, offsets] :
       {std::pair{kFrameOffsets, &frame_offsets_}, std::pair{kLabelOffsets, &label_offsets_}}) {
    H5Id dataset = create_dataset(file_.get(), name, H5T_STD_I64LE,
                                  {static_cast<hsize_t>(offsets->size())}, 8);
    write_range(dataset.get(), H5T_NATIVE_INT64, 0, static_cast<int64_t>(offsets->size()),
                offsets->data());
  }
}

SpeechFileWriter::~SpeechFileWriter() {
  if (committed_) return;
  features_.reset();
  labels_.reset();
  file_.reset();
  std::error_code ec;
  std::filesystem::remove(temp_path_, ec);
}

void SpeechFileWriter::write_utterances(int64_t first, int64_t count, const float* features,
                                        const int32_t* labels) {
  REPLAY_REQUIRE(!committed_, "write_utterances after commit");
  const int64_t n = static_cast<int64_t>(written_.size());
  REPLAY_REQUIRE(first >= 0 && count > 0 && first + count <= n,
                 "utterance range outside the speech file");
  const int64_t dim = header_.feature_dim;
  const int64_t frame0 = frame_offsets_[first], frames = frame_offsets_[first + count] - frame0;
  const int64_t label0 = label_offsets_[first], nlabels = label_offsets_[first + count] - label0;
  for (int64_t i = first; i < first + count; ++i) {
    for (int64_t k = label_offsets_[i]; k < label_offsets_[i + 1]; ++k) {
      const int32_t id = labels[k - label0];
      REPLAY_REQUIRE(id >= 0 && id < header_.vocab_size,
                     "utterance " + str(i) + " has label id " + str(id) +
                         ", outside the vocabulary [0, " + str(header_.vocab_size) + ")");
    }
  }
  // Checked before anything is written: finite, and within fp16's range when stored as fp16.
  std::vector<uint16_t> half;
  if (header_.stored == FeatureType::kFP16) half.resize(static_cast<size_t>(frames * dim));
  for (int64_t k = 0; k < frames * dim; ++k) {
    bool ok = std::isfinite(features[k]);
    if (ok && header_.stored == FeatureType::kFP16) {
      half[k] = fp16_from_float(features[k]);
      ok = fp16_finite(half[k]);
    }
    if (ok) continue;
    const int64_t row = frame0 + k / dim;
    const int64_t i = std::upper_bound(frame_offsets_.begin(), frame_offsets_.end(), row) -
                      frame_offsets_.begin() - 1;
    REPLAY_REQUIRE(false, "utterance " + str(i) + ", frame " + str(row - frame_offsets_[i]) +
                              " holds " + std::to_string(features[k]) +
                              ", not a finite value the file's " +
                              feature_type_name(header_.stored) + " can hold");
  }
  const void* values = half.empty() ? static_cast<const void*>(features) : half.data();

  H5Guard guard;
  if (frames > 0) {
    const hsize_t start[2] = {static_cast<hsize_t>(frame0), 0};
    const hsize_t extent[2] = {static_cast<hsize_t>(frames), static_cast<hsize_t>(dim)};
    H5Id file_space = REPLAY_H5_OWN(H5Dget_space(features_.get()), H5Sclose);
    REPLAY_HDF5_CHECK(
        H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, extent, nullptr));
    H5Id mem_space = REPLAY_H5_OWN(H5Screate_simple(2, extent, nullptr), H5Sclose);
    H5Id mem_type = header_.stored == FeatureType::kFP16
                        ? make_fp16_type(H5T_NATIVE_FLOAT)
                        : REPLAY_H5_OWN(H5Tcopy(H5T_NATIVE_FLOAT), H5Tclose);
    REPLAY_HDF5_CHECK(H5Dwrite(features_.get(), mem_type.get(), mem_space.get(), file_space.get(),
                               H5P_DEFAULT, values));
  }
  write_range(labels_.get(), H5T_NATIVE_INT32, label0, nlabels, labels);
  std::fill(written_.begin() + first, written_.begin() + first + count, uint8_t{1});
}

void SpeechFileWriter::commit(const SpeechProvenance& provenance) {
  REPLAY_REQUIRE(!committed_, "commit called twice");
  const auto missing = std::find(written_.begin(), written_.end(), uint8_t{0});
  REPLAY_REQUIRE(missing == written_.end(), "'" + path_ + "': utterance " +
                                                str(missing - written_.begin()) +
                                                " was never written; nothing is committed");
  {
    H5Guard guard;
    H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);
    data::write_attr(root.get(), "format", std::string(kSpeechFormatName));
    data::write_attr(root.get(), "format_version", kSpeechFormatVersion);
    data::write_attr(root.get(), "feature_dim", header_.feature_dim);
    data::write_attr(root.get(), "vocab_size", header_.vocab_size);
    data::write_attr(root.get(), "num_utterances", static_cast<int64_t>(written_.size()));
    data::write_attr(root.get(), "num_eval", header_.num_eval);
    data::write_attr(root.get(), "total_frames", total_frames());
    data::write_attr(root.get(), "total_labels", total_labels());
    if (provenance.seed) data::write_attr(root.get(), "seed", *provenance.seed);
    if (!provenance.generator.empty())
      data::write_attr(root.get(), "generator", provenance.generator);
    if (!std::isnan(provenance.frame_ms))
      data::write_attr(root.get(), "frame_ms", provenance.frame_ms);
    if (!std::isnan(provenance.noise)) data::write_attr(root.get(), "noise", provenance.noise);
    root.reset();
    features_.reset();
    labels_.reset();
  }
  data::commit_file(file_, temp_path_, path_);
  committed_ = true;
}

}  // namespace replay::rnnt
