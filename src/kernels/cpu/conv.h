// CPU kernels of convolutional image towers (ResNet): 2-D convolution, group normalisation, ReLU,
// max pooling and global average pooling, each a forward / backward_input / backward_weight set
// with its shapes above it, as in ops.h. Activations are channels-last (NHWC: x[n, h, w, c]),
// the layout oneDNN's direct convolutions run fastest in on this CPU; weights are kept as
// PyTorch keeps them (w[K, C, R, S], "OIHW"), so checkpoints and references read them as they are.
//
// float runs the convolutions through oneDNN's primitives (cached per shape; scratchpads per
// call); double runs direct loops — the finite-difference and reference checks' path, written
// from the definition and independent of oneDNN. Everything else is plain loops with static
// OpenMP schedules whose sums run in a fixed order: bit-identical run to run for a given thread
// count. `_backward_weight` kernels accumulate (+=); `_backward_input` kernels overwrite unless
// `accumulate` is set.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/cpu/bf16.h"

namespace keel::ops {

// One convolution's geometry: input [N, H, W, C], weights [K, C, R, S], symmetric zero padding,
// square stride; output [N, P, Q, K] with P = (H + 2 pad - R) / stride + 1 (Q likewise).
struct ConvShape {
  int N = 0, H = 0, W = 0, C = 0;  // input
  int K = 0, R = 0, S = 0;         // output channels, kernel height and width
  int stride = 1, pad = 0;
  int P() const { return (H + 2 * pad - R) / stride + 1; }
  int Q() const { return (W + 2 * pad - S) / stride + 1; }
  int64_t in_size() const { return static_cast<int64_t>(N) * H * W * C; }
  int64_t out_size() const { return static_cast<int64_t>(N) * P() * Q() * K; }
  int64_t weight_size() const { return static_cast<int64_t>(K) * C * R * S; }
  // Multiply-adds of one forward pass (each of the two backward passes costs the same).
  double macs() const { return static_cast<double>(out_size()) * C * R * S; }
  std::string str() const;
};

// ---- 2-D convolution, no bias ------------------------------------------------------------------
// float products at `precision` (kernels/cpu/bf16.h): bf16 operands where the CPU has bf16
// instructions, float32 otherwise (an int8 or fp32 call, or bf16 without the instructions); double
// callers pass MatmulPrecision::fp32 (direct loops in float64).
// y[N, P, Q, K] = sum_{c, r, s} x[N, p*stride - pad + r, q*stride - pad + s, c] * w[K, c, r, s]
template <typename T>
void conv2d_forward(MatmulPrecision precision, T* y, const T* x, const T* w, const ConvShape& s);
// dx[N, H, W, C] (= or +=) the transposed convolution of dy[N, P, Q, K] with w.
template <typename T>
void conv2d_backward_input(MatmulPrecision precision, T* dx, const T* dy, const T* w, const ConvShape& s,
                           bool accumulate);
// dw[K, C, R, S] += sum over n, p, q of dy[n, p, q, k] * x[n, p*stride - pad + r, q*stride - pad + s, c]
template <typename T>
void conv2d_backward_weight(MatmulPrecision precision, T* dw, const T* dy, const T* x, const ConvShape& s);

// ---- group normalisation (eps 1e-5), channels-last ---------------------------------------------
// x[N, HW, C], G groups of C/G consecutive channels: y = (x - mean) * rstd * gamma[c] + beta[c],
// mean and rstd over the HW x C/G values of (n, g); saves mean[N, G], rstd[N, G].
// With relu, y = max(y, 0) (the fused GroupNorm + ReLU of a ResNet's convolution units).
template <typename T>
void groupnorm_forward(T* y, T* mean, T* rstd, const T* x, const T* gamma, const T* beta, int N, int HW, int C, int G,
                       bool relu);
// dx[N, HW, C] (= or +=) d/dx given dy. With relu, y is the forward's output and dy is first
// masked by y > 0 (in a scratch of its own: dy is not written).
template <typename T>
void groupnorm_backward_input(T* dx, const T* dy, const T* x, const T* y, const T* mean, const T* rstd, const T* gamma,
                              int N, int HW, int C, int G, bool relu, bool accumulate);
// dgamma[C] += sum dy * xhat, dbeta[C] += sum dy (dy masked by y > 0 with relu).
template <typename T>
void groupnorm_backward_weight(T* dgamma, T* dbeta, const T* dy, const T* x, const T* y, const T* mean, const T* rstd,
                               int N, int HW, int C, int G, bool relu);

// ---- ReLU and residual ---------------------------------------------------------------------------
// y = max(a + b, 0) (b may be null: y = max(a, 0)); in place allowed.
template <typename T>
void add_relu_forward(T* y, const T* a, const T* b, int64_t n);
// dx = dy * (y > 0) (y: the forward's output; dx may alias dy).
template <typename T>
void relu_backward(T* dx, const T* dy, const T* y, int64_t n);

// ---- max pooling (ResNet's stem: 3 x 3, stride 2, padding 1) -----------------------------------
// y[N, P, Q, C] = max over the window of x[N, H, W, C] (padding never wins); arg[N, P, Q, C]
// records the winning input index h * W + w (the first in scan order on ties).
template <typename T>
void maxpool_forward(T* y, int32_t* arg, const T* x, int N, int H, int W, int C, int k, int stride, int pad);
// dx[N, H, W, C] = scatter-add of dy to the recorded winners (overwrites dx).
template <typename T>
void maxpool_backward_input(T* dx, const T* dy, const int32_t* arg, int N, int H, int W, int C, int P, int Q);
inline int pool_out(int size, int k, int stride, int pad) { return (size + 2 * pad - k) / stride + 1; }

// ---- global average pooling ----------------------------------------------------------------------
// y[N, C] = mean over HW of x[N, HW, C].
template <typename T>
void avgpool_forward(T* y, const T* x, int N, int HW, int C);
// dx[N, HW, C] = dy[N, C] / HW (overwrites).
template <typename T>
void avgpool_backward_input(T* dx, const T* dy, int N, int HW, int C);

// The convolution engine that runs float (oneDNN's implementation name for the first shape, for
// start-up lines).
std::string conv_engine();

}  // namespace keel::ops
