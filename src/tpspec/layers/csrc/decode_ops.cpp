// Float32 ops of decode and verification steps on x86 with AVX2 and FMA (tpspec.layers.cpu_kernels),
// one call each: RMSNorm with its residual add, where PyTorch dispatches 5-10 ops (~20-30 us for a row
// of 576), and attention of a few queries per sequence reading the paged KV cache in place, where
// PyTorch gathers the keys first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "vector_sum.h"

// exp of 8 floats <= 0 (Cephes' expf: x = n·ln2 + r, a degree-5 polynomial in r; ~1 ulp); -inf -> 0.
static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 is_neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365448f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_neg_inf, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

// x [N, D] (+ residual [N, D]) -> (s / sqrt(mean(s²) + eps) · weight, s) with s = x + residual
// (s = x without one). D a multiple of 8.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(D % 8 == 0, "the width must be a multiple of 8");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D, "weight: float32 [D]");
  at::Tensor sum = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat && residual->is_contiguous(),
                "residual: contiguous float32 like x");
    sum = at::empty_like(x);
  }
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* xr = xp + n * D;
      float* sr = sp + n * D;
      __m256 sq = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        if (rp) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(rp + n * D + i));
          _mm256_storeu_ps(sr + i, v);
        }
        sq = _mm256_fmadd_ps(v, v, sq);
      }
      const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum(sq) / static_cast<float>(D) + static_cast<float>(eps)));
      for (int64_t i = 0; i < D; i += 8)
        _mm256_storeu_ps(op + n * D + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sr + i), inv), _mm256_loadu_ps(wp + i)));
    }
  });
  return {out, sum};
}

// Rotary position embedding, rotate-half layout (layers.rotary.apply_rope): out[t, h] = x[t, h]·cos[t] +
// roll(x[t, h], d/2)·sin[t], sin's first half negated, rounded as PyTorch's ops round it (the two
// products, then their sum: no fused multiply-add), one call where PyTorch dispatches four ops and
// their temporaries (3 against 8 us a layer at one row). x [T, H, d] float32, unit stride along d (any row
// and head strides: the query and key columns of a fused projection's output); cos, sin [T, d]
// contiguous. -> [T, H, d] contiguous. d a multiple of 16.
// SwiGLU (layers.activation.silu_and_mul): x [T, 2·D] = [gate | up] contiguous float32 -> silu(gate)·up
// [T, D], silu(g) = g·σ(g) with σ(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(−|g|)
// (exp_nonpositive: within an ulp or two of PyTorch's, not its bits). One call where PyTorch
// dispatches two ops and a temporary. D a multiple of 8.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 16 == 0,
              "x: contiguous float32 [T, 2·D], D a multiple of 8");
  const int64_t T = x.size(0), D = x.size(1) / 2;
  auto out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 g = _mm256_loadu_ps(xp + t * 2 * D + i), u = _mm256_loadu_ps(xp + t * 2 * D + D + i);
        const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(−|g|)
        const __m256 num = _mm256_blendv_ps(one, e, g);  // g's sign bit set: e
        _mm256_storeu_ps(op + t * D + i, _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))), u));
      }
  });
  return out;
}

// One head of one token (a function of its own: the attribute must reach the code OpenMP outlines).
__attribute__((optimize("fp-contract=off"), noinline)) static void rotary_head(
    const float* x, const float* c, const float* s, float* o, int64_t half) {
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);  // roll: b before a
    _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                 _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
  }
}

at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x: float32 [T, H, d], unit stride in d");
  const int64_t T = x.size(0), H = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 16 == 0, "the head size must be a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous()
              && sin.is_contiguous() && cos.numel() == T * d && sin.numel() == T * d, "cos, sin: contiguous float32 [T, d]");
  auto out = at::empty({T, H, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h)
        rotary_head(xp + t * row_stride + h * head_stride, cp + t * d, sp + t * d, op + (t * H + h) * d, d / 2);
  });
  return out;
}

// Queries of any number of sequences over the layer's paged KV cache, read in place (no gather):
// q [T, H, d] float32; k_cache, v_cache [N, KVH, d] (slots), both float32 or both float16 (each value
// widened exactly as it is read); slots [S, L] int64, the slot of each of sequence s's keys;
// token_seq [T] int64, the row of slots each query reads; key_range [T, 2] int64, the first and
// one-past-last of those keys it attends to (a causal query: 0 and its position + 1); kv_head [H]
// int64, the KV head each query head reads. -> softmax(q·kᵀ·scale)·v as [T, H · d].
//
// Keys are taken in spans of SPAN at fixed positions (keys 0 … SPAN − 1, SPAN … 2·SPAN − 1, …). A work
// item is (a run of consecutive queries of one sequence, up to MAX_HEADS query heads of one KV head,
// one span): a verification's k + 1 queries or a prefill chunk's read each key of the span once from
// memory for all of the item's query vectors (at most MAX_VECS), not once per query, and each value
// once from memory and then from L1 (the output loop goes over PV_TILE keys at a time for all of
// them). One sequence's decode (3 KV heads on 2 threads) thus spreads over its spans instead of
// splitting the heads of a KV head over two items that would both read its keys (2x the bytes).
// Per query vector and span the item keeps the scores' maximum m, the sum l of exp(score − m) and
// the sum o of exp(score − m)·v; then, per query vector, the spans' (m, l, o) are merged in span
// order: with M the largest m, out = Σ e^(m − M)·o / Σ e^(m − M)·l.
// A query's result depends on its own q, key range and keys alone, never on which queries share its
// item (batch invariance): each score is the same dot product whatever block its key falls in, a
// span's max and sum are its own (8 lanes by key index; its blocks' keys outside its range add exact
// zeros), its output sums its own keys in order within tiles whose bounds are key positions
// (multiples of PV_TILE), and the spans are fixed positions merged in order. d a multiple of 8.
static constexpr int64_t MAX_HEADS = 4;
static constexpr int64_t MAX_VECS = 16;  // query vectors (queries × heads) of one work item
static constexpr int64_t PV_TILE = 32;  // keys per tile of the output loop (their values: 8 KB at d = 64)
static constexpr int64_t SPAN = 128;  // keys per span (a multiple of PV_TILE): 32 KB of keys and of values at d = 64
static constexpr int64_t PARTS_CAP = int64_t{1} << 22;  // floats of span partials kept at once (16 MB)

// 8 cached values as float32: a float32 cache's as they are, a float16 cache's widened (exact).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// ---- AVX-512 (`wide`, cpu_kernels.wide()): the loops below on 16 lanes, the same bits --------------
// A column's output sum takes the same fused multiply-adds in the same key order on 16 lanes as on 8
// (columns are independent); a run of several queries' scores hold two keys a register (one a
// half), each lane the same sum in the same order as on 8, each key chunk widened once for all the
// run's query vectors. On a Zen 5 (1-32 sequences, 300 and 1,000 keys, float16 caches, cold;
// benchmarks/bench_paged_attention.py --compare-wide): decodes 1.07-1.10x faster, one sequence's
// 4-query verification 1.10-1.13x, 8-32 sequences' 1.02-1.04x. With decodes' few query vectors
// scored on 16 lanes too, decodes of 8-32 sequences ran at 0.96-0.98x the 8-lane path: they stay on 8.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

static inline __m512 load2x8(const float* a, const float* b) {  // a's 8 values in the low half, b's in the high
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
static inline __m512 load2x8(const uint16_t* a, const uint16_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// NC chunks of 8 columns from column i0 on: the 8 keys' values loaded (and widened) once, two keys a
// register (one a half), then multiplied into every active query vector's running sums w[m][0..3].
template <int NC, typename KV>
static inline void score_chunks_wide(int64_t M, const float* const* qh, const bool* active, const KV* const* kt, int64_t i0,
                                     __m512 (*w)[4]) {
  __m512 kv[4][NC];
  for (int e = 0; e < 4; ++e)
    for (int c = 0; c < NC; ++c) kv[e][c] = load2x8(kt[2 * e] + i0 + 8 * c, kt[2 * e + 1] + i0 + 8 * c);
  for (int64_t m = 0; m < M; ++m) {
    if (!active[m]) continue;
    __m512 s0 = w[m][0], s1 = w[m][1], s2 = w[m][2], s3 = w[m][3];
    for (int c = 0; c < NC; ++c) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qh[m] + i0 + 8 * c));
      s0 = _mm512_fmadd_ps(kv[0][c], qv, s0);
      s1 = _mm512_fmadd_ps(kv[1][c], qv, s1);
      s2 = _mm512_fmadd_ps(kv[2][c], qv, s2);
      s3 = _mm512_fmadd_ps(kv[3][c], qv, s3);
    }
    w[m][0] = s0, w[m][1] = s1, w[m][2] = s2, w[m][3] = s3;
  }
}

// The scores' lanes of the 8 keys kt[0..7] for each query vector m < M with active[m], as the 8-lane
// loop leaves them: a[m][e] lane l = Σ over chunks c, in order, of kt[e][8c + l]·qh[m][8c + l]. Each
// key chunk is loaded and widened once for all the vectors (the 8-lane loop widens it once per vector).
template <typename KV>
__attribute__((noinline)) static void block_scores_wide(int64_t M, const float* const* qh, const bool* active,
                                                       const KV* const* kt, int64_t d, __m256 (*a)[8]) {
  __m512 w[MAX_VECS][4];
  for (int64_t m = 0; m < M; ++m)
    for (int e = 0; e < 4; ++e) w[m][e] = _mm512_setzero_ps();
  int64_t i0 = 0;
  for (; i0 + 32 <= d; i0 += 32) score_chunks_wide<4>(M, qh, active, kt, i0, w);
  switch ((d - i0) / 8) {
    case 3: score_chunks_wide<3>(M, qh, active, kt, i0, w); break;
    case 2: score_chunks_wide<2>(M, qh, active, kt, i0, w); break;
    case 1: score_chunks_wide<1>(M, qh, active, kt, i0, w); break;
  }
  for (int64_t m = 0; m < M; ++m) {
    if (!active[m]) continue;
    for (int e = 0; e < 4; ++e) {
      a[m][2 * e] = _mm512_castps512_ps256(w[m][e]);
      a[m][2 * e + 1] = _mm512_extractf32x8_ps(w[m][e], 1);
    }
  }
}

// o[0 .. whole) += Σ over keys u in [u0, u1), in order, of pu[u]·v_u (v_u = vp + ss[u]·row + off), whole a multiple of 64.
template <typename KV>
__attribute__((noinline)) static void tile_output_wide(float* o, const float* pu, int64_t u0, int64_t u1, const KV* vp,
                                                      const int64_t* ss, int64_t row, int64_t off, int64_t whole) {
  for (int64_t i = 0; i < whole; i += 64) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t u = u0; u < u1; ++u) {
      const KV* vt = vp + ss[u] * row + off + i;
      const __m512 wt = _mm512_set1_ps(pu[u]);
      c0 = _mm512_fmadd_ps(wt, load16(vt), c0);
      c1 = _mm512_fmadd_ps(wt, load16(vt + 16), c1);
      c2 = _mm512_fmadd_ps(wt, load16(vt + 32), c2);
      c3 = _mm512_fmadd_ps(wt, load16(vt + 48), c3);
    }
    float* oi = o + i;
    _mm512_storeu_ps(oi, _mm512_add_ps(_mm512_loadu_ps(oi), c0));
    _mm512_storeu_ps(oi + 16, _mm512_add_ps(_mm512_loadu_ps(oi + 16), c1));
    _mm512_storeu_ps(oi + 32, _mm512_add_ps(_mm512_loadu_ps(oi + 32), c2));
    _mm512_storeu_ps(oi + 48, _mm512_add_ps(_mm512_loadu_ps(oi + 48), c3));
  }
}

// Two query vectors' tile at once (each value chunk loaded and widened once for both): o[s][0 .. whole)
// += Σ over u in [u0[s], u1[s]) of pu[s][u]·v_u, over the keys of either in order.
template <typename KV>
__attribute__((noinline)) static void tile_output_pair_wide(float* const* o, const float* const* pu, const int64_t* u0,
                                                           const int64_t* u1, const KV* vp, const int64_t* ss, int64_t row,
                                                           int64_t off, int64_t whole) {
  for (int64_t i = 0; i < whole; i += 32) {
    __m512 c[2][2];
    for (int s = 0; s < 2; ++s) c[s][0] = c[s][1] = _mm512_setzero_ps();
    // (no std::min/std::max here: a template instantiated under this target could be shared with the AVX2 code)
    const int64_t first = u0[0] < u0[1] ? u0[0] : u0[1], end = u1[0] > u1[1] ? u1[0] : u1[1];
    for (int64_t u = first; u < end; ++u) {
      const KV* vt = vp + ss[u] * row + off + i;
      const __m512 v[2] = {load16(vt), load16(vt + 16)};
      for (int s = 0; s < 2; ++s) {
        if (u < u0[s] || u >= u1[s]) continue;
        const __m512 w = _mm512_set1_ps(pu[s][u]);
        c[s][0] = _mm512_fmadd_ps(w, v[0], c[s][0]);
        c[s][1] = _mm512_fmadd_ps(w, v[1], c[s][1]);
      }
    }
    for (int s = 0; s < 2; ++s) {
      float* oi = o[s] + i;
      _mm512_storeu_ps(oi, _mm512_add_ps(_mm512_loadu_ps(oi), c[s][0]));
      _mm512_storeu_ps(oi + 16, _mm512_add_ps(_mm512_loadu_ps(oi + 16), c[s][1]));
    }
  }
}

#pragma GCC pop_options

template <typename KV>  // the caches' element: float (float32) or uint16_t (float16's bits)
static at::Tensor paged_attention_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                                       at::Tensor token_seq, at::Tensor key_range, at::Tensor kv_head, double scale,
                                       bool wide) {
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2), N = k_cache.size(0), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && d % 8 == 0, "the caches' head size must be q's, a multiple of 8");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: contiguous int64 [S, L]");
  TORCH_CHECK(token_seq.numel() == T && token_seq.scalar_type() == at::kLong && token_seq.is_contiguous(),
              "token_seq: int64 [T]");
  TORCH_CHECK(key_range.numel() == 2 * T && key_range.scalar_type() == at::kLong && key_range.is_contiguous(),
              "key_range: int64 [T, 2]");
  TORCH_CHECK(kv_head.numel() == H && kv_head.scalar_type() == at::kLong && kv_head.is_contiguous(), "kv_head: int64 [H]");
  const int64_t S = slots.size(0), L = slots.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* tsp = token_seq.data_ptr<int64_t>();
  const int64_t* kr = key_range.data_ptr<int64_t>();
  const int64_t* hp = kv_head.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * L; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < N, "a slot outside the cache");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(tsp[t] >= 0 && tsp[t] < S, "a query of a sequence outside slots");
    TORCH_CHECK(kr[2 * t] >= 0 && kr[2 * t] <= kr[2 * t + 1] && kr[2 * t + 1] <= L, "a key range outside [0, L]");
  }
  // Query heads by KV head, in chunks of at most MAX_HEADS; runs of consecutive queries of one
  // sequence, as many as fit MAX_VECS with the widest chunk; each run's spans (those its queries'
  // keys meet). Chunks are halved while there are fewer work items than twice the threads.
  std::vector<std::vector<int64_t>> by_kv(KVH);
  for (int64_t h = 0; h < H; ++h) {
    TORCH_CHECK(hp[h] >= 0 && hp[h] < KVH, "a KV head outside the cache");
    by_kv[hp[h]].push_back(h);
  }
  std::vector<std::vector<int64_t>> chunks;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first query, one past the last)
  struct Item { int64_t run, span; };
  std::vector<Item> spans;  // (run, span) pairs, run by run
  auto plan = [&](int64_t w) {
    chunks.clear();
    runs.clear();
    spans.clear();
    int64_t widest = 1;
    for (const auto& heads : by_kv)
      for (size_t i = 0; i < heads.size(); i += w) {
        chunks.emplace_back(heads.begin() + i, heads.begin() + std::min(heads.size(), i + w));
        widest = std::max<int64_t>(widest, chunks.back().size());
      }
    const int64_t most = std::max<int64_t>(1, MAX_VECS / widest);
    for (int64_t t = 0; t < T; ++t)
      if (t == 0 || tsp[t] != tsp[t - 1] || t - runs.back().first == most) runs.emplace_back(t, t + 1);
      else runs.back().second = t + 1;
    for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
      int64_t first = std::numeric_limits<int64_t>::max(), end = 0;
      for (int64_t t = runs[r].first; t < runs[r].second; ++t)
        if (kr[2 * t + 1] > kr[2 * t]) {
          first = std::min(first, kr[2 * t]);
          end = std::max(end, kr[2 * t + 1]);
        }
      for (int64_t s = end > 0 ? first / SPAN : 0; s * SPAN < end; ++s) spans.push_back({r, s});
    }
  };
  int64_t width = MAX_HEADS;
  plan(width);
  while (width > 1 && static_cast<int64_t>(spans.size() * chunks.size()) < 2 * at::get_num_threads()) plan(width /= 2);
  const int64_t C = chunks.size();
  auto out = at::empty({T, H * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const KV* kp = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vp = static_cast<const KV*>(v_cache.data_ptr());
  constexpr int64_t per_line = 64 / sizeof(KV);  // cached values a cache line
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row = KVH * d;  // a slot's values
  const int64_t part = d + 2;  // a span's (o [d], m, l) for one query vector
  // Query t's keys meet spans first_span[t] … first_span[t] + nspan[t] − 1; the partials of its head
  // h and span s sit at parts[qoff[t] + (h · nspan[t] + s − first_span[t]) · part], qoff counted
  // within a group of runs. Runs are taken in groups whose partials fit PARTS_CAP floats (a long
  // prefill chunk over many spans would need hundreds of MB at once), a parallel pass and a merge
  // a group: which group a query falls in changes none of its arithmetic.
  std::vector<int64_t> first_span(T), nspan(T), qoff(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t first = kr[2 * t], end = kr[2 * t + 1];
    first_span[t] = end > first ? first / SPAN : 0;
    nspan[t] = end > first ? (end - 1) / SPAN - first_span[t] + 1 : 0;
  }
  thread_local std::vector<float> parts;  // grown only: every entry read is written first in the call
  const int64_t R = runs.size(), I = spans.size();
  for (int64_t r0 = 0, i0 = 0; r0 < R;) {
    int64_t need = 0, r1 = r0;
    for (; r1 < R; ++r1) {
      int64_t run_need = 0;
      for (int64_t t = runs[r1].first; t < runs[r1].second; ++t) run_need += H * nspan[t] * part;
      if (r1 > r0 && need + run_need > PARTS_CAP) break;
      for (int64_t t = runs[r1].first; t < runs[r1].second; ++t) {
        qoff[t] = need;
        need += H * nspan[t] * part;
      }
    }
    int64_t i1 = i0;
    while (i1 < I && spans[i1].run < r1) ++i1;
    if (parts.size() < static_cast<size_t>(need)) parts.resize(need);
    float* pp = parts.data();
    // Items (span-major within a run, then chunk) cut into one contiguous range per thread of about
    // equal work (keys × query vectors, and a fixed cost), not of equal counts: a run's last span
    // may hold a few keys.
    const int64_t items = (i1 - i0) * C, threads = std::min<int64_t>(at::get_num_threads(), items);
    std::vector<int64_t> cut(threads + 1, items);
    {
      std::vector<double> work(items + 1, 0.0);
      for (int64_t b = 0; b < items; ++b) {
        const auto [run, span] = spans[i0 + b / C];
        int64_t keys = 0;
        for (int64_t t = runs[run].first; t < runs[run].second; ++t)
          keys += std::max<int64_t>(0, std::min(kr[2 * t + 1], (span + 1) * SPAN) - std::max(kr[2 * t], span * SPAN));
        work[b + 1] = work[b] + static_cast<double>(keys * static_cast<int64_t>(chunks[b % C].size()) + 64);
      }
      cut[0] = 0;
      for (int64_t i = 1, b = 0; i < threads; ++i) {
        while (b < items && work[b] < work[items] * i / threads) ++b;
        cut[i] = b;
      }
    }
    at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
      const int64_t b0 = cut[w0], b1 = cut[w1];  // the items of threads w0 … w1 − 1
      // Per query vector: scores, then probabilities; kept per thread and only grown (every entry
      // read is written first in the call), not zeroed per call.
      thread_local std::vector<float> p;
      constexpr int64_t span_max = SPAN + 8;  // floats of one query vector's scores
      if (p.size() < static_cast<size_t>(MAX_VECS * span_max)) p.resize(MAX_VECS * span_max);
      for (int64_t b = b0; b < b1; ++b) {
        const auto [run, span] = spans[i0 + b / C];
        const auto [t0, t1] = runs[run];
        const std::vector<int64_t>& heads = chunks[b % C];
        const int64_t G = heads.size(), M = (t1 - t0) * G;
        const int64_t off = hp[heads[0]] * d;  // the KV head's values within a slot
        const int64_t* ss = sp + tsp[t0] * L;  // the run's sequence's slots
        const int64_t s0 = span * SPAN, s1 = s0 + SPAN;
        // Query vector m = (query t0 + m / G, head heads[m % G]); its keys in this span [lo[m], hi[m])
        // (empty: it does not meet the span); its 8-key blocks [blo[m], bhi[m]) counted from key 0. The
        // item's keys: blocks [base, top).
        const float* qh[MAX_VECS];
        float* part_of[MAX_VECS];
        int64_t lo[MAX_VECS], hi[MAX_VECS], blo[MAX_VECS], bhi[MAX_VECS];
        int64_t base = std::numeric_limits<int64_t>::max(), top = 0, span_end = 0;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t t = t0 + m / G, h = heads[m % G];
          qh[m] = qp + (t * H + h) * d;
          lo[m] = std::max(kr[2 * t], s0);
          hi[m] = std::min(kr[2 * t + 1], s1);
          if (hi[m] <= lo[m]) {
            hi[m] = lo[m];
            continue;
          }
          part_of[m] = pp + qoff[t] + (h * nspan[t] + span - first_span[t]) * part;
          blo[m] = lo[m] / 8;
          bhi[m] = (hi[m] + 7) / 8;
          base = std::min(base, blo[m]);
          top = std::max(top, bhi[m]);
          span_end = std::max(span_end, hi[m]);  // one past the last key any of them reads
        }
        if (top == 0) continue;
        // Query vector m's score of key u: p[m · span_max + u − 8 · base].
        // Scores, 8 keys at a time for every query vector whose keys meet the block: each key is
        // loaded from memory once per work item.
        __m256 mx8[MAX_VECS];
        for (int64_t m = 0; m < M; ++m) mx8[m] = _mm256_set1_ps(neg_inf);
        // A run of several queries (a verification, a prefill chunk) scores on 16 lanes, each key chunk
        // widened once for its query vectors; a decode's few vectors on 8 (slower on 16, above).
        const bool wide_scores = wide && t1 - t0 > 1;
        __m256 wa[MAX_VECS][8];  // its score lanes (block_scores_wide)
        for (int64_t blk = base; blk < top; ++blk) {
          const int64_t u = blk * 8;
          const KV* kt[8];
          for (int e = 0; e < 8; ++e) kt[e] = kp + ss[std::min(u + e, span_end - 1)] * row + off;  // past the span: a repeat, masked
          // Cold caches (a forward's other layers came between): the keys two blocks ahead into L1,
          // and this block's values into L2 for the output loop below.
          for (int e = 0; e < 8; ++e) {
            const int64_t ahead = ss[std::min(u + 16 + e, span_end - 1)] * row + off, here = ss[std::min(u + e, span_end - 1)] * row + off;
            for (int64_t i = 0; i < d; i += per_line) {
              _mm_prefetch(reinterpret_cast<const char*>(kp + ahead + i), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(vp + here + i), _MM_HINT_T1);
            }
          }
          bool active[MAX_VECS];
          for (int64_t m = 0; m < M; ++m) active[m] = blk >= blo[m] && blk < bhi[m] && hi[m] != lo[m];
          if (wide_scores) block_scores_wide<KV>(M, qh, active, kt, d, wa);
          for (int64_t m = 0; m < M; ++m) {
            if (!active[m]) continue;
            __m256 own[8];
            __m256* a = wide_scores ? wa[m] : own;
            if (!wide_scores) {
              for (int e = 0; e < 8; ++e) a[e] = _mm256_setzero_ps();
              for (int64_t i = 0; i < d; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qh[m] + i);
                for (int e = 0; e < 8; ++e) a[e] = _mm256_fmadd_ps(load8(kt[e] + i), qv, a[e]);
              }
            }
            const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
            const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
            const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
            // lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of s0123, the same for k4..k7 in s4567
            const __m256 lo4 = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi4 = _mm256_permute2f128_ps(s0123, s4567, 0x31);
            float* pm = p.data() + m * span_max + (u - 8 * base);
            _mm256_storeu_ps(pm, _mm256_mul_ps(_mm256_add_ps(lo4, hi4), _mm256_set1_ps(sc)));
            if (u < lo[m] || u + 8 > hi[m])  // an edge block: keys outside the query's span range count as -inf
              for (int e = 0; e < 8; ++e)
                if (u + e < lo[m] || u + e >= hi[m]) pm[e] = neg_inf;
            mx8[m] = _mm256_max_ps(mx8[m], _mm256_loadu_ps(pm));
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          if (hi[m] == lo[m]) continue;
          float lanes[8];
          _mm256_storeu_ps(lanes, mx8[m]);
          float mx = lanes[0];
          for (int e = 1; e < 8; ++e) mx = std::max(mx, lanes[e]);
          // Probabilities over the query's own blocks (8 lanes from key 0: its masked keys add zeros).
          float* pm = p.data() + m * span_max;  // key u at pm[u − 8 · base]
          const __m256 vmx = _mm256_set1_ps(mx);
          __m256 tot = _mm256_setzero_ps();
          for (int64_t j = (blo[m] - base) * 8; j < (bhi[m] - base) * 8; j += 8) {
            const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pm + j), vmx));
            _mm256_storeu_ps(pm + j, e);
            tot = _mm256_add_ps(tot, e);
          }
          float* o = part_of[m];
          std::fill(o, o + d, 0.f);
          o[d] = mx;
          o[d + 1] = hsum(tot);  // >= 1: the largest score's term is 1
        }
        // The span's outputs, over tiles of PV_TILE keys (their values stay in L1 while every query
        // vector of the item reads them): per query vector and tile, its keys in order, 64 columns at a
        // time in 8 accumulators the compiler keeps in registers (an array indexed by a run-time count
        // of vectors it spills), then added to the output. A query's sums are the same whatever
        // shares its item: the tiles' bounds are key positions, its keys its own.
        for (int64_t t = base * 8 / PV_TILE * PV_TILE; t < span_end; t += PV_TILE) {
          // A run of several queries (a verification, a prefill chunk): its vectors with keys in the
          // tile taken two at a time over 32 columns, each value chunk loaded (and widened) once for
          // both (1.04-1.09x faster at 4-8 queries; a decode's vectors, paired, were 2-3 % slower at
          // 32 sequences). A vector's lanes take the same fused multiply-adds in the same key order
          // paired or alone, so its bits are the same either way.
          // Query vector m's keys in the tile [u0, u1), and the probability of key u at pu[u].
          auto keys_of = [&](int64_t m) { return std::make_pair(std::max(lo[m], t), std::min(hi[m], t + PV_TILE)); };
          auto probs_of = [&](int64_t m) { return p.data() + m * span_max - 8 * base; };
          int64_t act[MAX_VECS], n_act = 0;  // the vectors with keys in the tile
          for (int64_t m = 0; m < M; ++m)
            if (const auto [u0, u1] = keys_of(m); u0 < u1) act[n_act++] = m;
          const int64_t whole = d / 64 * 64;
          int64_t paired = 0;
          for (; paired + 1 < n_act && whole > 0 && t1 - t0 > 1; paired += 2) {  // decodes alone: no faster paired
            const int64_t pair[2] = {act[paired], act[paired + 1]};
            int64_t u0[2], u1[2];
            const float* pu[2];
            for (int s = 0; s < 2; ++s) {
              std::tie(u0[s], u1[s]) = keys_of(pair[s]);
              pu[s] = probs_of(pair[s]);
            }
            if (wide) {
              float* const po[2] = {part_of[pair[0]], part_of[pair[1]]};
              tile_output_pair_wide<KV>(po, pu, u0, u1, vp, ss, row, off, whole);
              continue;
            }
            for (int64_t i = 0; i < whole; i += 32) {
              __m256 c[2][4];
              for (int s = 0; s < 2; ++s)
                for (int k = 0; k < 4; ++k) c[s][k] = _mm256_setzero_ps();
              for (int64_t u = std::min(u0[0], u0[1]); u < std::max(u1[0], u1[1]); ++u) {
                const KV* vt = vp + ss[u] * row + off + i;
                const __m256 v[4] = {load8(vt), load8(vt + 8), load8(vt + 16), load8(vt + 24)};
                for (int s = 0; s < 2; ++s) {
                  if (u < u0[s] || u >= u1[s]) continue;
                  const __m256 w = _mm256_broadcast_ss(pu[s] + u);
                  for (int k = 0; k < 4; ++k) c[s][k] = _mm256_fmadd_ps(w, v[k], c[s][k]);
                }
              }
              for (int s = 0; s < 2; ++s) {
                float* o = part_of[pair[s]] + i;
                for (int k = 0; k < 4; ++k) _mm256_storeu_ps(o + 8 * k, _mm256_add_ps(_mm256_loadu_ps(o + 8 * k), c[s][k]));
              }
            }
          }
          for (int64_t j = paired; j < n_act; ++j) {  // the last, unpaired (or all, with d < 64)
            const int64_t m = act[j];
            const auto [u0, u1] = keys_of(m);
            float* o = part_of[m];
            const float* pu = probs_of(m);
            if (wide) {
              tile_output_wide<KV>(o, pu, u0, u1, vp, ss, row, off, whole);
              continue;
            }
            for (int64_t i = 0; i < whole; i += 64) {
              __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
              for (int64_t u = u0; u < u1; ++u) {
                const KV* vt = vp + ss[u] * row + off + i;
                const __m256 wt = _mm256_broadcast_ss(pu + u);
                c0 = _mm256_fmadd_ps(wt, load8(vt), c0);
                c1 = _mm256_fmadd_ps(wt, load8(vt + 8), c1);
                c2 = _mm256_fmadd_ps(wt, load8(vt + 16), c2);
                c3 = _mm256_fmadd_ps(wt, load8(vt + 24), c3);
                c4 = _mm256_fmadd_ps(wt, load8(vt + 32), c4);
                c5 = _mm256_fmadd_ps(wt, load8(vt + 40), c5);
                c6 = _mm256_fmadd_ps(wt, load8(vt + 48), c6);
                c7 = _mm256_fmadd_ps(wt, load8(vt + 56), c7);
              }
              float* oi = o + i;
              _mm256_storeu_ps(oi, _mm256_add_ps(_mm256_loadu_ps(oi), c0));
              _mm256_storeu_ps(oi + 8, _mm256_add_ps(_mm256_loadu_ps(oi + 8), c1));
              _mm256_storeu_ps(oi + 16, _mm256_add_ps(_mm256_loadu_ps(oi + 16), c2));
              _mm256_storeu_ps(oi + 24, _mm256_add_ps(_mm256_loadu_ps(oi + 24), c3));
              _mm256_storeu_ps(oi + 32, _mm256_add_ps(_mm256_loadu_ps(oi + 32), c4));
              _mm256_storeu_ps(oi + 40, _mm256_add_ps(_mm256_loadu_ps(oi + 40), c5));
              _mm256_storeu_ps(oi + 48, _mm256_add_ps(_mm256_loadu_ps(oi + 48), c6));
              _mm256_storeu_ps(oi + 56, _mm256_add_ps(_mm256_loadu_ps(oi + 56), c7));
            }
          }
          for (int64_t j = 0; j < n_act; ++j) {  // every vector's rest, 8 columns at a time (columns are independent)
            const int64_t m = act[j];
            const auto [u0, u1] = keys_of(m);
            const float* pu = probs_of(m);
            for (int64_t i = whole; i < d; i += 8) {
              __m256 c = _mm256_setzero_ps();
              for (int64_t u = u0; u < u1; ++u)
                c = _mm256_fmadd_ps(_mm256_broadcast_ss(pu + u), load8(vp + ss[u] * row + off + i), c);
              _mm256_storeu_ps(part_of[m] + i, _mm256_add_ps(_mm256_loadu_ps(part_of[m] + i), c));
            }
          }
        }
      }
    });
    // Each query vector's spans merged in order: out = Σ e^(m − M)·o / Σ e^(m − M)·l (no key: zeros).
    const int64_t v_first = runs[r0].first * H, v_end = runs[r1 - 1].second * H;
    at::parallel_for(v_first, v_end, 64, [&](int64_t v0, int64_t v1) {
      for (int64_t v = v0; v < v1; ++v) {
        const int64_t t = v / H, first = kr[2 * t], end = kr[2 * t + 1];
        float* o = op + v * d;
        if (end == first) {
          std::fill(o, o + d, 0.f);
          continue;
        }
        const float* pv = pp + qoff[t] + (v % H) * nspan[t] * part;  // span f + s at pv + s · part
        const int64_t f = first / SPAN, l = (end - 1) / SPAN;
        float top = pv[d];
        for (int64_t s = f + 1; s <= l; ++s) top = std::max(top, pv[(s - f) * part + d]);
        float total = 0.f;
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
        for (int64_t s = f; s <= l; ++s) {
          const float* ps = pv + (s - f) * part;
          const float w = s == f && l == f ? 1.f : std::exp(ps[d] - top);
          total += w * ps[d + 1];
          const __m256 vw = _mm256_set1_ps(w);
          for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(ps + i), _mm256_loadu_ps(o + i)));
        }
        const __m256 inv = _mm256_set1_ps(1.f / total);
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
      }
    });
    r0 = r1;
    i0 = i1;
  }
  return out;
}

// wide: the output loops, and a run of several queries' scores, on 16 lanes (AVX-512: the caller
// checks the CPU has it), the same bits.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                              at::Tensor token_seq, at::Tensor key_range, at::Tensor kv_head, double scale, bool wide) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [T, H, d]");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && (dtype == at::kFloat || dtype == at::kHalf)
              && v_cache.scalar_type() == dtype && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 or float16 [slots, KVH, d], both the same");
  return dtype == at::kFloat ? paged_attention_impl<float>(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, scale, wide)
                             : paged_attention_impl<uint16_t>(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, scale, wide);
}

// The step's new keys and values into their slots of the paged cache (layers.attention), one call
// where PyTorch dispatches four ops (two conversions, two index copies: ~9 us a layer at one row).
// k, v [T, KVH, d] float32, unit stride along d and between heads (any row stride: columns of a fused
// projection's output); caches [slots, KVH, d] contiguous float32, or float16 rounded to nearest even
// as Tensor.to(float16) rounds (vcvtps2ph); slot_mapping [T] int64, each in 0 .. slots − 1. d a multiple of 8.
template <typename KV>
static inline void store8(KV* p, __m256 v);
template <>
inline void store8<float>(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <>
inline void store8<uint16_t>(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <typename KV>
static void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                          const int64_t* slot, int64_t T, int64_t width) {
  KV* kc = reinterpret_cast<KV*>(k_cache.data_ptr());
  KV* vc = reinterpret_cast<KV*>(v_cache.data_ptr());
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    KV* kd = kc + slot[t] * width;
    KV* vd = vc + slot[t] * width;
    for (int64_t i = 0; i < width; i += 8) {
      store8(kd + i, _mm256_loadu_ps(kp + t * ks + i));
      store8(vd + i, _mm256_loadu_ps(vp + t * vs + i));
    }
  }
}

void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && (dtype == at::kFloat || dtype == at::kHalf)
              && v_cache.scalar_type() == dtype && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 or float16 [slots, KVH, d], both the same");
  const int64_t T = k.size(0), H = k_cache.size(1), d = k_cache.size(2), slots = k_cache.size(0);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kFloat && x->size(0) == T && x->size(1) == H && x->size(2) == d
                && x->stride(2) == 1 && x->stride(1) == d, "k, v: float32 [T, KVH, d] like the cache's rows, heads adjacent");
  TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.scalar_type() == at::kLong
              && slot_mapping.is_contiguous(), "slot_mapping: contiguous int64 [T]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " outside the cache");
  if (dtype == at::kFloat) write_kv_impl<float>(k, v, k_cache, v_cache, slot, T, H * d);
  else write_kv_impl<uint16_t>(k, v, k_cache, v_cache, slot, T, H * d);
}
