// rnnt_model.cpp: the RNN-T model's buffers, parameters, plans, regions and data (rnnt_model.h).
#include "workloads/rnnt/rnnt_model.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/context.h"
#include "common/kernels/accumulate.h"
#include "graphs/graph.h"
#include "workloads/rnnt/rnnt_kernels.h"
#include "workloads/rnnt/transducer.h"
#include "workloads/rnnt/wer.h"

namespace replay::rnnt {

namespace {

FeatureType feature_type(DType t) {
  return t == DType::kBF16 ? FeatureType::kBF16 : FeatureType::kFP16;
}

train::ParamSpec spec(const std::string& name, std::vector<int64_t> shape, train::ParamInit init,
                      float stddev, bool weight_decay) {
  train::ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.init = init;
  p.stddev = stddev;
  p.weight_decay = weight_decay;
  return p;
}

std::string rung_name(const Rung& r) {
  return "T" + std::to_string(r.max_frames) + "xU" + std::to_string(r.max_labels);
}

}  // namespace

void RnntShape::validate() const {
  REPLAY_REQUIRE(dtype == DType::kFP16 || dtype == DType::kBF16, "RNN-T trains in fp16 or bf16");
  REPLAY_REQUIRE(feature_dim >= 8 && feature_dim % 8 == 0, "RNN-T: feature_dim a multiple of 8");
  REPLAY_REQUIRE(vocab >= 8 && vocab % 8 == 0,
                 "RNN-T: the vocabulary (blank included) must be a "
                 "multiple of 8");
  REPLAY_REQUIRE(enc_hidden % 8 == 0 && pred_hidden % 8 == 0 && joint_hidden % 8 == 0 &&
                     enc_hidden > 0 && pred_hidden > 0 && joint_hidden > 0,
                 "RNN-T: hidden sizes must be positive multiples of 8");
  REPLAY_REQUIRE(enc_pre_layers >= 1 && enc_post_layers >= 1 && pred_layers >= 1,
                 "RNN-T: every LSTM stack needs a layer");
  REPLAY_REQUIRE(batch >= 1, "RNN-T: batch >= 1");
  for (float p : {enc_dropout, pred_dropout, joint_dropout})
    REPLAY_REQUIRE(p >= 0.0f && p < 1.0f, "RNN-T: dropout in [0, 1)");
}

Rung RnntBatching::exact_shape(int64_t frames, int64_t labels) const {
  const int64_t g = std::max<int64_t>(2, granule);
  return Rung{std::max<int64_t>(g, (frames + g - 1) / g * g), std::max<int64_t>(1, labels)};
}

int RnntBatching::key_of(int64_t frames, int64_t labels) const {
  if (!exact) {
    REPLAY_REQUIRE(ladder.has_value(), "RNN-T batching without a ladder");
    return ladder->select(frames, labels);
  }
  const Rung want = exact_shape(frames, labels);
  for (size_t k = 0; k < shapes.size(); ++k)
    if (shapes[k] == want) return static_cast<int>(k);
  throw Error("replay", "invalid argument",
              "RNN-T: a batch of " + std::to_string(frames) + " frames and " +
                  std::to_string(labels) +
                  " labels has no planned exact shape (the exact shapes are planned for the "
                  "run's batches; a resumed or longer run needs the ladder: --pad ladder)");
}

// ---- Set-up ------------------------------------------------------------------------------------

RnntModel::RnntModel(const Context& ctx, const RnntShape& shape, RnntData data)
    : ctx_(ctx), shape_(shape), data_(std::move(data)), params_(shape.dtype) {
  shape_.validate();
  REPLAY_REQUIRE(data_.file != nullptr, "RNN-T model without data");
  REPLAY_REQUIRE(!data_.batching.shapes.empty(), "RNN-T model without shapes");
  const SpeechFileInfo& info = data_.file->info();
  REPLAY_REQUIRE(info.feature_dim == shape_.feature_dim,
                 "RNN-T: the data's feature size differs from the model's");
  REPLAY_REQUIRE(info.vocab_size <= shape_.vocab - 1,
                 "RNN-T: the data's vocabulary does not fit the model's (blank excluded)");
  for (const Rung& r : data_.batching.shapes)
    REPLAY_REQUIRE(r.max_frames % 2 == 0 && r.max_frames >= 2 && r.max_labels >= 1,
                   "RNN-T: a shape of odd frames or no labels: " + rung_name(r));
  sampler_ = std::make_unique<SpeechSampler>(data_.file->frame_lengths(), 0, info.num_train(),
                                             data_.sampler);

  // The held-out split's shape: its longest utterance, frames rounded up to even.
  int64_t eval_frames = 2, eval_labels = 1;
  for (int64_t i = info.num_train(); i < info.num_utterances; ++i) {
    eval_frames = std::max<int64_t>(eval_frames, data_.file->frame_length(i));
    eval_labels = std::max<int64_t>(eval_labels, data_.file->label_length(i));
  }
  eval_ = dims(Rung{(eval_frames + 1) / 2 * 2, eval_labels});
  eval_batches_ = std::max<int64_t>(1, (info.num_eval + shape_.batch - 1) / shape_.batch);

  int64_t T = eval_.T, U = eval_.U;
  for (const Rung& r : data_.batching.shapes) {
    T = std::max(T, r.max_frames);
    U = std::max(U, r.max_labels);
  }
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden;
  auto make = [&](Stack& st, int64_t in, int64_t hidden, int64_t layers, int64_t seq,
                  const std::string& name) {
    LstmDesc d;
    d.input_size = in, d.hidden_size = hidden, d.layers = layers, d.batch = B, d.max_seq = seq;
    d.dtype = shape_.dtype;
    d.layout = LstmLayout::kBatchMajor;
    st.plan = std::make_unique<LstmPlan>(ctx_, d);
    const size_t numel = st.plan->weight_bytes() / dtype_size(shape_.dtype);
    st.param = params_.add(
        spec(name, {static_cast<int64_t>(numel)}, train::ParamInit::kZeros, 0.0f, true));
    st.host_lengths.assign(static_cast<size_t>(B), 0);
    lstm_ws_bytes_ = std::max(lstm_ws_bytes_, st.plan->workspace_bytes());
  };
  make(enc_pre_, shape_.feature_dim, H, shape_.enc_pre_layers, T, "encoder.pre_rnn");
  make(enc_post_, 2 * H, H, shape_.enc_post_layers, T / 2, "encoder.post_rnn");
  embed_ = params_.add(
      spec("prediction.embed.weight", {shape_.vocab, Hp}, train::ParamInit::kNormal, 1.0f, true));
  make(pred_rnn_, Hp, Hp, shape_.pred_layers, U + 1, "prediction.dec_rnn");
  {
    LstmDesc d = pred_rnn_.plan->desc();
    d.max_seq = 1;
    if (data_.decode_own_handle)
      decode_ctx_ = std::make_unique<Context>(ctx_.device(), 0, /*allow_any_gpu=*/true);
    pred_step_ = std::make_unique<LstmPlan>(decode_ctx(), d);
    REPLAY_REQUIRE(pred_step_->weight_bytes() == pred_rnn_.plan->weight_bytes(),
                   "RNN-T: the one-step prediction LSTM's weight space differs");
    lstm_ws_bytes_ = std::max(lstm_ws_bytes_, pred_step_->workspace_bytes());
  }
  cond_ = std::make_unique<graphs::Conditionals>();
  if (data_.decoder == DecoderKind::kUnrolled) {
    unroll_stream_ = std::make_unique<graphs::CaptureStream>();
    for (cudaEvent_t& e : replayed_)
      REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  auto linear = [&](const std::string& name, int64_t in, int64_t out) {
    Linear l;
    l.weight =
        params_.add(spec(name + ".weight", {out, in}, train::ParamInit::kNormal,
                         static_cast<float>(1.0 / std::sqrt(3.0 * static_cast<double>(in))), true));
    l.bias = params_.add(spec(name + ".bias", {out}, train::ParamInit::kZeros, 0.0f, false));
    return l;
  };
  enc_proj_ = linear("joint.enc", H, shape_.joint_hidden);
  pred_proj_ = linear("joint.pred", Hp, shape_.joint_hidden);
  out_ = linear("joint.out", shape_.joint_hidden, shape_.vocab);
  gemms_ = std::make_unique<GemmCache>(ctx_);
  plan_gemms();
  gemms_->seal();

  // Host staging for one batch at the largest shape, and the event that says its copy is done.
  // Each staging buffer ends in a guard of kGuardBytes whose pattern every load checks: a write
  // past the end would land in whatever the driver mapped next to it.
  host_x_bytes_ = static_cast<size_t>(B * T * shape_.feature_dim) * 2;
  REPLAY_CUDA_CHECK(cudaHostAlloc(&host_x_, host_x_bytes_ + kGuardBytes, cudaHostAllocDefault));
  std::memset(static_cast<char*>(host_x_) + host_x_bytes_, kGuardByte, kGuardBytes);
  host_ints_count_ = static_cast<size_t>(B * (U + 1) + B * U + 2 * B);
  REPLAY_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_ints_),
                                  host_ints_count_ * sizeof(int32_t) + kGuardBytes,
                                  cudaHostAllocDefault));
  std::memset(reinterpret_cast<char*>(host_ints_ + host_ints_count_), kGuardByte, kGuardBytes);
  REPLAY_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  REPLAY_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&host_flag_), sizeof(int32_t), cudaHostAllocDefault));
  indices_.resize(static_cast<size_t>(B));
  frame_len_.resize(static_cast<size_t>(B));
  host_label_len_.resize(static_cast<size_t>(B));
  labels_tmp_.resize(static_cast<size_t>(B * U));
  select_shape(0);
}

void RnntModel::check_staging(const char* where) const {
  auto intact = [](const void* p) {
    const auto* g = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < kGuardBytes; ++i)
      if (g[i] != kGuardByte) return false;
    return true;
  };
  REPLAY_REQUIRE(intact(static_cast<const char*>(host_x_) + host_x_bytes_) &&
                     intact(host_ints_ + host_ints_count_),
                 std::string("RNN-T: a write past the host staging buffers (") + where + ")");
}

RnntModel::~RnntModel() {
  if (copied_) cudaEventDestroy(copied_);
  if (host_x_) cudaFreeHost(host_x_);
  if (host_ints_) cudaFreeHost(host_ints_);
  unrolled_.reset();
  for (cudaEvent_t e : replayed_)
    if (e) cudaEventDestroy(e);
  if (host_flag_) cudaFreeHost(host_flag_);
}

RnntModel::Dims RnntModel::dims(const Rung& r) const {
  Dims d;
  d.T = r.max_frames;
  d.Te = r.max_frames / 2;
  d.U = r.max_labels;
  d.P = r.max_labels + 1;
  return d;
}

int64_t RnntModel::joint_chunk(const Dims& d) const {
  const int64_t per = d.Te * d.P * std::max(shape_.vocab, shape_.joint_hidden);
  return std::max<int64_t>(1, std::min<int64_t>(shape_.batch, INT_MAX / per));
}

GemmDesc RnntModel::linear_forward(int64_t tokens, int64_t in, int64_t out) const {
  GemmDesc d = linear_gemms(tokens, in, out, true, false).forward;
  d.a_type = d.b_type = d.d_type = d.bias_type = shape_.dtype;
  return d;
}
GemmDesc RnntModel::linear_dgrad(int64_t tokens, int64_t in, int64_t out) const {
  GemmDesc d = linear_gemms(tokens, in, out, true, false).dgrad;
  d.a_type = d.b_type = d.d_type = shape_.dtype;
  return d;
}
GemmDesc RnntModel::linear_wgrad(int64_t tokens, int64_t in, int64_t out, bool accumulate) const {
  GemmDesc d = linear_gemms(tokens, in, out, true, accumulate).wgrad;
  d.a_type = d.b_type = shape_.dtype;
  return d;
}

void RnntModel::plan_gemms() {
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden,
                J = shape_.joint_hidden, V = shape_.vocab;
  gemms_->get(linear_forward(B * eval_.Te, H, J));  // evaluation: the encoder's projection,
  gemms_->get(linear_forward(B, Hp, J));            // and the joint of one decode step
  gemms_->get(linear_forward(B, J, V));
  for (const Rung& r : data_.batching.shapes) {
    const Dims d = dims(r);
    GemmDesc emb;  // emb [B P, Hp] = onehot [B P, V] E [V, Hp]
    emb.m = B * d.P, emb.n = Hp, emb.k = V;
    emb.a_type = emb.b_type = emb.d_type = shape_.dtype;
    gemms_->get(emb);
    GemmDesc demb;  // dE [V, Hp] = onehot^T demb
    demb.m = V, demb.n = Hp, demb.k = B * d.P, demb.trans_a = true;
    demb.a_type = demb.b_type = shape_.dtype;
    demb.d_type = DType::kFP32;
    gemms_->get(demb);
    for (const auto& [tokens, in] : {std::pair<int64_t, int64_t>{B * d.Te, H}, {B * d.P, Hp}}) {
      gemms_->get(linear_forward(tokens, in, J));
      gemms_->get(linear_dgrad(tokens, in, J));
      gemms_->get(linear_wgrad(tokens, in, J, false));
    }
    const int64_t cb = joint_chunk(d);
    for (int64_t b0 = 0; b0 < B; b0 += cb) {
      const int64_t rows = std::min(cb, B - b0) * d.Te * d.P;
      gemms_->get(linear_forward(rows, J, V));
      gemms_->get(linear_dgrad(rows, J, V));
      gemms_->get(linear_wgrad(rows, J, V, b0 > 0));
    }
  }
}

GemmPlan& RnntModel::gemm_plan(const GemmDesc& d) const {
  return gemms_->get(d);
}

void RnntModel::gemm(const GemmDesc& d, GemmArgs args, cudaStream_t s) const {
  args.workspace = gemm_ws_;
  args.workspace_bytes = gemms_->max_workspace_bytes();
  gemm_plan(d).run(s, args);
}

std::string RnntModel::describe() const {
  char buf[400];
  std::snprintf(buf, sizeof(buf),
                "RNN-T: %" PRId64 " features, encoder %" PRId64 "+%" PRId64
                " LSTM layers of %" PRId64 " (time stacking x2), prediction %" PRId64
                " LSTM layers of %" PRId64 ", joint %" PRId64 ", vocabulary %" PRId64
                " (blank last), batch %" PRId64 ", %s, %.2fM parameters, %zu shapes",
                shape_.feature_dim, shape_.enc_pre_layers, shape_.enc_post_layers,
                shape_.enc_hidden, shape_.pred_layers, shape_.pred_hidden, shape_.joint_hidden,
                shape_.vocab, shape_.batch, dtype_name(shape_.dtype),
                static_cast<double>(params_.total_numel()) / 1e6, data_.batching.shapes.size());
  return buf;
}

void RnntModel::add(ArenaPlan& plan, void** ptr, const std::string& name, DType dtype, int64_t n) {
  buffers_.push_back({plan.add("rnnt." + name, dtype, n, "activations", {1, 2}), dtype, n, ptr});
}

void RnntModel::add_bytes(ArenaPlan& plan, void** ptr, const std::string& name, size_t bytes) {
  add(plan, ptr, name, DType::kUINT8, static_cast<int64_t>(bytes));
}

size_t RnntModel::activation_bytes(int key) const {
  const Dims d = dims(data_.batching.shapes.at(static_cast<size_t>(key)));
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden,
                J = shape_.joint_hidden, V = shape_.vocab, F = shape_.feature_dim;
  const int64_t e = static_cast<int64_t>(dtype_size(shape_.dtype));
  int64_t n = 0;
  n += 2 * B * d.T * F;                          // x, dx
  n += 3 * B * d.T * H;                          // y1, x1, dx1
  n += 3 * B * d.Te * H;                         // y2, enc, denc
  n += B * d.P * V + 4 * B * d.P * Hp;           // onehot, emb, y3, pred, dpred + demb
  n += 2 * B * d.Te * J + 2 * B * d.P * J;       // e, de, q, dq
  n += B * d.Te * d.P * J + B * d.Te * d.P * V;  // h (dh), logits (their gradient)
  TransducerShape ts{B, d.Te, d.U, V, shape_.blank()};
  return static_cast<size_t>(n * e) + transducer_workspace_bytes(ts);
}

void RnntModel::plan(ArenaPlan& plan) {
  int64_t T = eval_.T, U = eval_.U, lattice = 0;
  size_t loss_ws = 0;
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden,
                J = shape_.joint_hidden, V = shape_.vocab, F = shape_.feature_dim;
  for (const Rung& r : data_.batching.shapes) {
    const Dims d = dims(r);
    T = std::max(T, d.T);
    U = std::max(U, d.U);
    lattice = std::max(lattice, B * d.Te * d.P);
    loss_ws = std::max(loss_ws, transducer_workspace_bytes({B, d.Te, d.U, V, shape_.blank()}));
  }
  loss_ws_bytes_ = loss_ws;
  const int64_t Te = T / 2, P = U + 1;
  const DType dt = shape_.dtype;
  params_.plan(plan, {2, 2});
  // Greedy decoding's state and the held-out hypotheses.
  const int64_t L = shape_.pred_layers, S = decode_shape().max_symbols;
  for (void** p : {&dec_h_, &dec_c_, &dec_hy_, &dec_cy_})
    add(plan, p, "decode.state", dt, L * B * Hp);
  add(plan, &dec_x_, "decode.x", dt, B * Hp);
  add(plan, &dec_y_, "decode.y", dt, B * Hp);
  add(plan, &dec_q_, "decode.q", dt, B * J);
  add(plan, &dec_hj_, "decode.hj", dt, B * J);
  add(plan, &dec_logits_, "decode.logits", dt, B * V);
  add(plan, &dec_ints_, "decode.ints", DType::kINT32, 5 * B + 1);
  add(plan, &dec_tokens_, "decode.tokens", DType::kINT32, B * S);
  add(plan, &dec_lengths_, "decode.lengths", DType::kINT32, B);
  add(plan, &eval_tokens_, "eval.tokens", DType::kINT32, eval_batches_ * B * S);
  add(plan, &eval_lens_, "eval.lengths", DType::kINT32, eval_batches_ * B);
  add(plan, &eval_counter_, "eval.counter", DType::kINT32, 1);
  add(plan, reinterpret_cast<void**>(&eval_clock_), "eval.clock", DType::kINT64, 3);
  if (shape_.ema > 0.0f) {
    // Carried from step to step: its own lifetime (the whole run), not the activations'.
    ema_id_ = plan.add("rnnt.ema", DType::kFP32, params_.buffer_numel(), "optimizer");
    add(plan, &eval_weights_, "eval.weights", dt, params_.buffer_numel());
  }
  add(plan, &x_, "x", dt, B * T * F);
  add(plan, &dx_, "dx", dt, B * T * F);
  add(plan, &y1_, "enc_pre.y", dt, B * T * H);
  add(plan, &x1_, "enc_pre.out", dt, B * T * H);
  add(plan, &dx1_, "enc_pre.dout", dt, B * T * H);
  add(plan, &y2_, "enc_post.y", dt, B * Te * H);
  add(plan, &enc_, "enc", dt, B * Te * H);
  add(plan, &denc_, "denc", dt, B * Te * H);
  add(plan, &onehot_, "onehot", dt, B * P * V);
  add(plan, &emb_, "emb", dt, B * P * Hp);
  add(plan, &demb_, "demb", dt, B * P * Hp);
  add(plan, &y3_, "pred.y", dt, B * P * Hp);
  add(plan, &pred_, "pred", dt, B * P * Hp);
  add(plan, &dpred_, "dpred", dt, B * P * Hp);
  add(plan, &e_, "joint.e", dt, B * Te * J);
  add(plan, &de_, "joint.de", dt, B * Te * J);
  add(plan, &q_, "joint.q", dt, B * P * J);
  add(plan, &dq_, "joint.dq", dt, B * P * J);
  add(plan, &h_, "joint.h", dt, lattice * J);
  add(plan, &logits_, "joint.logits", dt, lattice * V);
  add(plan, &db_scratch_, "joint.db_scratch", DType::kFP32, V);
  add(plan, &tokens_, "tokens", DType::kINT32, B * P);
  add(plan, &labels_, "labels", DType::kINT32, B * U);
  add(plan, &enc_len_, "enc_lengths", DType::kINT32, B);
  add(plan, &label_len_, "label_lengths", DType::kINT32, B);
  add(plan, &utt_loss_, "utterance_loss", DType::kFP32, B);
  add_bytes(plan, &loss_ws_, "loss_workspace", loss_ws);
  add_bytes(plan, &lstm_ws_, "lstm_workspace", lstm_ws_bytes_);
  add_bytes(plan, &gemm_ws_, "gemm_workspace", gemms_->max_workspace_bytes());
  for (Stack* st : {&enc_pre_, &enc_post_, &pred_rnn_}) {
    const std::string n = st == &enc_pre_ ? "enc_pre" : st == &enc_post_ ? "enc_post" : "pred_rnn";
    add_bytes(plan, &st->reserve, n + ".reserve", st->plan->reserve_bytes());
    add_bytes(plan, &st->dweights, n + ".dweights", st->plan->weight_bytes());
    add(plan, reinterpret_cast<void**>(&st->lengths), n + ".lengths", DType::kINT32, B);
    st->reserve_bytes = st->plan->reserve_bytes();
  }
  add(plan, reinterpret_cast<void**>(&step_lengths_), "decode.lstm_lengths", DType::kINT32, B);
}

void RnntModel::bind(const Arena& arena) {
  params_.bind(arena);
  for (const Buffer& b : buffers_) *b.ptr = arena.data(b.id);
  if (ema_id_ >= 0) ema_ = static_cast<float*>(arena.data(ema_id_));
  int32_t* ints = static_cast<int32_t*>(dec_ints_);
  const int64_t B = shape_.batch;
  dec_.label = ints;
  dec_.frame = ints + B;
  dec_.at_frame = ints + 2 * B;
  dec_.active = ints + 3 * B;
  dec_.flag = ints + 5 * B;
  dec_.tokens = static_cast<int32_t*>(dec_tokens_);
  dec_.lengths = static_cast<int32_t*>(dec_lengths_);
}

void RnntModel::initialize(uint64_t seed, const train::StepIO& io, cudaStream_t stream) {
  io_ = io;
  params_.initialize(seed, stream);
  // MLPerf's LSTM initialisation, drawn in fp32 into the master weights and rounded into the
  // model's: a stack's tensors draw from Philox streams 1,000,000 x (stack + 1) + k.
  uint64_t base = 1000000;
  for (Stack* st : {&enc_pre_, &enc_post_, &pred_rnn_}) {
    LstmWeightLayout master = st->plan->weights();
    const int64_t numel = params_.numel(st->param);
    master.dtype = DType::kFP32;
    master.bytes = static_cast<size_t>(numel) * sizeof(float);
    lstm_init_weights(master, params_.master(st->param), seed, base, LstmInit{}, stream);
    cast_from_fp32(params_.weight(st->param), shape_.dtype, params_.master(st->param), numel,
                   stream);
    st->plan->check_weight_layout(ctx_, params_.weight(st->param));
    base += 1000000;
  }
  pred_step_->check_weight_layout(decode_ctx(), params_.weight(pred_rnn_.param));
  if (ema_ != nullptr)  // the average starts at the initial weights
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(ema_, params_.masters().data,
                                      static_cast<size_t>(params_.buffer_numel()) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
  // Defined bytes in the inputs before the first batch (warm-up at a shape larger than the first
  // batch's reads past what it loaded).
  for (const Buffer& b : buffers_)
    if (b.ptr == &x_ || b.ptr == &tokens_ || b.ptr == &labels_ || b.ptr == &enc_len_ ||
        b.ptr == &label_len_)
      REPLAY_CUDA_CHECK(cudaMemsetAsync(
          *b.ptr, 0, static_cast<size_t>(b.elements) * dtype_size(b.dtype), stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void RnntModel::register_rng(graphs::RngTracker& rng) {
  const char* s = graphs::kDataParallelRng;
  rng_enc_pre_ = rng.register_op(s, "rnnt.encoder.pre.dropout");
  rng_enc_post_ = rng.register_op(s, "rnnt.encoder.post.dropout");
  rng_pred_ = rng.register_op(s, "rnnt.prediction.dropout");
  rng_joint_ = rng.register_op(s, "rnnt.joint.dropout");
}

std::vector<std::string> RnntModel::shape_keys() const {
  std::vector<std::string> names;
  for (const Rung& r : data_.batching.shapes) names.push_back(rung_name(r));
  return names;
}

void RnntModel::select_shape(int key) {
  REPLAY_REQUIRE(key >= 0 && key < static_cast<int>(data_.batching.shapes.size()),
                 "RNN-T: shape key out of range");
  key_ = key;
  cur_ = dims(data_.batching.shapes[static_cast<size_t>(key)]);
}

TensorView RnntModel::param_view(train::ParamId first, train::ParamId last) const {
  return params_.weight_range(first, last);
}
TensorView RnntModel::grad_view(train::ParamId first, train::ParamId last) const {
  return params_.grad_range(first, last);
}

// ---- The step ----------------------------------------------------------------------------------

void RnntModel::lstm_forward(Stack& st, int64_t seq, const void* x, void* y, cudaStream_t s) const {
  std::fill(st.host_lengths.begin(), st.host_lengths.end(), static_cast<int32_t>(seq));
  st.plan->set_lengths(st.host_lengths.data(), seq);
  fill_int32(st.lengths, static_cast<int32_t>(seq), shape_.batch, s);
  LstmForwardArgs a;
  a.lengths = st.lengths, a.x = x, a.weights = params_.weight(st.param), a.y = y;
  st.plan->forward(ctx_, s, LstmMode::kTraining, a, lstm_ws_, lstm_ws_bytes_, st.reserve,
                   st.reserve_bytes);
}

void RnntModel::lstm_backward(Stack& st, int64_t seq, const void* x, const void* y, const void* dy,
                              void* dx, cudaStream_t s) const {
  std::fill(st.host_lengths.begin(), st.host_lengths.end(), static_cast<int32_t>(seq));
  st.plan->set_lengths(st.host_lengths.data(), seq);
  fill_int32(st.lengths, static_cast<int32_t>(seq), shape_.batch, s);
  LstmBackwardDataArgs bd;
  bd.lengths = st.lengths, bd.y = y, bd.dy = dy, bd.weights = params_.weight(st.param);
  bd.dx = dx;
  st.plan->backward_data(ctx_, s, bd, lstm_ws_, lstm_ws_bytes_, st.reserve, st.reserve_bytes);
  st.plan->zero_weight_grad(st.dweights, s);
  LstmBackwardWeightsArgs bw;
  bw.lengths = st.lengths, bw.x = x, bw.y = y, bw.dweights = st.dweights;
  st.plan->backward_weights(ctx_, s, bw, lstm_ws_, lstm_ws_bytes_, st.reserve, st.reserve_bytes);
  cast_to_fp32(params_.grad(st.param), st.dweights, shape_.dtype, params_.numel(st.param), s);
}

void RnntModel::encoder_pre_fwd(cudaStream_t s) {
  lstm_forward(enc_pre_, cur_.T, x_, y1_, s);
  dropout_forward(x1_, y1_, shape_.dtype, shape_.batch * cur_.T * shape_.enc_hidden,
                  shape_.enc_dropout, rng_enc_pre_, s);
}

void RnntModel::encoder_post_fwd(cudaStream_t s) {
  lstm_forward(enc_post_, cur_.Te, x1_, y2_, s);  // x1 [B, T, H] is the stacked [B, T', 2H]
  dropout_forward(enc_, y2_, shape_.dtype, shape_.batch * cur_.Te * shape_.enc_hidden,
                  shape_.enc_dropout, rng_enc_post_, s);
}

void RnntModel::prediction_fwd(cudaStream_t s) {
  const int64_t rows = shape_.batch * cur_.P;
  one_hot(onehot_, shape_.dtype, static_cast<const int32_t*>(tokens_), rows, shape_.vocab, s);
  GemmDesc emb;
  emb.m = rows, emb.n = shape_.pred_hidden, emb.k = shape_.vocab;
  emb.a_type = emb.b_type = emb.d_type = shape_.dtype;
  GemmArgs a;
  a.a = onehot_, a.b = params_.weight(embed_), a.d = emb_;
  gemm(emb, a, s);
  lstm_forward(pred_rnn_, cur_.P, emb_, y3_, s);
  dropout_forward(pred_, y3_, shape_.dtype, rows * shape_.pred_hidden, shape_.pred_dropout,
                  rng_pred_, s);
}

void RnntModel::joint_loss(cudaStream_t s) {
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden,
                J = shape_.joint_hidden, V = shape_.vocab;
  const DType dt = shape_.dtype;
  const size_t esize = dtype_size(dt);
  // e = enc W1^T + b1, q = pred W2^T + b2.
  GemmArgs fe;
  fe.a = enc_, fe.b = params_.weight(enc_proj_.weight), fe.d = e_;
  fe.bias = params_.weight(enc_proj_.bias);
  gemm(linear_forward(B * cur_.Te, H, J), fe, s);
  GemmArgs fq;
  fq.a = pred_, fq.b = params_.weight(pred_proj_.weight), fq.d = q_;
  fq.bias = params_.weight(pred_proj_.bias);
  gemm(linear_forward(B * cur_.P, Hp, J), fq, s);
  const JointShape js{B, cur_.Te, cur_.P, J};
  joint_hidden_forward(h_, e_, q_, dt, js, shape_.joint_dropout, rng_joint_, s);
  // logits = h W3^T + b3, in chunks of utterances.
  const int64_t cb = joint_chunk(cur_), per = cur_.Te * cur_.P;
  for (int64_t b0 = 0; b0 < B; b0 += cb) {
    const int64_t rows = std::min(cb, B - b0) * per;
    GemmArgs a;
    a.a = static_cast<char*>(h_) + static_cast<size_t>(b0 * per * J) * esize;
    a.b = params_.weight(out_.weight);
    a.d = static_cast<char*>(logits_) + static_cast<size_t>(b0 * per * V) * esize;
    a.bias = params_.weight(out_.bias);
    gemm(linear_forward(rows, J, V), a, s);
  }
  // The loss and its gradient in place over the logits.
  TransducerInputs in;
  in.logits = logits_, in.dtype = dt, in.labels = static_cast<const int32_t*>(labels_);
  in.frame_lengths = static_cast<const int32_t*>(enc_len_);
  in.label_lengths = static_cast<const int32_t*>(label_len_);
  const TransducerShape ts{B, cur_.Te, cur_.U, V, shape_.blank()};
  transducer_forward(static_cast<float*>(utt_loss_), io_.loss, in, ts, loss_ws_, loss_ws_bytes_, s);
  transducer_backward(logits_, in, io_.loss_scale, TransducerReduction::kMean, ts, loss_ws_,
                      loss_ws_bytes_, s);
  // dW3, db3 = dlogits^T h (the first chunk writes, the others add; a later chunk's bias gradient
  // goes to scratch and is added in a fixed order), then dh = dlogits W3 over h.
  for (int64_t b0 = 0; b0 < B; b0 += cb) {
    const int64_t rows = std::min(cb, B - b0) * per;
    GemmArgs a;
    a.a = static_cast<char*>(logits_) + static_cast<size_t>(b0 * per * V) * esize;
    a.b = static_cast<char*>(h_) + static_cast<size_t>(b0 * per * J) * esize;
    a.d = params_.grad(out_.weight);
    a.bias_grad = b0 == 0 ? params_.grad(out_.bias) : static_cast<float*>(db_scratch_);
    gemm(linear_wgrad(rows, J, V, b0 > 0), a, s);
    if (b0 > 0) accumulate(params_.grad(out_.bias), static_cast<const float*>(db_scratch_), V, s);
  }
  for (int64_t b0 = 0; b0 < B; b0 += cb) {
    const int64_t rows = std::min(cb, B - b0) * per;
    GemmArgs a;
    a.a = static_cast<char*>(logits_) + static_cast<size_t>(b0 * per * V) * esize;
    a.b = params_.weight(out_.weight);
    a.d = static_cast<char*>(h_) + static_cast<size_t>(b0 * per * J) * esize;
    gemm(linear_dgrad(rows, J, V), a, s);
  }
  joint_hidden_backward(de_, dq_, h_, e_, q_, dt, js, shape_.joint_dropout, rng_joint_, s);
  // The two input projections' gradients and their inputs'.
  GemmArgs we;
  we.a = de_, we.b = enc_, we.d = params_.grad(enc_proj_.weight);
  we.bias_grad = params_.grad(enc_proj_.bias);
  gemm(linear_wgrad(B * cur_.Te, H, J, false), we, s);
  GemmArgs ge;
  ge.a = de_, ge.b = params_.weight(enc_proj_.weight), ge.d = denc_;
  gemm(linear_dgrad(B * cur_.Te, H, J), ge, s);
  GemmArgs wq;
  wq.a = dq_, wq.b = pred_, wq.d = params_.grad(pred_proj_.weight);
  wq.bias_grad = params_.grad(pred_proj_.bias);
  gemm(linear_wgrad(B * cur_.P, Hp, J, false), wq, s);
  GemmArgs gq;
  gq.a = dq_, gq.b = params_.weight(pred_proj_.weight), gq.d = dpred_;
  gemm(linear_dgrad(B * cur_.P, Hp, J), gq, s);
}

void RnntModel::prediction_bwd(cudaStream_t s) {
  const int64_t rows = shape_.batch * cur_.P;
  dropout_backward(dpred_, dpred_, shape_.dtype, rows * shape_.pred_hidden, shape_.pred_dropout,
                   rng_pred_, s);
  lstm_backward(pred_rnn_, cur_.P, emb_, y3_, dpred_, demb_, s);
  GemmDesc d;  // dE = onehot^T demb
  d.m = shape_.vocab, d.n = shape_.pred_hidden, d.k = rows, d.trans_a = true;
  d.a_type = d.b_type = shape_.dtype;
  d.d_type = DType::kFP32;
  GemmArgs a;
  a.a = onehot_, a.b = demb_, a.d = params_.grad(embed_);
  gemm(d, a, s);
}

void RnntModel::encoder_post_bwd(cudaStream_t s) {
  dropout_backward(denc_, denc_, shape_.dtype, shape_.batch * cur_.Te * shape_.enc_hidden,
                   shape_.enc_dropout, rng_enc_post_, s);
  lstm_backward(enc_post_, cur_.Te, x1_, y2_, denc_, dx1_, s);
}

void RnntModel::encoder_pre_bwd(cudaStream_t s) {
  dropout_backward(dx1_, dx1_, shape_.dtype, shape_.batch * cur_.T * shape_.enc_hidden,
                   shape_.enc_dropout, rng_enc_pre_, s);
  lstm_backward(enc_pre_, cur_.T, x_, y1_, dx1_, dx_, s);
}

std::vector<graphs::Region> RnntModel::regions() {
  using graphs::Region;
  using graphs::RegionArgs;
  using graphs::RegionKind;
  const DType dt = shape_.dtype;
  auto i32 = [](void* p, int64_t n) { return TensorView(p, DType::kINT32, {n}); };
  auto stack_params = [this](const Stack& st) { return param_view(st.param, st.param); };
  auto stack_grads = [this](const Stack& st) { return grad_view(st.param, st.param); };
  auto region = [](std::string name, RegionKind kind, std::function<void(cudaStream_t)> f,
                   std::function<RegionArgs()> args) {
    Region r;
    r.name = std::move(name);
    r.kind = kind;
    r.enqueue = [f = std::move(f)](cudaStream_t s, const RegionArgs&) { f(s); };
    r.args = std::move(args);
    return r;
  };
  std::vector<Region> out;
  if (ema_ != nullptr)
    out.push_back(region(
        "ema", RegionKind::kOther,
        [this](cudaStream_t s) {
          ema_update(ema_, static_cast<const float*>(params_.masters().data),
                     params_.buffer_numel(), shape_.ema, s);
        },
        [this] {
          return RegionArgs()
              .read("params.master", params_.masters())
              .read_write("ema", TensorView(ema_, DType::kFP32, {params_.buffer_numel()}));
        }));
  out.push_back(region(
      "encoder.pre.fwd", RegionKind::kForwardLayer, [this](cudaStream_t s) { encoder_pre_fwd(s); },
      [=] {
        const int64_t B = shape_.batch, T = cur_.T, H = shape_.enc_hidden;
        return RegionArgs()
            .read("x", TensorView(x_, dt, {B, T, shape_.feature_dim}))
            .read("weights", stack_params(enc_pre_))
            .write("lengths", i32(enc_pre_.lengths, B))
            .write("y", TensorView(y1_, dt, {B, T, H}))
            .write("out", TensorView(x1_, dt, {B, T, H}))
            .write("reserve", TensorView(enc_pre_.reserve, DType::kUINT8,
                                         {static_cast<int64_t>(enc_pre_.reserve_bytes)}));
      }));
  out.push_back(region(
      "encoder.post.fwd", RegionKind::kForwardLayer,
      [this](cudaStream_t s) { encoder_post_fwd(s); },
      [=] {
        const int64_t B = shape_.batch, Te = cur_.Te, H = shape_.enc_hidden;
        return RegionArgs()
            .read("x", TensorView(x1_, dt, {B, Te, 2 * H}))
            .read("weights", stack_params(enc_post_))
            .write("lengths", i32(enc_post_.lengths, B))
            .write("y", TensorView(y2_, dt, {B, Te, H}))
            .write("enc", TensorView(enc_, dt, {B, Te, H}))
            .write("reserve", TensorView(enc_post_.reserve, DType::kUINT8,
                                         {static_cast<int64_t>(enc_post_.reserve_bytes)}));
      }));
  out.push_back(region(
      "prediction.fwd", RegionKind::kForwardLayer, [this](cudaStream_t s) { prediction_fwd(s); },
      [=] {
        const int64_t B = shape_.batch, P = cur_.P, Hp = shape_.pred_hidden;
        return RegionArgs()
            .read("tokens", TensorView(tokens_, DType::kINT32, {B, P}))
            .read("embed", param_view(embed_, embed_))
            .read("weights", stack_params(pred_rnn_))
            .write("onehot", TensorView(onehot_, dt, {B * P, shape_.vocab}))
            .write("emb", TensorView(emb_, dt, {B, P, Hp}))
            .write("lengths", i32(pred_rnn_.lengths, B))
            .write("y", TensorView(y3_, dt, {B, P, Hp}))
            .write("pred", TensorView(pred_, dt, {B, P, Hp}))
            .write("reserve", TensorView(pred_rnn_.reserve, DType::kUINT8,
                                         {static_cast<int64_t>(pred_rnn_.reserve_bytes)}));
      }));
  Region joint = region(
      "joint_loss", RegionKind::kOther, [this](cudaStream_t s) { joint_loss(s); },
      [=] {
        const int64_t B = shape_.batch, Te = cur_.Te, P = cur_.P, J = shape_.joint_hidden,
                      V = shape_.vocab;
        return RegionArgs()
            .read("enc", TensorView(enc_, dt, {B, Te, shape_.enc_hidden}))
            .read("pred", TensorView(pred_, dt, {B, P, shape_.pred_hidden}))
            .read("labels", TensorView(labels_, DType::kINT32, {B, cur_.U}))
            .read("enc_lengths", i32(enc_len_, B))
            .read("label_lengths", i32(label_len_, B))
            .read("joint.params", param_view(enc_proj_.weight, out_.bias))
            .read("loss_scale", TensorView(const_cast<float*>(io_.loss_scale), DType::kFP32, {1}))
            .write("e", TensorView(e_, dt, {B, Te, J}))
            .write("q", TensorView(q_, dt, {B, P, J}))
            .write("h", TensorView(h_, dt, {B, Te, P, J}))
            .write("logits", TensorView(logits_, dt, {B, Te, P, V}))
            .write("utterance_loss", TensorView(utt_loss_, DType::kFP32, {B}))
            .write("loss", TensorView(io_.loss, DType::kFP32, {1}))
            .write("loss_workspace",
                   TensorView(loss_ws_, DType::kUINT8, {static_cast<int64_t>(loss_ws_bytes_)}))
            .write("db_scratch", TensorView(db_scratch_, DType::kFP32, {V}))
            .write("de", TensorView(de_, dt, {B, Te, J}))
            .write("dq", TensorView(dq_, dt, {B, P, J}))
            .write("denc", TensorView(denc_, dt, {B, Te, shape_.enc_hidden}))
            .write("dpred", TensorView(dpred_, dt, {B, P, shape_.pred_hidden}))
            .write("joint.grads", grad_view(enc_proj_.weight, out_.bias));
      });
  out.push_back(std::move(joint));
  out.push_back(region(
      "prediction.bwd", RegionKind::kBackwardLayer, [this](cudaStream_t s) { prediction_bwd(s); },
      [=] {
        const int64_t B = shape_.batch, P = cur_.P, Hp = shape_.pred_hidden;
        return RegionArgs()
            .read("onehot", TensorView(onehot_, dt, {B * P, shape_.vocab}))
            .read("emb", TensorView(emb_, dt, {B, P, Hp}))
            .read("y", TensorView(y3_, dt, {B, P, Hp}))
            .read("weights", stack_params(pred_rnn_))
            .read_write("dpred", TensorView(dpred_, dt, {B, P, Hp}))
            .read_write("reserve", TensorView(pred_rnn_.reserve, DType::kUINT8,
                                              {static_cast<int64_t>(pred_rnn_.reserve_bytes)}))
            .write("lengths", i32(pred_rnn_.lengths, B))
            .write("demb", TensorView(demb_, dt, {B, P, Hp}))
            .write("dweights", TensorView(pred_rnn_.dweights, DType::kUINT8,
                                          {static_cast<int64_t>(pred_rnn_.plan->weight_bytes())}))
            .write("grads", stack_grads(pred_rnn_))
            .write("embed.grad", grad_view(embed_, embed_));
      }));
  out.push_back(region(
      "encoder.post.bwd", RegionKind::kBackwardLayer,
      [this](cudaStream_t s) { encoder_post_bwd(s); },
      [=] {
        const int64_t B = shape_.batch, Te = cur_.Te, H = shape_.enc_hidden;
        return RegionArgs()
            .read("x", TensorView(x1_, dt, {B, Te, 2 * H}))
            .read("y", TensorView(y2_, dt, {B, Te, H}))
            .read("weights", stack_params(enc_post_))
            .read_write("denc", TensorView(denc_, dt, {B, Te, H}))
            .read_write("reserve", TensorView(enc_post_.reserve, DType::kUINT8,
                                              {static_cast<int64_t>(enc_post_.reserve_bytes)}))
            .write("lengths", i32(enc_post_.lengths, B))
            .write("dx", TensorView(dx1_, dt, {B, Te, 2 * H}))
            .write("dweights", TensorView(enc_post_.dweights, DType::kUINT8,
                                          {static_cast<int64_t>(enc_post_.plan->weight_bytes())}))
            .write("grads", stack_grads(enc_post_));
      }));
  out.push_back(region(
      "encoder.pre.bwd", RegionKind::kBackwardLayer, [this](cudaStream_t s) { encoder_pre_bwd(s); },
      [=] {
        const int64_t B = shape_.batch, T = cur_.T, H = shape_.enc_hidden;
        return RegionArgs()
            .read("x", TensorView(x_, dt, {B, T, shape_.feature_dim}))
            .read("y", TensorView(y1_, dt, {B, T, H}))
            .read("weights", stack_params(enc_pre_))
            .read_write("dout", TensorView(dx1_, dt, {B, T, H}))
            .read_write("reserve", TensorView(enc_pre_.reserve, DType::kUINT8,
                                              {static_cast<int64_t>(enc_pre_.reserve_bytes)}))
            .write("lengths", i32(enc_pre_.lengths, B))
            .write("dx", TensorView(dx_, dt, {B, T, shape_.feature_dim}))
            .write("dweights", TensorView(enc_pre_.dweights, DType::kUINT8,
                                          {static_cast<int64_t>(enc_pre_.plan->weight_bytes())}))
            .write("grads", stack_grads(enc_pre_));
      }));
  return out;
}

// ---- Data --------------------------------------------------------------------------------------

int RnntModel::load_batch(cudaStream_t stream) {
  const int64_t B = shape_.batch;
  sampler_->batch(next_batch_, indices_.data());
  const SpeechFile& file = *data_.file;
  int64_t max_frames = 0, max_labels = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = indices_[static_cast<size_t>(b)];
    if (i < 0) continue;
    max_frames = std::max<int64_t>(max_frames, file.frame_length(i));
    max_labels = std::max<int64_t>(max_labels, file.label_length(i));
  }
  const int key = data_.batching.key_of(max_frames, max_labels);
  const Dims d = dims(data_.batching.shapes[static_cast<size_t>(key)]);
  // The staging buffers are free once the previous batch's copies are done (they were enqueued
  // before the previous step, so this waits for no step).
  REPLAY_CUDA_CHECK(cudaEventSynchronize(copied_));
  PaddedBatchRef ref;
  ref.features = host_x_;
  ref.frame_lengths = frame_len_.data();
  ref.labels = labels_tmp_.data();
  ref.label_lengths = host_label_len_.data();
  file.read_batch(indices_.data(), B, d.T, d.U, feature_type(shape_.dtype), ref);
  int32_t* tokens = host_ints_;
  int32_t* labels = tokens + B * d.P;
  int32_t* enc_len = labels + B * d.U;
  int32_t* lab_len = enc_len + B;
  for (int64_t b = 0; b < B; ++b) {
    tokens[b * d.P] = shape_.blank();
    for (int64_t u = 0; u < d.U; ++u) {
      const int32_t y = labels_tmp_[static_cast<size_t>(b * d.U + u)];
      tokens[b * d.P + 1 + u] = y;
      labels[b * d.U + u] = y;
    }
    enc_len[b] = (frame_len_[static_cast<size_t>(b)] + 1) / 2;
    lab_len[b] = host_label_len_[static_cast<size_t>(b)];
  }
  check_staging("load_batch");
  const size_t esize = dtype_size(shape_.dtype);
  auto h2d = [&](void* dst, const void* src, size_t bytes) {
    REPLAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  };
  h2d(x_, host_x_, static_cast<size_t>(B * d.T * shape_.feature_dim) * esize);
  h2d(tokens_, tokens, static_cast<size_t>(B * d.P) * sizeof(int32_t));
  h2d(labels_, labels, static_cast<size_t>(B * d.U) * sizeof(int32_t));
  h2d(enc_len_, enc_len, static_cast<size_t>(B) * sizeof(int32_t));
  h2d(label_len_, lab_len, static_cast<size_t>(B) * sizeof(int32_t));
  REPLAY_CUDA_CHECK(cudaEventRecord(copied_, stream));
  next_batch_ += 1;
  select_shape(key);
  return key;
}

void RnntModel::seek_data(int64_t position) {
  REPLAY_REQUIRE(position >= 0, "RnntModel::seek_data: negative position");
  next_batch_ = position;
}

// ---- Evaluation: greedy decoding ---------------------------------------------------------------

DecodeShape RnntModel::decode_shape() const {
  DecodeShape d;
  d.batch = shape_.batch, d.vocab = shape_.vocab, d.layers = shape_.pred_layers;
  d.hidden = shape_.pred_hidden, d.blank = shape_.blank();
  return d;  // MLPerf's limits: 30 symbols a frame, 300 an utterance
}

std::optional<train::EvalInfo> RnntModel::evaluation() const {
  train::EvalInfo e;
  e.metric = "wer";
  e.higher_is_better = false;
  e.samples_per_batch = shape_.batch;
  // Whole batches of the held-out split (the last one's empty slots count as samples).
  e.default_samples = eval_batches_ * shape_.batch;
  e.available_samples = eval_batches_ * shape_.batch;
  // The encoder and the WHILE-node decoder as one graph in full mode (--eval-graph, the default):
  // this needs the decoder's LSTM on a cuDNN handle of its own (decode_own_handle). On the
  // encoder's handle, cuDNN's RNN forward joins streams of that handle to the evaluation graph's
  // capture, and its one-step call in the WHILE body then waits on them from the body's capture
  // (cudaErrorStreamCaptureMerge, which invalidates it); ending the captures then crashed the
  // driver on an H100 (free(): invalid pointer, a glibc mutex assertion, or a hang;
  // lab/rnnt_one_graph).
  e.one_graph_in_full = data_.eval_one_graph;
  return e;
}

void* RnntModel::eval_weight(train::ParamId id) const {
  if (eval_weights_ == nullptr) return params_.weight(id);
  return static_cast<char*>(eval_weights_) +
         static_cast<size_t>(params_.offset(id)) * dtype_size(shape_.dtype);
}

std::vector<train::Model::NamedTensor> RnntModel::checkpoint_state() const {
  if (ema_ == nullptr) return {};
  return {{"ema", TensorView(ema_, DType::kFP32, {params_.buffer_numel()})}};
}

void RnntModel::eval_encoder(cudaStream_t s) {
  clock_mark(eval_clock_, -1, 2, s);
  if (eval_weights_ != nullptr)  // evaluation decodes with the EMA of the weights
    cast_from_fp32(eval_weights_, shape_.dtype, ema_, params_.buffer_numel(), s);
  // No dropout: the stacked pre-network output feeds the post network directly.
  auto infer = [&](Stack& st, int64_t seq, const void* x, void* y) {
    std::fill(st.host_lengths.begin(), st.host_lengths.end(), static_cast<int32_t>(seq));
    st.plan->set_lengths(st.host_lengths.data(), seq);
    fill_int32(st.lengths, static_cast<int32_t>(seq), shape_.batch, s);
    LstmForwardArgs a;
    a.lengths = st.lengths, a.x = x, a.weights = eval_weight(st.param), a.y = y;
    st.plan->forward(ctx_, s, LstmMode::kInference, a, lstm_ws_, lstm_ws_bytes_, nullptr, 0);
  };
  infer(enc_pre_, eval_.T, x_, y1_);
  infer(enc_post_, eval_.Te, y1_, y2_);
  GemmArgs fe;
  fe.a = y2_, fe.b = eval_weight(enc_proj_.weight), fe.d = e_;
  fe.bias = eval_weight(enc_proj_.bias);
  gemm(linear_forward(shape_.batch * eval_.Te, shape_.enc_hidden, shape_.joint_hidden), fe, s);
  clock_mark(eval_clock_, 0, 2, s);
}

void RnntModel::decode_step(cudaStream_t s) {
  const DecodeShape ds = decode_shape();
  const int64_t B = shape_.batch, Hp = shape_.pred_hidden, J = shape_.joint_hidden,
                V = shape_.vocab;
  const DType dt = shape_.dtype;
  decode_embed(dec_x_, eval_weight(embed_), dec_.label, dt, ds, Hp, s);
  // The one-step plan's lengths are all 1 from its construction; the device copy: eval_decode.
  LstmForwardArgs a;
  a.lengths = step_lengths_, a.x = dec_x_, a.hx = dec_h_, a.cx = dec_c_;
  a.weights = eval_weight(pred_rnn_.param), a.y = dec_y_, a.hy = dec_hy_, a.cy = dec_cy_;
  pred_step_->forward(decode_ctx(), s, LstmMode::kInference, a, lstm_ws_, lstm_ws_bytes_, nullptr,
                      0);
  GemmArgs q;
  q.a = dec_y_, q.b = eval_weight(pred_proj_.weight), q.d = dec_q_;
  q.bias = eval_weight(pred_proj_.bias);
  gemm(linear_forward(B, Hp, J), q, s);
  decode_joint(dec_hj_, e_, dec_q_, dec_.frame, dt, B, eval_.Te, J, s);
  GemmArgs o;
  o.a = dec_hj_, o.b = eval_weight(out_.weight), o.d = dec_logits_;
  o.bias = eval_weight(out_.bias);
  gemm(linear_forward(B, J, V), o, s);
  decode_update(dec_, dec_logits_, dec_h_, dec_c_, dec_hy_, dec_cy_, dt,
                static_cast<const int32_t*>(enc_len_), ds, s);
}

void RnntModel::eval_decode(cudaStream_t s) {
  const DecodeShape ds = decode_shape();
  clock_mark(eval_clock_, -1, 2, s);
  fill_int32(step_lengths_, 1, shape_.batch, s);  // the one-step LSTM's lengths, once per batch
  decode_init(dec_, dec_h_, dec_c_, shape_.dtype, static_cast<const int32_t*>(enc_len_), ds, s);
  if (data_.decoder == DecoderKind::kHost) {
    // The eager reference: one step, then the host reads the flag (a sync per step). Every step
    // advances a frame or emits a symbol, so T' x (max_per_frame + 1) steps bound the loop.
    const int64_t bound = eval_.Te * (ds.max_per_frame + 1) + 1;
    for (int64_t i = 0; i < bound; ++i) {
      decode_step(s);
      REPLAY_CUDA_CHECK(
          cudaMemcpyAsync(host_flag_, dec_.flag, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
      REPLAY_CUDA_CHECK(cudaStreamSynchronize(s));
      if (*host_flag_ == 0) break;
    }
  } else if (data_.decoder == DecoderKind::kUnrolled) {
    // NVIDIA's: a graph of kUnroll steps that ends by copying the flag to pinned memory; the host
    // launches replay i, then waits for replay i - 1 and reads the flag it left, so the GPU always
    // has a replay queued. Steps after every utterance is done change nothing.
    if (!unrolled_) {
      unrolled_ = std::make_unique<graphs::Graph>("rnnt.greedy_decode_x4");
      unrolled_->build(
          unroll_stream_->get(),
          [this](cudaStream_t cs) {
            for (int k = 0; k < kUnroll; ++k) decode_step(cs);
            REPLAY_CUDA_CHECK(cudaMemcpyAsync(host_flag_, dec_.flag, sizeof(int32_t),
                                              cudaMemcpyDeviceToHost, cs));
          },
          s);
    }
    const int64_t bound = (eval_.Te * (ds.max_per_frame + 1) + 1) / kUnroll + 2;
    for (int64_t i = 0; i < bound; ++i) {
      unrolled_->launch(s);
      REPLAY_CUDA_CHECK(cudaEventRecord(replayed_[i % 2], s));
      if (i == 0) continue;
      REPLAY_CUDA_CHECK(cudaEventSynchronize(replayed_[(i - 1) % 2]));
      if (*host_flag_ == 0) break;
    }
  } else {
    // The body holds while_unroll steps: each iteration also runs the condition kernel and
    // relaunches the body on the device, about 5 us on an H100 (lab/rnnt_one_graph's timing)
    // against some 80 us of work in a step at mlperf-b192. Measured there (one graph, 128
    // utterances): 1 step a body 26.55 ms of decoding, 2 steps 25.70, 8 steps 25.20, NVIDIA's
    // 4-step unrolled graph 25.90. Up to while_unroll - 1 steps after the last utterance
    // finishes change nothing.
    cond_->while_nonzero(s, "rnnt.greedy_decode", dec_.flag, [this](cudaStream_t body) {
      for (int k = 0; k < data_.while_unroll; ++k) decode_step(body);
    });
  }
  decode_store(static_cast<int32_t*>(eval_tokens_), static_cast<int32_t*>(eval_lens_),
               static_cast<int32_t*>(eval_counter_), eval_batches_, dec_, ds, s);
  clock_mark(eval_clock_, 1, 2, s);
}

std::vector<graphs::Region> RnntModel::eval_regions() {
  using graphs::Region;
  using graphs::RegionArgs;
  const DType dt = shape_.dtype;
  const int64_t B = shape_.batch, H = shape_.enc_hidden, J = shape_.joint_hidden;
  std::vector<Region> out;
  Region enc;
  enc.name = "eval.encoder";
  enc.kind = graphs::RegionKind::kForwardLayer;
  enc.enqueue = [this](cudaStream_t s, const RegionArgs&) { eval_encoder(s); };
  enc.args = [=] {
    RegionArgs a;
    if (ema_ != nullptr)
      a.read("ema", TensorView(ema_, DType::kFP32, {params_.buffer_numel()}))
          .write("eval.weights", TensorView(eval_weights_, dt, {params_.buffer_numel()}));
    return a.read("x", TensorView(x_, dt, {B, eval_.T, shape_.feature_dim}))
        .read("params", params_.weights())
        .write("enc_pre.lengths", TensorView(enc_pre_.lengths, DType::kINT32, {B}))
        .write("enc_post.lengths", TensorView(enc_post_.lengths, DType::kINT32, {B}))
        .write("y1", TensorView(y1_, dt, {B, eval_.T, H}))
        .write("y2", TensorView(y2_, dt, {B, eval_.Te, H}))
        .write("e", TensorView(e_, dt, {B, eval_.Te, J}))
        .read_write("eval.clock", TensorView(eval_clock_, DType::kINT64, {3}));
  };
  out.push_back(std::move(enc));
  Region dec;
  dec.name = "eval.decode";
  dec.kind = graphs::RegionKind::kOther;
  dec.graphable = data_.decoder == DecoderKind::kWhile;  // the host loops read the device
  dec.enqueue = [this](cudaStream_t s, const RegionArgs&) { eval_decode(s); };
  dec.args = [=] {
    const int64_t L = shape_.pred_layers, Hp = shape_.pred_hidden, S = decode_shape().max_symbols;
    return RegionArgs()
        .read("e", TensorView(e_, dt, {B, eval_.Te, J}))
        .read("enc_lengths", TensorView(enc_len_, DType::kINT32, {B}))
        .read("params", eval_weights_ ? TensorView(eval_weights_, dt, {params_.buffer_numel()})
                                      : params_.weights())
        .write("state.h", TensorView(dec_h_, dt, {L, B, Hp}))
        .write("state.c", TensorView(dec_c_, dt, {L, B, Hp}))
        .write("state.hy", TensorView(dec_hy_, dt, {L, B, Hp}))
        .write("state.cy", TensorView(dec_cy_, dt, {L, B, Hp}))
        .write("x", TensorView(dec_x_, dt, {B, Hp}))
        .write("y", TensorView(dec_y_, dt, {B, Hp}))
        .write("q", TensorView(dec_q_, dt, {B, J}))
        .write("hj", TensorView(dec_hj_, dt, {B, J}))
        .write("logits", TensorView(dec_logits_, dt, {B, shape_.vocab}))
        .write("ints", TensorView(dec_ints_, DType::kINT32, {5 * B + 1}))
        .write("tokens", TensorView(dec_tokens_, DType::kINT32, {B, S}))
        .write("lengths", TensorView(dec_lengths_, DType::kINT32, {B}))
        .write("lstm_lengths", TensorView(step_lengths_, DType::kINT32, {B}))
        .read_write("eval.tokens", TensorView(eval_tokens_, DType::kINT32, {eval_batches_, B, S}))
        .read_write("eval.lengths", TensorView(eval_lens_, DType::kINT32, {eval_batches_, B}))
        .read_write("eval.counter", TensorView(eval_counter_, DType::kINT32, {1}))
        .read_write("eval.clock", TensorView(eval_clock_, DType::kINT64, {3}));
  };
  out.push_back(std::move(dec));
  return out;
}

void RnntModel::begin_eval(cudaStream_t stream) {
  REPLAY_CUDA_CHECK(cudaMemsetAsync(eval_counter_, 0, sizeof(int32_t), stream));
  REPLAY_CUDA_CHECK(cudaMemsetAsync(eval_clock_, 0, 3 * sizeof(uint64_t), stream));
  next_eval_ = 0;
  evaluated_ = 0;
}

void RnntModel::load_eval_batch(cudaStream_t stream) {
  const SpeechFileInfo& info = data_.file->info();
  const int64_t B = shape_.batch;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = info.num_train() + next_eval_ * B + b;
    indices_[static_cast<size_t>(b)] = i < info.num_utterances ? i : -1;
  }
  REPLAY_CUDA_CHECK(cudaEventSynchronize(copied_));
  PaddedBatchRef ref;
  ref.features = host_x_;
  ref.frame_lengths = frame_len_.data();
  ref.labels = labels_tmp_.data();
  ref.label_lengths = host_label_len_.data();
  data_.file->read_batch(indices_.data(), B, eval_.T, eval_.U, feature_type(shape_.dtype), ref);
  int32_t* enc_len = host_ints_;
  for (int64_t b = 0; b < B; ++b) enc_len[b] = (frame_len_[static_cast<size_t>(b)] + 1) / 2;
  check_staging("load_eval_batch");
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(
      x_, host_x_, static_cast<size_t>(B * eval_.T * shape_.feature_dim) * dtype_size(shape_.dtype),
      cudaMemcpyHostToDevice, stream));
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(enc_len_, enc_len, static_cast<size_t>(B) * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, stream));
  REPLAY_CUDA_CHECK(cudaEventRecord(copied_, stream));
  next_eval_ = (next_eval_ + 1) % eval_batches_;
  evaluated_ += 1;
}

double RnntModel::end_eval(cudaStream_t stream) {
  const int64_t B = shape_.batch, S = decode_shape().max_symbols;
  const int64_t n = std::min(evaluated_, eval_batches_);
  std::vector<int32_t> tokens(static_cast<size_t>(eval_batches_ * B * S)),
      lens(static_cast<size_t>(eval_batches_ * B));
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(tokens.data(), eval_tokens_, tokens.size() * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  REPLAY_CUDA_CHECK(cudaMemcpyAsync(lens.data(), eval_lens_, lens.size() * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  uint64_t clock[3] = {0, 0, 0};
  REPLAY_CUDA_CHECK(
      cudaMemcpyAsync(clock, eval_clock_, sizeof(clock), cudaMemcpyDeviceToHost, stream));
  REPLAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  const SpeechFileInfo& info = data_.file->info();
  ErrorRate er;
  RnntEvalLog log;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over (utterance, its hypothesis)
  auto mix = [&hash](uint64_t v) {
    for (int k = 0; k < 8; ++k) {
      hash ^= (v >> (8 * k)) & 0xff;
      hash *= 1099511628211ull;
    }
  };
  for (int64_t k = 0; k < n; ++k)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = info.num_train() + k * B + b;
      if (i >= info.num_utterances) continue;
      const int32_t len =
          std::min<int32_t>(lens[static_cast<size_t>(k * B + b)], static_cast<int32_t>(S));
      const int32_t* hyp = tokens.data() + (k * B + b) * S;
      er.add(hyp, len, data_.file->labels(i), data_.file->label_length(i));
      mix(static_cast<uint64_t>(i));
      mix(static_cast<uint64_t>(len));
      for (int32_t j = 0; j < len; ++j) mix(static_cast<uint64_t>(static_cast<uint32_t>(hyp[j])));
      log.utterances += 1;
      log.hypothesis_labels += len;
    }
  log.reference_labels = er.reference;
  log.wer = er.rate();
  log.tokens_hash = hash;
  log.batches = n;
  log.encode_s = static_cast<double>(clock[1]) * 1e-9;
  log.decode_s = static_cast<double>(clock[2]) * 1e-9;
  if (data_.eval_log) {
    log.decode_s_history = data_.eval_log->decode_s_history;
    log.decode_s_history.push_back(log.decode_s);
    *data_.eval_log = log;
  }
  return log.wer;
}

// ---- Cost --------------------------------------------------------------------------------------

double RnntModel::flops_per_step() const {
  // Forward FLOPs at the current shape (padded), times 3 for forward and backward.
  const int64_t B = shape_.batch, H = shape_.enc_hidden, Hp = shape_.pred_hidden,
                J = shape_.joint_hidden, V = shape_.vocab;
  auto lstm = [&](const Stack& st, int64_t seq) {
    LstmDesc d = st.plan->desc();
    d.max_seq = seq;
    return d.flops();
  };
  double f = lstm(enc_pre_, cur_.T) + lstm(enc_post_, cur_.Te) + lstm(pred_rnn_, cur_.P);
  f += 2.0 * static_cast<double>(B * cur_.Te) * static_cast<double>(H * J);
  f += 2.0 * static_cast<double>(B * cur_.P) * static_cast<double>(Hp * J);
  f += 2.0 * static_cast<double>(B * cur_.Te * cur_.P) * static_cast<double>(J * V);
  return 3.0 * f;
}

std::string RnntModel::flops_formula() const {
  return "3 x forward at the step's padded shape: LSTMs 8 H (I + H) B T per layer, joint "
         "2 B T' (H J) + 2 B P (Hp J) + 2 B T' P J V (embedding gather and loss excluded)";
}

}  // namespace replay::rnnt
