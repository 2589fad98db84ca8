// Q8_0 weights times float32 activations on x86 with AVX2, FMA and F16C (tpspec.layers.q8_0), and
// with AVX-512 (F, BW, VL, DQ) where the caller asks for it (`wide`, as in q4_1_linear.cpp).
//
// A Q8_0 weight row holds groups of 32 weights w = d·q: q an 8-bit signed integer, d float16
// (llama.cpp's Q8_0; the default model's GGUF stores its token embedding, the tied LM head, so).
// Each group is widened to float32 as d·q, which is exact (d·q needs at most 19 bits): out[r, o] is
// the float32 dot product of row r of x with the float32 weights, summed in another order.
// Layout: the q of a row in order, one byte each; one d per 32 of them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vector_sum.h"

// Rows r0 .. r0+RB-1 of out for outputs o0 .. o1-1, 8 lanes: each group widened once, then
// multiplied into every row.
template <int RB>
static void q8_0_block(const float* xp, const int8_t* qp, const uint16_t* dp, float* op, int64_t I, int64_t O,
                       int64_t G, int64_t r0, int64_t o0, int64_t o1) {
  constexpr int NA = RB == 1 ? 4 : 2;  // accumulators per row
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* qrow = qp + o * I;
    const uint16_t* drow = dp + o * G;
    __m256 acc[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(drow[g]));
      __m256 w[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qrow + g * 32 + 8 * j));
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
      }
      for (int r = 0; r < RB; ++r) {
        const float* xg = xp + (r0 + r) * I + g * 32;
        for (int j = 0; j < 4; ++j) acc[r][j % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * j), w[j], acc[r][j % NA]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
      op[(r0 + r) * O + o] = hsum(s);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// q8_0_block 16 lanes wide: a group is two vectors.
template <int RB>
static void q8_0_block_wide(const float* xp, const int8_t* qp, const uint16_t* dp, float* op, int64_t I, int64_t O,
                            int64_t G, int64_t r0, int64_t o0, int64_t o1) {
  constexpr int NA = 2;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* qrow = qp + o * I;
    const uint16_t* drow = dp + o * G;
    __m512 acc[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(drow[g]));
      __m512 w[2];
      for (int j = 0; j < 2; ++j) {
        const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * 32 + 16 * j));
        w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d);
      }
      for (int r = 0; r < RB; ++r) {
        const float* xg = xp + (r0 + r) * I + g * 32;
        for (int j = 0; j < 2; ++j) acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16 * j), w[j], acc[r][j]);
      }
    }
    for (int r = 0; r < RB; ++r) op[(r0 + r) * O + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
}

#pragma GCC pop_options

// x [R, I] float32, qweight [O, I] int8, scales [O, I / 32] float16 -> [R, O] float32.
// wide: take the AVX-512 path (the caller checks that the CPU has AVX-512 F, BW, VL and DQ).
at::Tensor q8_0_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [R, I]");
  TORCH_CHECK(x.size(1) % 32 == 0 && qweight.size(1) == x.size(1), "x's width must be the weight's, a multiple of 32");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight: contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
  const int64_t R = x.size(0), I = x.size(1), O = qweight.size(0), G = I / 32;
  auto out = at::empty({R, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
#define Q8_0_ROWS(RB) (wide ? q8_0_block_wide<RB>(xp, qp, dp, op, I, O, G, r0, o0, o1) \
                            : q8_0_block<RB>(xp, qp, dp, op, I, O, G, r0, o0, o1))
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
    int64_t r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) Q8_0_ROWS(8);
    switch (R - r0) {
      case 7: Q8_0_ROWS(7); break;
      case 6: Q8_0_ROWS(6); break;
      case 5: Q8_0_ROWS(5); break;
      case 4: Q8_0_ROWS(4); break;
      case 3: Q8_0_ROWS(3); break;
      case 2: Q8_0_ROWS(2); break;
      case 1: Q8_0_ROWS(1); break;
    }
  });
#undef Q8_0_ROWS
  return out;
}
