// keras_boost's centred momentum update: gradient centralization and Keras' SGD momentum in one pass.
//
//   KerasBoostCentredKerasMomentum(var, accum, lr, grad, sums, momentum)
//     g'    = grad - sums * (1 / n)    (n = grad's values per output channel: every axis but the last)
//     accum = accum * momentum - g' * lr
//     var  += accum                    (Nesterov: var += accum * momentum - g' * lr)
//
// The same IEEE operations, in the same order, as keras_boost's `centralize` in a compiled step
// (a broadcast subtraction of `sums / n`, which TensorFlow's graph optimizer computes as
// `sums * (1 / n)`) followed by TensorFlow's ResourceApplyKerasMomentum, element by element; built with -ffp-contract=off, so no multiply-add is fused and the results are those
// of the two-op form bit for bit. What it saves: the centred gradient is never written to
// memory and read back (one pass over the gradient less), and `var += accum` reads the new
// `accum` from a register instead of from memory.
#define EIGEN_USE_THREADS

#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("KerasBoostCentredKerasMomentum")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("lr: T")
    .Input("grad: T")
    .Input("sums: T")
    .Input("momentum: T")
    .Attr("T: {float, double}")
    .Attr("use_locking: bool = false")
    .Attr("use_nesterov: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext*) { return absl::OkStatus(); });

// Rows [first, last) of the (rows, channels) view. Compiled for AVX-512, AVX2 and plain x86-64;
// the loader picks the one this CPU runs (GCC's function multi-versioning).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"))) void UpdateRows(
    int64_t first, int64_t last, int64_t channels, const T* mean, const T* grad, T* accum, T* var, T lr,
    T momentum, bool nesterov) {
  for (int64_t r = first; r < last; ++r) {
    const T* g = grad + r * channels;
    T* a = accum + r * channels;
    T* w = var + r * channels;
    if (nesterov) {
      for (int64_t c = 0; c < channels; ++c) {
        const T centred = g[c] - mean[c];
        const T next = a[c] * momentum - centred * lr;
        a[c] = next;
        w[c] = w[c] + (next * momentum - centred * lr);
      }
    } else {
      for (int64_t c = 0; c < channels; ++c) {
        const T centred = g[c] - mean[c];
        const T next = a[c] * momentum - centred * lr;
        a[c] = next;
        w[c] = w[c] + next;
      }
    }
  }
}

template <typename T>
class CentredKerasMomentumOp : public OpKernel {
 public:
  explicit CentredKerasMomentumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_locking", &use_exclusive_lock_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_nesterov", &use_nesterov_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr bool kSparse = false;
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, T>(ctx, use_exclusive_lock_, kSparse, {0, 1});
    Tensor var, accum;
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(ctx, 0, use_exclusive_lock_, kSparse, &var));
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, T>(ctx, 1, use_exclusive_lock_, kSparse, &accum));
    OP_REQUIRES(ctx, var.IsInitialized() && accum.IsInitialized(),
                errors::FailedPrecondition("KerasBoostCentredKerasMomentum: var and accum must be initialized"));
    const Tensor& lr = ctx->input(2);
    const Tensor& grad = ctx->input(3);
    const Tensor& sums = ctx->input(4);
    const Tensor& momentum = ctx->input(5);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(lr.shape()) && TensorShapeUtils::IsScalar(momentum.shape()),
                errors::InvalidArgument("KerasBoostCentredKerasMomentum: lr and momentum must be scalars, got ",
                                        lr.shape().DebugString(), " and ", momentum.shape().DebugString()));
    OP_REQUIRES(ctx, var.shape().IsSameSize(accum.shape()) && var.shape().IsSameSize(grad.shape()),
                errors::InvalidArgument("KerasBoostCentredKerasMomentum: var, accum and grad must have one shape, got ",
                                        var.shape().DebugString(), ", ", accum.shape().DebugString(), " and ",
                                        grad.shape().DebugString()));
    OP_REQUIRES(ctx, grad.dims() >= 2,
                errors::InvalidArgument("KerasBoostCentredKerasMomentum: grad must have rank 2 or more, got ",
                                        grad.shape().DebugString()));
    const int64_t channels = grad.dim_size(grad.dims() - 1);
    OP_REQUIRES(ctx, sums.NumElements() == channels,
                errors::InvalidArgument("KerasBoostCentredKerasMomentum: sums must hold one value per output channel (",
                                        channels, "), got ", sums.shape().DebugString()));
    if (grad.NumElements() == 0) return;
    const int64_t rows = grad.NumElements() / channels;
    // `sums / n` as a compiled step computes it: TensorFlow's graph optimizer turns the division
    // by a constant into a multiplication by its reciprocal (rounded once, in T).
    const T reciprocal = T(1) / static_cast<T>(rows);
    std::vector<T> mean(channels);
    const T* s = sums.flat<T>().data();
    for (int64_t c = 0; c < channels; ++c) mean[c] = s[c] * reciprocal;

    const T lr_value = lr.scalar<T>()();
    const T momentum_value = momentum.scalar<T>()();
    const T* mean_data = mean.data();
    const T* g = grad.flat<T>().data();
    T* a = accum.flat<T>().data();
    T* w = var.flat<T>().data();
    const bool nesterov = use_nesterov_;
    const double bytes = static_cast<double>(channels) * sizeof(T);
    ctx->eigen_device<CPUDevice>().parallelFor(
        rows, Eigen::TensorOpCost(3 * bytes, 2 * bytes, 5.0 * channels),
        [=](Eigen::Index first, Eigen::Index last) {
          UpdateRows<T>(first, last, channels, mean_data, g, a, w, lr_value, momentum_value, nesterov);
        });
  }

 private:
  bool use_exclusive_lock_;
  bool use_nesterov_;
};

#define KERAS_BOOST_REGISTER(T)                                                                 \
  REGISTER_KERNEL_BUILDER(                                                                     \
      Name("KerasBoostCentredKerasMomentum").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      CentredKerasMomentumOp<T>);
KERAS_BOOST_REGISTER(float);
KERAS_BOOST_REGISTER(double);
#undef KERAS_BOOST_REGISTER

}  // namespace
}  // namespace tensorflow
