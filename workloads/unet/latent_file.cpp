// latent_file.cpp: validation and reading of latent files, and the atomic writer.
#include "workloads/unet/latent_file.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "workloads/unet/fp16_bits.h"

namespace replay::unet {

namespace {

using data::H5Guard;
using data::H5Id;

// A problem with the user's file: an Error that names the file.
[[noreturn]] void bad_file(const std::string& path, const std::string& problem, int line) {
  throw_error("replay", "invalid data file", "LatentFile", __FILE__, line,
              "data file '" + path + "': " + problem);
}
#define REPLAY_BAD_LATENTS(path, problem) bad_file((path), (problem), __LINE__)

const std::string kSeeLayout = " (the layout is documented in datasets/unet.md)";
constexpr double kSdScaleFactor = 0.18215;

enum class Storage { kFP16, kFP32, kOther };

// fp16 is recognised by its bit layout (sign 15, exponent 10..14 with bias 15, mantissa 0..9), as
// h5py writes numpy's float16; fp32 by its size. Byte order does not matter: HDF5 converts.
Storage storage_of(hid_t dataset) {
  H5Id type = REPLAY_H5_OWN(H5Dget_type(dataset), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  REPLAY_HDF5_CHECK(cls);
  if (cls != H5T_FLOAT) return Storage::kOther;
  const size_t size = H5Tget_size(type.get());
  if (size == 4) return Storage::kFP32;
  if (size != 2) return Storage::kOther;
  size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
  REPLAY_HDF5_CHECK(H5Tget_fields(type.get(), &spos, &epos, &esize, &mpos, &msize));
  const size_t ebias = H5Tget_ebias(type.get());
  const bool ieee_half = spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10;
  return ieee_half && ebias == 15 ? Storage::kFP16 : Storage::kOther;
}

// Samples per chunk: about 64 KiB, at least one.
hsize_t chunk_samples(int64_t sample_bytes, int64_t num_samples) {
  return static_cast<hsize_t>(std::clamp<int64_t>((64 << 10) / sample_bytes, 1, num_samples));
}

// Opens dataset `name` of the root group, or fails naming it.
H5Id open_dataset(const std::string& path, hid_t root, const char* name) {
  const htri_t exists = H5Lexists(root, name, H5P_DEFAULT);
  REPLAY_HDF5_CHECK(exists);
  if (exists == 0) REPLAY_BAD_LATENTS(path, std::string("no dataset '/") + name + "'" + kSeeLayout);
  H5Id object = REPLAY_H5_OWN(H5Oopen(root, name, H5P_DEFAULT), H5Oclose);
  const H5I_type_t type = H5Iget_type(object.get());
  REPLAY_HDF5_CHECK(type);
  if (type != H5I_DATASET)
    REPLAY_BAD_LATENTS(path, std::string("'/") + name + "' is not a dataset" + kSeeLayout);
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

std::string dims_text(const std::vector<hsize_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Selects samples [first, first + count) of a dataset whose first dimension is the sample; returns
// (memory, file) dataspaces, the memory one flat.
std::pair<H5Id, H5Id> select_samples(hid_t dataset, int64_t first, int64_t count,
                                     int64_t per_sample) {
  H5Id file_space = REPLAY_H5_OWN(H5Dget_space(dataset), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(file_space.get());
  REPLAY_HDF5_CHECK(rank);
  REPLAY_REQUIRE(rank >= 1 && rank <= 4, "select_samples: rank 1 to 4");
  hsize_t dims[4] = {}, start[4] = {};
  REPLAY_HDF5_CHECK(H5Sget_simple_extent_dims(file_space.get(), dims, nullptr));
  start[0] = static_cast<hsize_t>(first);
  dims[0] = static_cast<hsize_t>(count);
  REPLAY_HDF5_CHECK(
      H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, dims, nullptr));
  const hsize_t flat = static_cast<hsize_t>(count * per_sample);
  H5Id mem_space = REPLAY_H5_OWN(H5Screate_simple(1, &flat, nullptr), H5Sclose);
  return {std::move(mem_space), std::move(file_space)};
}

}  // namespace

int64_t default_held_out_samples(int64_t n) {
  return std::max<int64_t>(0, std::min<int64_t>(64, n / 16));
}

H5Id make_fp16_type() {
  H5Guard guard;
  H5Id type = REPLAY_H5_OWN(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  // h5py's order: the fields first (they fit in 16 bits, so the size may then shrink), the size,
  // the exponent bias.
  REPLAY_HDF5_CHECK(H5Tset_fields(type.get(), 15, 10, 5, 0, 10));
  REPLAY_HDF5_CHECK(H5Tset_size(type.get(), 2));
  REPLAY_HDF5_CHECK(H5Tset_ebias(type.get(), 15));
  return type;
}

LatentFile::LatentFile(const std::string& path, const LatentDataShape& shape) : shape_(shape) {
  REPLAY_REQUIRE(shape.micro_batch > 0 && shape.latent_channels > 0 && shape.latent_height > 0 &&
                     shape.latent_width > 0 && shape.context_len > 0 && shape.context_dim > 0,
                 "LatentDataShape needs a positive micro-batch and positive dimensions");
  info_.path = path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) REPLAY_BAD_LATENTS(path, "no such file");
  if (!std::filesystem::is_regular_file(path, ec)) REPLAY_BAD_LATENTS(path, "not a regular file");

  H5Guard guard;
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  REPLAY_HDF5_CHECK(is_hdf5);
  if (is_hdf5 == 0) REPLAY_BAD_LATENTS(path, "not an HDF5 file" + kSeeLayout);
  file_ = REPLAY_H5_OWN(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);

  const std::optional<std::string> format = data::read_string_attr(root.get(), "format");
  if (format != kLatentFormatName)
    REPLAY_BAD_LATENTS(path, std::string("the root attribute 'format' is ") +
                                 (format ? "'" + *format + "'" : "missing") + ", not '" +
                                 kLatentFormatName + "'" + kSeeLayout);
  const std::optional<int64_t> version = data::read_int_attr(root.get(), "format_version");
  if (version != kLatentFormatVersion)
    REPLAY_BAD_LATENTS(path,
                       "format_version is " + (version ? std::to_string(*version) : "missing") +
                           "; this build reads version " + std::to_string(kLatentFormatVersion));

  moments_ = open_dataset(path, root.get(), kMomentsDataset);
  text_ = open_dataset(path, root.get(), kTextDataset);
  const std::vector<hsize_t> mdims = dataset_dims(moments_.get());
  const std::vector<hsize_t> tdims = dataset_dims(text_.get());
  if (mdims.size() != 4)
    REPLAY_BAD_LATENTS(path, "'/moments' has rank " + std::to_string(mdims.size()) +
                                 ", expected 4: [num_samples, 2 * latent_channels, latent_height, "
                                 "latent_width]");
  if (tdims.size() != 3)
    REPLAY_BAD_LATENTS(path, "'/text_embeddings' has rank " + std::to_string(tdims.size()) +
                                 ", expected 3: [num_samples, context_len, context_dim]");
  const Storage ms = storage_of(moments_.get()), ts = storage_of(text_.get());
  if (ms == Storage::kOther)
    REPLAY_BAD_LATENTS(path, "'/moments' must hold IEEE fp16 or fp32 floats");
  if (ts == Storage::kOther)
    REPLAY_BAD_LATENTS(path, "'/text_embeddings' must hold IEEE fp16 or fp32 floats");
  info_.moments_fp32 = ms == Storage::kFP32;
  info_.text_fp32 = ts == Storage::kFP32;

  const char* required[] = {"num_samples",  "latent_channels", "latent_height",
                            "latent_width", "context_len",     "context_dim"};
  int64_t values[6] = {};
  for (int i = 0; i < 6; ++i) {
    const std::optional<int64_t> v = data::read_int_attr(root.get(), required[i]);
    if (!v || *v <= 0)
      REPLAY_BAD_LATENTS(path, std::string("the root attribute '") + required[i] +
                                   "' is missing or not a positive integer" + kSeeLayout);
    values[i] = *v;
  }
  info_.num_samples = values[0];
  info_.latent_channels = values[1];
  info_.latent_height = values[2];
  info_.latent_width = values[3];
  info_.context_len = values[4];
  info_.context_dim = values[5];
  const std::vector<hsize_t> want_m = {
      static_cast<hsize_t>(info_.num_samples), static_cast<hsize_t>(2 * info_.latent_channels),
      static_cast<hsize_t>(info_.latent_height), static_cast<hsize_t>(info_.latent_width)};
  const std::vector<hsize_t> want_t = {static_cast<hsize_t>(info_.num_samples),
                                       static_cast<hsize_t>(info_.context_len),
                                       static_cast<hsize_t>(info_.context_dim)};
  if (mdims != want_m)
    REPLAY_BAD_LATENTS(path, "'/moments' has shape " + dims_text(mdims) +
                                 " but the attributes say " + dims_text(want_m) +
                                 " ([num_samples, 2 * latent_channels, latent_height, "
                                 "latent_width]: NCHW, the mean's channels then the "
                                 "log-variance's)");
  if (tdims != want_t)
    REPLAY_BAD_LATENTS(path, "'/text_embeddings' has shape " + dims_text(tdims) +
                                 " but the attributes say " + dims_text(want_t) +
                                 " ([num_samples, context_len, context_dim])");

  const htri_t has_held_out = H5Aexists(root.get(), "held_out_samples");
  REPLAY_HDF5_CHECK(has_held_out);
  if (has_held_out > 0) {
    const std::optional<int64_t> h = data::read_int_attr(root.get(), "held_out_samples");
    if (!h || *h < 0 || *h >= info_.num_samples)
      REPLAY_BAD_LATENTS(path, "held_out_samples must be an integer in [0, num_samples = " +
                                   std::to_string(info_.num_samples) + ")");
    info_.held_out_samples = *h;
  } else {
    info_.held_out_samples = default_held_out_samples(info_.num_samples);
  }
  const htri_t has_scale = H5Aexists(root.get(), "scale_factor");
  REPLAY_HDF5_CHECK(has_scale);
  if (has_scale > 0) {
    const std::optional<double> f = data::read_float_attr(root.get(), "scale_factor");
    if (!f || std::fabs(*f - kSdScaleFactor) > 1e-6)
      REPLAY_BAD_LATENTS(path, "scale_factor is " + (f ? std::to_string(*f) : "not a number") +
                                   ": the latents were made for another VAE; this model scales "
                                   "by Stable Diffusion's 0.18215");
    info_.scale_factor = *f;
  }

  // Against the model.
  auto mismatch = [&](const char* what, int64_t file, int64_t model) {
    if (file != model)
      REPLAY_BAD_LATENTS(path, std::string(what) + " is " + std::to_string(file) +
                                   " but the model's is " + std::to_string(model));
  };
  mismatch("latent_channels", info_.latent_channels, shape.latent_channels);
  mismatch("latent_height", info_.latent_height, shape.latent_height);
  mismatch("latent_width", info_.latent_width, shape.latent_width);
  mismatch("context_len", info_.context_len, shape.context_len);
  mismatch("context_dim", info_.context_dim, shape.context_dim);
  if (info_.training_samples() < shape.micro_batch)
    REPLAY_BAD_LATENTS(path, "holds " + std::to_string(info_.training_samples()) +
                                 " training samples (" + std::to_string(info_.num_samples) +
                                 " less " + std::to_string(info_.held_out_samples) +
                                 " held out), fewer than one micro-batch of " +
                                 std::to_string(shape.micro_batch));

  LatentProvenance& p = info_.provenance;
  p.seed = data::read_uint_attr(root.get(), "seed");
  p.generator = data::read_string_attr(root.get(), "generator").value_or("");
  p.vae = data::read_string_attr(root.get(), "vae").value_or("");
  p.text_encoder = data::read_string_attr(root.get(), "text_encoder").value_or("");
  p.num_classes = data::read_int_attr(root.get(), "num_classes").value_or(0);
  p.class_share = data::read_float_attr(root.get(), "class_share").value_or(p.class_share);
  p.loss_floor = data::read_float_attr(root.get(), "loss_floor").value_or(p.loss_floor);
  p.loss_floor_method = data::read_string_attr(root.get(), "loss_floor_method").value_or("");
}

void LatentFile::read_dataset(hid_t dataset, bool fp32, int64_t per_sample, const char* name,
                              int64_t first, int64_t count, uint16_t* dst) const {
  const int64_t n = count * per_sample;
  std::vector<float> wide;
  {
    H5Guard guard;
    auto [mem_space, file_space] = select_samples(dataset, first, count, per_sample);
    if (fp32) {
      wide.resize(static_cast<size_t>(n));
      REPLAY_HDF5_CHECK(H5Dread(dataset, H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(),
                                H5P_DEFAULT, wide.data()));
    } else {
      const H5Id half = make_fp16_type();
      REPLAY_HDF5_CHECK(
          H5Dread(dataset, half.get(), mem_space.get(), file_space.get(), H5P_DEFAULT, dst));
    }
  }
  // Where element k of a sample is, for the message.
  auto where = [&](int64_t i) {
    const int64_t sample = first + i / per_sample, k = i % per_sample;
    std::string at = "sample " + std::to_string(sample) + " of '/" + name + "', ";
    if (dataset == moments_.get()) {
      const int64_t hw = info_.latent_height * info_.latent_width;
      const int64_t ch = k / hw, y = (k % hw) / info_.latent_width, x = k % info_.latent_width;
      at += std::string(ch < info_.latent_channels ? "mean" : "log-variance") + " channel " +
            std::to_string(ch % info_.latent_channels) + " at (" + std::to_string(y) + ", " +
            std::to_string(x) + ")";
    } else {
      at += "token " + std::to_string(k / info_.context_dim) + ", channel " +
            std::to_string(k % info_.context_dim);
    }
    return at;
  };
  if (fp32) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = wide[static_cast<size_t>(i)];
      // 65520 and above round to infinity in fp16.
      if (!std::isfinite(v) || std::fabs(v) >= 65520.0f)
        REPLAY_BAD_LATENTS(info_.path, where(i) + " holds " + std::to_string(v) +
                                           ", not a finite value within fp16's range");
      dst[i] = float_to_half_bits(v);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if (!half_bits_finite(dst[i]))
        REPLAY_BAD_LATENTS(info_.path, where(i) + " holds a NaN or an infinity");
    }
  }
}

void LatentFile::read_samples(int64_t first, int64_t count, uint16_t* moments,
                              uint16_t* text) const {
  REPLAY_REQUIRE(first >= 0 && count > 0 && first + count <= info_.num_samples,
                 "sample range [" + std::to_string(first) + ", " + std::to_string(first + count) +
                     ") outside the data file's " + std::to_string(info_.num_samples));
  if (moments)
    read_dataset(moments_.get(), info_.moments_fp32, shape_.moment_elements(), kMomentsDataset,
                 first, count, moments);
  if (text)
    read_dataset(text_.get(), info_.text_fp32, shape_.text_elements(), kTextDataset, first, count,
                 text);
}

void LatentFile::read_batch(const int64_t* samples, int64_t count, uint16_t* moments,
                            uint16_t* text) const {
  for (int64_t i = 0; i < count;) {
    int64_t run = 1;
    while (i + run < count && samples[i + run] == samples[i] + run) ++run;
    read_samples(samples[i], run, moments ? moments + i * shape_.moment_elements() : nullptr,
                 text ? text + i * shape_.text_elements() : nullptr);
    i += run;
  }
}

LatentFileWriter::LatentFileWriter(std::string path, const LatentFileDims& dims)
    : path_(std::move(path)), temp_path_(path_ + ".tmp." + std::to_string(getpid())), dims_(dims) {
  REPLAY_REQUIRE(dims.num_samples > 0 && dims.latent_channels > 0 && dims.latent_height > 0 &&
                     dims.latent_width > 0 && dims.context_len > 0 && dims.context_dim > 0,
                 "a latent file needs positive dimensions and at least one sample");
  if (dims_.held_out_samples < 0)
    dims_.held_out_samples = default_held_out_samples(dims_.num_samples);
  REPLAY_REQUIRE(dims_.held_out_samples < dims_.num_samples,
                 "the held-out split must leave training samples");
  H5Guard guard;
  file_ = REPLAY_H5_OWN(H5Fcreate(temp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                        H5Fclose);
  const H5Id half = make_fp16_type();
  auto create = [&](const char* name, std::vector<hsize_t> shape) {
    int64_t per_sample = 1;
    for (size_t i = 1; i < shape.size(); ++i) per_sample *= static_cast<int64_t>(shape[i]);
    std::vector<hsize_t> chunk = shape;
    chunk[0] = chunk_samples(per_sample * 2, dims_.num_samples);
    H5Id space = REPLAY_H5_OWN(
        H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr), H5Sclose);
    H5Id plist = REPLAY_H5_OWN(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    REPLAY_HDF5_CHECK(H5Pset_chunk(plist.get(), static_cast<int>(chunk.size()), chunk.data()));
    REPLAY_HDF5_CHECK(H5Pset_fletcher32(plist.get()));  // a checksum per chunk, checked on reads
    return REPLAY_H5_OWN(H5Dcreate2(file_.get(), name, half.get(), space.get(), H5P_DEFAULT,
                                    plist.get(), H5P_DEFAULT),
                         H5Dclose);
  };
  const auto n = static_cast<hsize_t>(dims_.num_samples);
  moments_ = create(kMomentsDataset, {n, static_cast<hsize_t>(2 * dims_.latent_channels),
                                      static_cast<hsize_t>(dims_.latent_height),
                                      static_cast<hsize_t>(dims_.latent_width)});
  text_ = create(kTextDataset, {n, static_cast<hsize_t>(dims_.context_len),
                                static_cast<hsize_t>(dims_.context_dim)});
}

LatentFileWriter::~LatentFileWriter() {
  if (committed_) return;
  moments_.reset();
  text_.reset();
  file_.reset();
  std::error_code ec;
  std::filesystem::remove(temp_path_, ec);
}

void LatentFileWriter::write_samples(int64_t first, int64_t count, const uint16_t* moments,
                                     const uint16_t* text) {
  REPLAY_REQUIRE(!committed_, "write_samples after commit");
  REPLAY_REQUIRE(first >= 0 && count > 0 && first + count <= dims_.num_samples,
                 "sample range outside the latent file");
  REPLAY_REQUIRE(moments && text, "write_samples: null data");
  H5Guard guard;
  const H5Id half = make_fp16_type();
  const int64_t per_moments = 2 * dims_.latent_channels * dims_.latent_height * dims_.latent_width;
  const int64_t per_text = dims_.context_len * dims_.context_dim;
  {
    auto [mem_space, file_space] = select_samples(moments_.get(), first, count, per_moments);
    REPLAY_HDF5_CHECK(H5Dwrite(moments_.get(), half.get(), mem_space.get(), file_space.get(),
                               H5P_DEFAULT, moments));
  }
  auto [mem_space, file_space] = select_samples(text_.get(), first, count, per_text);
  REPLAY_HDF5_CHECK(
      H5Dwrite(text_.get(), half.get(), mem_space.get(), file_space.get(), H5P_DEFAULT, text));
}

void LatentFileWriter::commit(const LatentProvenance& provenance) {
  REPLAY_REQUIRE(!committed_, "commit called twice");
  {
    H5Guard guard;
    H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);
    using data::write_attr;
    write_attr(root.get(), "format", std::string(kLatentFormatName));
    write_attr(root.get(), "format_version", kLatentFormatVersion);
    write_attr(root.get(), "num_samples", dims_.num_samples);
    write_attr(root.get(), "latent_channels", dims_.latent_channels);
    write_attr(root.get(), "latent_height", dims_.latent_height);
    write_attr(root.get(), "latent_width", dims_.latent_width);
    write_attr(root.get(), "context_len", dims_.context_len);
    write_attr(root.get(), "context_dim", dims_.context_dim);
    write_attr(root.get(), "held_out_samples", dims_.held_out_samples);
    write_attr(root.get(), "scale_factor", kSdScaleFactor);
    if (provenance.seed) write_attr(root.get(), "seed", *provenance.seed);
    if (!provenance.generator.empty()) write_attr(root.get(), "generator", provenance.generator);
    if (!provenance.vae.empty()) write_attr(root.get(), "vae", provenance.vae);
    if (!provenance.text_encoder.empty())
      write_attr(root.get(), "text_encoder", provenance.text_encoder);
    if (provenance.num_classes > 0) write_attr(root.get(), "num_classes", provenance.num_classes);
    if (!std::isnan(provenance.class_share))
      write_attr(root.get(), "class_share", provenance.class_share);
    if (!std::isnan(provenance.loss_floor)) {
      write_attr(root.get(), "loss_floor", provenance.loss_floor);
      write_attr(root.get(), "loss_floor_method", provenance.loss_floor_method);
    }
    root.reset();
    moments_.reset();
    text_.reset();
  }
  data::commit_file(file_, temp_path_, path_);
  committed_ = true;
}

}  // namespace replay::unet
