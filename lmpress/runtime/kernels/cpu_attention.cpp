// Attention of a few queries over a preallocated KV cache, reading only the slots the queries see (AVX-512).
//
// The compiled decode step's cache has a fixed number of slots (the prompt plus the new tokens), and the attention
// Inductor builds from broadcast products reads all of them whatever the fill, masked: on average 1.5x the slots a
// decode of as many new tokens as prompt tokens sees. Here each query row finds the first and last slot its mask
// shows and reads only those: keys for its scores (float32, scaled), a softmax, and the values weighted by it. One
// work item per (batch row, head, query); the query heads sharing a KV head (GQA) read the same keys and values.
// Built into the library of cpu_int.cpp (its second source; the op joins the lmpress_cpu namespace).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ATTN_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

namespace {

// exp(x) for x <= 0 (scores less their row's maximum), masked lanes (-inf) to 0: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error under 2e-7, float32's rounding), times 2^n by vscalefps.
ATTN_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 visible = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: exact product, then rest
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(visible, p, n);
}

// One query row: q (D), keys and values of its KV head (L, D) and (L, Dv), mask (L), out (Dv); scores scratch (L).
ATTN_AVX512 void attend_row(const float* q, const float* keys, const float* values, const bool* mask, int64_t L,
                            int64_t D, int64_t Dv, float scale, float* scores, float* out) {
  int64_t first = 0, end = L;
  while (end > 0 && !mask[end - 1]) --end;
  while (first < end && !mask[first]) ++first;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  for (int64_t s = first; s < end; ++s) {
    if (!mask[s]) {
      scores[s] = neg_inf;
      continue;
    }
    const float* key = keys + s * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(key + d), acc);
    scores[s] = _mm512_reduce_add_ps(acc) * scale;
    top = std::max(top, scores[s]);
  }
  for (int64_t d = 0; d < Dv; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
  if (top == neg_inf) return;  // no slot visible (never for a cache's query, whose own slot is)
  __m512 total = _mm512_setzero_ps();
  int64_t s = first;
  for (; s + 16 <= end; s += 16) {
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + s), _mm512_set1_ps(top)));
    _mm512_storeu_ps(scores + s, p);
    total = _mm512_add_ps(total, p);
  }
  if (s < end) {
    const __mmask16 k = static_cast<__mmask16>((1u << (end - s)) - 1);
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + s), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(scores + s, k, p);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, p));
  }
  for (int64_t t = first; t < end; ++t) {
    if (scores[t] == 0.f) continue;
    const __m512 p = _mm512_set1_ps(scores[t]);
    const float* value = values + t * Dv;
    for (int64_t d = 0; d < Dv; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(value + d), _mm512_loadu_ps(out + d)));
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t d = 0; d < Dv; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
}

// q (B, H, n, D), keys (B, KV, L, D), values (B, KV, L, Dv), mask (B, 1, n, L) bool, all contiguous float32 but the
// mask: (B, H, n, Dv) float32.
at::Tensor slots_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& mask, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"),
              "slots_attention: this CPU has no AVX-512");
  for (const at::Tensor* t : {&q, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->is_contiguous(), "slots_attention: float32");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), L = keys.size(2), Dv = values.size(3);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && values.size(0) == B && values.size(1) == KV &&
                  values.size(2) == L && H % KV == 0 && D % 16 == 0 && Dv % 16 == 0,
              "slots_attention: shapes");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 4 && mask.size(0) == B &&
                  mask.size(1) == 1 && mask.size(2) == n && mask.size(3) == L,
              "slots_attention: mask (B, 1, n, L) bool");
  at::Tensor out = at::empty({B, H, n, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / KV;
  at::parallel_for(0, B * H * n, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * n), h = i / n % H, query = i % n, kv = b * KV + h / group;
      attend_row(qp + i * D, kp + kv * L * D, vp + kv * L * Dv, mp + (b * n + query) * L, L, D, Dv,
                 static_cast<float>(scale), scores.data(), op + i * Dv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) {
  m.def("slots_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("slots_attention", &slots_attention); }

#endif
