// context.cpp: device selection, streams, library handles, environment report.
#include "common/context.h"

#include <cudnn.h>
#include <hdf5.h>
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>

namespace replay {

std::string EnvironmentReport::get(const std::string& key) const {
  for (const auto& [k, v] : fields)
    if (k == key) return v;
  return {};
}

std::string EnvironmentReport::to_text() const {
  std::ostringstream os;
  for (const auto& [k, v] : fields) os << "# " << k << ": " << v << "\n";
  return os.str();
}

int Context::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Context::Context(int device, int side_streams, bool allow_any_gpu) : device_(device) {
  const int n = device_count();
  if (n == 0)
    throw Error("replay", "no GPU", "no CUDA device is visible: replay needs a Hopper GPU");
  REPLAY_REQUIRE(device >= 0 && device < n, "device " + std::to_string(device) + " requested, " +
                                                std::to_string(n) + " visible");
  REPLAY_CUDA_CHECK(cudaSetDevice(device_));
  REPLAY_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
  if (!allow_any_gpu && props_.major != 9) {
    throw Error("replay", "unsupported GPU",
                std::string(props_.name) + " has compute capability " +
                    std::to_string(props_.major) + "." + std::to_string(props_.minor) +
                    "; replay is built for Hopper (sm_90a: H100, H200, GH200)");
  }
  REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (int i = 0; i < side_streams; ++i) {
    cudaStream_t s = nullptr;
    REPLAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    side_streams_.push_back(s);
  }
  REPLAY_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
  REPLAY_CUDNN_CHECK(cudnnCreate(&cudnn_));
  REPLAY_CUDNN_CHECK(cudnnSetStream(cudnn_, stream_));
}

Context::~Context() {
  // Order: arena (memory) last but one, streams last; handles before their streams.
  arena_.reset();
  if (cudnn_) cudnnDestroy(cudnn_);
  if (cublaslt_) cublasLtDestroy(cublaslt_);
  for (cudaStream_t s : side_streams_) cudaStreamDestroy(s);
  if (stream_) cudaStreamDestroy(stream_);
}

Arena& Context::create_arena(ArenaPlan plan) {
  REPLAY_REQUIRE(arena_ == nullptr, "the arena is created once per run");
  arena_ = std::make_unique<Arena>(std::move(plan), device_);
  return *arena_;
}

Arena& Context::arena() const {
  REPLAY_REQUIRE(arena_ != nullptr, "the arena has not been created yet");
  return *arena_;
}

namespace {
std::string version3(int v, int major_div, int minor_div) {
  return std::to_string(v / major_div) + "." + std::to_string((v % major_div) / minor_div) + "." +
         std::to_string(v % minor_div);
}
}  // namespace

EnvironmentReport Context::environment() const {
  EnvironmentReport r;
  auto add = [&](std::string k, std::string v) {
    r.fields.emplace_back(std::move(k), std::move(v));
  };
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  add("host", host);
  add("gpu", props_.name);
  add("compute_capability", std::to_string(props_.major) + "." + std::to_string(props_.minor));
  add("sm_count", std::to_string(props_.multiProcessorCount));
  add("memory_gib", std::to_string(props_.totalGlobalMem / double(1 << 30)));
  add("l2_mib", std::to_string(props_.l2CacheSize / (1 << 20)));
  int sm_clock_khz = 0, mem_clock_khz = 0, bus_width = 0;
  cudaDeviceGetAttribute(&sm_clock_khz, cudaDevAttrClockRate, device_);
  cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, device_);
  cudaDeviceGetAttribute(&bus_width, cudaDevAttrGlobalMemoryBusWidth, device_);
  (void)cudaGetLastError();  // attributes not reported by this driver leave zeros
  add("sm_clock_mhz", std::to_string(sm_clock_khz / 1000));
  add("memory_clock_mhz", std::to_string(mem_clock_khz / 1000));
  add("memory_bus_bits", std::to_string(bus_width));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  add("cuda_driver", std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10));
  add("cuda_runtime", std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10));
  add("cublaslt", version3(static_cast<int>(cublasLtGetVersion()), 10000, 100));
  add("cudnn", version3(static_cast<int>(cudnnGetVersion()), 10000, 100));
  int nccl = 0;
  ncclGetVersion(&nccl);
  add("nccl", version3(nccl, 10000, 100));
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  std::string mpi_s(mpi, static_cast<size_t>(len));
  if (auto nl = mpi_s.find_first_of(",\n"); nl != std::string::npos) mpi_s.resize(nl);
  add("mpi", mpi_s);
  unsigned h5maj = 0, h5min = 0, h5rel = 0;
  H5get_libversion(&h5maj, &h5min, &h5rel);
  add("hdf5", std::to_string(h5maj) + "." + std::to_string(h5min) + "." + std::to_string(h5rel));
  return r;
}

}  // namespace replay
