// lstm.h: RNN-T's LSTM layers on cuDNN's RNN API (cudnnRNNForward, cudnnRNNBackwardData_v8,
// cudnnRNNBackwardWeights_v8) as a replay op: an LstmPlan made at set-up holds the descriptors, the
// weight space's layout and the workspace and reserve sizes of the largest shape; its calls take a
// stream and device pointers and never allocate, synchronise or read device memory on the host, so
// a CUDA graph can capture them. The fp64 CPU reference is lstm_reference.h.
//
// The cell. cuDNN's CUDNN_LSTM with two biases (CUDNN_RNN_DOUBLE_BIAS), which is PyTorch's
// torch.nn.LSTM:
//   a_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh, gates i, f, g, o = sigma, sigma, tanh, sigma of
//   its four H-blocks, c_t = f c_{t-1} + i g, h_t = o tanh(c_t)
// layer by layer (layer l > 0 reads layer l - 1's h), unidirectional, no projection, no clipping.
//
// The weight space. One buffer of weight_bytes() in the storage type, laid out by cuDNN.
// LstmPlan::weights() names its tensors as PyTorch does, per layer N: weight_ih_lN [4H, I_N]
// (I_0 = input size, I_N = H above), weight_hh_lN [4H, H], bias_ih_lN [4H], bias_hh_lN [4H], each
// row-major and contiguous, the rows in gate blocks i, f, g, o. The plan reads this from
// cudnnGetRNNWeightParams at set-up (cuDNN's linLayerID 0-3 are the input matrices of the gates
// i, f, g (cuDNN's "new memory") and o, 4-7 the recurrent ones, each an [H, I_N] or [H, H] matrix,
// and the biases come with them) and refuses a layout that is not that: a gate block out of place,
// a matrix not row-major. So a torch.nn.LSTM state dict copies in tensor by tensor, and a
// checkpoint saves the same names. The weight-gradient space has the same layout. Bytes between
// the tensors (cuDNN's alignment) belong to no tensor; lstm_init_weights zeroes them.
//
// Layouts (LstmDesc::layout): x [T, B, I], y [T, B, H] time-major (CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_
// UNPACKED), or [B, T, I], [B, T, H] batch-major (..._BATCH_MAJOR_UNPACKED), padded to T =
// max_seq; hx, cx, hy, cy and their gradients [L, B, H]. dx is x's shape, dy is y's.
//
// Types. x, y, the states, the weights and every gradient in LstmDesc::dtype; cuDNN computes in
// fp32 (mathPrec FLOAT): fp16 and bf16 on tensor cores (CUDNN_TENSOR_OP_MATH), fp32 with FMA only
// (CUDNN_FMA_MATH: no TF32, so fp32 results are fp32-accurate). The recurrent state is rounded to
// the storage type at every step (h_t is an input of the next step's GEMM), so fp16 errors grow
// with T.
//
// Sequence lengths. cuDNN takes the per-sample lengths twice: as a host array in the data
// descriptors (LstmPlan::set_lengths sets it; host-only, no GPU work) and as a device copy in every
// call (the args' `lengths`, cuDNN's devSeqLengths), and the two must agree (cuDNN's contract,
// though 9.14 computes from the host array alone). A sample of length n runs steps t < n; its hy,
// cy are the states after step n - 1. What a CUDA graph does with them: "Graphs and lengths".
//
// Padding. y past each sample's length is written with LstmDesc::padding_fill (cuDNN's
// paddingFill); see "Padding" below for dx and for what x and dy may hold there.
//
// Training order. forward(kTraining) writes the reserve space; backward_data reads it (and may
// write it); backward_weights reads that and must come after backward_data (cuDNN's
// order); neither the reserve nor x, y, hx, cx may change in between. The workspace is scratch,
// free again after each call; one workspace of workspace_bytes() serves every call of a plan, one
// stream at a time. backward_weights adds into the weight-gradient space
// (CUDNN_WGRAD_MODE_ADD, the only mode cuDNN implements): zero it first (zero_weight_grad, a
// capturable memset) unless accumulating over micro-batches is the point.
//
// Dropout. LstmDesc::dropout > 0 gives cuDNN's dropout between layers (on every layer's output but
// the last, training forward only) with its own RNG state (bind_dropout: a buffer of
// dropout_state_bytes() from the arena, initialised once at set-up by a cuDNN kernel). See
// "Dropout" below for what that means for determinism and graphs.
//
// ---- What cuDNN does, measured on an H100 with cuDNN 9.14
// (tests/workloads/rnnt/test_lstm_gpu.cpp)
//
// Graphs and lengths. The results depend on the host lengths of the data descriptors only: a call
// whose device array (devSeqLengths) says otherwise gives bitwise the results of the host lengths,
// and a CUDA graph replays with the lengths the descriptors held at its capture, whatever the
// device array holds at the replay (LengthsUnderReplay, fp32 time-major and fp16 batch-major). So
// per-sample lengths do not follow a replay: one graph serves one set of lengths. What stays
// correct is what NVIDIA's RNN-T graphs did: capture each rung of the ladder with every length at
// the rung's T (set_lengths with all lengths T, then capture; one plan serves every rung, a graph
// keeps the descriptors' state of its capture: OnePlanServesALadder), pad x, and mask the loss, so
// that dy is zero past each sample's real length and dhy, dcy are zero. Then y and dx inside the
// real lengths, dhx, dcx and the weight gradient equal a ragged run's to fp32 rounding
// (RungLengthWithMaskedGradient: 4.6e-7 from the fp64 ragged reference, as for a ragged run): the
// padded steps come after a sample's real ones and no gradient flows back from them. hy and cy are
// then the states after step T - 1, not after each sample's last step: a caller that needs those
// (greedy decoding) must not take them from a rung-length run. Eager runs may use the exact
// lengths: set_lengths per batch is host-only.
//
// Padding. cuDNN writes padding_fill into y and into dx past each sample's length (every dtype,
// both layouts) and never reads x or dy there: finite junk and NaN there give bitwise the results
// of zeros (PaddingContent), so the arena's NaN poison may stay. A length of 0 is accepted: that
// sample's y and dx are the fill and its hy, cy, dhx, dcx are zeros (not hx, cx, dhy, dcy, as
// torch.nn.LSTM would give; ZeroLength).
//
// Determinism. With CUDNN_RNN_ALGO_STANDARD the forward (training and inference), backward data
// and backward weights are bitwise reproducible run to run (BitwiseReproducible; LstmTiming at the
// three MLPerf shapes), and a graph captured in global mode replays bitwise what eager calls give
// (GraphReplayMatchesEager). The inference forward's y is bitwise the training forward's.
// backward_weights adds partial sums into dweights as it goes: a second call over the same data
// gives twice the first to fp32 rounding (7e-8), not bitwise.
//
// Dropout. cuDNN's dropout is deterministic in the sequence of calls and capturable: each training
// forward draws a new mask and advances the state in device memory, bind_dropout with the same
// seed repeats the sequence, and a graph's replay k draws what eager call k would. The inference
// forward applies none. But the state is cuDNN's opaque buffer (6.5 MB), not one of the graph
// layer's Philox streams: a checkpoint must save it to resume bit-exactly, and any extra training
// forward (a warm-up step) shifts every later mask. MLPerf also drops out after the last layer,
// which cuDNN does not. So the workload keeps dropout = 0 here and runs the project's dropout
// kernel itself, between single-layer plans and after the stack. Splitting costs about a fifth:
// the encoder's first two layers (B 192, T 410, fp16) take 11.4 ms forward and 30.5 ms forward
// and backward as two plans, 9.6 and 25.2 ms as one (LstmTiming). The gradient under cuDNN's
// dropout is not checked against a reference.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/context.h"
#include "common/tensor.h"

namespace replay::rnnt {

enum class LstmLayout : uint8_t {
  kSeqMajor,    // x [T, B, I]: CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED (torch.nn.LSTM's default)
  kBatchMajor,  // x [B, T, I]: CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED (batch_first=True)
};
const char* lstm_layout_name(LstmLayout layout);

enum class LstmMode : uint8_t {
  kTraining,   // writes the reserve space the backward reads (and applies dropout)
  kInference,  // no reserve space, no dropout
};

// One LSTM stack's shape and settings: what an LstmPlan is built for.
struct LstmDesc {
  int64_t input_size = 0;      // I
  int64_t hidden_size = 0;     // H
  int64_t layers = 1;          // L
  int64_t batch = 1;           // B
  int64_t max_seq = 1;         // T: the padded length x and y are laid out with
  DType dtype = DType::kFP16;  // storage: kFP16, kBF16 or kFP32
  LstmLayout layout = LstmLayout::kSeqMajor;
  float padding_fill = 0.0f;  // written into y past each sample's length
  bool bias = true;      // both biases (CUDNN_RNN_DOUBLE_BIAS); false: none (CUDNN_RNN_NO_BIAS)
  float dropout = 0.0f;  // between layers, in [0, 1); 0: none
  uint64_t dropout_seed = 0;  // seeds cuDNN's dropout state (bind_dropout)

  int64_t layer_input(int64_t l) const { return l == 0 ? input_size : hidden_size; }
  int64_t x_elements() const { return max_seq * batch * input_size; }
  int64_t y_elements() const { return max_seq * batch * hidden_size; }
  int64_t state_elements() const { return layers * batch * hidden_size; }  // hx, cx, hy, cy
  // Multiply-adds times two of one forward over every padded step (the backward does twice this).
  double flops() const;

  // Throws Error naming the field when the desc is malformed; what cuDNN refuses is reported when
  // the plan is built.
  void validate() const;
  std::string describe() const;
};

enum class LstmParam : uint8_t { kWeightIH, kWeightHH, kBiasIH, kBiasHH };

// One named tensor of the weight space.
struct LstmWeightTensor {
  std::string name;  // PyTorch's: weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, ... _l1
  int64_t layer = 0;
  LstmParam param = LstmParam::kWeightIH;
  int64_t offset = 0;  // elements from the start of the weight space
  int64_t rows = 0;    // 4H
  int64_t cols = 0;    // I_N or H for the matrices, 1 for the biases

  int64_t elements() const { return rows * cols; }
  // The first element of gate block k (0 i, 1 f, 2 g, 3 o): H rows of `cols`.
  int64_t gate_offset(int k) const { return offset + k * (rows / 4) * cols; }
};

// The weight space's named tensors, layer by layer in the order weight_ih, weight_hh, bias_ih,
// bias_hh (PyTorch's parameter order).
struct LstmWeightLayout {
  DType dtype = DType::kFP16;
  size_t bytes = 0;  // the weight space's size
  int64_t hidden = 0;
  std::vector<LstmWeightTensor> tensors;

  // The tensor of that name; throws Error listing the names when there is none.
  const LstmWeightTensor& find(const std::string& name) const;
  // A view of one tensor in a weight space (or a weight-gradient space) of this layout: [rows,
  // cols] for the matrices, [rows] for the biases.
  TensorView view(void* space, const LstmWeightTensor& tensor) const;
};

// MLPerf RNN-T's LSTM initialisation (the reference's rnn.py): PyTorch's default for every tensor,
// uniform in [-1/sqrt(H), 1/sqrt(H)]; then bias_ih's forget block set to forget_gate_bias and
// bias_hh's forget block multiplied by hidden_hidden_bias_scale; then everything multiplied by
// weights_init_scale. MLPerf's settings are these defaults: the forget block of bias_ih is 0.5, of
// bias_hh 0, every other value uniform in [-0.5/sqrt(H), 0.5/sqrt(H)].
struct LstmInit {
  float forget_gate_bias = 1.0f;
  float hidden_hidden_bias_scale = 0.0f;
  float weights_init_scale = 0.5f;
};

// Fills a weight space on the device (memset of the whole space, then init_uniform / init_constant
// per tensor): tensor k of layout.tensors draws from Philox stream stream_base + k of `seed` (the
// forget block of bias_hh, when hidden_hidden_bias_scale is not 0, from stream_base + 1000 + k), so
// the values depend on the seed, the stream base and the shape only. Set-up work; capturable.
void lstm_init_weights(const LstmWeightLayout& layout, void* weight_space, uint64_t seed,
                       uint64_t stream_base, const LstmInit& init, cudaStream_t stream);

// Device pointers of one call. Required ones: lengths, x or y or dy as the call reads them,
// weights, and the outputs named below; the optional states: null reads as zeros, and a null
// output is not written. Every pointer 16-byte aligned (arena buffers are 256-byte aligned).
struct LstmForwardArgs {
  const int32_t* lengths = nullptr;  // [B] int32, the host lengths of set_lengths
  const void* x = nullptr;
  const void* hx = nullptr;  // optional
  const void* cx = nullptr;  // optional
  const void* weights = nullptr;
  void* y = nullptr;
  void* hy = nullptr;  // optional
  void* cy = nullptr;  // optional
};

// dx, dhx, dcx from dy, dhy, dcy; y, hx, cx are the forward's.
struct LstmBackwardDataArgs {
  const int32_t* lengths = nullptr;
  const void* y = nullptr;
  const void* dy = nullptr;
  const void* dhy = nullptr;  // optional
  const void* dcy = nullptr;  // optional
  const void* hx = nullptr;   // optional (as in the forward)
  const void* cx = nullptr;   // optional (as in the forward)
  const void* weights = nullptr;
  void* dx = nullptr;
  void* dhx = nullptr;  // optional
  void* dcx = nullptr;  // optional
};

// Adds dloss/dweights into dweights; x, hx, y are the forward's.
struct LstmBackwardWeightsArgs {
  const int32_t* lengths = nullptr;
  const void* x = nullptr;
  const void* hx = nullptr;  // optional (as in the forward)
  const void* y = nullptr;
  void* dweights = nullptr;
};

// One LSTM stack's cuDNN descriptors and sizes. Built at set-up from a Context (its cuDNN handle);
// must not outlive it.
class LstmPlan {
 public:
  // Builds the descriptors for desc with every length at max_seq, and reads the sizes: weight
  // space, workspace (training and inference) and reserve space (training). Throws Error naming the
  // desc and cuDNN's status when cuDNN cannot run it.
  LstmPlan(const Context& ctx, const LstmDesc& desc);
  ~LstmPlan();
  LstmPlan(const LstmPlan&) = delete;
  LstmPlan& operator=(const LstmPlan&) = delete;

  const LstmDesc& desc() const { return desc_; }
  size_t weight_bytes() const;              // weight space, and weight-gradient space
  size_t training_workspace_bytes() const;  // forward(kTraining) and both backwards
  size_t inference_workspace_bytes() const;
  size_t workspace_bytes() const;      // the larger of the two
  size_t reserve_bytes() const;        // training forward to backward
  size_t dropout_state_bytes() const;  // 0 without dropout
  const LstmWeightLayout& weights() const;
  const char* math() const;  // the cuDNN math type in use, for reports
  // How the layout was read: against a stand-in address (cuDNN 9.14 only adds offsets to
  // it), or, where a cuDNN refuses that, from a temporary device buffer at set-up.
  const std::string& layout_note() const;

  // Queries cuDNN again with the real weight space (the layout was read at set-up against a
  // stand-in address) and throws Error at the first tensor whose offset or shape differs.
  void check_weight_layout(const Context& ctx, const void* weight_space) const;

  // Sets the host lengths (B values in [0, max_seq]; max_seq in [1, desc().max_seq], 0 meaning
  // desc().max_seq) of the data descriptors every later call uses: host-only. In the batch-major
  // layout max_seq is also the padded length x and y are laid out with. Throws Error when cuDNN
  // refuses the lengths or would need more workspace or reserve than the plan reported (never so
  // far: the sizes depend on the padded shape, not the lengths).
  void set_lengths(const int32_t* host_lengths, int64_t max_seq = 0);
  const std::vector<int32_t>& lengths() const;
  int64_t current_max_seq() const;

  // With dropout: initialises cuDNN's dropout state in `states` (dropout_state_bytes(), from the
  // arena) from desc().dropout_seed, a cuDNN kernel on `stream`. Set-up only, once, before the
  // first training forward; again to restart the dropout sequence from the seed.
  void bind_dropout(const Context& ctx, void* states, size_t bytes, cudaStream_t stream);

  // The calls. Each enqueues cuDNN's kernels on `stream` (the handle of ctx is pointed at it for
  // the call and back after), checks the pointers and sizes on the host and nothing else.
  void forward(const Context& ctx, cudaStream_t stream, LstmMode mode, const LstmForwardArgs& args,
               void* workspace, size_t workspace_bytes, void* reserve, size_t reserve_bytes) const;
  void backward_data(const Context& ctx, cudaStream_t stream, const LstmBackwardDataArgs& args,
                     void* workspace, size_t workspace_bytes, void* reserve,
                     size_t reserve_bytes) const;
  void backward_weights(const Context& ctx, cudaStream_t stream,
                        const LstmBackwardWeightsArgs& args, void* workspace,
                        size_t workspace_bytes, void* reserve, size_t reserve_bytes) const;
  // dweights = 0 (weight_bytes()), a cudaMemsetAsync: capturable.
  void zero_weight_grad(void* dweights, cudaStream_t stream) const;

 private:
  struct Impl;
  LstmDesc desc_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace replay::rnnt
