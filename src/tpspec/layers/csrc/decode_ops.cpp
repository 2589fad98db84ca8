// Float32 ops of decode and verification steps on x86 with AVX2 and FMA (tpspec.layers.cpu_kernels),
// one call each: RMSNorm with its residual add, where PyTorch dispatches 5-10 ops (~20-30 us for a row
// of 576), and attention of a few queries per sequence reading the paged KV cache in place, where
// PyTorch gathers the keys first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

// Queries of any number of sequences over the layer's paged KV cache, read in place (no gather):
// q [T, H, d]; k_cache, v_cache [N, KVH, d] (slots); slots [S, L] int64, the slot of each of sequence
// s's keys; token_seq [T] int64, the row of slots each query reads; key_range [T, 2] int64, the
// first and one-past-last of those keys it attends to (a causal query: 0 and its position + 1);
// kv_head [H] int64, the KV head each query head reads. -> softmax(q·kᵀ·scale)·v as [T, H · d].
// Work items are (query, up to MAX_HEADS query heads of one KV head): each key is loaded once for
// the item's heads. d a multiple of 8.
static constexpr int64_t MAX_HEADS = 4;

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                              at::Tensor token_seq, at::Tensor key_range, at::Tensor kv_head, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [T, H, d]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kFloat
              && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 [slots, KVH, d]");
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
  // Query heads by KV head, in chunks of at most MAX_HEADS, halved while there are fewer work items
  // than twice the threads (one sequence's decode: 3 KV heads on 2 threads).
  std::vector<std::vector<int64_t>> by_kv(KVH);
  for (int64_t h = 0; h < H; ++h) {
    TORCH_CHECK(hp[h] >= 0 && hp[h] < KVH, "a KV head outside the cache");
    by_kv[hp[h]].push_back(h);
  }
  int64_t width = MAX_HEADS;
  auto chunk_heads = [&](int64_t w) {
    std::vector<std::vector<int64_t>> chunks;
    for (const auto& heads : by_kv)
      for (size_t i = 0; i < heads.size(); i += w)
        chunks.emplace_back(heads.begin() + i, heads.begin() + std::min(heads.size(), i + w));
    return chunks;
  };
  auto chunks = chunk_heads(width);
  while (width > 1 && T * static_cast<int64_t>(chunks.size()) < 2 * at::get_num_threads()) chunks = chunk_heads(width /= 2);
  const int64_t C = chunks.size();
  auto out = at::empty({T, H * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = KVH * d;  // a slot's floats
  at::parallel_for(0, T * C, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> p(MAX_HEADS * L);  // per head of the item: scores, then probabilities
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b / C;
      const std::vector<int64_t>& heads = chunks[b % C];
      const int64_t G = heads.size(), first = kr[2 * t], n = kr[2 * t + 1] - first;
      const int64_t off = hp[heads[0]] * d;  // the KV head's floats within a slot
      const int64_t* ss = sp + tsp[t] * L + first;
      float* out_t = op + t * H * d;
      if (n == 0) {  // no key: zeros
        for (int64_t j = 0; j < G; ++j) std::fill(out_t + heads[j] * d, out_t + (heads[j] + 1) * d, 0.f);
        continue;
      }
      const float* qh[MAX_HEADS];
      float mx[MAX_HEADS];
      __m256 mx8[MAX_HEADS];
      for (int64_t j = 0; j < G; ++j) {
        qh[j] = qp + (t * H + heads[j]) * d;
        mx[j] = -std::numeric_limits<float>::infinity();
        mx8[j] = _mm256_set1_ps(mx[j]);
      }
      // Scores of 8 keys at a time per head: 8 dot products reduced into one vector.
      int64_t tail = 0;  // the first key past the 8-key blocks
      for (; tail + 8 <= n; tail += 8) {
        const int64_t u = tail;
        const float* kt[8];
        for (int e = 0; e < 8; ++e) kt[e] = kp + ss[u + e] * row + off;
        for (int64_t j = 0; j < G; ++j) {
          __m256 a[8];
          for (int e = 0; e < 8; ++e) a[e] = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qh[j] + i);
            for (int e = 0; e < 8; ++e) a[e] = _mm256_fmadd_ps(_mm256_loadu_ps(kt[e] + i), qv, a[e]);
          }
          const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
          const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
          const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
          // lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of s0123, the same for k4..k7 in s4567
          const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
          const __m256 scores = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(sc));
          _mm256_storeu_ps(p.data() + j * L + u, scores);
          mx8[j] = _mm256_max_ps(mx8[j], scores);
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        float lanes[8];
        _mm256_storeu_ps(lanes, mx8[j]);
        for (int e = 0; e < 8; ++e) mx[j] = std::max(mx[j], lanes[e]);
      }
      for (int64_t u = tail; u < n; ++u) {
        const float* kt = kp + ss[u] * row + off;
        for (int64_t j = 0; j < G; ++j) {
          __m256 a0 = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i), _mm256_loadu_ps(qh[j] + i), a0);
          const float score = hsum(a0) * sc;
          p[j * L + u] = score;
          mx[j] = std::max(mx[j], score);
        }
      }
      __m256 inv[MAX_HEADS];
      for (int64_t j = 0; j < G; ++j) {
        float* pj = p.data() + j * L;
        const __m256 vmx = _mm256_set1_ps(mx[j]);
        __m256 tot = _mm256_setzero_ps();
        int64_t u = 0;
        for (; u + 8 <= n; u += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pj + u), vmx));
          _mm256_storeu_ps(pj + u, e);
          tot = _mm256_add_ps(tot, e);
        }
        float total = hsum(tot);
        for (; u < n; ++u) {
          pj[u] = std::exp(pj[u] - mx[j]);
          total += pj[u];
        }
        inv[j] = _mm256_set1_ps(1.f / total);  // total >= 1: the largest score's term is 1
      }
      // Each head's output 64 columns (8 vectors) at a time, over every key.
      for (int64_t j = 0; j < G; ++j) {
        const float* pj = p.data() + j * L;
        for (int64_t i = 0; i < d; i += 64) {
          const int64_t w = std::min<int64_t>(8, (d - i) / 8);  // vectors in this block
          __m256 c[8];
          for (int e = 0; e < 8; ++e) c[e] = _mm256_setzero_ps();
          for (int64_t u = 0; u < n; ++u) {
            const float* vt = vp + ss[u] * row + off + i;
            const __m256 wt = _mm256_set1_ps(pj[u]);
            if (w == 8) {
              for (int e = 0; e < 8; ++e) c[e] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 8 * e), c[e]);
            } else {
              for (int e = 0; e < w; ++e) c[e] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 8 * e), c[e]);
            }
          }
          float* oj = out_t + heads[j] * d + i;
          for (int e = 0; e < w; ++e) _mm256_storeu_ps(oj + 8 * e, _mm256_mul_ps(c[e], inv[j]));
        }
      }
    }
  });
  return out;
}
