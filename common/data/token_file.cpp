// token_file.cpp: validation and reading of token files, and the atomic writer.
#include "common/data/token_file.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>
#include <utility>

namespace replay::data {

namespace {

// A problem with the user's file: an Error that names the file.
[[noreturn]] void bad_file(const std::string& path, const std::string& problem, int line) {
  throw_error("replay", "invalid data file", "TokenFile", __FILE__, line,
              "data file '" + path + "': " + problem);
}
#define REPLAY_BAD_FILE(path, problem) bad_file((path), (problem), __LINE__)

const std::string kSeeLayout = " (the layout is documented in datasets/gpt3.md)";

// Rows per chunk: about 64 KiB, so that a batch's rows read as a few chunks, each with its
// checksum.
hsize_t chunk_rows(int64_t seq_len, int64_t num_sequences) {
  const int64_t row_bytes = (seq_len + 1) * static_cast<int64_t>(sizeof(int32_t));
  return static_cast<hsize_t>(std::clamp<int64_t>((64 << 10) / row_bytes, 1, num_sequences));
}

// Selects rows [first, first + count) of the 2-D tokens dataset; returns (memory, file) dataspaces.
std::pair<H5Id, H5Id> select_rows(hid_t tokens, int64_t first, int64_t count, int64_t row_tokens) {
  const hsize_t start[2] = {static_cast<hsize_t>(first), 0};
  const hsize_t extent[2] = {static_cast<hsize_t>(count), static_cast<hsize_t>(row_tokens)};
  H5Id file_space = REPLAY_H5_OWN(H5Dget_space(tokens), H5Sclose);
  REPLAY_HDF5_CHECK(
      H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, extent, nullptr));
  H5Id mem_space = REPLAY_H5_OWN(H5Screate_simple(2, extent, nullptr), H5Sclose);
  return {std::move(mem_space), std::move(file_space)};
}

}  // namespace

TokenFile::TokenFile(const std::string& path, const BatchShape& shape) : shape_(shape) {
  REPLAY_REQUIRE(shape.micro_batch > 0 && shape.seq_len > 0 && shape.vocab_size > 0,
                 "BatchShape needs a positive micro-batch, sequence length and vocabulary");
  info_.path = path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) REPLAY_BAD_FILE(path, "no such file");
  if (!std::filesystem::is_regular_file(path, ec)) REPLAY_BAD_FILE(path, "not a regular file");

  H5Guard guard;
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  REPLAY_HDF5_CHECK(is_hdf5);
  if (is_hdf5 == 0) REPLAY_BAD_FILE(path, "not an HDF5 file" + kSeeLayout);
  file_ = REPLAY_H5_OWN(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);

  if (read_string_attr(root.get(), "format") != kFormatName)
    REPLAY_BAD_FILE(path, std::string("the root attribute 'format' is missing or not '") +
                              kFormatName + "'" + kSeeLayout);
  const std::optional<int64_t> version = read_int_attr(root.get(), "format_version");
  if (version != kFormatVersion)
    REPLAY_BAD_FILE(path, "format_version is " + (version ? std::to_string(*version) : "missing") +
                              "; this build reads version " + std::to_string(kFormatVersion));

  const htri_t has_tokens = H5Lexists(root.get(), kTokensDataset, H5P_DEFAULT);
  REPLAY_HDF5_CHECK(has_tokens);
  if (has_tokens == 0) REPLAY_BAD_FILE(path, "no dataset '/tokens'" + kSeeLayout);
  tokens_ = REPLAY_H5_OWN(H5Oopen(root.get(), kTokensDataset, H5P_DEFAULT), H5Oclose);
  const H5I_type_t object_type = H5Iget_type(tokens_.get());
  REPLAY_HDF5_CHECK(object_type);
  if (object_type != H5I_DATASET) REPLAY_BAD_FILE(path, "'/tokens' is not a dataset" + kSeeLayout);

  H5Id space = REPLAY_H5_OWN(H5Dget_space(tokens_.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  REPLAY_HDF5_CHECK(rank);
  if (rank != 2)
    REPLAY_BAD_FILE(path, "'/tokens' has rank " + std::to_string(rank) +
                              ", expected 2: [num_sequences, seq_len + 1]");
  hsize_t dims[2] = {0, 0};
  REPLAY_HDF5_CHECK(H5Sget_simple_extent_dims(space.get(), dims, nullptr));

  H5Id type = REPLAY_H5_OWN(H5Dget_type(tokens_.get()), H5Tclose);
  const H5T_class_t type_class = H5Tget_class(type.get());
  REPLAY_HDF5_CHECK(type_class);
  const H5T_sign_t sign = type_class == H5T_INTEGER ? H5Tget_sign(type.get()) : H5T_SGN_ERROR;
  if (type_class != H5T_INTEGER || H5Tget_size(type.get()) != 4 || sign != H5T_SGN_2)
    REPLAY_BAD_FILE(path, "'/tokens' must hold 32-bit signed integers (int32)");

  const char* required[] = {"vocab_size", "seq_len", "num_sequences"};
  int64_t values[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    const std::optional<int64_t> v = read_int_attr(root.get(), required[i]);
    if (!v || *v <= 0)
      REPLAY_BAD_FILE(path, std::string("the root attribute '") + required[i] +
                                "' is missing or not a positive integer" + kSeeLayout);
    values[i] = *v;
  }
  info_.vocab_size = values[0];
  info_.seq_len = values[1];
  info_.num_sequences = values[2];
  if (static_cast<int64_t>(dims[0]) != info_.num_sequences ||
      static_cast<int64_t>(dims[1]) != info_.seq_len + 1)
    REPLAY_BAD_FILE(path, "'/tokens' has shape [" + std::to_string(dims[0]) + ", " +
                              std::to_string(dims[1]) + "] but the attributes say [num_sequences " +
                              std::to_string(info_.num_sequences) +
                              ", seq_len + 1 = " + std::to_string(info_.seq_len + 1) + "]");

  // Against the model.
  if (info_.seq_len != shape.seq_len)
    REPLAY_BAD_FILE(path, "sequence length " + std::to_string(info_.seq_len) +
                              " does not match the model's " + std::to_string(shape.seq_len));
  if (info_.vocab_size > shape.vocab_size)
    REPLAY_BAD_FILE(path, "vocabulary of " + std::to_string(info_.vocab_size) +
                              " tokens does not fit the model's " +
                              std::to_string(shape.vocab_size));
  if (info_.num_sequences < shape.micro_batch)
    REPLAY_BAD_FILE(path, "holds " + std::to_string(info_.num_sequences) +
                              " sequences, fewer than one micro-batch of " +
                              std::to_string(shape.micro_batch));

  Provenance& p = info_.provenance;
  p.seed = read_uint_attr(root.get(), "seed");
  p.generator = read_string_attr(root.get(), "generator").value_or("");
  p.entropy_rate = read_float_attr(root.get(), "entropy_rate").value_or(p.entropy_rate);
  p.entropy_rate_method = read_string_attr(root.get(), "entropy_rate_method").value_or("");
  p.sample_entropy = read_float_attr(root.get(), "sample_entropy").value_or(p.sample_entropy);
}

void TokenFile::read_rows(int64_t first, int64_t count, int32_t* dst) const {
  REPLAY_REQUIRE(first >= 0 && count > 0 && first + count <= info_.num_sequences,
                 "row range outside the data file");
  {
    H5Guard guard;
    auto [mem_space, file_space] = select_rows(tokens_.get(), first, count, row_tokens());
    REPLAY_HDF5_CHECK(H5Dread(tokens_.get(), H5T_NATIVE_INT32, mem_space.get(), file_space.get(),
                              H5P_DEFAULT, dst));
  }
  const int64_t n = count * row_tokens();
  for (int64_t i = 0; i < n; ++i) {
    if (dst[i] < 0 || dst[i] >= shape_.vocab_size)
      REPLAY_BAD_FILE(info_.path, "row " + std::to_string(first + i / row_tokens()) +
                                      " holds token id " + std::to_string(dst[i]) +
                                      ", outside the model's vocabulary [0, " +
                                      std::to_string(shape_.vocab_size) + ")");
  }
}

TokenFileWriter::TokenFileWriter(std::string path, int64_t vocab_size, int64_t seq_len,
                                 int64_t num_sequences)
    : path_(std::move(path)),
      temp_path_(path_ + ".tmp." + std::to_string(getpid())),
      vocab_size_(vocab_size),
      seq_len_(seq_len),
      num_sequences_(num_sequences) {
  REPLAY_REQUIRE(vocab_size > 0 && seq_len > 0 && num_sequences > 0,
                 "a token file needs a positive vocabulary, sequence length and sequence count");
  H5Guard guard;
  file_ = REPLAY_H5_OWN(H5Fcreate(temp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                        H5Fclose);
  const hsize_t dims[2] = {static_cast<hsize_t>(num_sequences), static_cast<hsize_t>(seq_len + 1)};
  const hsize_t chunk[2] = {chunk_rows(seq_len, num_sequences), dims[1]};
  H5Id space = REPLAY_H5_OWN(H5Screate_simple(2, dims, nullptr), H5Sclose);
  H5Id create = REPLAY_H5_OWN(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  REPLAY_HDF5_CHECK(H5Pset_chunk(create.get(), 2, chunk));
  REPLAY_HDF5_CHECK(
      H5Pset_fletcher32(create.get()));  // a checksum per chunk, verified on every read
  tokens_ = REPLAY_H5_OWN(H5Dcreate2(file_.get(), kTokensDataset, H5T_STD_I32LE, space.get(),
                                     H5P_DEFAULT, create.get(), H5P_DEFAULT),
                          H5Dclose);
}

TokenFileWriter::~TokenFileWriter() {
  if (committed_) return;
  tokens_.reset();
  file_.reset();
  std::error_code ec;
  std::filesystem::remove(temp_path_, ec);
}

void TokenFileWriter::write_rows(int64_t first, int64_t count, const int32_t* tokens) {
  REPLAY_REQUIRE(!committed_, "write_rows after commit");
  REPLAY_REQUIRE(first >= 0 && count > 0 && first + count <= num_sequences_,
                 "row range outside the token file");
  H5Guard guard;
  auto [mem_space, file_space] = select_rows(tokens_.get(), first, count, seq_len_ + 1);
  REPLAY_HDF5_CHECK(H5Dwrite(tokens_.get(), H5T_NATIVE_INT32, mem_space.get(), file_space.get(),
                             H5P_DEFAULT, tokens));
}

void TokenFileWriter::commit(const Provenance& provenance) {
  REPLAY_REQUIRE(!committed_, "commit called twice");
  {
    H5Guard guard;
    H5Id root = REPLAY_H5_OWN(H5Gopen2(file_.get(), "/", H5P_DEFAULT), H5Gclose);
    write_attr(root.get(), "format", std::string(kFormatName));
    write_attr(root.get(), "format_version", kFormatVersion);
    write_attr(root.get(), "vocab_size", vocab_size_);
    write_attr(root.get(), "seq_len", seq_len_);
    write_attr(root.get(), "num_sequences", num_sequences_);
    if (provenance.seed) write_attr(root.get(), "seed", *provenance.seed);
    if (!provenance.generator.empty()) write_attr(root.get(), "generator", provenance.generator);
    if (!std::isnan(provenance.entropy_rate)) {
      write_attr(root.get(), "entropy_rate", provenance.entropy_rate);
      write_attr(root.get(), "entropy_rate_method", provenance.entropy_rate_method);
    }
    if (!std::isnan(provenance.sample_entropy))
      write_attr(root.get(), "sample_entropy", provenance.sample_entropy);
    root.reset();
    tokens_.reset();
  }
  commit_file(file_, temp_path_, path_);
  committed_ = true;
}

}  // namespace replay::data
