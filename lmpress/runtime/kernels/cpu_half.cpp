// A few float32 rows times a bfloat16 or float16 weight, in float32 (AVX-512): y = x @ w.T.
//
// Both half types widen to float32 exactly, so the products and sums are float32's: the layer computes what it
// would with its weight widened, reading half the bytes. 32 half values load at once. float16: vcvtph2ps widens each
// 256-bit half into 16 floats, columns in order. bfloat16: as 16 int32 lanes, lane i holds column 2i in its low half
// and column 2i + 1 in its high half; shifting left by 16 gives the even columns as float32, masking off the low
// half the odd ones, so each input row is split once per call into its even and odd columns per 32
// (``split_columns``) and both meet their inputs with plain loads. Four weight rows are dotted at once with up to
// four input rows (16 accumulators); decode is one row, speculative verification a few. Built into the library of
// cpu_int.cpp (a third source; the op joins lmpress_cpu).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HALF_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

namespace {

constexpr int64_t COLUMNS = 32;  // half-precision columns per 512-bit load; in_features is a multiple of it
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

// y[m, n0 .. n0 + R) for the M rows at xs (bfloat16: split) against the R weight rows at w.
template <bool BF16, int M, int R>
HALF_AVX512 inline void dot_rows(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, float* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < K; k += COLUMNS) {
    __m512 first[R], second[R];  // bfloat16: even and odd columns; float16: columns 0-15 and 16-31
    for (int r = 0; r < R; ++r) {
      const uint16_t* at = w + (n0 + r) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(at) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(at);
      if constexpr (BF16) {
        first[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        second[r] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      } else {
        first[r] = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
        second[r] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 x0 = _mm512_loadu_ps(xs + m * K + k), x1 = _mm512_loadu_ps(xs + m * K + k + COLUMNS / 2);
      for (int r = 0; r < R; ++r)
        acc[m][r] = _mm512_fmadd_ps(second[r], x1, _mm512_fmadd_ps(first[r], x0, acc[m][r]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <bool BF16, int M>
HALF_AVX512 void rows_of(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + WROWS <= n1; n += WROWS) dot_rows<BF16, M, WROWS>(xs, w, K, N, n, y);
  for (; n < n1; ++n) dot_rows<BF16, M, 1>(xs, w, K, N, n, y);
}

using Rows = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*);
constexpr Rows BF16_ROWS[XROWS] = {rows_of<true, 1>, rows_of<true, 2>, rows_of<true, 3>, rows_of<true, 4>};
constexpr Rows F16_ROWS[XROWS] = {rows_of<false, 1>, rows_of<false, 2>, rows_of<false, 3>, rows_of<false, 4>};

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "half_linear: x (M, K) float32");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16 || weight.scalar_type() == at::kHalf) && weight.is_contiguous(),
              "half_linear: weight (N, K) bfloat16 or float16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && K % COLUMNS == 0, "half_linear: in_features a multiple of 32, the same in both");
  at::Tensor y = at::empty({M, N}, x.options());
  const std::vector<float> split = bf16 ? split_columns(x.data_ptr<float>(), M, K) : std::vector<float>();
  const float* xs = bf16 ? split.data() : x.data_ptr<float>();
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  const Rows* rows_of_m = bf16 ? BF16_ROWS : F16_ROWS;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += XROWS) {
      const int64_t rows = std::min(XROWS, M - m);
      rows_of_m[rows - 1](xs + m * K, w, K, N, n0, n1, yp + m * N);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) { m.def("half_linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("half_linear", &half_linear); }

#endif
