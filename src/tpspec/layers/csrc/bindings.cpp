// The Python module of tpspec's CPU kernels (tpspec.layers.cpu_kernels). Only this file includes
// torch's pybind11 type casters (torch/csrc/utils/pybind.h: ~7 s of compiling it, against ~19 s with
// torch/extension.h, which adds torch's whole C++ frontend); the kernels include ATen's Tensor and
// the one or two ops they call (~3-7 s a file, against ~5-8 s with ATen/ATen.h). The first build
// takes 19 s on a 2-core Zen 5 (29 s before).
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <vector>

at::Tensor q4_1_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, bool wide);
at::Tensor q8_0_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, bool wide);
at::Tensor q4_1_int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t out_features,
                            int64_t bits, int64_t isa);
at::Tensor q8_0_int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor qsums, int64_t out_features,
                            int64_t bits, int64_t isa);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor token_seq,
                           at::Tensor key_range, at::Tensor kv_head, double scale, bool wide);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor argmax_rows(at::Tensor x);

// A kernel call of some size (a prefill chunk, a verification of many sequences, an LM head, attention
// over a long context or many sequences) runs with the GIL released: in a server the HTTP event loop's
// thread runs Python while the engine thread computes, instead of waiting up to a whole call (tens of
// ms in a long prompt's prefill). Releasing and taking back the GIL costs ~0.2 us a call, under 2 % of
// a one-sequence decode step's ~300 calls of a few microseconds, so small calls keep it. A call's size:
// for the products, its rows times its weight's bytes (a one-row LM head reads all of its weight); for
// attention, its queries' elements times the longest context's keys: at least RELEASE_WORK; for the
// other kernels their first tensor's elements: at least RELEASE_ELEMENTS.
constexpr int64_t RELEASE_ELEMENTS = int64_t(1) << 16;
constexpr int64_t RELEASE_WORK = int64_t(1) << 21;
enum class Size { FirstTensor, Product, Attention };

template <auto Kernel, Size S>
struct GilReleasedWhenLarge;

template <typename R, typename... Rest, R (*Kernel)(at::Tensor, Rest...), Size S>
struct GilReleasedWhenLarge<Kernel, S> {
  static R call(at::Tensor x, Rest... rest) {
    bool large;
    if constexpr (S == Size::Product) {  // (x, qweight, ...)
      large = x.size(0) * std::get<0>(std::forward_as_tuple(rest...)).nbytes() >= RELEASE_WORK;
    } else if constexpr (S == Size::Attention) {  // (q, k_cache, v_cache, slots [sequences, longest context], ...)
      large = x.numel() * std::get<2>(std::forward_as_tuple(rest...)).size(1) >= RELEASE_WORK;
    } else {
      large = x.numel() >= RELEASE_ELEMENTS;
    }
    if (!large) return Kernel(std::move(x), std::move(rest)...);
    py::gil_scoped_release released;
    return Kernel(std::move(x), std::move(rest)...);
  }
};

#define KERNEL(name, size, doc) m.def(#name, &GilReleasedWhenLarge<&name, Size::size>::call, doc)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  KERNEL(q4_1_linear, Product, "Q4_1 weights times float32 activations (q4_1_linear.cpp)");
  KERNEL(q8_0_linear, Product, "Q8_0 weights times float32 activations (q8_0_linear.cpp)");
  KERNEL(q4_1_int8_linear, Product,
         "Q4_1 weights times activations rounded to 8 or 15 bits, integer multiply-adds (int8_dot_linear.cpp)");
  KERNEL(q8_0_int8_linear, Product,
         "Q8_0 weights times activations rounded to 8 or 15 bits, integer multiply-adds (int8_dot_linear.cpp)");
  KERNEL(add_rms_norm, FirstTensor, "(x + residual) RMS-normalized, and x + residual (decode_ops.cpp)");
  KERNEL(paged_attention, Attention, "queries over their key ranges of the paged KV cache (decode_ops.cpp)");
  KERNEL(write_kv, FirstTensor, "new keys and values into their slots of the paged cache (decode_ops.cpp)");
  KERNEL(rotary, FirstTensor, "rotary position embedding, rotate-half layout (decode_ops.cpp)");
  KERNEL(silu_and_mul, FirstTensor, "SwiGLU: silu(gate) * up (decode_ops.cpp)");
  KERNEL(argmax_rows, FirstTensor, "each row's first maximum, torch.argmax's answer (argmax.cpp)");
  m.attr("RELEASE_ELEMENTS") = RELEASE_ELEMENTS;
  m.attr("RELEASE_WORK") = RELEASE_WORK;
}

#undef KERNEL
