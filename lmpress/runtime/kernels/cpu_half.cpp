// A few float32 rows times a bfloat16 or float16 weight, in float32 (AVX-512 or AVX2): y = x @ w.T.
//
// Both half types widen to float32 exactly, so the products are float32's: the layer computes what it would with
// its weight widened (sums in another order), reading half the bytes. AVX-512 loads 32 half values at once.
// float16: vcvtph2ps widens each 256-bit half into 16 floats, columns in order. bfloat16: as 16 int32 lanes, lane i
// holds column 2i in its low half and column 2i + 1 in its high half; shifting left by 16 gives the even columns as
// float32, masking off the low half the odd ones, so each input row is split once per call into its even and odd
// columns per 32 (``split_columns``) and both meet their inputs with plain loads. AVX2 loads 16 half values, the
// first or second half of each 32: its even columns are the split's first 8 (or next 8) values, its odd ones
// those 16 further on, so both instruction sets read one split. ``rows`` weight rows (4 or 1) are dotted at once
// with up to four input rows; decode is one row, speculative verification a few. Each row's sum is the same chain
// of products either way, so both compute the same outputs bit for bit; which streams faster is the host's
// (cpu_probe.py). Four was tuned on a Xeon; on a Zen 4 EPYC (2 threads, the head streamed from memory) four
// interleaved rows ran at 17-23 GB/s and one row at a time at 28-30, its memory's read rate. Built into the library
// of cpu_int.cpp (a third source; the op joins lmpress_cpu). ``isa``: 2 AVX-512, 1 AVX2 (cpu_int.py's levels).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HALF_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
#define HALF_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

constexpr int64_t COLUMNS = 32;  // half-precision columns per 512-bit load; in_features is a multiple of it
constexpr int64_t XROWS = 4;     // input rows per pass over the weight
// How far ahead of each load its weight row is prefetched (the op's "prefetch"; 0: not at all), probed per host
// (cpu_probe.py). The default: streaming SmolLM2's head from memory (not cache), one row at 17.8 GB/s without and
// 27.4 GB/s with 4.5 KiB (a one-off experiment, 2 threads on the Xeon of docs/runtime.md).
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
HALF_AVX512 inline void dot_rows(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, float* y,
                                 int64_t ahead) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < K; k += COLUMNS) {
    __m512 first[R], second[R];  // bfloat16: even and odd columns; float16: columns 0-15 and 16-31
    for (int r = 0; r < R; ++r) {
      const uint16_t* at = w + (n0 + r) * K + k;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(at) + ahead, _MM_HINT_T0);
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

HALF_AVX2 inline float sum_lanes(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 twos = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(twos, _mm_shuffle_ps(twos, twos, 1)));
}

// dot_rows with 256-bit vectors: each 32 columns in two halves of 16.
template <bool BF16, int M, int R>
HALF_AVX2 inline void dot_rows_avx2(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, float* y,
                                    int64_t ahead) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < K; k += COLUMNS) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256 first[R], second[R];  // bfloat16: even and odd columns; float16: columns 0-7 and 8-15 of the half
      for (int r = 0; r < R; ++r) {
        const uint16_t* at = w + (n0 + r) * K + k + half * (COLUMNS / 2);
        if (ahead && half == 0) _mm_prefetch(reinterpret_cast<const char*>(at) + ahead, _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        if constexpr (BF16) {
          first[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          second[r] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        } else {
          first[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
          second[r] = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
        }
      }
      // bfloat16: this half's even columns sit at split offset 8 * half, its odd ones 16 further; float16: in order.
      const int64_t x0_at = BF16 ? k + half * 8 : k + half * 16, x1_at = BF16 ? x0_at + 16 : x0_at + 8;
      for (int m = 0; m < M; ++m) {
        const __m256 x0 = _mm256_loadu_ps(xs + m * K + x0_at), x1 = _mm256_loadu_ps(xs + m * K + x1_at);
        for (int r = 0; r < R; ++r)
          acc[m][r] = _mm256_fmadd_ps(second[r], x1, _mm256_fmadd_ps(first[r], x0, acc[m][r]));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n0 + r] = sum_lanes(acc[m][r]);
}

template <bool BF16, int M, int WR>
HALF_AVX512 void rows_of(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y,
                        int64_t ahead) {
  int64_t n = n0;
  for (; n + WR <= n1; n += WR) dot_rows<BF16, M, WR>(xs, w, K, N, n, y, ahead);
  for (; n < n1; ++n) dot_rows<BF16, M, 1>(xs, w, K, N, n, y, ahead);
}

template <bool BF16, int M, int WR>
HALF_AVX2 void rows_of_avx2(const float* xs, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
                            float* y, int64_t ahead) {
  int64_t n = n0;
  for (; n + WR <= n1; n += WR) dot_rows_avx2<BF16, M, WR>(xs, w, K, N, n, y, ahead);
  for (; n < n1; ++n) dot_rows_avx2<BF16, M, 1>(xs, w, K, N, n, y, ahead);
}

using Rows = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
using RowsByM = std::array<Rows, XROWS>;

template <bool AVX512, bool BF16, int WR>
constexpr RowsByM rows_by_m() {
  if constexpr (AVX512)
    return {rows_of<BF16, 1, WR>, rows_of<BF16, 2, WR>, rows_of<BF16, 3, WR>, rows_of<BF16, 4, WR>};
  else
    return {rows_of_avx2<BF16, 1, WR>, rows_of_avx2<BF16, 2, WR>, rows_of_avx2<BF16, 3, WR>,
            rows_of_avx2<BF16, 4, WR>};
}

// [AVX-512][bfloat16][four weight rows at once] -> the function per input row count.
constexpr RowsByM ROWS[2][2][2] = {
    {{rows_by_m<false, false, 1>(), rows_by_m<false, false, 4>()},
     {rows_by_m<false, true, 1>(), rows_by_m<false, true, 4>()}},
    {{rows_by_m<true, false, 1>(), rows_by_m<true, false, 4>()},
     {rows_by_m<true, true, 1>(), rows_by_m<true, true, 4>()}}};

bool runs(int64_t isa) {
  if (isa == 2) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return isa == 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight, int64_t isa, int64_t prefetch, int64_t rows) {
  TORCH_CHECK(runs(isa), "half_linear: this CPU cannot run instruction set level ", isa, " (2 AVX-512, 1 AVX2)");
  TORCH_CHECK(prefetch >= 0 && prefetch <= (int64_t{1} << 20), "prefetch: 0 to 1 MiB ahead, not ", prefetch);
  TORCH_CHECK(rows == 1 || rows == 4, "half_linear: 1 or 4 weight rows at once, not ", rows);
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
  const RowsByM& rows_of_m = ROWS[isa == 2][bf16][rows == 4];
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += XROWS) {
      const int64_t inputs = std::min(XROWS, M - m);
      rows_of_m[inputs - 1](xs + m * K, w, K, N, n0, n1, yp + m * N, prefetch);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) {
  m.def("half_linear(Tensor x, Tensor weight, int isa, int prefetch=4608, int rows=4) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("half_linear", &half_linear); }

#endif
