// A few float32 rows times a bfloat16 weight, in float32 (AVX-512): y = x @ w.T.
//
// A bfloat16 widens to float32 exactly (its 16 bits become the high half), so the products and sums are float32's:
// the layer computes what it would with its weight upcast, reading half the bytes. 32 bfloat16s load as 16 int32
// lanes, lane i holding column 2i in its low half and column 2i + 1 in its high half: shifting left by 16 gives
// the even columns as float32, masking off the low half the odd ones. Each input row is split once per call into
// its even and odd columns per 32 (``split_columns``), so both halves meet their inputs with plain loads.
// Four weight rows are dotted at once with up to four input rows (16 accumulators); decode is one row, speculative
// verification a few. Built into the library of cpu_int.cpp (a third source; the op joins lmpress_cpu).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BF16_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

namespace {

constexpr int64_t COLUMNS = 32;  // bfloat16 columns per 512-bit load; in_features is a multiple of it
constexpr int64_t WROWS = 4;     // weight rows dotted at once
constexpr int64_t XROWS = 4;     // input rows per pass over the weight
// How far ahead of each load its weight row is prefetched: streaming SmolLM2's head from memory (not cache), one row
// at 17.8 GB/s without and 27.4 GB/s with 4.5 KiB (a one-off experiment, 2 threads on the Xeon of docs/runtime.md).
constexpr int64_t PREFETCH_BYTES = 4608;

// Row m of x as, per 32 columns, its 16 even columns then its 16 odd ones.
std::vector<float> split_columns(const float* x, int64_t M, int64_t K) {
  std::vector<float> split(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += COLUMNS)
      for (int64_t j = 0; j < COLUMNS / 2; ++j) {
        split[m * K + k + j] = x[m * K + k + 2 * j];
        split[m * K + k + COLUMNS / 2 + j] = x[m * K + k + 2 * j + 1];
      }
  return split;
}

// y[m, n0 .. n0 + R) for the M rows at xs (split) against the R weight rows at w.
template <int M, int R>
BF16_AVX512 inline void dot_rows(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, float* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < K; k += COLUMNS) {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* at = w + (n0 + r) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(at) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(at);
      even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[r] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xe = _mm512_loadu_ps(xs + m * K + k), xo = _mm512_loadu_ps(xs + m * K + k + COLUMNS / 2);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(odd[r], xo, _mm512_fmadd_ps(even[r], xe, acc[m][r]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int M>
BF16_AVX512 void rows_of(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + WROWS <= n1; n += WROWS) dot_rows<M, WROWS>(xs, w, K, N, n, y);
  for (; n < n1; ++n) dot_rows<M, 1>(xs, w, K, N, n, y);
}

using Rows = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*);
constexpr Rows ROWS_OF[XROWS] = {rows_of<1>, rows_of<2>, rows_of<3>, rows_of<4>};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "bf16_linear: x (M, K) float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear: weight (N, K) bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && K % COLUMNS == 0, "bf16_linear: in_features a multiple of 32, the same in both");
  at::Tensor y = at::empty({M, N}, x.options());
  const std::vector<float> split = split_columns(x.data_ptr<float>(), M, K);
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += XROWS) {
      const int64_t rows = std::min(XROWS, M - m);
      ROWS_OF[rows - 1](split.data() + m * K, w, K, N, n0, n1, yp + m * N);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) { m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

#endif
