// N18: dropout under activation checkpointing, with a forward graph and a backward graph replayed
// for two micro-batches a step. The backward graph recomputes the forward's dropout and must draw
// the very same mask; each micro-batch and each step must draw a new one. With the Philox seed and
// offset passed by value, each graph keeps the numbers of the moment it was captured: the forward
// graph (captured during micro-batch 0) draws micro-batch 0's mask for every micro-batch of every
// step, and the backward graph (captured during micro-batch 1's backward) recomputes with
// micro-batch 1's offset, a mask the forward never used (no error: the gradients are simply wrong).
// The fix keeps the generator state in device memory ({seed, offset}, as replay's PhiloxSlot in
// graphs/rng.h): the forward reads it, saves it for its micro-batch on a device stack and advances
// the offset, all inside the graph; the backward pops the saved state and draws from it.
#include "common.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// With REPLAY_GRAPH_DUMP=<dir> set (as for the workloads), writes the graph as
// <dir>/n18.<name>.dot.
void dump_dot(cudaGraph_t graph, const char* name) {
  const char* dir = std::getenv("REPLAY_GRAPH_DUMP");
  if (dir == nullptr || dir[0] == '\0') return;
  mkdir(dir, 0755);
  const std::string path = std::string(dir) + "/n18." + name + ".dot";
  EX_CHECK(cudaGraphDebugDotPrint(graph, path.c_str(), cudaGraphDebugDotFlagsVerbose));
}

constexpr int kN = 4096;  // activations of one micro-batch
constexpr int kMicroBatches = 2;
constexpr int kSteps = 2;
constexpr uint64_t kSeed = 1234;

// Philox4x32-10 (Salmon et al., SC'11), as replay's common/philox.h: a draw depends only on
// (seed, position, block), so the same state always gives the same mask.
struct Philox4 {
  uint32_t x, y, z, w;
};
__device__ Philox4 philox_block(uint64_t seed, uint64_t position, uint64_t block) {
  Philox4 c{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
            static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32)};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// One generator state: the device-resident slot of the fix (graphs/rng.h's PhiloxSlot).
struct PhiloxSlot {
  uint64_t seed, offset;
};

// Dropout with p = 0.5: element i is kept when the top bit of its Philox number is set. Writes
// y = 2 * x where kept, 0 elsewhere, and the mask (for the check; a real checkpointed forward
// keeps neither).
__device__ void dropout(uint64_t seed, uint64_t offset, const float* x, float* y, uint8_t* mask) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= kN) return;
  const Philox4 r = philox_block(seed, offset, static_cast<uint64_t>(i / 4));
  const uint32_t bits[4] = {r.x, r.y, r.z, r.w};
  const bool keep = (bits[i % 4] >> 31) != 0;
  y[i] = keep ? 2.0f * x[i] : 0.0f;
  mask[i] = keep ? 1 : 0;
}

// Broken: seed and offset are kernel arguments, copied into the graph at capture.
__global__ void dropout_by_value(uint64_t seed, uint64_t offset, const float* x, float* y,
                                 uint8_t* mask) {
  dropout(seed, offset, x, y, mask);
}

// Fixed, forward: draw from the slot as it is when the graph runs...
__global__ void dropout_from_slot(const PhiloxSlot* slot, const float* x, float* y, uint8_t* mask) {
  dropout(slot->seed, slot->offset, x, y, mask);
}
// ...then save that state for this micro-batch (push on the device stack) and advance the offset.
__global__ void save_and_advance(PhiloxSlot* slot, PhiloxSlot* saved, int* depth) {
  saved[*depth] = *slot;
  *depth += 1;
  slot->offset += 1;
}
// Fixed, backward: pop the micro-batch's saved state (micro-batches go backward in reverse)...
__global__ void pop_state(int* depth) {
  *depth -= 1;
}
// ...and recompute the dropout from it.
__global__ void recompute_from_saved(const PhiloxSlot* saved, const int* depth, const float* x,
                                     float* y, uint8_t* mask) {
  const PhiloxSlot s = saved[*depth];
  dropout(s.seed, s.offset, x, y, mask);
}

int differ(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i] ? 1 : 0;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const ex::Args args = ex::parse_args(argc, argv, "N18");
  ex::require_gpu();
  const cudaStream_t stream = ex::nonblocking_stream();
  float* x = ex::device_zeros<float>(kN);
  float* y = ex::device_zeros<float>(kN);
  float* y_recomputed = ex::device_zeros<float>(kN);
  uint8_t* mask_fwd = ex::device_zeros<uint8_t>(kN);
  uint8_t* mask_bwd = ex::device_zeros<uint8_t>(kN);
  PhiloxSlot* slot = ex::device_zeros<PhiloxSlot>();
  PhiloxSlot* saved = ex::device_zeros<PhiloxSlot>(kMicroBatches);
  int* depth = ex::device_zeros<int>();
  std::vector<float> ones(kN, 1.0f);
  EX_CHECK(cudaMemcpy(x, ones.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  const PhiloxSlot start{kSeed, 0};
  EX_CHECK(cudaMemcpy(slot, &start, sizeof(start), cudaMemcpyHostToDevice));
  const dim3 grid(kN / 256), block(256);

  // The eager habit: a host-side generator state advanced after every draw, and the state saved
  // per micro-batch for the recompute (as a checkpoint saves the RNG state).
  uint64_t host_offset = 0;
  uint64_t host_saved[kMicroBatches] = {};
  cudaGraphExec_t fwd = nullptr, bwd = nullptr;
  if (!args.broken()) {
    cudaGraph_t graph;
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    dropout_from_slot<<<grid, block, 0, stream>>>(slot, x, y, mask_fwd);
    save_and_advance<<<1, 1, 0, stream>>>(slot, saved, depth);
    fwd = ex::end_capture_and_instantiate(stream, &graph);
    dump_dot(graph, "forward");
    EX_CHECK(cudaGraphDestroy(graph));
    EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    pop_state<<<1, 1, 0, stream>>>(depth);
    recompute_from_saved<<<grid, block, 0, stream>>>(saved, depth, x, y_recomputed, mask_bwd);
    bwd = ex::end_capture_and_instantiate(stream, &graph);
    dump_dot(graph, "backward");
    EX_CHECK(cudaGraphDestroy(graph));
  }

  // masks[step][mb][0: forward, 1: recompute]
  std::vector<uint8_t> masks[kSteps][kMicroBatches][2];
  const auto keep_mask = [&](const uint8_t* device, std::vector<uint8_t>& host) {
    host.resize(kN);
    EX_CHECK(cudaMemcpyAsync(host.data(), device, kN, cudaMemcpyDeviceToHost, stream));
    EX_CHECK(cudaStreamSynchronize(stream));  // the check's harness, outside every graph
  };
  for (int step = 0; step < kSteps; ++step) {
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      if (args.broken()) {
        host_saved[mb] = host_offset;
        if (fwd == nullptr) {  // captured during the first forward, with that forward's offset
          cudaGraph_t graph;
          EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
          dropout_by_value<<<grid, block, 0, stream>>>(kSeed, host_offset, x, y, mask_fwd);
          fwd = ex::end_capture_and_instantiate(stream, &graph);
          dump_dot(graph, "forward-by-value");
          EX_CHECK(cudaGraphDestroy(graph));
        }
        host_offset += 1;  // advances the host's counter; the graph never sees it
      }
      EX_CHECK(cudaGraphLaunch(fwd, stream));
      keep_mask(mask_fwd, masks[step][mb][0]);
    }
    for (int mb = kMicroBatches - 1; mb >= 0; --mb) {
      if (args.broken() && bwd == nullptr) {
        // Captured during the first backward (micro-batch 1's), restoring that micro-batch's
        // saved offset by value.
        cudaGraph_t graph;
        EX_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        dropout_by_value<<<grid, block, 0, stream>>>(kSeed, host_saved[mb], x, y_recomputed,
                                                     mask_bwd);
        bwd = ex::end_capture_and_instantiate(stream, &graph);
        dump_dot(graph, "backward-by-value");
        EX_CHECK(cudaGraphDestroy(graph));
      }
      EX_CHECK(cudaGraphLaunch(bwd, stream));
      keep_mask(mask_bwd, masks[step][mb][1]);
    }
  }
  EX_CHECK(cudaGraphExecDestroy(fwd));
  EX_CHECK(cudaGraphExecDestroy(bwd));

  int recompute_mismatch[kSteps][kMicroBatches];
  int worst = 0, best = kN;
  for (int s = 0; s < kSteps; ++s)
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      recompute_mismatch[s][mb] = differ(masks[s][mb][0], masks[s][mb][1]);
      worst = std::max(worst, recompute_mismatch[s][mb]);
      best = std::min(best, recompute_mismatch[s][mb]);
    }
  const int mb_differ = differ(masks[0][0][0], masks[0][1][0]);
  const int step_differ = differ(masks[0][0][0], masks[1][0][0]);
  int kept = 0;
  for (uint8_t m : masks[0][0][0]) kept += m;
  const bool fair = kept > kN * 45 / 100 && kept < kN * 55 / 100;  // p = 0.5 really drops half
  const bool ok = args.broken() ? fair && best > kN / 4 && mb_differ == 0 && step_differ == 0
                                : fair && worst == 0 && mb_differ > kN / 4 && step_differ > kN / 4;
  return ex::report(
      "N18", args, ok,
      "%s: recompute vs forward mask, elements that differ (step 0 mb 0, mb 1, step 1 mb 0, mb 1): "
      "%d %d %d %d of %d (expected 0); forward masks of micro-batches 0 and 1 differ in %d, steps "
      "0 and 1 in %d (expected about %d: fresh numbers); %d of %d kept",
      args.broken() ? "seed and offset by value" : "Philox state in device memory",
      recompute_mismatch[0][0], recompute_mismatch[0][1], recompute_mismatch[1][0],
      recompute_mismatch[1][1], kN, mb_differ, step_differ, kN / 2, kept, kN);
}
