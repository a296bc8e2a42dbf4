// rnnt_model.h: MLPerf's RNN-T as a train::Model (train/model.h): the encoder (LSTM stack,
// time stacking x2, LSTM stack), the prediction network (embedding, LSTM stack), the joint and the
// transducer loss, trained at a set of padded shapes (shape keys: a ladder's rungs, or every
// batch's own shape), one executable per shape in the runtime's shape-keyed cache.
//
// The step, all tensors batch-major, B utterances padded to key k's T input frames (even) and U
// labels, T' = T / 2 encoder frames, P = U + 1 label positions:
//   encoder.pre.fwd   y1 = LSTM_pre(x) [B, T, H] (cuDNN, 2 layers), x1 = dropout(y1), which *is*
//                     the time-stacked [B, T', 2H] (two consecutive frames side by side: a view)
//   encoder.post.fwd  y2 = LSTM_post(x1) [B, T', H] (3 layers), enc = dropout(y2)
//   prediction.fwd    tokens [B, P] = (blank, y_1 .. y_U); emb = onehot(tokens) E (a GEMM);
//                     y3 = LSTM_pred(emb) [B, P, Hp] (2 layers), pred = dropout(y3)
//   joint_loss        e = enc W1^T + b1, q = pred W2^T + b2 (GEMMs); h = dropout(relu(e + q))
//                     [B, T', P, J]; logits = h W3^T + b3 [B, T', P, V] (GEMMs in chunks of
//                     utterances below 2^31 elements); the transducer loss (transducer.h), its
//                     gradient written in place over the logits (scaled by the loss scale); dW3,
//                     db3 from the logits' gradient and h; dh = dlogits W3 over h; de, dq summed
//                     over the lattice (rnnt_kernels.h); dW1, db1, dW2, db2; denc, dpred
//   prediction.bwd    dropout backward, LSTM backward data and weights, dE = onehot^T demb
//   encoder.post.bwd  dropout backward, LSTM backward data and weights
//   encoder.pre.bwd   dropout backward, LSTM backward data and weights
// `layer` mode captures the six LSTM regions per shape key (NVIDIA's graphs: encoder and
// prediction network; joint and loss eager); `full` captures the whole step, optimizer included.
//
// Lengths under graphs. cuDNN's graphs keep the host sequence lengths of their capture
// (workloads/rnnt/lstm.h, "Graphs and lengths"), so every LSTM call runs every sample to the
// key's padded length, in every mode (so the modes stay bit-identical), and the loss masks: the
// transducer loss reads only t < T'_b and u <= U_b and writes zero gradient elsewhere, so dy is
// zero past each sample's length and no gradient flows back from the padded steps (they come
// after the real ones). An utterance of T_b input frames has ceil(T_b / 2) encoder frames.
//
// Parameters (train::ParamStore, fp16 or bf16 weights, fp32 masters and gradients): each LSTM stack
// is one flat tensor holding cuDNN's weight space (PyTorch's names and layout inside: lstm.h),
// initialised as MLPerf does (forget-gate bias 1, everything x0.5); its gradient comes from cuDNN
// in the weight type into a scratch space, then cast to fp32. The linear layers and the embedding
// are ordinary tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/gemm.h"
#include "graphs/conditional.h"
#include "train/model.h"
#include "workloads/rnnt/ladder.h"
#include "workloads/rnnt/lstm.h"
#include "workloads/rnnt/rnnt_kernels.h"
#include "workloads/rnnt/speech_batches.h"
#include "workloads/rnnt/speech_file.h"

namespace replay::rnnt {

struct RnntShape {
  int64_t feature_dim = 240;
  int64_t vocab = 1024;  // V: 1023 labels and the blank, which is last (V - 1)
  int64_t enc_hidden = 1024;
  int64_t enc_pre_layers = 2;
  int64_t enc_post_layers = 3;
  int64_t pred_hidden = 512;
  int64_t pred_layers = 2;
  int64_t joint_hidden = 512;
  int64_t batch = 192;
  float enc_dropout = 0.1f;
  float pred_dropout = 0.3f;
  float joint_dropout = 0.3f;
  DType dtype = DType::kFP16;
  // Evaluation decodes with an exponential moving average of the weights (MLPerf's EMA) when
  // ema > 0: updated at the start of every step from the previous step's weights; 0: the weights.
  float ema = 0.0f;

  int32_t blank() const { return static_cast<int32_t>(vocab - 1); }
  // Throws bench::UsageError-free Error naming the field when the shape cannot run.
  void validate() const;
};

// The padded shapes a run uses and which one each training batch takes.
struct RnntBatching {
  std::vector<Rung> shapes;      // shape key k: T input frames (even), U labels
  bool exact = false;            // each batch at its own shape (else a ladder's rungs)
  std::optional<Ladder> ladder;  // the ladder, when not exact
  int64_t granule = 2;           // exact shapes: frames rounded up to a multiple of it

  // The key of a batch whose longest utterance has `frames` frames and `labels` labels; an Error
  // when no shape holds it.
  int key_of(int64_t frames, int64_t labels) const;
  Rung exact_shape(int64_t frames, int64_t labels) const;
};

// Greedy decoding's loop: on the host (the eager reference: a step, then the host reads the
// "any active" flag), NVIDIA's (a graph of 4 steps replayed while the host reads the flag one
// replay late from pinned memory), or on the device as a WHILE conditional node
// (graphs/conditional.h).
enum class DecoderKind { kHost, kUnrolled, kWhile };

// What the last evaluation decoded (for tests and reports): the error rate and a hash of every
// hypothesis, so two decoders can be compared token for token.
// Each evaluation also times its two phases on the device (clock_mark, rnnt_kernels.h), summed
// over its batches: the encoder (with the EMA's cast to the model's type) and greedy decoding
// (decode_init to decode_store: the host loop's synchronisations and, for the unrolled and the
// eager WHILE decoders, any capture made during the evaluation included).
struct RnntEvalLog {
  double wer = 0;
  int64_t utterances = 0, hypothesis_labels = 0, reference_labels = 0;
  uint64_t tokens_hash = 0;
  int64_t batches = 0;
  double encode_s = 0, decode_s = 0;
  std::vector<double> decode_s_history;  // every evaluation's decode_s, in order
};

// The data the model reads: the file, the training sampler and the batching; the decoder.
struct RnntData {
  std::shared_ptr<SpeechFile> file;
  SamplerOptions sampler;
  RnntBatching batching;
  DecoderKind decoder = DecoderKind::kWhile;
  // In `full` mode: the evaluation's encoder and WHILE-node decoder captured into one graph
  // (EvalInfo::one_graph_in_full) instead of two.
  bool eval_one_graph = false;
  // The decoder's one-step prediction LSTM on a cuDNN handle of its own (a second Context), not
  // the one the encoder's LSTMs use (lab/rnnt_one_graph tests whether sharing one handle is what
  // breaks one evaluation graph).
  bool decode_own_handle = true;
  // Decode steps in one iteration of the WHILE node's body (the condition is tested after them;
  // steps after every utterance is done change nothing).
  int while_unroll = 8;
  std::shared_ptr<RnntEvalLog> eval_log;  // written by every evaluation; may be null
};

class RnntModel : public train::Model {
 public:
  RnntModel(const Context& ctx, const RnntShape& shape, RnntData data);
  ~RnntModel() override;

  std::string describe() const override;
  train::ParamStore& params() override { return params_; }
  const train::ParamStore& params() const override { return params_; }
  void plan(ArenaPlan& plan) override;
  void bind(const Arena& arena) override;
  void initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) override;
  void register_rng(graphs::RngTracker& rng) override;
  std::vector<graphs::Region> regions() override;
  std::vector<std::string> shape_keys() const override;
  void select_shape(int key) override;
  int load_batch(cudaStream_t stream) override;
  int64_t data_position() const override { return next_batch_; }
  void seek_data(int64_t position) override;

  // Evaluation: greedy decoding of the held-out split (sequential batches, each padded to the
  // split's longest utterance), scored by the label error rate (wer.h) as MLPerf's eval_accuracy.
  std::optional<train::EvalInfo> evaluation() const override;
  std::vector<graphs::Region> eval_regions() override;
  void begin_eval(cudaStream_t stream) override;
  void load_eval_batch(cudaStream_t stream) override;
  double end_eval(cudaStream_t stream) override;

  double flops_per_step() const override;
  std::string flops_formula() const override;
  // The EMA weights (with shape.ema > 0), carried from step to step and checkpointed.
  std::vector<NamedTensor> checkpoint_state() const override;
  double units_per_step() const override { return static_cast<double>(shape_.batch); }
  double samples_per_step() const override { return static_cast<double>(shape_.batch); }

  // Activation bytes the step needs at key k's shape (the arena holds the largest).
  size_t activation_bytes(int key) const;
  const RnntBatching& batching() const { return data_.batching; }
  int64_t total_params() const { return params_.total_numel(); }

 private:
  struct Buffer {
    BufferId id = -1;
    DType dtype = DType::kFP16;
    int64_t elements = 0;
    void** ptr = nullptr;
  };
  struct Stack {
    std::unique_ptr<LstmPlan> plan;
    train::ParamId param = -1;
    void* reserve = nullptr;
    size_t reserve_bytes = 0;
    void* dweights = nullptr;  // cuDNN's weight gradient, in the weight type
    int32_t* lengths = nullptr;
    std::vector<int32_t> host_lengths;
  };
  struct Linear {
    train::ParamId weight = -1, bias = -1;
  };
  // The element counts of the per-shape activations at a shape.
  struct Dims {
    int64_t T = 0, Te = 0, U = 0, P = 0;
  };
  Dims dims(const Rung& r) const;

  void add(ArenaPlan& plan, void** ptr, const std::string& name, DType dtype, int64_t n);
  void add_bytes(ArenaPlan& plan, void** ptr, const std::string& name, size_t bytes);
  TensorView view(void* p, DType t, std::initializer_list<int64_t> d) const {
    return TensorView(p, t, d);
  }
  TensorView act(void* p, std::initializer_list<int64_t> d) const {
    return TensorView(p, shape_.dtype, d);
  }
  TensorView param_view(train::ParamId first, train::ParamId last) const;
  TensorView grad_view(train::ParamId first, train::ParamId last) const;
  GemmPlan& gemm_plan(const GemmDesc& d) const;
  void gemm(const GemmDesc& d, GemmArgs args, cudaStream_t s) const;
  GemmDesc linear_forward(int64_t tokens, int64_t in, int64_t out) const;
  GemmDesc linear_dgrad(int64_t tokens, int64_t in, int64_t out) const;
  GemmDesc linear_wgrad(int64_t tokens, int64_t in, int64_t out, bool accumulate) const;
  // Utterances per chunk of the joint's output GEMMs at a shape.
  int64_t joint_chunk(const Dims& d) const;
  void plan_gemms();

  void lstm_forward(Stack& st, int64_t seq, const void* x, void* y, cudaStream_t s) const;
  void lstm_backward(Stack& st, int64_t seq, const void* x, const void* y, const void* dy, void* dx,
                     cudaStream_t s) const;
  void encoder_pre_fwd(cudaStream_t s);
  void encoder_post_fwd(cudaStream_t s);
  void prediction_fwd(cudaStream_t s);
  void joint_loss(cudaStream_t s);
  void prediction_bwd(cudaStream_t s);
  void encoder_post_bwd(cudaStream_t s);
  void encoder_pre_bwd(cudaStream_t s);
  void eval_encoder(cudaStream_t s);
  // A weight as evaluation reads it: the EMA's copy in the model's type, or the weight itself.
  void* eval_weight(train::ParamId id) const;
  void eval_decode(cudaStream_t s);
  const Context& decode_ctx() const { return decode_ctx_ ? *decode_ctx_ : ctx_; }
  void decode_step(cudaStream_t s);
  DecodeShape decode_shape() const;

  const Context& ctx_;
  RnntShape shape_;
  RnntData data_;
  std::unique_ptr<SpeechSampler> sampler_;
  train::ParamStore params_;
  std::unique_ptr<GemmCache> gemms_;
  Stack enc_pre_, enc_post_, pred_rnn_;
  train::ParamId embed_ = -1;
  Linear enc_proj_, pred_proj_, out_;
  train::StepIO io_;
  RngArgs rng_enc_pre_, rng_enc_post_, rng_pred_, rng_joint_;
  int key_ = 0;
  Dims cur_;
  int64_t next_batch_ = 0;
  size_t lstm_ws_bytes_ = 0, loss_ws_bytes_ = 0;

  // Host staging (pinned): the batch being loaded, each buffer followed by a guard pattern.
  static constexpr size_t kGuardBytes = 256;
  static constexpr unsigned char kGuardByte = 0xa5;
  void check_staging(const char* where) const;
  void* host_x_ = nullptr;
  size_t host_x_bytes_ = 0;
  int32_t* host_ints_ =
      nullptr;  // tokens [B, P], labels [B, U], enc lengths [B], label lengths [B]
  size_t host_ints_count_ = 0;
  cudaEvent_t copied_ = nullptr;
  std::vector<int64_t> indices_;
  std::vector<int32_t> frame_len_, host_label_len_, labels_tmp_;

  // Evaluation.
  Dims eval_;  // the held-out split's padded shape
  int64_t eval_batches_ = 0, next_eval_ = 0, evaluated_ = 0;
  std::unique_ptr<Context> decode_ctx_;  // with decode_own_handle: the decoder's cuDNN handle
  std::unique_ptr<LstmPlan> pred_step_;  // the prediction network, one step (decoding)
  int32_t* step_lengths_ = nullptr;      // its device lengths (all 1)
  std::unique_ptr<graphs::Conditionals> cond_;
  DecodeState dec_;
  int32_t* host_flag_ = nullptr;     // pinned: the host decoders' copy of the flag
  static constexpr int kUnroll = 4;  // NVIDIA's decoder: steps per graph replay
  std::unique_ptr<graphs::CaptureStream> unroll_stream_;
  std::unique_ptr<graphs::Graph> unrolled_;
  cudaEvent_t replayed_[2] = {nullptr, nullptr};
  void *dec_h_ = nullptr, *dec_c_ = nullptr, *dec_hy_ = nullptr, *dec_cy_ = nullptr;
  void *dec_x_ = nullptr, *dec_y_ = nullptr, *dec_q_ = nullptr, *dec_hj_ = nullptr;
  void *dec_logits_ = nullptr, *dec_ints_ = nullptr, *dec_tokens_ = nullptr;
  void* dec_lengths_ = nullptr;
  void *eval_tokens_ = nullptr, *eval_lens_ = nullptr, *eval_counter_ = nullptr;
  uint64_t* eval_clock_ = nullptr;  // [3]: the last mark, encoder ns, decoder ns (clock_mark)
  BufferId ema_id_ = -1;
  float* ema_ = nullptr;          // fp32, the masters' layout (with shape.ema > 0)
  void* eval_weights_ = nullptr;  // the EMA rounded to the model's type, for evaluation

  std::vector<Buffer> buffers_;
  // Device buffers (sized for the largest shape; views take the current one).
  void *x_ = nullptr, *y1_ = nullptr, *x1_ = nullptr, *y2_ = nullptr, *enc_ = nullptr;
  void *onehot_ = nullptr, *emb_ = nullptr, *y3_ = nullptr, *pred_ = nullptr;
  void *e_ = nullptr, *q_ = nullptr, *h_ = nullptr, *logits_ = nullptr;
  void *de_ = nullptr, *dq_ = nullptr, *denc_ = nullptr, *dpred_ = nullptr;
  void *dx1_ = nullptr, *demb_ = nullptr, *dx_ = nullptr;
  void *lstm_ws_ = nullptr, *gemm_ws_ = nullptr, *loss_ws_ = nullptr;
  void* db_scratch_ = nullptr;  // fp32 [V]: the bias gradient of a later joint chunk
  void* tokens_ = nullptr;      // int32 [B, P]
  void* labels_ = nullptr;      // int32 [B, U]
  void* enc_len_ = nullptr;     // int32 [B]
  void* label_len_ = nullptr;   // int32 [B]
  void* utt_loss_ = nullptr;    // fp32 [B]
};

}  // namespace replay::rnnt
