// The Python module mlxgate_kernels._ext: the operations of primitives.h under the names and
// keywords of the MLX functions they stand in for.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"
#include "pool.h"
#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "mlxgate's CPU kernels as MLX operations (AVX2, FMA and F16C on x86-64)";

  m.def("cpu_supported", &mlxgate::cpu_supported,
        "Whether this CPU runs the kernels; where not, every operation is MLX's own.");
  m.def("threads", &mlxgate::pool_threads, "Threads the kernels use, the caller's included.");
  m.def("set_sgemm_rows", &mlxgate::set_sgemm_rows, "rows"_a,
        "Rows from which quantized_matmul dequantizes tiles for sgemm (0: never).");
  m.def("sgemm_rows", &mlxgate::sgemm_rows);
  m.def("use_avx512", &mlxgate::use_avx512, "use"_a,
        "Whether the quantized matmul may use AVX-512 where the CPU has it (else AVX2).");
  m.def("using_avx512", &mlxgate::using_avx512);

  m.def("quantized_matmul", &mlxgate::quantized_matmul, nb::arg("x"), nb::arg("w"),
        "scales"_a, "biases"_a = nb::none(), "transpose"_a = true,
        "group_size"_a = nb::none(), "bits"_a = nb::none(), "mode"_a = "affine",
        nb::kw_only(), "stream"_a = nb::none(),
        "mx.quantized_matmul, with the kernel where it applies.");
  m.def("int8_matmul", &mlxgate::int8_matmul, nb::arg("x"), nb::arg("packed"), "scales"_a,
        "biases"_a, nb::kw_only(), "group_size"_a, "bits"_a, "stream"_a = nb::none(),
        "x @ w.T with x quantized to 8 bits a group, w in the int8 layout (models/cpu/int8.py): "
        "faster where a step is bound by its multiply-adds, not exact.");
  m.def("vnni_supported", &mlxgate::vnni_supported,
        "Whether int8_matmul can use AVX-512 VNNI here (when using_avx512()).");
  m.def("gather_qmm", &mlxgate::gather_qmm, nb::arg("x"), nb::arg("w"), "scales"_a,
        "biases"_a = nb::none(), "lhs_indices"_a = nb::none(), "rhs_indices"_a = nb::none(),
        "transpose"_a = true, "group_size"_a = nb::none(), "bits"_a = nb::none(),
        "mode"_a = "affine", "global_scale"_a = nb::none(), nb::kw_only(),
        "sorted_indices"_a = false, "stream"_a = nb::none(),
        "mx.gather_qmm, with the kernel where it applies.");
  m.def("activation", &mlxgate::activation, nb::arg("x"), "up"_a = nb::none(), nb::kw_only(),
        "kind"_a, "stream"_a = nb::none(),
        "A gated MLP's activation, kind(x) * up: \"silu\" (mlx-lm's swiglu(x, up)) or "
        "\"gelu_tanh\" (nn.gelu_approx), or None where the kernel does not apply.");
  m.def("rms_norm", &mlxgate::rms_norm, nb::arg("x"), nb::arg("weight").none(), "eps"_a,
        nb::kw_only(), "stream"_a = nb::none(), "mx.fast.rms_norm, with the kernel where it applies.");
  m.def(
      "rope",
      [](const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
         const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
         mx::StreamOrDevice s) {
        const auto at = std::holds_alternative<int>(offset) ? mx::array(std::get<int>(offset))
                                                            : std::get<mx::array>(offset);
        return mlxgate::rope(x, dims, traditional, base, scale, at, freqs, s);
      },
      nb::arg("a"), "dims"_a, nb::kw_only(), "traditional"_a, "base"_a.none(), "scale"_a,
      "offset"_a, "freqs"_a = nb::none(), "stream"_a = nb::none(),
      "mx.fast.rope, with the kernel where it applies.");
  m.def(
      "scaled_dot_product_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale,
         const std::optional<std::variant<std::string, mx::array>>& mask, mx::StreamOrDevice s) {
        if (mask && std::holds_alternative<mx::array>(*mask)) {
          return mlxgate::scaled_dot_product_attention(q, k, v, scale, "array",
                                                       std::get<mx::array>(*mask), s);
        }
        const std::string mode = mask ? std::get<std::string>(*mask) : "";
        return mlxgate::scaled_dot_product_attention(q, k, v, scale, mode, std::nullopt, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::kw_only(), "scale"_a,
      "mask"_a = nb::none(), "stream"_a = nb::none(),
      "mx.fast.scaled_dot_product_attention without sinks, with the kernel where it applies.");
  m.def(
      "quantized_scaled_dot_product_attention",
      [](const mx::array& q, const std::vector<mx::array>& k, const std::vector<mx::array>& v,
         float scale, const std::optional<std::variant<std::string, mx::array>>& mask,
         int group_size, int bits, mx::StreamOrDevice s) {
        if (mask && std::holds_alternative<mx::array>(*mask)) {
          return mlxgate::quantized_scaled_dot_product_attention(
              q, k, v, scale, "array", std::get<mx::array>(*mask), group_size, bits, s);
        }
        const std::string mode = mask ? std::get<std::string>(*mask) : "";
        return mlxgate::quantized_scaled_dot_product_attention(
            q, k, v, scale, mode, std::nullopt, group_size, bits, s);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::kw_only(), "scale"_a,
      "mask"_a = nb::none(), "group_size"_a, "bits"_a, "stream"_a = nb::none(),
      "mlx-lm's attention over its quantized KV cache (keys and values as mx.quantize triples), "
      "or None where the kernel does not apply.");
}
