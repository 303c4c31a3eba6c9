#include "primitives.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "pool.h"

namespace mlxgate {
namespace {

// Columns of the weight each pool task computes (decode) or dequantizes (sgemm tiles).
constexpr int COLUMNS_PER_TASK = 64;
constexpr int SGEMM_TILE_COLUMNS = 1024;
// Rows of a norm or rope each pool task takes.
constexpr int ROWS_PER_TASK = 16;
// Elements of an activation each pool task takes (a one-row step's MLP is one task).
constexpr long ACTIVATION_ELEMENTS = 8192;
// Query rows of one head each attention task takes (at most the kernel's MAX_ROWS).
constexpr int ATTENTION_ROWS = 16;

// From 48 rows the tiles win on both instruction sets and both real models' steps (1.07-1.31x
// at 48 and 56 rows; 32 and 40 are a wash): benches/results/sgemm-rows-48-20261128.md.
int sgemm_rows_ = 48;

bool on_cpu(const mx::Stream& stream) { return stream.device == mx::Device::cpu; }

std::optional<ScaleType> scale_type(mx::Dtype dtype) {
  if (dtype == mx::float32) return ScaleType::float32;
  if (dtype == mx::float16) return ScaleType::float16;
  if (dtype == mx::bfloat16) return ScaleType::bfloat16;
  return std::nullopt;
}

// OpenBLAS's cblas_sgemm where it is loaded (mlxgate preloads it before mlx), else null.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);
Sgemm find_sgemm() {
  static Sgemm sgemm = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return sgemm;
}
constexpr int CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112;

// An input's float32 elements in row-major order: its own buffer when it is row-contiguous (as
// nearly every input is), else a copy gathered from its strides (a transposed view).
class RowMajor {
 public:
  explicit RowMajor(const mx::array& a) : data_(a.data<float>()) {
    if (a.flags().row_contiguous) return;
    copy_.resize(a.size());
    const auto& shape = a.shape();
    const auto& strides = a.strides();
    const int last = static_cast<int>(a.ndim()) - 1;
    const int64_t width = shape[last];
    for (size_t row = 0; row < a.size() / width; ++row) {
      int64_t at = 0;
      size_t rest = row;
      for (int axis = last - 1; axis >= 0; --axis) {
        at += static_cast<int64_t>(rest % shape[axis]) * strides[axis];
        rest /= shape[axis];
      }
      for (int64_t j = 0; j < width; ++j) copy_[row * width + j] = data_[at + j * strides[last]];
    }
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  const float* data_;
  std::vector<float> copy_;
};

// The rows as the dot products read them, copied: 64-byte aligned, so that no vector load
// straddles two cache lines, and `spread_stride(k)` floats apart: k rounded up to whole cache
// lines, plus one line where that makes an even number. Rows a power of two apart (k = 2048:
// 8 KB) fall in the same L1 set, and a block of 16 such rows evicts itself on every load; an
// odd number of lines between rows spreads them over the sets. (Gemma 3's down_proj at 32 rows:
// 3.6x faster than read in place.)
long spread_stride(int k) {
  const long lines = (k + 15) / 16;
  return 16 * (lines % 2 == 0 ? lines + 1 : lines);
}

// One row of x as the dot products read it: copied, or in pairs order where the kernel takes it
// (kernels.h: one row of a 4-bit weight).
void spread_row(const float* x, bool pairs, int k, float* dst) {
  if (!pairs) {
    std::copy_n(x, k, dst);
    return;
  }
  for (int j = 0; j < k; j += 32) {
    for (int i = 0; i < 16; ++i) {
      dst[j + i] = x[j + 2 * i];
      dst[j + 16 + i] = x[j + 2 * i + 1];
    }
  }
}

// A 64-byte aligned buffer of this thread's for `rows` spread rows `stride` floats apart.
float* spread_buffer(std::vector<float>& buffer, int rows, long stride) {
  buffer.resize(static_cast<size_t>(rows) * stride + 16);
  const auto at = (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63};
  return reinterpret_cast<float*>(at);
}

const float* spread_rows(const float* x, int rows, const QuantizedWeight& w, long stride) {
  thread_local std::vector<float> buffer;
  float* spread = spread_buffer(buffer, rows, stride);
  const bool pairs = takes_pairs(rows, w);
  for (int r = 0; r < rows; ++r) {
    spread_row(x + static_cast<long>(r) * w.k, pairs, w.k, spread + r * stride);
  }
  return spread;
}

// Many rows (a prefill chunk): the weight dequantized a tile at a time, each tile multiplied
// by OpenBLAS, whose blocking beats dot products once the rows outnumber the registers. x's
// rows lie `x_stride` floats apart; out is [rows, w.n].
void multiply_by_tiles(
    const float* x, long x_stride, int rows, const QuantizedWeight& w, float* out) {
  const Sgemm sgemm = find_sgemm();
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(SGEMM_TILE_COLUMNS) * w.k);
  float* tile = scratch.data();  // the workers see this thread's buffer, not their own
  for (int c0 = 0; c0 < w.n; c0 += SGEMM_TILE_COLUMNS) {
    const int columns = std::min(SGEMM_TILE_COLUMNS, w.n - c0);
    const int tasks = (columns + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK;
    parallel_for(tasks, [&](int t) {
      const int a = c0 + t * COLUMNS_PER_TASK;
      const int b = std::min(c0 + columns, a + COLUMNS_PER_TASK);
      dequantize_columns(w, tile + static_cast<size_t>(a - c0) * w.k, a, b);
    });
    sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, rows, columns, w.k, 1.0f, x,
          static_cast<int>(x_stride), tile, w.k, 0.0f, out + c0, w.n);
  }
}

bool by_tiles(int rows) {
  return find_sgemm() != nullptr && sgemm_rows_ > 0 && rows >= sgemm_rows_;
}

// Runs `work(operands, out)` on the stream's thread: `out` allocated, every input and `out`
// registered with the stream's encoder, the operands the inputs as the task holds them (weak
// copies: the encoder keeps the arrays alive).
template <typename Work>
void dispatch_over(
    const mx::Stream& stream, const std::vector<mx::array>& inputs, mx::array& out, Work work) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) encoder.set_input_array(input);
  encoder.set_output_array(out);
  std::vector<mx::array> operands;
  for (const auto& input : inputs) operands.push_back(mx::array::unsafe_weak_copy(input));
  encoder.dispatch([operands = std::move(operands), work = std::move(work), o = out.data<float>()] {
    work(operands, o);
  });
}

class Kernel : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxgate's kernels run on the CPU only");
  }
};

// The quantized matmuls: their group size and bits are what tell two apart.
class QuantizedKernel : public Kernel {
 public:
  QuantizedKernel(mx::Stream stream, int group, int bits)
      : Kernel(stream), group_(group), bits_(bits) {}

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const QuantizedKernel&>(other);  // MLX compares like types
    return group_ == that.group_ && bits_ == that.bits_;
  }

 protected:
  // The weight [..., n, k * bits / 32] with its scales and biases (a stack's first matrix).
  QuantizedWeight weight(
      const mx::array& w, const mx::array& scales, const mx::array& biases) const {
    return {w.data<uint32_t>(), scales.data<void>(), biases.data<void>(),
            *scale_type(scales.dtype()), bits_, group_, static_cast<int>(w.shape(-2)),
            static_cast<int>(w.shape(-1)) * 32 / bits_};
  }

 private:
  int group_;
  int bits_;
};

class QuantizedMatmul : public QuantizedKernel {
 public:
  using QuantizedKernel::QuantizedKernel;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto work = [w = weight(inputs[1], inputs[2], inputs[3])](
                          const std::vector<mx::array>& operands, float* o) {
      const RowMajor input(operands[0]);
      const int rows = static_cast<int>(operands[0].size() / w.k);
      if (by_tiles(rows)) {
        multiply_by_tiles(input.data(), w.k, rows, w, o);
        return;
      }
      const long x_stride = spread_stride(w.k);
      const float* spread = spread_rows(input.data(), rows, w, x_stride);
      parallel_for((w.n + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK, [&](int t) {
        const int c0 = t * COLUMNS_PER_TASK;
        quantized_matmul_columns(
            spread, x_stride, rows, w, o, c0, std::min(w.n, c0 + COLUMNS_PER_TASK));
      });
    };
    dispatch_over(stream(), inputs, outputs[0], work);
  }

  const char* name() const override { return "MlxgateQuantizedMatmul"; }
};

// The int8-activation matmul: x quantized a group at a time (rows over the pool), then the
// weight's columns over the pool.
class Int8Matmul : public Kernel {
 public:
  Int8Matmul(mx::Stream stream, int group, int bits)
      : Kernel(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& scales = inputs[2];
    const Int8Weight w{inputs[1].data<uint8_t>(), scales.data<float>(), inputs[3].data<float>(),
                       bits_, group_, static_cast<int>(scales.shape(0)),
                       static_cast<int>(scales.shape(1))};
    const auto work = [w](const std::vector<mx::array>& operands, float* o) {
      const RowMajor input(operands[0]);
      const int k = static_cast<int>(operands[0].shape(-1));
      const int rows = static_cast<int>(operands[0].size() / k);
      const long row_bytes = static_cast<long>(w.padded_groups) * w.group;
      thread_local std::vector<int8_t> quantized;
      thread_local std::vector<float> row_scales, row_sums;
      thread_local std::vector<int32_t> row_shifts;
      quantized.resize(static_cast<size_t>(rows) * row_bytes);
      row_scales.resize(static_cast<size_t>(rows) * w.padded_groups);
      row_sums.resize(static_cast<size_t>(rows) * w.padded_groups);
      row_shifts.resize(static_cast<size_t>(rows) * w.padded_groups);
      // (The workers see this thread's buffers, not their own.)
      const Int8Rows x{quantized.data(), row_scales.data(), row_sums.data(), row_shifts.data()};
      const float* xs = input.data();
      parallel_for((rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, [&](int t) {
        const int r0 = t * ROWS_PER_TASK;
        const int r1 = std::min(rows, r0 + ROWS_PER_TASK);
        quantize_rows_int8(xs, k, k, w.group, w.padded_groups, x, r0, r1);
      });
      parallel_for((w.n + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK, [&](int t) {
        const int c0 = t * COLUMNS_PER_TASK;
        int8_matmul_columns(x, rows, w, o, c0, std::min(w.n, c0 + COLUMNS_PER_TASK));
      });
    };
    dispatch_over(stream(), inputs, outputs[0], work);
  }

  const char* name() const override { return "MlxgateInt8Matmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const Int8Matmul&>(other);
    return group_ == that.group_ && bits_ == that.bits_;
  }

 private:
  int group_;
  int bits_;
};

class RMSNorm : public Kernel {
 public:
  RMSNorm(mx::Stream stream, float eps) : Kernel(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const int d = static_cast<int>(x.shape(-1));
    const int rows = static_cast<int>(x.size() / d);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), w = inputs[1].data<float>(), eps = eps_,
                      d, rows, o = out.data<float>()] {
      const RowMajor input(x);
      const float* xs = input.data();
      parallel_for((rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, [&](int t) {
        const int r0 = t * ROWS_PER_TASK;
        rms_norm_rows(xs, w, eps, d, o, r0, std::min(rows, r0 + ROWS_PER_TASK));
      });
    });
  }

  const char* name() const override { return "MlxgateRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class RoPE : public Kernel {
 public:
  // `frequencies`: the third input holds frequencies (a model's own: YaRN, Llama 3), whose
  // reciprocals the kernel takes, as MLX's rope does; else the inverse frequencies.
  RoPE(mx::Stream stream, int dims, bool traditional, float scale, bool frequencies)
      : Kernel(stream),
        dims_(dims),
        traditional_(traditional),
        scale_(scale),
        frequencies_(frequencies) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& offset = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const int batch = static_cast<int>(x.shape(0));
    const int heads = static_cast<int>(x.shape(1));
    const int tokens = static_cast<int>(x.shape(2));
    const int d = static_cast<int>(x.shape(3));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), offsets = offset.data<int32_t>(),
                      per_row = offset.size() > 1, given = inputs[2].data<float>(),
                      frequencies = frequencies_, dims = dims_, traditional = traditional_, scale = scale_, batch, heads,
                      tokens, d, o = out.data<float>()] {
      const RowMajor input(x);
      const float* xs = input.data();
      std::vector<float> reciprocals;
      const float* inv_freqs = given;
      if (frequencies) {  // 1 / f in float32, as MLX's reciprocal gives it
        reciprocals.resize(dims / 2);
        for (int i = 0; i < dims / 2; ++i) reciprocals[i] = 1.0f / given[i];
        inv_freqs = reciprocals.data();
      }
      // Each row's position, as MLX computes it: (token index + offset) * scale in float32.
      std::vector<float> positions(static_cast<size_t>(batch) * heads * tokens);
      for (int b = 0; b < batch; ++b) {
        const float start = static_cast<float>(offsets[per_row ? b : 0]);
        for (int h = 0; h < heads; ++h) {
          for (int t = 0; t < tokens; ++t) {
            positions[(static_cast<size_t>(b) * heads + h) * tokens + t] =
                (static_cast<float>(t) + start) * scale;
          }
        }
      }
      const int rows = batch * heads * tokens;
      parallel_for((rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, [&](int t) {
        const int r0 = t * ROWS_PER_TASK;
        rope_rows(xs, positions.data(), inv_freqs, dims, traditional, d, o, r0,
                  std::min(rows, r0 + ROWS_PER_TASK));
      });
    });
  }

  const char* name() const override { return "MlxgateRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const RoPE&>(other);
    return dims_ == that.dims_ && traditional_ == that.traditional_ && scale_ == that.scale_ &&
        frequencies_ == that.frequencies_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
  bool frequencies_;
};

// An operand of attention as the kernel reads it: its start and strides, the features
// contiguous (a copy, kept in `copy`, where they are not).
Strided4 strided(const mx::array& a, std::vector<float>& copy) {
  if (a.strides(3) == 1) {
    return {a.data<float>(), a.strides(0), a.strides(1), a.strides(2)};
  }
  const RowMajor rows(a);
  copy.assign(rows.data(), rows.data() + a.size());
  const int64_t row = a.shape(3), head = row * a.shape(2), batch = head * a.shape(1);
  return {copy.data(), batch, head, row};
}

void set_mask(Attention& a, const mx::array& mask) {
  a.mask = a.mask_kind == MaskKind::boolean ? static_cast<const void*>(mask.data<bool>())
                                            : static_cast<const void*>(mask.data<float>());
  for (int axis = 0; axis < 4; ++axis) a.mask_strides[axis] = mask.strides(axis);
}

class ScaledDotProductAttention : public Kernel {
 public:
  ScaledDotProductAttention(mx::Stream stream, float scale, MaskKind mask_kind)
      : Kernel(stream), scale_(scale), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_over(stream(), inputs, outputs[0], [scale = scale_, kind = mask_kind_](
                                                    const std::vector<mx::array>& operands, float* o) {
      const auto& q = operands[0];
      const auto& k = operands[1];
      const auto& v = operands[2];
      std::vector<float> copies[3];
      Attention a{
          strided(q, copies[0]), strided(k, copies[1]), strided(v, copies[2]),
          static_cast<int>(q.shape(1)), static_cast<int>(k.shape(1)),
          static_cast<int>(q.shape(2)), static_cast<int>(k.shape(2)),
          static_cast<int>(q.shape(3)), static_cast<int>(v.shape(3)), scale, kind, nullptr, {}};
      if (operands.size() > 3) set_mask(a, operands[3]);
      const int batch = static_cast<int>(q.shape(0));
      const int chunks = (a.n + ATTENTION_ROWS - 1) / ATTENTION_ROWS;
      parallel_for(batch * a.heads * chunks, [&](int task) {
        const int chunk = task % chunks;
        const int head = (task / chunks) % a.heads;
        const int b = task / chunks / a.heads;
        const int r0 = chunk * ATTENTION_ROWS;
        attention_rows(a, b, head, r0, std::min(a.n, r0 + ATTENTION_ROWS), o);
      });
    });
  }

  const char* name() const override { return "MlxgateScaledDotProductAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const ScaledDotProductAttention&>(other);
    return scale_ == that.scale_ && mask_kind_ == that.mask_kind_;
  }

 private:
  float scale_;
  MaskKind mask_kind_;
};

// Keys or values of batch row b, key head h, as a quantized weight of `rows` rows: an
// mx.quantize triple [batch, heads, rows, ...] whose rows lie one after another (the op checks).
QuantizedWeight cache_rows(
    const std::vector<mx::array>& triple, int b, int h, int rows, int dim, int group, int bits) {
  const auto at = [&](const mx::array& a) {
    return a.data<char>() + (b * a.strides(0) + h * a.strides(1)) * a.itemsize();
  };
  return {reinterpret_cast<const uint32_t*>(at(triple[0])), at(triple[1]), at(triple[2]),
          *scale_type(triple[1].dtype()), bits, group, rows, dim};
}

// Attention over a quantized cache (mlx-lm's QuantizedKVCache): per batch row and key head, its
// keys and values dequantized once into the task's own buffer, then the float kernel over them
// for each query head that shares them. Inputs: queries, the keys' and the values' triples, the
// mask where it is an array.
class QuantizedAttention : public Kernel {
 public:
  QuantizedAttention(mx::Stream stream, float scale, MaskKind mask_kind, int group, int bits)
      : Kernel(stream), scale_(scale), mask_kind_(mask_kind), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_over(stream(), inputs, outputs[0],
                  [scale = scale_, kind = mask_kind_, group = group_, bits = bits_](
                      const std::vector<mx::array>& operands, float* o) {
      const auto& q = operands[0];
      const std::vector<mx::array> keys(operands.begin() + 1, operands.begin() + 4);
      const std::vector<mx::array> values(operands.begin() + 4, operands.begin() + 7);
      const int kv_heads = static_cast<int>(keys[0].shape(1));
      const int t = static_cast<int>(keys[0].shape(2));
      const int dk = static_cast<int>(q.shape(3));
      const int dv = static_cast<int>(values[0].shape(3)) * 32 / bits;
      std::vector<float> copy;
      Attention a{strided(q, copy), {}, {}, static_cast<int>(q.shape(1)), kv_heads,
                  static_cast<int>(q.shape(2)), t, dk, dv, scale, kind, nullptr, {}};
      if (operands.size() > 7) set_mask(a, operands[7]);
      const int repeats = a.heads / kv_heads;
      parallel_for(static_cast<int>(q.shape(0)) * kv_heads, [&](int task) {
        const int b = task / kv_heads;
        const int kv_head = task % kv_heads;
        thread_local std::vector<float> buffer;
        buffer.resize(static_cast<size_t>(t) * (dk + dv));
        float* dequantized_values = buffer.data() + static_cast<size_t>(t) * dk;
        dequantize_columns(cache_rows(keys, b, kv_head, t, dk, group, bits), buffer.data(), 0, t);
        dequantize_columns(
            cache_rows(values, b, kv_head, t, dv, group, bits), dequantized_values, 0, t);
        Attention mine = a;  // this task's key head alone, at offset 0 of its buffer
        mine.keys = {buffer.data(), 0, 0, dk};
        mine.values = {dequantized_values, 0, 0, dv};
        for (int head = kv_head * repeats; head < (kv_head + 1) * repeats; ++head) {
          for (int r0 = 0; r0 < a.n; r0 += ATTENTION_ROWS) {
            attention_rows(mine, b, head, r0, std::min(a.n, r0 + ATTENTION_ROWS), o);
          }
        }
      });
    });
  }

  const char* name() const override { return "MlxgateQuantizedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& that = static_cast<const QuantizedAttention&>(other);
    return scale_ == that.scale_ && mask_kind_ == that.mask_kind_ && group_ == that.group_ &&
        bits_ == that.bits_;
  }

 private:
  float scale_;
  MaskKind mask_kind_;
  int group_;
  int bits_;
};

// A gated MLP's activation, act(x) * up (or act(x) alone), over the elements in tasks of
// ACTIVATION_ELEMENTS: MLX's sigmoid and tanh call libm once per element (~25 ns each).
class GatedActivation : public Kernel {
 public:
  GatedActivation(mx::Stream stream, Activation act) : Kernel(stream), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto work = [act = act_](const std::vector<mx::array>& operands, float* o) {
      const RowMajor x(operands[0]);
      std::optional<RowMajor> up;
      if (operands.size() > 1) up.emplace(operands[1]);
      const long n = static_cast<long>(operands[0].size());
      const int tasks = static_cast<int>((n + ACTIVATION_ELEMENTS - 1) / ACTIVATION_ELEMENTS);
      parallel_for(tasks, [&](int t) {
        const long i0 = static_cast<long>(t) * ACTIVATION_ELEMENTS;
        activation_range(x.data(), up ? up->data() : nullptr, act, o, i0,
                         std::min(n, i0 + ACTIVATION_ELEMENTS));
      });
    };
    dispatch_over(stream(), inputs, outputs[0], work);
  }

  const char* name() const override { return "MlxgateGatedActivation"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return act_ == static_cast<const GatedActivation&>(other).act_;
  }

 private:
  Activation act_;
};

// Broadcast uint32 indices, one per position in row-major order (a broadcast has strides 0, so
// its buffer holds fewer elements than it has).
std::vector<uint32_t> indices(const mx::array& a) {
  std::vector<uint32_t> out(a.size());
  const auto* data = a.data<uint32_t>();
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    size_t rest = i;
    for (int axis = static_cast<int>(a.ndim()) - 1; axis >= 0; --axis) {
      at += static_cast<int64_t>(rest % a.shape(axis)) * a.strides(axis);
      rest /= a.shape(axis);
    }
    out[i] = data[at];
  }
  return out;
}

// One expert's matrix of a [experts, n, ...] quantized stack (mlx-lm's SwitchLinear).
QuantizedWeight expert(const QuantizedWeight& stack, int e) {
  const long values = static_cast<long>(stack.n) * stack.k;
  const long scale_bytes = stack.scale_type == ScaleType::float32 ? 4 : 2;
  QuantizedWeight w = stack;
  w.packed += values * stack.bits / 32 * e;
  w.scales = static_cast<const char*>(stack.scales) + values / stack.group * e * scale_bytes;
  w.biases = static_cast<const char*>(stack.biases) + values / stack.group * e * scale_bytes;
  return w;
}

// mx.gather_qmm: out[p] = x[lhs[p]] @ w[rhs[p]].T for every position p of the broadcast
// indices. The positions are grouped by expert, so each expert's weight is read once for all
// the rows sent to it (a decode step's rows, a prefill chunk's tokens), by the same dot products
// (or sgemm tiles) as quantized_matmul. Inputs: x [..., m, k], the stack's weight, scales
// and biases [experts, n, ...], the lhs and rhs indices broadcast to one shape (uint32); out
// [that shape..., m, n].
class GatherQuantizedMatmul : public QuantizedKernel {
 public:
  using QuantizedKernel::QuantizedKernel;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto work = [stack = weight(inputs[1], inputs[2], inputs[3])](
                          const std::vector<mx::array>& operands, float* o) {
      const auto& x = operands[0];
      const int experts = static_cast<int>(operands[1].shape(0));
      const int m = static_cast<int>(x.shape(-2));
      const int n = stack.n, k = stack.k;
      const auto batches = static_cast<uint32_t>(x.size() / (static_cast<size_t>(m) * k));
      const auto lhs = indices(operands[4]);
      const auto rhs = indices(operands[5]);
      const int positions = static_cast<int>(lhs.size());

      // The positions in expert order (an index out of range gives zeros, as no expert).
      const auto valid = [&](int p) {
        return rhs[p] < static_cast<uint32_t>(experts) && lhs[p] < batches;
      };
      std::vector<int> starts(experts + 1, 0), order;
      for (int p = 0; p < positions; ++p) {
        if (valid(p)) ++starts[rhs[p] + 1];
      }
      for (int e = 0; e < experts; ++e) starts[e + 1] += starts[e];
      order.resize(starts[experts]);
      std::vector<int> filled(starts.begin(), starts.end() - 1);
      for (int p = 0; p < positions; ++p) {
        if (valid(p)) order[filled[rhs[p]]++] = p;
      }

      // Each expert's rows spread one after another, and its tasks: sgemm tiles for many rows
      // (which split their own work), column blocks of the dot products for the rest.
      const RowMajor input(x);
      const long stride = spread_stride(k);
      thread_local std::vector<float> buffer;
      float* spread = spread_buffer(buffer, static_cast<int>(order.size()) * m, stride);
      std::vector<float> results(order.size() * m * n);
      std::vector<std::pair<int, int>> tasks;  // (expert, first column)
      for (int e = 0; e < experts; ++e) {
        const int rows = (starts[e + 1] - starts[e]) * m;
        if (rows == 0) continue;
        const bool pairs = takes_pairs(rows, stack);
        float* first = spread + static_cast<long>(starts[e]) * m * stride;
        for (int i = starts[e]; i < starts[e + 1]; ++i) {
          for (int r = 0; r < m; ++r) {
            spread_row(input.data() + (static_cast<long>(lhs[order[i]]) * m + r) * k, pairs, k,
                       spread + (static_cast<long>(i) * m + r) * stride);
          }
        }
        if (by_tiles(rows)) {
          multiply_by_tiles(first, stride, rows, expert(stack, e),
                            results.data() + static_cast<long>(starts[e]) * m * n);
          continue;
        }
        for (int c = 0; c < n; c += COLUMNS_PER_TASK) tasks.emplace_back(e, c);
      }
      parallel_for(static_cast<int>(tasks.size()), [&](int t) {
        const auto [e, c0] = tasks[t];
        const long row = static_cast<long>(starts[e]) * m;
        quantized_matmul_columns(spread + row * stride, stride, (starts[e + 1] - starts[e]) * m,
                                 expert(stack, e), results.data() + row * n, c0,
                                 std::min(n, c0 + COLUMNS_PER_TASK));
      });

      const long block = static_cast<long>(m) * n;
      std::fill_n(o, static_cast<long>(positions) * block, 0.0f);
      for (size_t i = 0; i < order.size(); ++i) {
        std::copy_n(results.data() + i * block, block, o + order[i] * block);
      }
    };
    dispatch_over(stream(), inputs, outputs[0], work);
  }

  const char* name() const override { return "MlxgateGatherQuantizedMatmul"; }
};

// The inverse frequencies of a rope with this base, computed by MLX's own ops as its rope
// computes them, once per (base, dims).
mx::array inverse_frequencies(float base, int dims, const mx::Stream& s) {
  static std::mutex mutex;
  static std::vector<std::tuple<float, int, mx::array>> computed;
  std::lock_guard lock(mutex);
  for (auto& [b, n, freqs] : computed) {
    if (b == base && n == dims) return freqs;
  }
  const int half = dims / 2;
  auto freqs = mx::exp(
      mx::multiply(mx::arange(0, -half, -1, mx::float32, s),
                   mx::array(std::log(base) / half, mx::float32), s),
      s);
  mx::eval(freqs);
  computed.emplace_back(base, dims, freqs);
  return freqs;
}

// The kernel's mask for attention's mask argument ("causal", an array, none), or nullopt
// where the kernel takes no such mask.
std::optional<MaskKind> mask_kind(const std::string& mode, const std::optional<mx::array>& mask) {
  if (mode == "causal") return MaskKind::causal;
  if (mask.has_value()) {
    if (mask->ndim() > 4) return std::nullopt;
    if (mask->dtype() == mx::bool_) return MaskKind::boolean;
    if (mask->dtype() == mx::float32) return MaskKind::additive;
    return std::nullopt;
  }
  if (!mode.empty() && mode != "array") return std::nullopt;
  return MaskKind::none;
}

// An array mask, as the kernel reads it: broadcast to [batch, heads, queries, keys].
void add_mask(
    std::vector<mx::array>& inputs, MaskKind kind, const std::optional<mx::array>& mask,
    const mx::array& queries, int keys, const mx::Stream& stream) {
  if (kind == MaskKind::boolean || kind == MaskKind::additive) {
    inputs.push_back(mx::broadcast_to(
        *mask, {queries.shape(0), queries.shape(1), queries.shape(2), keys}, stream));
  }
}

}  // namespace

void set_sgemm_rows(int rows) { sgemm_rows_ = rows; }
int sgemm_rows() { return sgemm_rows_; }

// The quantized matmul's conditions on a weight of these shapes (a matrix's or an expert
// stack's: the leading axes of w, scales and biases agree).
bool quantized_fits(
    const mx::array& x, const mx::array& w, const mx::array& scales,
    const std::optional<mx::array>& biases, bool transpose, int group, int width,
    const std::string& mode) {
  const int axes = static_cast<int>(w.ndim());
  return cpu_supported() && transpose && mode == "affine" && biases.has_value() &&
      (width == 4 || width == 8) && (group == 32 || group == 64 || (group == 16 && width == 8)) &&
      x.dtype() == mx::float32 && x.ndim() >= 1 && w.dtype() == mx::uint32 &&
      scale_type(scales.dtype()).has_value() && biases->dtype() == scales.dtype() &&
      x.shape(-1) == w.shape(-1) * 32 / width && x.shape(-1) % group == 0 &&
      scales.ndim() == axes &&
      std::equal(w.shape().begin(), w.shape().end() - 1, scales.shape().begin()) &&
      scales.shape(-1) == x.shape(-1) / group && biases->shape() == scales.shape() &&
      scales.flags().row_contiguous && biases->flags().row_contiguous &&
      w.flags().row_contiguous && x.size() > 0;
}

mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales,
    const std::optional<mx::array>& biases, bool transpose, std::optional<int> group_size,
    std::optional<int> bits, const std::string& mode, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const int group = group_size.value_or(64);
  const int width = bits.value_or(4);
  const bool fits = on_cpu(stream) && w.ndim() == 2 &&
      quantized_fits(x, w, scales, biases, transpose, group, width, mode);
  if (!fits) {
    return mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode, s);
  }
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape), mx::float32, std::make_shared<QuantizedMatmul>(stream, group, width),
      {x, w, scales, *biases});
}

mx::array int8_matmul(
    const mx::array& x, const mx::array& packed, const mx::array& scales,
    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const auto fail = [](const std::string& why) {
    throw std::invalid_argument("int8_matmul: " + why);
  };
  if (!on_cpu(stream) || !cpu_supported()) fail("runs on a CPU with AVX2 only");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (!(group_size == 32 || group_size == 64 || (group_size == 16 && bits == 8))) {
    fail("group_size must be 32 or 64 (or 16 at 8 bits)");
  }
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.size() == 0) fail("x must be float32");
  if (scales.ndim() != 2 || scales.dtype() != mx::float32 || biases.shape() != scales.shape() ||
      biases.dtype() != mx::float32 || scales.shape(1) % INT8_LANES != 0) {
    fail("scales and biases must be float32 [n, padded groups], a multiple of 8 groups");
  }
  const int k = static_cast<int>(x.shape(-1));
  if (k % group_size != 0 || k > scales.shape(1) * group_size ||
      k <= (scales.shape(1) - INT8_LANES) * group_size) {
    fail("x's last axis does not match the weight's groups");
  }
  const mx::Shape packed_shape{scales.shape(0), scales.shape(1) * group_size * bits / 8};
  if (packed.dtype() != mx::uint8 || packed.shape() != packed_shape) {
    fail("the packed weight must be uint8 [n, padded groups * group_size * bits / 8]");
  }
  auto shape = x.shape();
  shape.back() = scales.shape(0);
  const auto contiguous = [&](const mx::array& a) { return mx::contiguous(a, false, stream); };
  return mx::array(
      std::move(shape), mx::float32, std::make_shared<Int8Matmul>(stream, group_size, bits),
      {x, contiguous(packed), contiguous(scales), contiguous(biases)});
}

mx::array gather_qmm(
    const mx::array& x, const mx::array& w, const mx::array& scales,
    const std::optional<mx::array>& biases, const std::optional<mx::array>& lhs_indices,
    const std::optional<mx::array>& rhs_indices, bool transpose, std::optional<int> group_size,
    std::optional<int> bits, const std::string& mode, const std::optional<mx::array>& global_scale,
    bool sorted_indices, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const int group = group_size.value_or(64);
  const int width = bits.value_or(4);
  const auto integral = [](const std::optional<mx::array>& a) {
    return !a || mx::issubdtype(a->dtype(), mx::integer);
  };
  const bool fits = on_cpu(stream) && w.ndim() == 3 && x.ndim() >= 2 && !global_scale &&
      integral(lhs_indices) && integral(rhs_indices) &&
      quantized_fits(x, w, scales, biases, transpose, group, width, mode);
  if (!fits) {
    return mx::gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, transpose, group_size,
                          bits, mode, global_scale, sorted_indices, s);
  }
  // As MLX: missing indices are every batch of x (of w) in order, and the two broadcast.
  const auto every = [&](const mx::Shape& batch) {
    int count = 1;
    for (const auto d : batch) count *= d;
    return mx::reshape(mx::arange(count, mx::uint32, stream), batch, stream);
  };
  auto lhs = lhs_indices ? *lhs_indices : every(mx::Shape(x.shape().begin(), x.shape().end() - 2));
  auto rhs = rhs_indices ? *rhs_indices : every(mx::Shape(w.shape().begin(), w.shape().end() - 2));
  auto both = mx::broadcast_arrays({lhs, rhs}, stream);
  auto shape = both[0].shape();
  shape.push_back(x.shape(-2));
  shape.push_back(w.shape(1));
  const auto flat = [&](const mx::array& a) {
    return mx::flatten(mx::astype(a, mx::uint32, stream), stream);
  };
  return mx::array(
      std::move(shape), mx::float32, std::make_shared<GatherQuantizedMatmul>(stream, group, width),
      {x, w, scales, *biases, flat(both[0]), flat(both[1])});
}

std::optional<mx::array> activation(
    const mx::array& x, const std::optional<mx::array>& up, const std::string& kind,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const bool fits = cpu_supported() && on_cpu(stream) && x.dtype() == mx::float32 &&
      x.size() > 0 && (kind == "silu" || kind == "gelu_tanh") &&
      (!up || (up->dtype() == mx::float32 && up->shape() == x.shape()));
  if (!fits) return std::nullopt;
  std::vector<mx::array> inputs = {x};
  if (up) inputs.push_back(*up);
  const auto act = kind == "silu" ? Activation::silu : Activation::gelu_tanh;
  return mx::array(
      x.shape(), mx::float32, std::make_shared<GatedActivation>(stream, act), std::move(inputs));
}

mx::array rms_norm(
    const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const bool fits = cpu_supported() && on_cpu(stream) && x.dtype() == mx::float32 &&
      x.ndim() >= 1 && x.size() > 0 && weight.has_value() && weight->dtype() == mx::float32 &&
      weight->ndim() == 1 && weight->shape(0) == x.shape(-1) && weight->flags().row_contiguous;
  if (!fits) return mx::fast::rms_norm(x, weight, eps, s);
  return mx::array(
      x.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps),
      {x, *weight});
}

mx::array rope(
    const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
    const mx::array& offset, const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const bool fits = cpu_supported() && on_cpu(stream) && x.dtype() == mx::float32 &&
      x.ndim() == 4 && x.size() > 0 && dims > 0 && dims % 2 == 0 && dims <= x.shape(3) &&
      base.has_value() != freqs.has_value() && offset.ndim() <= 1 &&
      (offset.size() == 1 || offset.size() == static_cast<size_t>(x.shape(0))) &&
      mx::issubdtype(offset.dtype(), mx::integer) &&
      (!freqs || (freqs->ndim() == 1 && freqs->shape(0) == dims / 2));
  if (!fits) return mx::fast::rope(x, dims, traditional, base, scale, offset, freqs, s);
  auto frequencies = freqs ? mx::astype(*freqs, mx::float32, stream)
                           : inverse_frequencies(*base, dims, stream);
  return mx::array(
      x.shape(), mx::float32, std::make_shared<RoPE>(stream, dims, traditional, scale, freqs.has_value()),
      {x, mx::astype(offset, mx::int32, stream), frequencies});
}

mx::array scaled_dot_product_attention(
    const mx::array& queries, const mx::array& keys, const mx::array& values, float scale,
    const std::string& mask_mode, const std::optional<mx::array>& mask, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const auto f32 = [](const mx::array& a) { return a.dtype() == mx::float32 && a.ndim() == 4; };
  bool fits = cpu_supported() && on_cpu(stream) && f32(queries) && f32(keys) && f32(values) &&
      queries.size() > 0 && keys.size() > 0 && queries.shape(0) == keys.shape(0) &&
      keys.shape(0) == values.shape(0) && keys.shape(1) == values.shape(1) &&
      queries.shape(1) % keys.shape(1) == 0 && keys.shape(2) == values.shape(2) &&
      queries.shape(3) == keys.shape(3) && queries.shape(2) <= keys.shape(2);
  const auto kind = mask_kind(mask_mode, mask);
  if (!fits || !kind) {
    return mx::fast::scaled_dot_product_attention(
        queries, keys, values, scale, mask_mode, mask, std::nullopt, false, s);
  }
  std::vector<mx::array> inputs = {queries, keys, values};
  add_mask(inputs, *kind, mask, queries, keys.shape(2), stream);
  return mx::array(
      {queries.shape(0), queries.shape(1), queries.shape(2), values.shape(3)}, mx::float32,
      std::make_shared<ScaledDotProductAttention>(stream, scale, *kind), std::move(inputs));
}

std::optional<mx::array> quantized_scaled_dot_product_attention(
    const mx::array& queries, const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values, float scale, const std::string& mask_mode,
    const std::optional<mx::array>& mask, int group_size, int bits, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const auto kind = mask_kind(mask_mode, mask);
  if (!cpu_supported() || !on_cpu(stream) || !kind || queries.dtype() != mx::float32 ||
      queries.ndim() != 4 || queries.size() == 0 || keys.size() != 3 || values.size() != 3 ||
      (bits != 4 && bits != 8) || group_size % 8 != 0 || group_size <= 0) {
    return std::nullopt;
  }
  const auto triple_fits = [&](const std::vector<mx::array>& triple, int dim) {
    const auto& packed = triple[0];
    for (const auto& part : triple) {
      if (part.ndim() != 4 || part.strides(3) != 1 || part.strides(2) != part.shape(3) ||
          part.shape(0) != queries.shape(0) || part.shape(1) != packed.shape(1) ||
          part.shape(2) != packed.shape(2)) {
        return false;
      }
    }
    return packed.dtype() == mx::uint32 && packed.shape(3) * 32 / bits == dim &&
        dim % group_size == 0 && scale_type(triple[1].dtype()).has_value() &&
        triple[2].dtype() == triple[1].dtype() && triple[1].shape(3) == dim / group_size &&
        triple[2].shape(3) == dim / group_size;
  };
  const auto t = keys[0].ndim() == 4 ? keys[0].shape(2) : 0;
  if (!triple_fits(keys, queries.shape(3)) || values[0].ndim() != 4 ||
      !triple_fits(values, values[0].shape(3) * 32 / bits) || values[0].shape(1) != keys[0].shape(1) ||
      values[0].shape(2) != t || queries.shape(1) % keys[0].shape(1) != 0 ||
      queries.shape(2) > t || t == 0) {
    return std::nullopt;
  }
  std::vector<mx::array> inputs = {queries};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  add_mask(inputs, *kind, mask, queries, t, stream);
  return mx::array(
      {queries.shape(0), queries.shape(1), queries.shape(2), values[0].shape(3) * 32 / bits},
      mx::float32, std::make_shared<QuantizedAttention>(stream, scale, *kind, group_size, bits),
      std::move(inputs));
}

}  // namespace mlxgate
