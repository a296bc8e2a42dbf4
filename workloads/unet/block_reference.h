// block_reference.h: fp64 CPU references of the UNet's two composite blocks, forward and backward,
// with the GPU model's layouts, order and parameter shapes (unet_model.cpp): the residual block and
// the spatial transformer. Built from the op references (unet_reference.h, pointwise_reference.h)
// plus a linear layer, SiLU and multi-head softmax attention written here. Naive loops: for tests.
//
// Residual block (diffusers' ResnetBlock2D), x [N, H, W, Cin], temb [N, T] (the time MLP's output):
//   h = conv1(silu(norm1(x))) + time_emb_proj(silu(temb))[n, :]     (3x3, padding 1)
//   out = shortcut(x) + conv2(silu(norm2(h)))                       shortcut: 1x1 conv when Cin !=
//                                                                   Cout, else the identity
// GroupNorm eps 1e-5, G groups. In the GPU model the SiLU of temb is one shared node; here it is
// part of the block, and dtemb is the gradient of the pre-SiLU embedding.
//
// Spatial transformer (Transformer2DModel with use_linear_projection, one BasicTransformerBlock),
// x [N, S, C] (S = H * W pixels), context [N, L, D]; heads of C / heads channels:
//   h = proj_in(groupnorm(x))                       (eps 1e-6)
//   h = h + to_out1(attn(qkv(ln1(h))))               self-attention, qkv [3C, C]: rows q, k, v
//   h = h + to_out2(attn(to_q(ln2(h)), to_k(ctx), to_v(ctx)))   cross-attention
//   h = h + ff2(geglu(ff1(ln3(h))))                  ff1 [8C, C], ff2 [C, 4C]
//   out = proj_out(h) + x
// LayerNorm eps 1e-5; attention scale 1 / sqrt(C / heads); q, k, v without bias.
#pragma once

#include <cstdint>
#include <vector>

namespace replay::unet::ref {

using Vec = std::vector<double>;

// y [rows, out] = x [rows, in] W^T + b (b may be empty). Backward overwrites dw, db (the bias
// gradient, whether or not the layer has a bias) and, when dx is not null, dx.
void linear_forward(double* y, const double* x, const Vec& w, const Vec& b, int64_t rows,
                    int64_t in, int64_t out);
void linear_backward(double* dx, Vec& dw, Vec& db, const double* dy, const double* x, const Vec& w,
                     int64_t rows, int64_t in, int64_t out);

// Multi-head softmax attention: q [N, Sq, C], k and v [N, Skv, C], o [N, Sq, C]; head h is
// channels [h * d, (h + 1) * d) of each, d = C / heads. Backward overwrites dq, dk, dv.
void attention_forward(double* o, const double* q, const double* k, const double* v, int64_t N,
                       int64_t Sq, int64_t Skv, int64_t C, int64_t heads);
void attention_backward(double* dq, double* dk, double* dv, const double* d_o, const double* q,
                        const double* k, const double* v, int64_t N, int64_t Sq, int64_t Skv,
                        int64_t C, int64_t heads);

struct ResnetDims {
  int64_t N = 1, H = 1, W = 1, Cin = 8, Cout = 8, T = 8;
  int G = 2;
  bool shortcut() const { return Cin != Cout; }
};
// Every parameter, in the GPU model's ParamStore order and shapes ([K, R, S, C] filters, [out, in]
// matrices); the shortcut's are empty when Cin == Cout.
struct ResnetParams {
  Vec norm1_w, norm1_b, conv1_w, conv1_b, temb_w, temb_b, norm2_w, norm2_b, conv2_w, conv2_b,
      short_w, short_b;
  std::vector<Vec*> all();
  static ResnetParams shaped_like(const ResnetDims& d);  // zeros of every shape
};
// out [N, H, W, Cout]; backward overwrites every field of grads, dx and dtemb.
void resnet_forward(Vec& out, const ResnetDims& d, const ResnetParams& p, const Vec& x,
                    const Vec& temb);
void resnet_backward(ResnetParams& grads, Vec& dx, Vec& dtemb, const ResnetDims& d,
                     const ResnetParams& p, const Vec& x, const Vec& temb, const Vec& dout);

struct TransformerDims {
  int64_t N = 1, S = 4, C = 8, L = 3, D = 8, heads = 2;
  int G = 2;
};
struct TransformerParams {
  Vec norm_w, norm_b, proj_in_w, proj_in_b, ln1_w, ln1_b, qkv_w, out1_w, out1_b, ln2_w, ln2_b, q_w,
      k_w, v_w, out2_w, out2_b, ln3_w, ln3_b, ff1_w, ff1_b, ff2_w, ff2_b, proj_out_w, proj_out_b;
  std::vector<Vec*> all();
  static TransformerParams shaped_like(const TransformerDims& d);
};
// out [N, S, C]; backward overwrites every field of grads and dx (the context gets no gradient:
// it is data).
void transformer_forward(Vec& out, const TransformerDims& d, const TransformerParams& p,
                         const Vec& x, const Vec& context);
void transformer_backward(TransformerParams& grads, Vec& dx, const TransformerDims& d,
                          const TransformerParams& p, const Vec& x, const Vec& context,
                          const Vec& dout);

}  // namespace replay::unet::ref
