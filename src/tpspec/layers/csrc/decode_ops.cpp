// Float32 ops of a decode step on x86 with AVX2 and FMA (tpspec.layers.cpu_kernels), one call each:
// RMSNorm with its residual add, where PyTorch dispatches 5-10 ops (~20-30 us for a row of 576), and
// single-query attention reading the paged KV cache in place, where PyTorch gathers the keys first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(D % 8 == 0, "the width must be a multiple of 8");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D, "weight: float32 [D]");
  torch::Tensor sum = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat && residual->is_contiguous(),
                "residual: contiguous float32 like x");
    sum = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
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

// One query per sequence, reading the layer's paged KV cache in place (no gather): q [S, H, d];
// k_cache, v_cache [N, KVH, d] (slots); slots [S, L] int64, the slot of each of sequence s's keys;
// kv_head [H] int64, the KV head each query head reads; mask [S, L] additive or undefined (every
// key; -inf: never read). -> softmax(q·kᵀ·scale + mask)·v as [S, H · d]. d a multiple of 8.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                     torch::Tensor kv_head, c10::optional<torch::Tensor> mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [S, H, d]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kFloat
              && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 [slots, KVH, d]");
  const int64_t S = q.size(0), H = q.size(1), d = q.size(2), N = k_cache.size(0), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && d % 8 == 0, "the caches' head size must be q's, a multiple of 8");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == S && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots: contiguous int64 [S, L]");
  TORCH_CHECK(kv_head.numel() == H && kv_head.scalar_type() == at::kLong && kv_head.is_contiguous(), "kv_head: int64 [H]");
  const int64_t L = slots.size(1);
  const float* mp = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->is_contiguous() && mask->numel() == S * L, "mask: float32 [S, L]");
    mp = mask->data_ptr<float>();
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* hp = kv_head.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * L; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < N, "a slot outside the cache");
  for (int64_t h = 0; h < H; ++h) TORCH_CHECK(hp[h] >= 0 && hp[h] < KVH, "a KV head outside the cache");
  auto out = torch::empty({S, H * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, S * H, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> p(L);  // scores, then probabilities
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = b / H, h = b % H;
      const float* qh = qp + b * d;
      const int64_t* ss = sp + s * L;
      const float* ms = mp ? mp + s * L : nullptr;
      const int64_t row = KVH * d, off = hp[h] * d;  // a slot's floats; the KV head's within it
      float mx = neg_inf;
      for (int64_t t = 0; t < L; ++t) {
        if (ms && ms[t] == neg_inf) {
          p[t] = neg_inf;
          continue;
        }
        const float* kt = kp + ss[t] * row + off;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i), _mm256_loadu_ps(qh + i), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i + 8), _mm256_loadu_ps(qh + i + 8), a1);
        }
        if (i < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i), _mm256_loadu_ps(qh + i), a0);
        p[t] = hsum(_mm256_add_ps(a0, a1)) * sc + (ms ? ms[t] : 0.f);
        mx = std::max(mx, p[t]);
      }
      if (mx == neg_inf) mx = 0.f;  // every key masked: zeros
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 tot = _mm256_setzero_ps();
      int64_t t = 0;
      for (; t + 8 <= L; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p.data() + t), vmx));
        _mm256_storeu_ps(p.data() + t, e);
        tot = _mm256_add_ps(tot, e);
      }
      float total = hsum(tot);
      for (; t < L; ++t) {
        p[t] = p[t] == neg_inf ? 0.f : std::exp(p[t] - mx);
        total += p[t];
      }
      const __m256 inv = _mm256_set1_ps(total > 0.f ? 1.f / total : 0.f);
      for (int64_t i = 0; i < d; i += 16) {  // two 8-wide columns at a time (d a multiple of 8)
        const bool two = i + 16 <= d;
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
        for (int64_t t = 0; t < L; ++t) {
          if (p[t] == 0.f) continue;  // masked (never read) or too small to count
          const __m256 w = _mm256_set1_ps(p[t]);
          const float* vt = vp + ss[t] * row + off + i;
          c0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt), c0);
          if (two) c1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8), c1);
        }
        _mm256_storeu_ps(op + b * d + i, _mm256_mul_ps(c0, inv));
        if (two) _mm256_storeu_ps(op + b * d + i + 8, _mm256_mul_ps(c1, inv));
      }
    }
  });
  return out;
}
