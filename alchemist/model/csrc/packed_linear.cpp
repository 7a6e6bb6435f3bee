// alchemist::packed_linear(x, weight, bias, out_features): oneDNN's linear over a weight packed once
// (mkldnn::_linear_pointwise), as an op of our own for torch.compile: inductor lowers the packed linear only for
// weights frozen into the graph, and a served adapter's merged weights change with every version, so the compiled
// decode layer (alchemist/engine/compiled_decode.py) calls it as an opaque op. In C++ rather than a Python
// custom op: a decode step makes 120 of these calls, and the Python op's dispatch cost about 17 us each.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  (void)out_features;  // the output's width, for the shape function (register_fake in cpu_kernels.py)
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(alchemist, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(alchemist, CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }
