// The UNet's pointwise ops on the GPU against the fp64 references (pointwise_reference.h): GEGLU
// forward and backward (small widths, SD2's 1280 and 5120, fp16 and bf16, din aliasing in),
// nearest-neighbour 2x upsampling (the forward an exact copy, the backward's fixed-order sum), and
// the skip concatenation with its backward split, with and without accumulation; bitwise
// determinism, and a CUDA graph replay equal to the eager calls.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/check.h"
#include "graphs/graph.h"
#include "tests/support/compare.h"
#include "workloads/unet/pointwise.h"
#include "workloads/unet/pointwise_reference.h"

namespace replay::unet {
namespace {

using test::DeviceBuffer;
using test::same_bits;
using Vec = std::vector<double>;

using test::from_bits;
using test::from_storage;
using test::to_bits;
using test::to_storage;
// Drawn, rounded to the storage type; `bits` gets what the GPU sees, the result what the
// reference sees.
Vec draw(size_t n, uint64_t seed, float stddev, DType t, std::vector<uint16_t>* bits) {
  *bits = to_storage(test::random_normal(n, seed, 0.0f, stddev), t);
  return test::to_double(from_storage(*bits, t));
}

test::Tolerance tol(DType t) {
  return t == DType::kFP16 ? test::Tolerance{1e-3, 2e-3} : test::Tolerance{4e-3, 8e-3};
}

// --- GEGLU ---------------------------------------------------------------------------------------

void check_geglu(int64_t rows, int F, DType dtype) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " F " + std::to_string(F) + " " +
               dtype_name(dtype));
  graphs::CaptureStream stream;
  std::vector<uint16_t> in_bits, dout_bits;
  const Vec in = draw(static_cast<size_t>(rows * 2 * F), 7 + F, 1.5f, dtype, &in_bits);
  const Vec dout = draw(static_cast<size_t>(rows * F), 8 + F, 1.0f, dtype, &dout_bits);
  DeviceBuffer<uint16_t> d_in(in_bits), d_dout(dout_bits), out(static_cast<size_t>(rows * F)),
      din(in_bits.size());
  geglu_forward(dtype, out.get(), d_in.get(), rows, F, stream.get());
  geglu_backward(dtype, din.get(), d_dout.get(), d_in.get(), rows, F, stream.get());
  Vec out_ref(static_cast<size_t>(rows * F)), din_ref(in.size());
  ref::geglu_forward(out_ref.data(), in.data(), rows, F);
  ref::geglu_backward(din_ref.data(), dout.data(), in.data(), rows, F);
  EXPECT_TRUE(
      test::all_close("geglu out", from_storage(out.download(), dtype), out_ref, tol(dtype)));
  EXPECT_TRUE(
      test::all_close("geglu din", from_storage(din.download(), dtype), din_ref, tol(dtype)));

  // Deterministic, and the backward in place (din aliasing in) gives the same bits.
  const std::vector<uint16_t> first = din.download();
  geglu_backward(dtype, din.get(), d_dout.get(), d_in.get(), rows, F, stream.get());
  EXPECT_TRUE(same_bits("din twice", first, din.download()));
  geglu_backward(dtype, d_in.get(), d_dout.get(), d_in.get(), rows, F, stream.get());
  EXPECT_TRUE(same_bits("din in place", first, d_in.download()));
}

TEST(PointwiseGpu, GegluMatchesTheReference) {
  for (DType dtype : {DType::kFP16, DType::kBF16}) {
    check_geglu(1, 8, dtype);
    check_geglu(37, 24, dtype);
    check_geglu(4096, 1280, dtype);  // 64x64 tokens of one image at C = 320
    check_geglu(256, 5120, dtype);   // 16x16 at C = 1280
  }
}

// --- upsampling ----------------------------------------------------------------------------------

void check_upsample(const UpsampleShape& s, DType dtype) {
  SCOPED_TRACE("N " + std::to_string(s.batch) + " H " + std::to_string(s.height) + " W " +
               std::to_string(s.width) + " C " + std::to_string(s.channels) + " " +
               dtype_name(dtype));
  graphs::CaptureStream stream;
  const int64_t nx = s.batch * s.height * s.width * s.channels, ny = 4 * nx;
  std::vector<uint16_t> x_bits, dy_bits;
  const Vec x = draw(static_cast<size_t>(nx), 51, 1.0f, dtype, &x_bits);
  const Vec dy = draw(static_cast<size_t>(ny), 52, 1.0f, dtype, &dy_bits);
  DeviceBuffer<uint16_t> d_x(x_bits), d_dy(dy_bits), y(static_cast<size_t>(ny)),
      dx(static_cast<size_t>(nx));
  upsample_nearest2x_forward(dtype, y.get(), d_x.get(), s, stream.get());
  upsample_nearest2x_backward(dtype, dx.get(), d_dy.get(), s, stream.get());
  Vec y_ref(static_cast<size_t>(ny)), dx_ref(static_cast<size_t>(nx));
  ref::upsample_nearest2x_forward(y_ref.data(), x.data(), s.batch, s.height, s.width, s.channels);
  ref::upsample_nearest2x_backward(dx_ref.data(), dy.data(), s.batch, s.height, s.width,
                                   s.channels);
  // The forward copies: exact.
  EXPECT_TRUE(test::all_close("upsample y", from_storage(y.download(), dtype), y_ref, {0.0, 0.0}));
  // The backward adds four in fp32 (exact for fp16 and bf16 inputs of similar size) and rounds
  // once.
  EXPECT_TRUE(
      test::all_close("upsample dx", from_storage(dx.download(), dtype), dx_ref, tol(dtype)));
  const std::vector<uint16_t> first = dx.download();
  upsample_nearest2x_backward(dtype, dx.get(), d_dy.get(), s, stream.get());
  EXPECT_TRUE(same_bits("dx twice", first, dx.download()));
}

TEST(PointwiseGpu, UpsampleMatchesTheReference) {
  for (DType dtype : {DType::kFP16, DType::kBF16}) {
    check_upsample({1, 1, 1, 8}, dtype);
    check_upsample({2, 3, 5, 24}, dtype);
    check_upsample({4, 8, 8, 1280}, dtype);   // SD2's 8x8 -> 16x16
    check_upsample({2, 32, 32, 640}, dtype);  // 32x32 -> 64x64
  }
}

// --- concatenation -------------------------------------------------------------------------------

void check_concat(int64_t rows, int Ca, int Cb, DType dtype) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " Ca " + std::to_string(Ca) + " Cb " +
               std::to_string(Cb) + " " + dtype_name(dtype));
  graphs::CaptureStream stream;
  std::vector<uint16_t> a_bits, b_bits, dy_bits, da0_bits, db0_bits;
  const Vec a = draw(static_cast<size_t>(rows * Ca), 61, 1.0f, dtype, &a_bits);
  const Vec b = draw(static_cast<size_t>(rows * Cb), 62, 1.0f, dtype, &b_bits);
  const Vec dy = draw(static_cast<size_t>(rows * (Ca + Cb)), 63, 1.0f, dtype, &dy_bits);
  const Vec da0 = draw(static_cast<size_t>(rows * Ca), 64, 1.0f, dtype, &da0_bits);
  const Vec db0 = draw(static_cast<size_t>(rows * Cb), 65, 1.0f, dtype, &db0_bits);
  DeviceBuffer<uint16_t> d_a(a_bits), d_b(b_bits), d_dy(dy_bits), y(dy_bits.size()),
      da(a_bits.size()), db(b_bits.size());
  concat_channels_forward(dtype, y.get(), d_a.get(), Ca, d_b.get(), Cb, rows, stream.get());
  Vec y_ref(dy.size()), da_ref(a.size()), db_ref(b.size());
  ref::concat_channels_forward(y_ref.data(), a.data(), Ca, b.data(), Cb, rows);
  EXPECT_TRUE(test::all_close("concat y", from_storage(y.download(), dtype), y_ref, {0.0, 0.0}));

  concat_channels_backward(dtype, da.get(), db.get(), d_dy.get(), Ca, Cb, rows, false, false,
                           stream.get());
  ref::concat_channels_backward(da_ref.data(), db_ref.data(), dy.data(), Ca, Cb, rows);
  EXPECT_TRUE(test::all_close("concat da", from_storage(da.download(), dtype), da_ref, {0.0, 0.0}));
  EXPECT_TRUE(test::all_close("concat db", from_storage(db.download(), dtype), db_ref, {0.0, 0.0}));

  // The skip's gradient adds to what the down path left there; the up path's overwrites.
  db.upload(db0_bits);
  da.upload(da0_bits);
  concat_channels_backward(dtype, da.get(), db.get(), d_dy.get(), Ca, Cb, rows, false, true,
                           stream.get());
  for (size_t i = 0; i < db_ref.size(); ++i) db_ref[i] += db0[i];
  EXPECT_TRUE(test::all_close("concat da overwritten", from_storage(da.download(), dtype), da_ref,
                              {0.0, 0.0}));
  EXPECT_TRUE(test::all_close("concat db accumulated", from_storage(db.download(), dtype), db_ref,
                              tol(dtype)));
}

TEST(PointwiseGpu, ConcatMatchesTheReference) {
  for (DType dtype : {DType::kFP16, DType::kBF16}) {
    check_concat(3, 8, 16, dtype);
    check_concat(1024, 1280, 640, dtype);  // 32x32 up block: 1280 up-path + 640 skip channels
    check_concat(4096, 320, 320, dtype);   // the last up block at 64x64
  }
}

// --- graphs --------------------------------------------------------------------------------------

TEST(PointwiseGpu, AGraphReplayEqualsTheEagerCalls) {
  const DType dtype = DType::kFP16;
  const int64_t rows = 64;
  const int F = 40, C = 16;
  const UpsampleShape up{1, 4, 4, C};  // 16 pixels of C channels -> 64 rows
  graphs::CaptureStream work, capture;
  std::vector<uint16_t> in_bits, dout_bits, x_bits, skip_bits;
  draw(static_cast<size_t>(rows * 2 * F), 71, 1.0f, dtype, &in_bits);
  draw(static_cast<size_t>(rows * F), 72, 1.0f, dtype, &dout_bits);
  draw(static_cast<size_t>(16 * C), 73, 1.0f, dtype, &x_bits);
  draw(static_cast<size_t>(rows * C), 74, 1.0f, dtype, &skip_bits);
  DeviceBuffer<uint16_t> in(in_bits), dout(dout_bits), x(x_bits), skip(skip_bits);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(rows * F)), din(in_bits.size()),
      y(static_cast<size_t>(rows * C)), cat(static_cast<size_t>(rows * 2 * C)),
      dcat_a(static_cast<size_t>(rows * C)), dskip(static_cast<size_t>(rows * C)),
      dx(x_bits.size());
  auto work_fn = [&](cudaStream_t s) {
    geglu_forward(dtype, out.get(), in.get(), rows, F, s);
    geglu_backward(dtype, din.get(), dout.get(), in.get(), rows, F, s);
    upsample_nearest2x_forward(dtype, y.get(), x.get(), up, s);
    concat_channels_forward(dtype, cat.get(), y.get(), C, skip.get(), C, rows, s);
    concat_channels_backward(dtype, dcat_a.get(), dskip.get(), cat.get(), C, C, rows, false, false,
                             s);
    upsample_nearest2x_backward(dtype, dx.get(), dcat_a.get(), up, s);
  };
  work_fn(work.get());
  const std::vector<uint16_t> e_out = out.download(), e_din = din.download(),
                              e_cat = cat.download(), e_dskip = dskip.download(),
                              e_dx = dx.download();
  for (auto* b : {&out, &din, &y, &cat, &dcat_a, &dskip, &dx})
    ASSERT_EQ(cudaMemset(b->get(), 0xFF, b->size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  graphs::Graph g("unet.pointwise");
  g.build(capture.get(), work_fn, work.get());
  g.launch(work.get());
  EXPECT_TRUE(same_bits("graph geglu out", e_out, out.download()));
  EXPECT_TRUE(same_bits("graph geglu din", e_din, din.download()));
  EXPECT_TRUE(same_bits("graph concat", e_cat, cat.download()));
  EXPECT_TRUE(same_bits("graph dskip", e_dskip, dskip.download()));
  EXPECT_TRUE(same_bits("graph upsample dx", e_dx, dx.download()));
  // dskip is the skip itself (the backward of the concat of [up(x), skip] fed the concat).
  EXPECT_TRUE(same_bits("dskip is skip", skip_bits, e_dskip));
}

}  // namespace
}  // namespace replay::unet
