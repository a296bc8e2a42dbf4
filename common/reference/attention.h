// reference/attention.h: fp64 CPU reference of scaled dot-product attention (causal or not,
// GQA/MQA, different q/k and v head dims, any softmax scale), forward with log-sum-exp stats and
// backward. No dropout: its mask is drawn inside cuDNN and cannot be reproduced here.
//
// Layouts match common/attention.h's kSeparate: q [B, Sq, Hq, Dqk], k [B, Skv, Hkv, Dqk],
// v [B, Skv, Hkv, Dv], o and d_o [B, Sq, Hq, Dv], lse [B, Hq, Sq], all contiguous. Query head h
// reads kv head h / (Hq / Hkv). Causal is top-left aligned: query i sees keys 0..i.
#pragma once

#include <cstdint>

namespace replay::reference {

struct AttentionShape {
  int64_t batch = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t seq_q = 1;
  int64_t seq_kv = 1;
  int64_t dim_qk = 1;
  int64_t dim_v = 1;
  bool causal = false;
  double scale = 1.0;
};

// o = softmax(scale * q k^T, masked) v; lse = log(sum(exp(scale * q k^T))) over the visible keys.
void attention_forward(const AttentionShape& s, const double* q, const double* k, const double* v,
                       double* o, double* lse);

// Gradients of sum(o * d_o) with respect to q, k and v (overwritten). The softmax is recomputed
// from q and k, so the result does not depend on a forward's outputs.
void attention_backward(const AttentionShape& s, const double* q, const double* k, const double* v,
                        const double* d_o, double* dq, double* dk, double* dv);

}  // namespace replay::reference
