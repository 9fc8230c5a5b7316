// lmpress's CPU kernels for 4-bit (groups of 64k) and 8-bit (per row) weights times int8-quantized activations.
//
// Activations are quantized per block of 4: q = round(x / d), d = max|x| / 127.
// A weight row is dotted with them in integers and scaled per activation block b:
//   W4: y = sum_g s_g * sum_{b in g} d_b * (dot_b(q, xq) - z_g * sum_b(xq))
//   W8: y = s * sum_b d_b * (dot_b(q, xq) - z * sum_b(xq))
// (Blocks of 64 moved SmolLM2 W4's perplexity by +0.78%, 32 by +0.53%, 16 W8's by +0.58%, over the 0.5% the
// runtime may differ from the evaluator: docs/runtime.md.) A block of 4 is one lane of an int32 dot product
// (4 codes), so the SIMD paths apply every block's d by a per-lane vector of scales (Acts::fb, fp) at no cost over
// longer blocks; only quantizing the activations (once per call) does more work. Weight codes come in superblocks
// of 64.
// with q the unsigned code (0..15 or 0..255) and z its zero point. One pass over a weight row serves every input
// row (up to ROWS at a time: decode is one, speculative verification a few). The ISA is picked per call by the
// caller (isa: 2 = AVX-512 VNNI, 1 = AVX2 + FMA, 0 = portable C++); kernels for all three are compiled into one
// library with per-function target attributes, so one build runs on any x86-64 host.
//
// W4 layouts (repacked once at load, cpu_int.py): AVX2 and portable, per row, per superblock of 64 codes, 32 bytes;
// byte j holds code j in its low nibble and code j + 32 in its high nibble, so one 32-byte load unpacks into codes
// 0..31 and 32..63 in order. AVX-512 VNNI: outputs in lanes, 16 rows per tile ("t16", w4_tiles_avx512): with 4 rows
// (speculative verification) the natural layout spent two conversions and three float operations besides its two dot
// products per 128 codes of a weight row and input row, plus a reduction across lanes per output and input row; in
// lanes, one dot product, one conversion and one multiply-add per 64 codes (4 codes of 16 weight rows) and input
// row, the group scale once per 64-block, 16 weight rows and input row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMPRESS_X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

constexpr int64_t BLOCK = 64;  // weight superblock: W4's groups and K are multiples of it
constexpr int64_t ABLOCK = 4;  // activation block: one scale d per 4 values (one int32 lane of a dot product)
constexpr int64_t APER = BLOCK / ABLOCK;  // activation blocks per 64 codes
constexpr int64_t ROWS = 8;
// How far ahead of the weights being dotted the SIMD kernels prefetch ("ahead_bytes"; 0: no prefetch instructions),
// an argument of every op: the best distance differs between hosts and is probed per host (cpu_tuning.py).
constexpr int64_t PREFETCH_BYTES = 4096;  // the ops' default

inline int64_t rows_ahead(int64_t row_bytes, int64_t ahead_bytes) {
  return std::max<int64_t>(1, ahead_bytes / row_bytes);
}

struct Acts {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;   // (M, K)
  std::vector<float> d;    // (M, K / ABLOCK): the block's scale
  std::vector<float> s;    // (M, K / ABLOCK): d * sum(q) over the block
  std::vector<float> fb;   // SIMD only: per 64 codes, 16 lanes: lane i the d of codes 4i..4i+3
  std::vector<int8_t> qp;  // AVX-512 W4 only: q with each pair of 64-blocks as [a 0:32, b 0:32, a 32:64, b 32:64]
  std::vector<float> fp;   // AVX-512 W4 only: per pair of 64-blocks, 32 lanes: the d of each lane's 4 codes in qp
};

// One block: scale d = max|x| / 127 and codes round-half-even(x * (1 / d)); returns sum(q).
int32_t quantize_block_portable(const float* x, int8_t* q, float* d) {
  float amax = 0.f;
  for (int64_t i = 0; i < ABLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
  *d = amax / 127.f;
  const float inv = *d > 0.f ? 1.f / *d : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < ABLOCK; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

// 16 values (16 / ABLOCK blocks): codes q, each block's d and s = d * sum(q).
void quantize16_portable(const float* x, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < 16 / ABLOCK; ++b)
    s[b] = static_cast<float>(quantize_block_portable(x + b * ABLOCK, q + b * ABLOCK, d + b)) * d[b];
}

#ifdef LMPRESS_X86
static_assert(ABLOCK == 4, "the SIMD quantizers take blocks of 4 (one per 128-bit lane)");

TARGET_AVX512 void quantize16_avx512(const float* x, int8_t* q, float* d, float* s) {
  const __m512 v = _mm512_loadu_ps(x);
  __m512 a = _mm512_abs_ps(v);
  a = _mm512_max_ps(a, _mm512_permute_ps(a, 0xB1));  // max of each 4 (a 128-bit lane) in all 4
  a = _mm512_max_ps(a, _mm512_permute_ps(a, 0x4E));
  const __m512 dv = _mm512_div_ps(a, _mm512_set1_ps(127.f));
  const __mmask16 nonzero = _mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.f), dv);
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // round to nearest even (MXCSR default)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(r));
  __m512i t = _mm512_add_epi32(r, _mm512_shuffle_epi32(r, static_cast<_MM_PERM_ENUM>(0xB1)));
  t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, static_cast<_MM_PERM_ENUM>(0x4E)));
  _mm512_mask_compressstoreu_ps(d, 0x1111, dv);
  _mm512_mask_compressstoreu_ps(s, 0x1111, _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv));
}

TARGET_AVX2 void quantize16_avx2(const float* x, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int h = 0; h < 2; ++h) {
    const __m256 v = _mm256_loadu_ps(x + 8 * h);
    __m256 a = _mm256_andnot_ps(sign, v);
    a = _mm256_max_ps(a, _mm256_permute_ps(a, 0xB1));
    a = _mm256_max_ps(a, _mm256_permute_ps(a, 0x4E));
    const __m256 dv = _mm256_div_ps(a, _mm256_set1_ps(127.f));
    const __m256 nonzero = _mm256_cmp_ps(dv, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), dv), nonzero);
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
    __m256i t = _mm256_add_epi32(r, _mm256_shuffle_epi32(r, 0xB1));
    t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
    alignas(32) int32_t codes[8];
    alignas(32) float ds[8], ss[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), r);
    _mm256_store_ps(ds, dv);
    _mm256_store_ps(ss, _mm256_mul_ps(_mm256_cvtepi32_ps(t), dv));
    for (int i = 0; i < 8; ++i) q[8 * h + i] = static_cast<int8_t>(codes[i]);
    d[2 * h] = ds[0], d[2 * h + 1] = ds[4];
    s[2 * h] = ss[0], s[2 * h + 1] = ss[4];
  }
}
#endif

// lane_scales: build Acts::fb (the SIMD paths of the natural layout); pairs: also Acts::qp and fp (AVX-512's W4).
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t isa, bool lane_scales, bool pairs, Acts& a) {
  const int64_t na = K / ABLOCK;
  a.M = M, a.K = K;
  a.q.resize(M * K);
  a.d.resize(M * na);
  a.s.resize(M * na);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < K / 16; ++c) {
      const float* xc = x + m * K + c * 16;
      int8_t* qc = a.q.data() + m * K + c * 16;
      float* d = a.d.data() + m * na + c * (16 / ABLOCK);
      float* s = a.s.data() + m * na + c * (16 / ABLOCK);
#ifdef LMPRESS_X86
      if (isa == 2)
        quantize16_avx512(xc, qc, d, s);
      else if (isa == 1)
        quantize16_avx2(xc, qc, d, s);
      else
#endif
        quantize16_portable(xc, qc, d, s);
    }
  }
  if (!lane_scales) return;
  const int64_t nb = K / BLOCK;
  a.fb.resize(M * nb * 16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < 16; ++i) a.fb[(m * nb + b) * 16 + i] = a.d[m * na + b * APER + 4 * i / ABLOCK];
  if (!pairs) return;
  const int64_t np = nb / 2;
  a.qp.resize(M * K);
  a.fp.resize(M * std::max<int64_t>(np, 1) * 32);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = a.q.data() + m * K;
    int8_t* qp = a.qp.data() + m * K;
    const float* d = a.d.data() + m * na;
    for (int64_t p = 0; p < np; ++p) {
      const int8_t* blk = q + p * 2 * BLOCK;
      int8_t* out = qp + p * 2 * BLOCK;
      std::copy(blk, blk + 32, out);
      std::copy(blk + 64, blk + 96, out + 32);
      std::copy(blk + 32, blk + 64, out + 64);
      std::copy(blk + 96, blk + 128, out + 96);
      float* f = a.fp.data() + (m * np + p) * 32;
      for (int64_t j = 0; j < 32; ++j) {  // lanes 0-15 (low nibbles): codes 0:32 of a, of b; 16-31: codes 32:64
        const int64_t half = j / 16, block = 2 * p + (j % 16) / 8, code = 32 * half + 4 * (j % 8);
        f[j] = d[block * APER + code / ABLOCK];
      }
    }
    std::copy(q + np * 2 * BLOCK, q + K, qp + np * 2 * BLOCK);  // an odd last block stays as it is
  }
}

// sum over the activation blocks of each group of d * sum(q): the zero point's term, (M, G).
void group_sums(const Acts& a, int64_t G, std::vector<float>& out) {
  const int64_t na = a.K / ABLOCK, spg = na / G;
  out.assign(a.M * G, 0.f);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = 0; b < na; ++b) out[m * G + b / spg] += a.s[m * na + b];
}

// The group of 64-block b: a shift where the blocks per group are a power of two (a 64-bit division per block
// would cost more than the block's arithmetic).
inline int64_t log2_or_minus1(int64_t v) {
  int64_t k = 0;
  while ((int64_t{1} << k) < v) ++k;
  return (int64_t{1} << k) == v ? k : -1;
}

inline int64_t group_of(int64_t b, int64_t spg, int64_t shift) { return shift >= 0 ? b >> shift : b / spg; }

// ---- portable ----------------------------------------------------------------------------------------------------

void w4_rows_portable(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                      int64_t K, int64_t G, const Acts& a, const float* zsum, int64_t m0, int64_t M, int64_t N,
                      float* y) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK, spg = nb / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    for (int64_t m = m0; m < m0 + M; ++m) {
      const int8_t* xq = a.q.data() + m * K;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot[APER] = {};  // per activation block of the 64 codes (low nibbles: codes 0:32, high: 32:64)
        for (int64_t j = 0; j < 32; ++j) {
          const uint8_t byte = row[b * 32 + j];
          dot[j / ABLOCK] += (byte & 0x0F) * xq[b * BLOCK + j];
          dot[(32 + j) / ABLOCK] += (byte >> 4) * xq[b * BLOCK + 32 + j];
        }
        const float* d = a.d.data() + m * na + APER * b;
        float block = 0.f;
        for (int64_t j = 0; j < APER; ++j) block += d[j] * static_cast<float>(dot[j]);
        acc += scales[n * G + b / spg] * block;
      }
      for (int64_t g = 0; g < G; ++g) acc -= scales[n * G + g] * static_cast<float>(zeros[n * G + g]) * zsum[m * G + g];
      y[m * N + n] = acc;
    }
  }
}

void w8_rows_portable(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                      int64_t K, const Acts& a, int64_t m0, int64_t M, int64_t N, float* y) {
  const int64_t na = K / ABLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * K;
    for (int64_t m = m0; m < m0 + M; ++m) {
      const int8_t* xq = a.q.data() + m * K;
      float acc = 0.f, xs = 0.f;
      for (int64_t b = 0; b < na; ++b) {
        int32_t dot = 0;
        for (int64_t j = 0; j < ABLOCK; ++j) dot += row[b * ABLOCK + j] * xq[b * ABLOCK + j];
        acc += a.d[m * na + b] * static_cast<float>(dot);
        xs += a.s[m * na + b];
      }
      y[m * N + n] = scales[n] * (acc - static_cast<float>(zeros[n]) * xs);
    }
  }
}

#ifdef LMPRESS_X86

// ---- AVX2 + FMA --------------------------------------------------------------------------------------------------

TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The zero points' term, scale x zero x (the group's d * sum(q)): subtracted from M rows' lanes 8 groups at a time;
// what is left of the last 8 (fewer) returned per row in tail[m], to subtract after the lane sum (a scalar loop, as
// staging it through memory into a vector stalls on the store).
template <int M>
TARGET_AVX2 inline void subtract_zero_term_avx2(const float* sc, const uint8_t* zeros, const float* zs, int64_t G,
                                                __m256* acc, float* tail) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 z =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + g))));
    const __m256 sz = _mm256_mul_ps(_mm256_loadu_ps(sc + g), z);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fnmadd_ps(sz, _mm256_loadu_ps(zs + m * G + g), acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    tail[m] = 0.f;
    for (int64_t i = g; i < G; ++i) tail[m] += sc[i] * static_cast<float>(zeros[i]) * zs[m * G + i];
  }
}

// R weight rows per pass over the M input rows' activations: decode (M = 1, 2) dots 2 rows at once, sharing each
// 64-block's activation loads (codes and per-4 scales) between them; more input rows take one weight row at a time
// (their accumulators fill the 16 registers). Each weight row is prefetched ahead_bytes ahead.
template <int M, int R>
TARGET_AVX2 void w4_rows_avx2_by(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0,
                                 int64_t n1, int64_t K, int64_t G, const Acts& a, const float* zsum, int64_t m0,
                                 int64_t N, float* y, int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, spg = nb / G, shift = log2_or_minus1(spg);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq = a.q.data() + m0 * K;
  const float* xf = a.fb.data() + m0 * nb * 16;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* row[R];
    const float* sc[R];
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r) {
      row[r] = codes + (n + r) * (K / 2);
      sc[r] = scales + (n + r) * G;
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < R; ++r) {
        if (ahead_bytes && (b & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(row[r] + b * 32) + ahead_bytes, _MM_HINT_T0);
        const __m256 s = _mm256_set1_ps(sc[r][group_of(b, spg, shift)]);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + b * 32));
        const __m256i lo = _mm256_and_si256(w, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xq + m * K + b * BLOCK;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
          const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones));
          const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones));
          const float* f = xf + (m * nb + b) * 16;  // lane i of d0 sums codes 4i..4i+3: one block of 4
          const __m256 dot = _mm256_fmadd_ps(d1, _mm256_loadu_ps(f + 8), _mm256_mul_ps(d0, _mm256_loadu_ps(f)));
          acc[r][m] = _mm256_fmadd_ps(dot, s, acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float tail[M];
      subtract_zero_term_avx2<M>(sc[r], zeros + (n + r) * G, zsum + m0 * G, G, acc[r], tail);
      for (int m = 0; m < M; ++m) y[(m0 + m) * N + n + r] = hsum256(acc[r][m]) - tail[m];
    }
  }
  if (n < n1) w4_rows_avx2_by<M, 1>(codes, scales, zeros, n, n1, K, G, a, zsum, m0, N, y, ahead_bytes);
}

template <int M>
TARGET_AVX2 void w4_rows_avx2(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                              int64_t K, int64_t G, const Acts& a, const float* zsum, int64_t m0, int64_t N, float* y,
                              int64_t ahead_bytes) {
  w4_rows_avx2_by<M, (M <= 2 ? 2 : 1)>(codes, scales, zeros, n0, n1, K, G, a, zsum, m0, N, y, ahead_bytes);
}

template <int M>
TARGET_AVX2 void w8_rows_avx2(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                              int64_t K, const Acts& a, int64_t m0, int64_t N, float* y, int64_t ahead_bytes) {
  // maddubs takes unsigned x signed bytes into saturating int16 pairs: 255 * 127 * 2 overflows, so the codes go in
  // as q - 128 (signed) through the sign trick: |w| * sign(x, w) = w * x, at most 128 * 127 * 2 per pair.
  const int64_t nb = K / BLOCK, na = K / ABLOCK;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  float xs[M];  // sum of d * sum(q) over the row's blocks: the zero point's term
  for (int m = 0; m < M; ++m) {
    xs[m] = 0.f;
    for (int64_t b = 0; b < na; ++b) xs[m] += a.s[(m0 + m) * na + b];
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(row + b * BLOCK) + ahead_bytes, _MM_HINT_T0);
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * BLOCK)), flip);
      const __m256i w1 =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * BLOCK + 32)), flip);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = a.q.data() + (m0 + m) * K + b * BLOCK;
        const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), w0);
        const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)), w1);
        const float* f = a.fb.data() + ((m0 + m) * nb + b) * 16;
        const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, x0), ones));
        const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a1, x1), ones));
        acc[m] = _mm256_fmadd_ps(d0, _mm256_loadu_ps(f), acc[m]);
        acc[m] = _mm256_fmadd_ps(d1, _mm256_loadu_ps(f + 8), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)  // sum d * dot(q - 128, x) + 128 * xs = sum d * dot(q, x)
      y[(m0 + m) * N + n] = scales[n] * (hsum256(acc[m]) + (128.f - static_cast<float>(zeros[n])) * xs[m]);
  }
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------------------------

// The lane sums of up to 4 rows' accumulators, each by the same tree whatever the other slots hold (so a row's result
// does not depend on how many rows share the pass): 128-bit blocks 0+2 and 1+3, their sum, then within the block.
// 13 operations for 4 rows where one reduction per row takes 8.
TARGET_AVX512 inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  _mm512_mask_compressstoreu_ps(out, 0x1111, u);  // lane 0 of each block: rows a, b, c, d
}

// One row's sum by reduce4's tree (IEEE addition commutes, so a2 + a0 is a0 + a2): 8 operations where reduce4 with
// three empty slots takes 13.
TARGET_AVX512 inline float reduce1(__m512 a) {
  __m512 u = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4E));  // blocks 0+2, 1+3
  u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  return _mm512_cvtss_f32(u);
}

template <int M>
TARGET_AVX512 inline void reduce_rows(const __m512* acc, float* sums) {
  const __m512 z = _mm512_setzero_ps();
  int m = 0;
  for (; m + 1 < M; m += 4)
    reduce4(acc[m], acc[m + 1], m + 2 < M ? acc[m + 2] : z, m + 3 < M ? acc[m + 3] : z, sums + m);
  if (m < M) sums[m] = reduce1(acc[m]);
}

// Two blocks (128 codes, 64 bytes) per step: the low nibbles are codes 0:32 of both, the high ones 32:64, against the
// activations arranged as Acts::qp; in each product the lanes 0-7 sum block a's 32 codes, 8-15 block b's, each
// scaled by its activation block's d (Acts::fp). The zero points' term, scale x zero x (the group's d * sum(q)), is
// subtracted from the lanes 16 groups at a time.
template <int M>
TARGET_AVX512 void w4_rows_avx512(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0,
                                  int64_t n1, int64_t K, int64_t G, const Acts& a, const float* zsum, int64_t m0,
                                  int64_t N, float* y, int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, spg = nb / G, np = nb / 2, shift = log2_or_minus1(spg);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xq = a.qp.data() + m0 * K;
  const float* xf = a.fp.data() + m0 * std::max<int64_t>(np, 1) * 32;
  const float* xb = a.fb.data() + m0 * nb * 16;
  const float* zs = zsum + m0 * G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const float* sc = scales + n * G;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* ahead = codes + std::min(n + rows_ahead(K / 2, ahead_bytes), n1 - 1) * (K / 2);
    for (int64_t p = 0; p < np; ++p) {
      if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 64), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(row + p * 64);
      const __m512i lo = _mm512_and_si512(w, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sc[group_of(2 * p, spg, shift)]),
                                          _mm256_set1_ps(sc[group_of(2 * p + 1, spg, shift)]), 1);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xq + m * K + p * 2 * BLOCK;
        const float* f = xf + (m * np + p) * 32;
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 64));
        const __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(d0), _mm512_loadu_ps(f));
        acc[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_loadu_ps(f + 16), f0), s, acc[m]);
      }
    }
    if (nb % 2) {  // the odd last block, 256 bits wide
      const int64_t b = nb - 1;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
      const __m256i l4 = _mm256_set1_epi8(0x0F);
      const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, l4)),
                                            _mm256_and_si256(_mm256_srli_epi16(w, 4), l4), 1);
      const __m512 s = _mm512_set1_ps(sc[group_of(b, spg, shift)]);
      for (int m = 0; m < M; ++m) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xq + m * K + b * BLOCK));
        const __m512 f = _mm512_mul_ps(_mm512_loadu_ps(xb + (m * nb + b) * 16), s);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), f, acc[m]);
      }
    }
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, zeros + n * G + g)));
      const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + g), z);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fnmadd_ps(sz, _mm512_maskz_loadu_ps(k, zs + m * G + g), acc[m]);
    }
    float sums[(M + 3) / 4 * 4];
    reduce_rows<M>(acc, sums);
    for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = sums[m];
  }
}

template <int M>
TARGET_AVX512 void w8_rows_avx512(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0,
                                  int64_t n1, int64_t K, const Acts& a, int64_t m0, int64_t N, float* y,
                                  int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK;
  float xs[M];
  for (int m = 0; m < M; ++m) {
    xs[m] = 0.f;
    for (int64_t b = 0; b < na; ++b) xs[m] += a.s[(m0 + m) * na + b];
  }
  const int8_t* xq = a.q.data() + m0 * K;
  const float* xf = a.fb.data() + m0 * nb * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* ahead = codes + std::min(n + rows_ahead(K, ahead_bytes), n1 - 1) * K;
    for (int64_t b = 0; b < nb; ++b) {
      if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(ahead + b * BLOCK), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(row + b * BLOCK);
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(xq + m * K + b * BLOCK);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_loadu_ps(xf + (m * nb + b) * 16), acc[m]);
      }
    }
    float sums[(M + 3) / 4 * 4];
    reduce_rows<M>(acc, sums);
    for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = scales[n] * (sums[m] - static_cast<float>(zeros[n]) * xs[m]);
  }
}

// W4, outputs in lanes (layout "t16", repack_w4_t16 in cpu_int.py): 16 output rows per tile; per tile, per 64-block,
// 8 vectors of 64 bytes, vector j's byte 4l + i holding code 4j + i of the tile's row l (low nibble) and code
// 32 + 4j + i (high nibble). Each nibble half is one step: 4 codes of 16 rows against 4 activations broadcast, one
// vpdpbusd; the step's int32 lanes scaled by the activation block's d (a broadcast), so a row's 16 outputs build up
// in one vector: no reductions across lanes, and the group scale (a vector over the 16 rows) is applied once per
// 64-block rather than per pair of blocks and row of weights. Scales and zeros are stored (tiles, G, 16).
template <int M>
TARGET_AVX512 void w4_tiles_avx512(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t t0,
                                   int64_t t1, int64_t K, int64_t G, const Acts& a, const float* zsum, int64_t m0,
                                   int64_t N, float* y, int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK, spg = nb / G, shift = log2_or_minus1(spg);
  const int64_t tile_bytes = nb * 8 * 64;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xq = a.q.data() + m0 * K;
  const float* xd = a.d.data() + m0 * na;
  const float* zs = zsum + m0 * G;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * tile_bytes;
    const int64_t t_ahead = std::min(t + rows_ahead(tile_bytes, ahead_bytes), t1 - 1);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      // The high nibbles go in unshifted, as 16 times their codes (at most 240 x 128 x 4 per int32 lane), and their
      // sum is scaled by 1/16 (exact) once per block: a shift per 128 codes less on the port that also runs every
      // vpdpbusd and conversion. Two sums per row (low, high) also halve the chain of dependent multiply-adds.
      __m512 part[M], part_hi[M];
      for (int m = 0; m < M; ++m) part[m] = part_hi[m] = _mm512_setzero_ps();
      const uint8_t* blk = tile + b * 512;
      for (int64_t j = 0; j < 8; ++j) {
        if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead_bytes + j * 64), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(blk + j * 64);
        const __m512i lo = _mm512_and_si512(w, low);
        const __m512i hi = _mm512_andnot_si512(low, w);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xq + m * K + b * BLOCK + 4 * j;
          const float* d = xd + m * na + b * APER + j;
          int32_t x0, x1;
          std::memcpy(&x0, x, 4);
          std::memcpy(&x1, x + 32, 4);
          const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi32(x0));
          const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_set1_epi32(x1));
          part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(d[0]), part[m]);
          part_hi[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_set1_ps(d[32 / ABLOCK]), part_hi[m]);
        }
      }
      const int64_t g = group_of(b, spg, shift);
      if (ahead_bytes) {
        _mm_prefetch(reinterpret_cast<const char*>(scales + (t_ahead * G + g) * 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(zeros + (t_ahead * G + g) * 16), _MM_HINT_T0);
      }
      const __m512 sv = _mm512_loadu_ps(scales + (t * G + g) * 16);
      const bool last = spg == 1 || (b + 1) % spg == 0;  // the group's zero term once, after its last block
      const __m512 sz = last ? _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                                       reinterpret_cast<const __m128i*>(zeros + (t * G + g) * 16)))))
                             : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(part_hi[m], _mm512_set1_ps(1.f / 16), part[m]), sv, acc[m]);
        if (last) acc[m] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(zs[m * G + g]), acc[m]);
      }
    }
    const int64_t valid = std::min<int64_t>(16, N - t * 16);
    const __mmask16 k = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + t * 16, k, acc[m]);
  }
}

// W8 per row, outputs in lanes (layout "t16", repack_w8_t16 in cpu_int.py): 16 output rows per tile; per tile, per
// 64-block, 16 vectors of 64 bytes, vector j's byte 4l + i holding code 4j + i of the tile's row l. One vpdpbusd per
// 4 codes of 16 rows, scaled by the activation block's d (a broadcast); no reductions across lanes. Scales and zeros
// (tiles, 16).
template <int M>
TARGET_AVX512 void w8_tiles_avx512(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t t0,
                                   int64_t t1, int64_t K, const Acts& a, int64_t m0, int64_t N, float* y,
                                   int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK, tile_bytes = nb * 16 * 64;
  float xs[M];  // sum of d * sum(q) over the row's blocks: the zero point's term
  for (int m = 0; m < M; ++m) {
    xs[m] = 0.f;
    for (int64_t b = 0; b < na; ++b) xs[m] += a.s[(m0 + m) * na + b];
  }
  const int8_t* xq = a.q.data() + m0 * K;
  const float* xd = a.d.data() + m0 * na;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * tile_bytes;
    const uint8_t* ahead = tile + ahead_bytes;  // tiles follow each other in memory (a prefetch never faults)
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb * 16; ++j) {  // 4 codes of the 16 rows per step
      if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * 64), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(tile + j * 64);
      for (int m = 0; m < M; ++m) {
        int32_t x4;
        std::memcpy(&x4, xq + m * K + 4 * j, 4);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_set1_epi32(x4));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(xd[m * na + j]), acc[m]);
      }
    }
    const __m512 sv = _mm512_loadu_ps(scales + t * 16);
    const __m512 zv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + t * 16))));
    const int64_t valid = std::min<int64_t>(16, N - t * 16);
    const __mmask16 k = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int m = 0; m < M; ++m)
      _mm512_mask_storeu_ps(y + (m0 + m) * N + t * 16, k,
                            _mm512_mul_ps(sv, _mm512_fnmadd_ps(zv, _mm512_set1_ps(xs[m]), acc[m])));
  }
}

#endif  // LMPRESS_X86

// ---- dispatch ----------------------------------------------------------------------------------------------------

template <template <int> class F, typename... Args>
void by_rows(int64_t M, const Args&... args) {
  switch (M) {
    case 1: return F<1>::run(args...);
    case 2: return F<2>::run(args...);
    case 3: return F<3>::run(args...);
    case 4: return F<4>::run(args...);
    case 5: return F<5>::run(args...);
    case 6: return F<6>::run(args...);
    case 7: return F<7>::run(args...);
    default: return F<8>::run(args...);
  }
}

#ifdef LMPRESS_X86
template <int M>
struct W4Avx512 {
  template <typename... A>
  static void run(const A&... a) { w4_rows_avx512<M>(a...); }
};
template <int M>
struct W4TilesAvx512 {
  template <typename... A>
  static void run(const A&... a) { w4_tiles_avx512<M>(a...); }
};
template <int M>
struct W8TilesAvx512 {
  template <typename... A>
  static void run(const A&... a) { w8_tiles_avx512<M>(a...); }
};
template <int M>
struct W4Avx2 {
  template <typename... A>
  static void run(const A&... a) { w4_rows_avx2<M>(a...); }
};
template <int M>
struct W8Avx512 {
  template <typename... A>
  static void run(const A&... a) { w8_rows_avx512<M>(a...); }
};
template <int M>
struct W8Avx2 {
  template <typename... A>
  static void run(const A&... a) { w8_rows_avx2<M>(a...); }
};
#endif

int64_t detect_isa() {
#ifdef LMPRESS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

int64_t best_isa() {
  static const int64_t level = detect_isa();
  return level;
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
           int64_t isa, int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0 && prefetch <= (int64_t{1} << 20), "prefetch: 0 to 1 MiB ahead, not ", prefetch);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales: contiguous float32");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous(), "zeros: contiguous uint8");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run instruction set level ", isa);
}

at::Tensor w4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t isa, int64_t prefetch) {
  check(x, codes, scales, zeros, isa, prefetch);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  TORCH_CHECK(codes.size(1) == K / 2 && scales.size(0) == N && zeros.sizes() == scales.sizes(), "w4 shapes");
  TORCH_CHECK(G > 0 && (K / BLOCK) % G == 0, "w4 groups must be multiples of 64 columns");
  at::Tensor y = at::empty({M, N}, x.options());
  // Buffers kept per calling thread: a decode step calls this some hundred times with the same sizes.
  // The parallel body names them through these locals: in another thread the thread_local names would be its own.
  static thread_local Acts buffer;
  static thread_local std::vector<float> zsums;
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, isa, isa != 0, isa == 2, buffer);
  group_sums(acts, G, zsums);
  const float* zsum = zsums.data();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      const int64_t rows = std::min(ROWS, M - m0);
#ifdef LMPRESS_X86
      if (isa == 2) {
        by_rows<W4Avx512>(rows, c, s, z, n0, n1, K, G, acts, zsum, m0, N, out, prefetch);
        continue;
      }
      if (isa == 1) {
        by_rows<W4Avx2>(rows, c, s, z, n0, n1, K, G, acts, zsum, m0, N, out, prefetch);
        continue;
      }
#endif
      w4_rows_portable(c, s, z, n0, n1, K, G, acts, zsum, m0, rows, N, out);
    }
  });
  return y;
}

// W4 in the "t16" layout (AVX-512 VNNI only): codes (tiles, K / 64, 8, 64), scales (tiles, G, 16) float32, zeros
// (tiles, G, 16) uint8, rows past out_features padded (scale 0).
at::Tensor w4_linear_t16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& zeros, int64_t out_features, int64_t prefetch) {
  check(x, codes, scales, zeros, 2, prefetch);
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = scales.size(1), N = out_features;
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == K / BLOCK && codes.size(2) == 8 && codes.size(3) == 64,
              "w4 t16 codes: (tiles, K / 64, 8, 64)");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == T && scales.size(2) == 16 && zeros.sizes() == scales.sizes(),
              "w4 t16 scales and zeros: (tiles, G, 16)");
  TORCH_CHECK(G > 0 && (K / BLOCK) % G == 0 && N > (T - 1) * 16 && N <= T * 16, "w4 t16 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  static thread_local std::vector<float> zsums;
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, 2, false, false, buffer);
  group_sums(acts, G, zsums);
  const float* zsum = zsums.data();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
#ifdef LMPRESS_X86
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS)
      by_rows<W4TilesAvx512>(std::min(ROWS, M - m0), c, s, z, t0, t1, K, G, acts, zsum, m0, N, out, prefetch);
  });
#endif
  return y;
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t isa, int64_t prefetch) {
  check(x, codes, scales, zeros, isa, prefetch);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && scales.numel() == N && zeros.numel() == N, "w8 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, isa, isa != 0, false, buffer);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      const int64_t rows = std::min(ROWS, M - m0);
#ifdef LMPRESS_X86
      if (isa == 2) {
        by_rows<W8Avx512>(rows, c, s, z, n0, n1, K, acts, m0, N, out, prefetch);
        continue;
      }
      if (isa == 1) {
        by_rows<W8Avx2>(rows, c, s, z, n0, n1, K, acts, m0, N, out, prefetch);
        continue;
      }
#endif
      w8_rows_portable(c, s, z, n0, n1, K, acts, m0, rows, N, out);
    }
  });
  return y;
}

// W8 in the "t16" layout (AVX-512 VNNI only): codes (tiles, K / 64, 16, 64), scales (tiles, 16) float32, zeros
// (tiles, 16) uint8, rows past out_features padded.
at::Tensor w8_linear_t16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& zeros, int64_t out_features, int64_t prefetch) {
  check(x, codes, scales, zeros, 2, prefetch);
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), N = out_features;
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == K / BLOCK && codes.size(2) == 16 && codes.size(3) == 64,
              "w8 t16 codes: (tiles, K / 64, 16, 64)");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == T && scales.size(1) == 16 && zeros.sizes() == scales.sizes(),
              "w8 t16 scales and zeros: (tiles, 16)");
  TORCH_CHECK(N > (T - 1) * 16 && N <= T * 16, "w8 t16 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, 2, false, false, buffer);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
#ifdef LMPRESS_X86
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS)
      by_rows<W8TilesAvx512>(std::min(ROWS, M - m0), c, s, z, t0, t1, K, acts, m0, N, out, prefetch);
  });
#endif
  return y;
}

// A copy of contiguous t in memory of its own, aligned to 2 MiB and advised for transparent huge pages (Linux;
// elsewhere just aligned): a weight streamed once per decode step then crosses a page (and its TLB miss) every 2 MiB
// rather than every 4 KiB. Hosts where THP is "madvise" (the default of many distributions) give huge pages only to
// memory so advised, which torch's allocator does not do.
at::Tensor huge_page_copy(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "huge_page_copy: a contiguous CPU tensor");
  constexpr size_t HUGE = size_t{2} << 20;
  const size_t bytes = t.nbytes(), size = std::max<size_t>(HUGE, (bytes + HUGE - 1) / HUGE * HUGE);
  void* p = std::aligned_alloc(HUGE, size);
  TORCH_CHECK(p != nullptr, "huge_page_copy: out of memory for ", size, " bytes");
#ifdef __linux__
  madvise(p, size, MADV_HUGEPAGE);  // advice: where the kernel declines, the memory is still ordinary memory
#endif
  std::memcpy(p, t.data_ptr(), bytes);
  return at::from_blob(p, t.sizes(), t.strides(), [](void* q) { std::free(q); }, t.options());
}

// The activations as the kernels see them (for tests): (q as float, d per block).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % BLOCK == 0,
              "x: contiguous float32 (M, K), K a multiple of 64");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run instruction set level ", isa);
  const int64_t M = x.size(0), K = x.size(1);
  Acts acts;
  quantize_acts(x.data_ptr<float>(), M, K, isa, false, false, acts);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / ABLOCK}, x.options());
  std::copy(acts.q.begin(), acts.q.end(), q.data_ptr<int8_t>());
  std::copy(acts.d.begin(), acts.d.end(), d.data_ptr<float>());
  return {q, d};
}

int64_t cpu_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY(lmpress_cpu, m) {
  m.def("w4_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int isa, int prefetch=4096) -> Tensor");
  m.def("w8_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int isa, int prefetch=4096) -> Tensor");
  m.def("w4_linear_t16(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, int prefetch=4096) -> "
        "Tensor");
  m.def("w8_linear_t16(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, int prefetch=4096) -> "
        "Tensor");
  m.def("quantize_activations(Tensor x, int isa) -> (Tensor, Tensor)");
  m.def("huge_page_copy(Tensor t) -> Tensor");
  m.def("cpu_isa", &cpu_isa);
}

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) {
  m.impl("w4_linear", &w4_linear);
  m.impl("w8_linear", &w8_linear);
  m.impl("w4_linear_t16", &w4_linear_t16);
  m.impl("w8_linear_t16", &w8_linear_t16);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("huge_page_copy", &huge_page_copy);
}
