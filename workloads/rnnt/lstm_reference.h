// lstm_reference.h: the fp64 CPU reference of a multi-layer LSTM (lstm.h runs it on cuDNN), forward
// and backward through time, with per-sample sequence lengths. Written from the cell's definition,
// for the tests: slow loops, one sample at a time.
//
// The cell (PyTorch's torch.nn.LSTM and cuDNN's CUDNN_LSTM with CUDNN_RNN_DOUBLE_BIAS), for layer l
// with input x_t (the sample's input for l = 0, layer l - 1's h_t above it):
//   a_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh              [4H], gate blocks in the order i, f,
//   g, o i = sigmoid(a_i)  f = sigmoid(a_f)  g = tanh(a_g)  o = sigmoid(a_o) c_t = f * c_{t-1} + i
//   * g        h_t = o * tanh(c_t)
// from (h_{-1}, c_{-1}) = (h0[l], c0[l]). A sample of length n runs steps t < n only: its outputs
// past n are zero here, and its final state is the one after step n - 1 (h0, c0 when n = 0).
#pragma once

#include <cstdint>
#include <vector>

namespace replay::rnnt::ref {

struct LstmShape {
  int64_t input = 0;    // I: layer 0's input size
  int64_t hidden = 0;   // H
  int64_t layers = 1;   // L
  int64_t batch = 1;    // B
  int64_t max_seq = 1;  // T: the padding of x and y

  int64_t layer_input(int64_t l) const { return l == 0 ? input : hidden; }
};

// One layer's parameters, row-major with PyTorch's shapes and names: w_ih [4H, I_l] (weight_ih_lN),
// w_hh [4H, H], b_ih [4H], b_hh [4H]; the rows of each are the gate blocks i, f, g, o.
struct LstmLayerWeights {
  std::vector<double> w_ih, w_hh, b_ih, b_hh;
};

// Zero-filled weights of the shape's sizes (for gradients).
std::vector<LstmLayerWeights> lstm_zero_weights(const LstmShape& shape);

// Forward. x [B, T, I] (batch-major: the tests move cuDNN's layouts to and from this one); lengths
// [B], each in [0, T]; h0, c0 [L, B, H] or null (zeros). Writes y [B, T, H] (the last layer's h_t,
// zeros past each length) and hn, cn [L, B, H] (each layer's state after the sample's last step);
// any output may be null. Positions of x past a sample's length are never read.
void lstm_forward(const LstmShape& shape, const std::vector<LstmLayerWeights>& weights,
                  const double* x, const int32_t* lengths, const double* h0, const double* c0,
                  double* y, double* hn, double* cn);

// Backward through time of  loss = sum(dy * y) + sum(dhn * hn) + sum(dcn * cn)  over the positions
// inside the lengths (dy past a sample's length is never read; dy, dhn, dcn may be null: zeros).
// Writes dx [B, T, I] (zeros past the lengths), dh0, dc0 [L, B, H]; adds the weight gradients into
// dweights (sized by lstm_zero_weights; the cuDNN call accumulates too). Any output may be null.
// Runs the forward itself.
void lstm_backward(const LstmShape& shape, const std::vector<LstmLayerWeights>& weights,
                   const double* x, const int32_t* lengths, const double* h0, const double* c0,
                   const double* dy, const double* dhn, const double* dcn, double* dx, double* dh0,
                   double* dc0, std::vector<LstmLayerWeights>* dweights);

}  // namespace replay::rnnt::ref
