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
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
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

// The softmax's weights in place of the visible scores in [first, end) (masked ones -inf), less their maximum top;
// returns their sum.
ATTN_AVX512 float softmax_weights(float* scores, int64_t first, int64_t end, float top) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t s = first; s < end; s += 16) {
    const __mmask16 k = end - s >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (end - s)) - 1);
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + s), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(scores + s, k, p);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, p));
  }
  return _mm512_reduce_add_ps(total);
}

// One query row: q (16 NV), keys and values of its KV head (L, 16 NV), mask (L), out (16 NV); scores scratch (L).
// The query and the output stay in registers across the slots.
template <int NV>
ATTN_AVX512 void attend_row(const float* q, const float* keys, const float* values, const bool* mask, int64_t L,
                            float scale, float* scores, float* out) {
  constexpr int64_t D = 16 * NV;
  int64_t first = 0, end = L;
  while (end > 0 && !mask[end - 1]) --end;
  while (first < end && !mask[first]) ++first;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 qv[NV], acc[NV];
  for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j), acc[j] = _mm512_setzero_ps();
  float top = neg_inf;
  for (int64_t s = first; s < end; ++s) {
    if (!mask[s]) {
      scores[s] = neg_inf;
      continue;
    }
    __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys + s * D));
    for (int j = 1; j < NV; ++j) dot = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(keys + s * D + 16 * j), dot);
    scores[s] = _mm512_reduce_add_ps(dot) * scale;
    top = std::max(top, scores[s]);
  }
  if (top != neg_inf) {  // some slot visible (always, for a cache's query: its own slot is)
    const float total = softmax_weights(scores, first, end, top);
    for (int64_t s = first; s < end; ++s) {
      const __m512 p = _mm512_set1_ps(scores[s]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + s * D + 16 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_mul_ps(acc[j], _mm512_set1_ps(1.f / total));
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, acc[j]);
}

// The same for any dims (multiples of 16; values' Dv apart from the keys' D), through memory.
ATTN_AVX512 void attend_row_any(const float* q, const float* keys, const float* values, const bool* mask, int64_t L,
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
    __m512 dot = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16)
      dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(keys + s * D + d), dot);
    scores[s] = _mm512_reduce_add_ps(dot) * scale;
    top = std::max(top, scores[s]);
  }
  for (int64_t d = 0; d < Dv; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
  if (top == neg_inf) return;
  const __m512 inv = _mm512_set1_ps(1.f / softmax_weights(scores, first, end, top));
  for (int64_t s = first; s < end; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s]);
    for (int64_t d = 0; d < Dv; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(values + s * Dv + d), _mm512_loadu_ps(out + d)));
  }
  for (int64_t d = 0; d < Dv; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
}

using Row = void (*)(const float*, const float*, const float*, const bool*, int64_t, float, float*, float*);

Row row_kernel(int64_t D, int64_t Dv) {
  if (D != Dv) return nullptr;
  switch (D / 16) {
    case 1: return attend_row<1>;
    case 2: return attend_row<2>;
    case 3: return attend_row<3>;
    case 4: return attend_row<4>;
    case 6: return attend_row<6>;
    case 8: return attend_row<8>;
    default: return nullptr;
  }
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
  const Row fixed = row_kernel(D, Dv);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * n, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * n), h = i / n % H, query = i % n, kv = b * KV + h / group;
      const float *keys_of = kp + kv * L * D, *values_of = vp + kv * L * Dv;
      const bool* mask_of = mp + (b * n + query) * L;
      if (fixed != nullptr)
        fixed(qp + i * D, keys_of, values_of, mask_of, L, sc, scores.data(), op + i * Dv);
      else
        attend_row_any(qp + i * D, keys_of, values_of, mask_of, L, D, Dv, sc, scores.data(), op + i * Dv);
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
