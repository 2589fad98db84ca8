// Q4_1 and Q8_0 weights times activations rounded to 8 bits, in integer multiply-adds, as llama.cpp
// multiplies them (tpspec.layers.int8_dot, --quantization w4a8).
//
// Each row of x is rounded once per call, per 32 values, to integers (`quantize_rows`: x ≈ dx·qx with
// dx = max |x| / QMAX): 8 bits (QMAX = 127, llama.cpp's Q8_0 / Q8_1 activations with dx kept float32)
// or 15 (QMAX = 16256 = 127·128, stored as two bytes qx = 128·h + l, h in -127..127 and l in 0..127,
// each multiplied as the 8-bit case is: twice the integer work, the activations 128x finer).
// A group's dot product is then dw·dx·Σ q·qx (+ m·dx·Σ qx for Q4_1's minimum m), Σ q·qx exact in
// integers: vpmaddubsw + vpmaddwd (`avx2`) or vpdpbusd (`avx512_vnni`).
//
// Outputs are taken 16 at a time (a block), their weights interleaved (`int8_dot.pack_*`): chunk c of a
// group is its weights 4c .. 4c+3 of the block's 16 outputs, output j's 4 bytes at 4j, so that one
// integer multiply-add of the chunk by x's 4 values broadcast gives 16 outputs' (8 on AVX2) partial
// sums in 16 lanes: a lane is an output, and nothing is ever summed across lanes.
//
// Batch invariance: out[r, o] is one lane's float operations, the same in the same order whatever the
// row count, the row block and output range it falls in, and the path (AVX2 and AVX-512 VNNI give the
// same bits): per group, acc = fma(float(Σ q·qx)·dw, dx, acc), then for Q4_1 acc = fma(m, dx·Σ qx, acc);
// for Q6_K's halves the first, once per half, the first half's before the second's.
//
// Layouts, per block of 16 outputs (the last padded with zero weights) and group g:
// Q4_1: 256 bytes, 4 x 64: byte 4j + i of part l holds weight 4l + i (low nibble) and 16 + 4l + i
// (high nibble) of output j. Q8_0: 512 bytes, 8 x 64: byte 4j + i of part c holds weight 4c + i of
// output j, signed; with it Σ q over the group per output (int16), for vpdpbusd's unsigned x.
// Scales d, mins m: float16 [blocks, groups, 16]; float32 for Q4_1's layout holding groups whose d and m
// are not float16 values (Q4_K's: a float16 times a 6-bit integer, tpspec.layers.q4_k). Q8_0's layout
// with float32 scales holds Q6_K's groups (tpspec.layers.q6_k): a scale per 16 weights, [blocks, groups,
// 2, 16] (and Σ q likewise), weights 0-15 (chunks 0-3) and 16-31 (chunks 4-7) summed apart.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t BLOCK = 16;  // outputs a block
enum Isa : int64_t { AVX2 = 0, AVX512_VNNI = 1 };  // int8_dot.ISAS

// What a product reads: x rounded (xq [R, I] bytes: qx, or h with 15 bits; + 128 for Q8_0 on
// avx512_vnni; xl [R, I] bytes: l with 15 bits; xd [R, G] = dx; xs [R, G] = dx·Σ qx) and the weight
// (q, d, m or Σ q); out [R, O].
struct Operands {
  const uint8_t* xq;
  const uint8_t* xl;
  const float* xd;
  const float* xs;
  const uint8_t* q;
  const void* d;         // float16, or float32 (F32 below)
  const void* m;         // Q4_1: mins, as d
  const int16_t* qsum;   // Q8_0: Σ q of each group and output
  float* out;
  int64_t I, O, G;
};

static inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Rows r0 .. r1-1 of x [R, I] rounded per group (round to nearest, ties to even) to 8 bits, or to 15
// with xl given (h into xq, l into xl); with offset, xq's bytes stored + 128 (unsigned).
void quantize_rows(const float* x, uint8_t* xq, uint8_t* xl, float* xd, float* xs, int64_t I, int64_t r0, int64_t r1,
                   bool offset) {
  const int64_t G = I / GROUP;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(offset ? 0x80 : 0));
  const float qmax = xl == nullptr ? 127.0f : 16256.0f;  // h = qx >> 7 stays in -127..127 (negated by vpsignb)
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * I + g * GROUP;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(p + 8 * j);
      __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
      a = _mm256_max_ps(a, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      const float amax = hmax(a);
      const float d = amax / qmax;
      const __m256 scale = _mm256_set1_ps(amax > 0.0f ? qmax / amax : 0.0f);
      __m256i i[4];
      for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
      const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
      if (xl != nullptr) {  // l = qx & 127 (0..127), h = qx >> 7 (-127..127)
        __m256i l[4];
        for (int j = 0; j < 4; ++j) {
          l[j] = _mm256_and_si256(i[j], _mm256_set1_epi32(127));
          i[j] = _mm256_srai_epi32(i[j], 7);
        }
        const __m256i low = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xl + r * I + g * GROUP), _mm256_permutevar8x32_epi32(low, order));
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * I + g * GROUP),
                          _mm256_xor_si256(_mm256_permutevar8x32_epi32(bytes, order), flip));
      xd[r * G + g] = d;
      xs[r * G + g] = d * static_cast<float>(sum);
    }
  }
}

// 8 scales (or mins) of a group's block, from float16 or float32 (F32).
template <bool F32>
static inline __m256 scales8(const void* p, int64_t i) {
  if constexpr (F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
}

static inline int32_t x_chunk(const uint8_t* xq) {  // 4 bytes of x, to broadcast
  int32_t v;
  std::memcpy(&v, xq, 4);
  return v;
}

// ---- AVX2: half a block (8 outputs, half h) for rows r0 .. r0+RB-1 ----------------------------

// Σ over a group of 8 outputs' unsigned 4-bit weights (w[c]: chunk c) times one row's 32 bytes of x.
static inline __m256i q4_group_avx2(const __m256i w[8], const uint8_t* xg) {
  // |Σ of 8 chunks' pairs| <= 8·2·15·127 = 30480: int16 holds it
  __m256i sum16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x_chunk(xg)));
  for (int c = 1; c < 8; ++c)
    sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x_chunk(xg + 4 * c))));
  return _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
}

template <int RB, bool Q8, bool A15, bool F32>
void half_block_avx2(const Operands& a, int64_t b, int h, int64_t r0) {
  const int64_t G = a.G, part = 64, group_bytes = Q8 ? 8 * part : 4 * part;
  const uint8_t* wb = a.q + b * G * group_bytes + 32 * h;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wb + g * group_bytes;
    if (h == 0)  // the next block's same group, a block ahead (as block_vnni prefetches)
      for (int64_t l = 0; l < group_bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + G * group_bytes + l), _MM_HINT_T0);
    if constexpr (Q8) {
      constexpr int HALVES = F32 ? 2 : 1;  // Q6_K: a scale per 16 weights, chunks 0-3 and 4-7 apart
      __m256 dw[HALVES];
      for (int k = 0; k < HALVES; ++k) dw[k] = scales8<F32>(a.d, ((b * G + g) * HALVES + k) * BLOCK + 8 * h);
      for (int r = 0; r < RB; ++r) {
        const uint8_t* xg = a.xq + (r0 + r) * a.I + g * GROUP;
        const uint8_t* lg = A15 ? a.xl + (r0 + r) * a.I + g * GROUP : nullptr;
        __m256i sum[HALVES], low_sum[HALVES];
        for (int k = 0; k < HALVES; ++k) sum[k] = low_sum[k] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const int k = HALVES == 2 ? c / 4 : 0;
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * part));
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x_chunk(xg + 4 * c)), w);
          sum[k] = _mm256_add_epi32(sum[k], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), x), ones));
          if constexpr (A15)  // l is unsigned: the weights' signs stay where they are
            low_sum[k] = _mm256_add_epi32(low_sum[k], _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_set1_epi32(x_chunk(lg + 4 * c)), w), ones));
        }
        for (int k = 0; k < HALVES; ++k) {
          if constexpr (A15) sum[k] = _mm256_add_epi32(_mm256_slli_epi32(sum[k], 7), low_sum[k]);
          const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[k]), dw[k]);
          acc[r] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(a.xd + (r0 + r) * G + g), acc[r]);
        }
      }
    } else {
      const __m256 dw = scales8<F32>(a.d, (b * G + g) * BLOCK + 8 * h);
      __m256i w[8];  // chunk c: weights 4c .. 4c+3 of the 8 outputs
      for (int l = 0; l < 4; ++l) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + l * part));
        w[l] = _mm256_and_si256(v, low);
        w[l + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 mv = scales8<F32>(a.m, (b * G + g) * BLOCK + 8 * h);
      for (int r = 0; r < RB; ++r) {
        const int64_t xo = (r0 + r) * a.I + g * GROUP;
        __m256i sum = q4_group_avx2(w, a.xq + xo);
        if constexpr (A15) sum = _mm256_add_epi32(_mm256_slli_epi32(sum, 7), q4_group_avx2(w, a.xl + xo));
        const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), dw);
        acc[r] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(a.xd + (r0 + r) * G + g), acc[r]);
        acc[r] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(a.xs + (r0 + r) * G + g), acc[r]);
      }
    }
  }
  const int64_t o0 = b * BLOCK + 8 * h, n = std::min<int64_t>(8, a.O - o0);
  for (int r = 0; r < RB; ++r) {
    float* dst = a.out + (r0 + r) * a.O + o0;
    if (n == 8) {
      _mm256_storeu_ps(dst, acc[r]);
    } else if (n > 0) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(dst, lanes, n * sizeof(float));  // the last, padded block
    }
  }
}

template <bool Q8, bool A15, bool F32>
void blocks_avx2(const Operands& a, int64_t R, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int h = 0; h < 2; ++h) {
      int64_t r0 = 0;
      for (; r0 + 4 <= R; r0 += 4) half_block_avx2<4, Q8, A15, F32>(a, b, h, r0);
      switch (R - r0) {
        case 3: half_block_avx2<3, Q8, A15, F32>(a, b, h, r0); break;
        case 2: half_block_avx2<2, Q8, A15, F32>(a, b, h, r0); break;
        case 1: half_block_avx2<1, Q8, A15, F32>(a, b, h, r0); break;
      }
    }
}

// ---- AVX-512 VNNI: a whole block (16 outputs) for rows r0 .. r0+RB-1 ---------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// Σ over a group of 16 outputs' weights (w[c]: chunk c) times one row's 32 bytes of x: two
// chains of vpdpbusd (half the latency). Q8_0's weights are signed, so x is the unsigned operand.
template <bool Q8>
static inline __m512i group_vnni(const __m512i w[8], const uint8_t* xg) {
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int c = 0; c < 8; c += 2) {
    const __m512i xe = _mm512_set1_epi32(x_chunk(xg + 4 * c)), xo = _mm512_set1_epi32(x_chunk(xg + 4 * c + 4));
    if constexpr (Q8) {
      even = _mm512_dpbusd_epi32(even, xe, w[c]);
      odd = _mm512_dpbusd_epi32(odd, xo, w[c + 1]);
    } else {
      even = _mm512_dpbusd_epi32(even, w[c], xe);
      odd = _mm512_dpbusd_epi32(odd, w[c + 1], xo);
    }
  }
  return _mm512_add_epi32(even, odd);
}

// The same over half a group, weights 16·k .. 16·k + 15 (chunks 4k .. 4k + 3): Q6_K's groups.
static inline __m512i half_group_vnni(const __m512i w[8], const uint8_t* xg, int k) {
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int c = 4 * k; c < 4 * k + 4; c += 2) {
    even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(x_chunk(xg + 4 * c)), w[c]);
    odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(x_chunk(xg + 4 * c + 4)), w[c + 1]);
  }
  return _mm512_add_epi32(even, odd);
}

// 16 scales (or mins) of a group's block, from float16 or float32 (F32).
template <bool F32>
static inline __m512 scales16(const void* p, int64_t i) {
  if constexpr (F32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
}

template <int RB, bool Q8, bool A15, bool F32>
void block_vnni(const Operands& a, int64_t b, int64_t r0) {
  const int64_t G = a.G, part = 64, group_bytes = Q8 ? 8 * part : 4 * part;
  const uint8_t* wb = a.q + b * G * group_bytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wb + g * group_bytes;
    const int64_t bg = (b * G + g) * BLOCK;
    // The next block's same group, a block ahead: its weights stream in while this block computes
    // (1.1-1.9x faster products at 1-32 rows than without on the VNNI path, benchmarks/history.md).
    for (int64_t l = 0; l < group_bytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg + G * group_bytes + l), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Q8) {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(wg + c * part);
    } else {
      for (int l = 0; l < 4; ++l) {
        const __m512i v = _mm512_loadu_si512(wg + l * part);
        w[l] = _mm512_and_si512(v, low);
        w[l + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    if constexpr (Q8 && F32) {  // Q6_K: a scale (and Σ q) per 16 weights, the halves summed apart
      __m512 dw[2];
      __m512i bias[2];
      for (int k = 0; k < 2; ++k) {
        dw[k] = scales16<true>(a.d, (b * G + g) * 2 * BLOCK + k * BLOCK);
        bias[k] = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.qsum + (b * G + g) * 2 * BLOCK + k * BLOCK))), 7);
      }
      for (int r = 0; r < RB; ++r) {
        const int64_t xo = (r0 + r) * a.I + g * GROUP;
        for (int k = 0; k < 2; ++k) {
          __m512i sum = _mm512_sub_epi32(half_group_vnni(w, a.xq + xo, k), bias[k]);
          if constexpr (A15) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), half_group_vnni(w, a.xl + xo, k));
          const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dw[k]);
          acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(a.xd[(r0 + r) * G + g]), acc[r]);
        }
      }
      continue;
    }
    const __m512 dw = scales16<F32>(a.d, bg);
    // Q8_0: x is stored qx + 128 (vpdpbusd's unsigned operand), so Σ (qx + 128)·q − 128·Σ q
    const __m512i bias = Q8 ? _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(a.qsum + bg))), 7)
                            : _mm512_setzero_si512();
    const __m512 mv = Q8 ? _mm512_setzero_ps() : scales16<F32>(a.m, bg);
    for (int r = 0; r < RB; ++r) {
      const int64_t xo = (r0 + r) * a.I + g * GROUP;
      __m512i sum = _mm512_sub_epi32(group_vnni<Q8>(w, a.xq + xo), bias);
      // + Σ q·l: l is unsigned (no offset), the weights' signs stay where they are
      if constexpr (A15) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), group_vnni<Q8>(w, a.xl + xo));
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dw);
      acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(a.xd[(r0 + r) * G + g]), acc[r]);
      if constexpr (!Q8) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xs[(r0 + r) * G + g]), acc[r]);
    }
  }
  const int64_t o0 = b * BLOCK, n = std::min<int64_t>(BLOCK, a.O - o0);
  const __mmask16 valid = n == BLOCK ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(a.out + (r0 + r) * a.O + o0, valid, acc[r]);
}

template <bool Q8, bool A15, bool F32>
void blocks_vnni(const Operands& a, int64_t R, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) block_vnni<8, Q8, A15, F32>(a, b, r0);
    switch (R - r0) {
      case 7: block_vnni<7, Q8, A15, F32>(a, b, r0); break;
      case 6: block_vnni<6, Q8, A15, F32>(a, b, r0); break;
      case 5: block_vnni<5, Q8, A15, F32>(a, b, r0); break;
      case 4: block_vnni<4, Q8, A15, F32>(a, b, r0); break;
      case 3: block_vnni<3, Q8, A15, F32>(a, b, r0); break;
      case 2: block_vnni<2, Q8, A15, F32>(a, b, r0); break;
      case 1: block_vnni<1, Q8, A15, F32>(a, b, r0); break;
    }
  }
}

#pragma GCC pop_options

template <bool Q8, bool A15, bool F32>
void blocks(const Operands& a, Isa isa, int64_t R, int64_t b0, int64_t b1) {
  if (isa == AVX2) blocks_avx2<Q8, A15, F32>(a, R, b0, b1);
  else blocks_vnni<Q8, A15, F32>(a, R, b0, b1);
}

at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const void* mins, const int16_t* qsum, int64_t O, int64_t bits, int64_t isa_code) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [R, I]");
  TORCH_CHECK(isa_code == AVX2 || isa_code == AVX512_VNNI, "isa: 0 (avx2) or 1 (avx512_vnni)");
  TORCH_CHECK(bits == 8 || bits == 15, "activation bits: 8 or 15");
  const bool q8 = mins == nullptr;
  const int64_t R = x.size(0), I = x.size(1), G = I / GROUP, num_blocks = (O + BLOCK - 1) / BLOCK;
  TORCH_CHECK(I % GROUP == 0 && qweight.is_contiguous() && qweight.dim() == 2 && qweight.size(0) == num_blocks
              && qweight.size(1) == G * (q8 ? 512 : 256), "qweight: the packed [ceil(O / 16), I / 32 · bytes] of x's width");
  const bool f32 = scales.scalar_type() == at::kFloat;
  const std::vector<int64_t> scale_shape = q8 && f32 ? std::vector<int64_t>{num_blocks, G, 2, BLOCK}
                                                     : std::vector<int64_t>{num_blocks, G, BLOCK};
  TORCH_CHECK((scales.scalar_type() == at::kHalf || f32) && scales.is_contiguous() && scales.sizes() == scale_shape,
              "scales: contiguous float16 [ceil(O / 16), I / 32, 16] or float32 (Q4_1's layout); Q8_0's layout with "
              "float32 [ceil(O / 16), I / 32, 2, 16]");
  const Isa isa = static_cast<Isa>(isa_code);
  const bool a15 = bits == 15;
  // x rounded: xd, xs [R, G] float32, then xq (and xl) [R, I] bytes, in one buffer kept per thread
  thread_local std::vector<float> scratch;
  scratch.resize(2 * R * G + (a15 ? 2 : 1) * R * I / 4);
  float* xdp = scratch.data();
  float* xsp = xdp + R * G;
  uint8_t* xqp = reinterpret_cast<uint8_t*>(xsp + R * G);
  uint8_t* xlp = a15 ? xqp + R * I : nullptr;
  auto out = at::empty({R, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const bool offset = q8 && isa == AVX512_VNNI;
  at::parallel_for(0, R, 32, [&](int64_t r0, int64_t r1) { quantize_rows(xp, xqp, xlp, xdp, xsp, I, r0, r1, offset); });
  const Operands a{xqp, xlp, xdp, xsp, reinterpret_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(), mins,
                   qsum, out.data_ptr<float>(), I, O, G};
  at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    if (q8 && f32) a15 ? blocks<true, true, true>(a, isa, R, b0, b1) : blocks<true, false, true>(a, isa, R, b0, b1);
    else if (q8) a15 ? blocks<true, true, false>(a, isa, R, b0, b1) : blocks<true, false, false>(a, isa, R, b0, b1);
    else if (f32) a15 ? blocks<false, true, true>(a, isa, R, b0, b1) : blocks<false, false, true>(a, isa, R, b0, b1);
    else a15 ? blocks<false, true, false>(a, isa, R, b0, b1) : blocks<false, false, false>(a, isa, R, b0, b1);
  });
  return out;
}

}  // namespace

// x [R, I] float32, rounded to `bits` (8 or 15), times a Q4_1 weight of O outputs packed as above
// (qweight [ceil(O / 16), I / 32 · 256] uint8, scales and mins [ceil(O / 16), I / 32, 16] float16, or
// both float32) -> [R, O] float32. isa: 0 avx2, 1 avx512_vnni (the caller checks the CPU has it).
at::Tensor q4_1_int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                               int64_t out_features, int64_t bits, int64_t isa) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "qweight: uint8");
  TORCH_CHECK(mins.scalar_type() == scales.scalar_type() && mins.is_contiguous() && mins.sizes() == scales.sizes(),
              "mins: contiguous, the scales' dtype and shape");
  return int8_dot_linear(x, qweight, scales, mins.data_ptr(), nullptr, out_features, bits, isa);
}

// x [R, I] float32, rounded to `bits`, times a Q8_0 weight of O outputs packed as above (qweight
// [ceil(O / 16), I / 32 · 512] int8, scales [ceil(O / 16), I / 32, 16] float16, qsums likewise int16;
// Q6_K's: scales float32 [ceil(O / 16), I / 32, 2, 16], qsums likewise) -> [R, O] float32.
at::Tensor q8_0_int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor qsums,
                               int64_t out_features, int64_t bits, int64_t isa) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "qweight: int8");
  TORCH_CHECK(qsums.scalar_type() == at::kShort && qsums.is_contiguous() && qsums.sizes() == scales.sizes(),
              "qsums: contiguous int16, the scales' shape");
  return int8_dot_linear(x, qweight, scales, nullptr, qsums.data_ptr<int16_t>(), out_features, bits, isa);
}
