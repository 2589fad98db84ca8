// Q4_1 weights times float32 activations on x86 with AVX2, FMA and F16C (tpspec.layers.q4_1), and
// with AVX-512 (F, BW, VL, DQ) where the caller asks for it (`wide`: the CPU has it, no ISA cap).
//
// A Q4_1 weight row holds groups of 32 weights w = d·q + m: q a 4-bit integer, d and m float16
// (llama.cpp's Q4_1; the default model's GGUF stores its layers so). Each group is widened to float32
// as d·q + m by one fused multiply-add, which is exact (d·q needs at most 15 bits): out[r, o] is the
// float32 dot product of row r of x with the float32 weights, summed in another order.
// Layout of a row's I / 2 bytes: groups in pairs, 32 bytes a pair, as 8 little-endian 32-bit words
// whose nibble k of word l is weight 8k + l of the pair (so weights 8k .. 8k+7 are one shift and one
// mask away); a last unpaired group as 16 bytes whose byte j holds weight j (low nibble) and j + 16.
// The AVX-512 path reads two pairs (4 groups, 128 weights) as one 64-byte vector: after shift 4k its
// 16 lanes are weights 8k .. 8k+7 of the first pair and of the second, so x is permuted once a call
// into that lane order (`permute_x`), and the row's last pair and group take the AVX2 path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vector_sum.h"

// The 32 weights of one group as 4 x 8 floats q (0..15, before scale and min).
static inline void unpack_group(const uint8_t* bytes, __m256 q[4]) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  __m128i lo = _mm_and_si128(b, low);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Two groups (64 weights, 32 bytes) stored as 8 dwords: nibble k of dword l is weight 8k + l, so
// weights 8k .. 8k+7 are a shift and a mask away (no byte shuffles). q[0..3]: group a, q[4..7]: group b.
static inline void unpack_pair(const uint8_t* bytes, __m256 q[8]) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i low = _mm256_set1_epi32(0x0F);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), low));
  q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), low));
  q[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 12), low));
  q[4] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), low));
  q[5] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 20), low));
  q[6] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 24), low));
  q[7] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
}

// Adds rows r0 .. r0+RB-1 of x times groups g0 .. G-1 of one output row (q, d, m) into acc (AVX2).
template <int RB, int NA>
static inline void q4_1_groups(const float* xp, const uint8_t* qrow, const uint16_t* drow, const uint16_t* mrow,
                               int64_t I, int64_t G, int64_t r0, int64_t g0, __m256 acc[RB][NA]) {
  int64_t g = g0;
  for (; g + 2 <= G; g += 2) {
    __m256 q[8];
    unpack_pair(qrow + g * 16, q);
    const __m256 da = _mm256_set1_ps(_cvtsh_ss(drow[g])), db = _mm256_set1_ps(_cvtsh_ss(drow[g + 1]));
    const __m256 ma = _mm256_set1_ps(_cvtsh_ss(mrow[g])), mb = _mm256_set1_ps(_cvtsh_ss(mrow[g + 1]));
    for (int j = 0; j < 4; ++j) q[j] = _mm256_fmadd_ps(q[j], da, ma);
    for (int j = 4; j < 8; ++j) q[j] = _mm256_fmadd_ps(q[j], db, mb);
    for (int r = 0; r < RB; ++r) {
      const float* xg = xp + (r0 + r) * I + g * 32;
      for (int j = 0; j < 8; ++j) acc[r][j % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * j), q[j], acc[r][j % NA]);
    }
  }
  if (g < G) {
    __m256 q[4];
    unpack_group(qrow + g * 16, q);
    const __m256 da = _mm256_set1_ps(_cvtsh_ss(drow[g])), ma = _mm256_set1_ps(_cvtsh_ss(mrow[g]));
    for (int j = 0; j < 4; ++j) q[j] = _mm256_fmadd_ps(q[j], da, ma);
    for (int r = 0; r < RB; ++r) {
      const float* xg = xp + (r0 + r) * I + g * 32;
      for (int j = 0; j < 4; ++j) acc[r][j % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * j), q[j], acc[r][j % NA]);
    }
  }
}

// Rows r0 .. r0+RB-1 of out for outputs o0 .. o1-1: each group widened once, then multiplied into
// every row (several accumulators a row: fused multiply-adds wait on their sums).
template <int RB>
static void q4_1_block(const float* xp, const uint8_t* qp, const uint16_t* dp, const uint16_t* mp,
                       float* op, int64_t I, int64_t O, int64_t G, int64_t r0, int64_t o0, int64_t o1) {
  constexpr int NA = RB == 1 ? 4 : 2;  // accumulators per row
  for (int64_t o = o0; o < o1; ++o) {
    __m256 acc[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
    q4_1_groups<RB, NA>(xp, qp + o * (I / 2), dp + o * G, mp + o * G, I, G, r0, 0, acc);
    for (int r = 0; r < RB; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
      op[(r0 + r) * O + o] = hsum(s);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

constexpr int64_t WIDE_GROUPS = 4;  // groups a 64-byte vector of the AVX-512 path holds

// x [R, I] in the AVX-512 path's lane order: within each whole 4-group block, lane i of slot k
// (xw[b·128 + 16k + i]) holds x[b·128 + (i / 8)·64 + 8k + i % 8]; the groups after them as they are.
static void permute_x(const float* xp, float* xw, int64_t R, int64_t I, int64_t G) {
  const int64_t blocks = G / WIDE_GROUPS;
  for (int64_t r = 0; r < R; ++r) {
    const float* src = xp + r * I;
    float* dst = xw + r * I;
    for (int64_t b = 0; b < blocks; ++b)
      for (int k = 0; k < 8; ++k)
        for (int i = 0; i < 16; ++i) dst[b * 128 + 16 * k + i] = src[b * 128 + (i / 8) * 64 + 8 * k + i % 8];
    for (int64_t c = blocks * 128; c < I; ++c) dst[c] = src[c];
  }
}

// q4_1_block with x permuted (`permute_x`): whole 4-group blocks 16 lanes wide, the rest as AVX2.
template <int RB>
static void q4_1_block_wide(const float* xw, const uint8_t* qp, const uint16_t* dp, const uint16_t* mp,
                            float* op, int64_t I, int64_t O, int64_t G, int64_t r0, int64_t o0, int64_t o1) {
  constexpr int NA = RB == 1 ? 4 : 2;
  const int64_t blocks = G / WIDE_GROUPS;
  const __m512i low = _mm512_set1_epi32(0x0F);
  // Lanes 0-7 take the first pair's group, 8-15 the second's: d and m of groups (0, 2), then (1, 3).
  const __m512i first = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qrow = qp + o * (I / 2);
    const uint16_t* drow = dp + o * G;
    const uint16_t* mrow = mp + o * G;
    __m512 acc[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = b * WIDE_GROUPS;
      const __m512i v = _mm512_loadu_si512(qrow + g * 16);
      const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(drow + g))));
      const __m512 m4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mrow + g))));
      const __m512 da = _mm512_permutexvar_ps(first, d4), db = _mm512_permutexvar_ps(second, d4);
      const __m512 ma = _mm512_permutexvar_ps(first, m4), mb = _mm512_permutexvar_ps(second, m4);
      __m512 q[8];
      for (int k = 0; k < 8; ++k) {
        const __m512 qk = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * k), low));
        q[k] = k < 4 ? _mm512_fmadd_ps(qk, da, ma) : _mm512_fmadd_ps(qk, db, mb);
      }
      for (int r = 0; r < RB; ++r) {
        const float* xg = xw + (r0 + r) * I + g * 32;
        for (int k = 0; k < 8; ++k) acc[r][k % NA] = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16 * k), q[k], acc[r][k % NA]);
      }
    }
    __m256 tail[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) tail[r][a] = _mm256_setzero_ps();
    q4_1_groups<RB, NA>(xw, qrow, drow, mrow, I, G, r0, blocks * WIDE_GROUPS, tail);
    for (int r = 0; r < RB; ++r) {
      __m512 s = acc[r][0];
      for (int a = 1; a < NA; ++a) s = _mm512_add_ps(s, acc[r][a]);
      __m256 t = tail[r][0];
      for (int a = 1; a < NA; ++a) t = _mm256_add_ps(t, tail[r][a]);
      op[(r0 + r) * O + o] = _mm512_reduce_add_ps(s) + hsum(t);
    }
  }
}

#pragma GCC pop_options

// x [R, I] float32, qweight [O, I / 2] uint8, scales and mins [O, I / 32] float16 -> [R, O] float32.
// wide: take the AVX-512 path (the caller checks that the CPU has AVX-512 F, BW, VL and DQ).
at::Tensor q4_1_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [R, I]");
  TORCH_CHECK(x.size(1) % 32 == 0 && qweight.size(1) * 2 == x.size(1), "x's width must be the weight's, a multiple of 32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous()
              && mins.is_contiguous(), "scales, mins: contiguous float16");
  const int64_t R = x.size(0), I = x.size(1), O = qweight.size(0), G = I / 32;
  auto out = at::empty({R, O}, x.options());
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::Tensor xw = x;  // x in the lane order of the path taken
  if (wide) {
    xw = at::empty_like(x);
    permute_x(x.data_ptr<float>(), xw.data_ptr<float>(), R, I, G);
  }
  const float* xp = xw.data_ptr<float>();
#define Q4_1_ROWS(RB) (wide ? q4_1_block_wide<RB>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1) \
                            : q4_1_block<RB>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1))
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
    int64_t r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) Q4_1_ROWS(8);
    switch (R - r0) {
      case 7: Q4_1_ROWS(7); break;
      case 6: Q4_1_ROWS(6); break;
      case 5: Q4_1_ROWS(5); break;
      case 4: Q4_1_ROWS(4); break;
      case 3: Q4_1_ROWS(3); break;
      case 2: Q4_1_ROWS(2); break;
      case 1: Q4_1_ROWS(1); break;
    }
  });
#undef Q4_1_ROWS
  return out;
}
