// Q4_1 weights times float32 activations on x86 with AVX2, FMA and F16C (tpspec.layers.q4_1).
//
// A Q4_1 weight row holds groups of 32 weights w = d·q + m: q a 4-bit integer, d and m float16
// (llama.cpp's Q4_1; the default model's GGUF stores its layers so). Each group is widened to float32
// as d·q + m by one fused multiply-add, which is exact (d·q needs at most 15 bits): out[r, o] is the
// float32 dot product of row r of x with the float32 weights, summed in another order.
// Layout of a row's I / 2 bytes: groups in pairs, 32 bytes a pair, as 8 little-endian 32-bit words
// whose nibble k of word l is weight 8k + l of the pair (so weights 8k .. 8k+7 are one shift and one
// mask away); a last unpaired group as 16 bytes whose byte j holds weight j (low nibble) and j + 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// Rows r0 .. r0+RB-1 of out for outputs o0 .. o1-1: each group widened once, then multiplied into
// every row (several accumulators a row: fused multiply-adds wait on their sums).
template <int RB>
static void q4_1_block(const float* xp, const uint8_t* qp, const uint16_t* dp, const uint16_t* mp,
                       float* op, int64_t I, int64_t O, int64_t G, int64_t r0, int64_t o0, int64_t o1) {
  constexpr int NA = RB == 1 ? 4 : 2;  // accumulators per row
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qrow = qp + o * (I / 2);
    const uint16_t* drow = dp + o * G;
    const uint16_t* mrow = mp + o * G;
    __m256 acc[RB][NA];
    for (int r = 0; r < RB; ++r) for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
    int64_t g = 0;
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
    for (int r = 0; r < RB; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
      op[(r0 + r) * O + o] = hsum(s);
    }
  }
}

// x [R, I] float32, qweight [O, I / 2] uint8, scales and mins [O, I / 32] float16 -> [R, O] float32.
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [R, I]");
  TORCH_CHECK(x.size(1) % 32 == 0 && qweight.size(1) * 2 == x.size(1), "x's width must be the weight's, a multiple of 32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous()
              && mins.is_contiguous(), "scales, mins: contiguous float16");
  const int64_t R = x.size(0), I = x.size(1), O = qweight.size(0), G = I / 32;
  auto out = torch::empty({R, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
    int64_t r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) q4_1_block<8>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1);
    switch (R - r0) {
      case 7: q4_1_block<7>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 6: q4_1_block<6>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 5: q4_1_block<5>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 4: q4_1_block<4>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 3: q4_1_block<3>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 2: q4_1_block<2>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
      case 1: q4_1_block<1>(xp, qp, dp, mp, op, I, O, G, r0, o0, o1); break;
    }
  });
  return out;
}
