// lmpress's CPU kernels for 4-bit (groups of 64k) and 8-bit (per row) weights times int8-quantized activations.
//
// Activations are quantized per block of 4: q = round(x / d), d = max|x| / 127.
// A weight row is dotted with them in integers and scaled per activation block b:
//   W4: y = sum_g s_g * sum_{b in g} d_b * (dot_b(q, xq) - z_g * sum_b(xq))
//   W8: y = s * sum_b d_b * (dot_b(q, xq) - z * sum_b(xq))
// W8A8 per token (one d a row) sums in int32 across the row instead: y = float(dot(q - z, xq)) * d * s.
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

#include "cpu_quantize_acts.h"

// lane_scales: build Acts::fb (the SIMD paths of the natural layout); pairs: also Acts::qp and fp (AVX-512's W4);
// per_token: one scale a row (W4A8 and W8A8 as compressed-tensors describes them) where the kernels' own is one per
// 4 values.
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t isa, bool lane_scales, bool pairs, bool per_token,
                   Acts& a) {
  const int64_t na = K / ABLOCK;
  a.M = M, a.K = K;
  a.q.resize(M * K);
  a.d.resize(M * na);
  a.s.resize(M * na);
  for (int64_t m = 0; m < M; ++m) {
    if (per_token) {
      quantize_row_per_token(x + m * K, K, a.q.data() + m * K, a.d.data() + m * na, a.s.data() + m * na);
      continue;
    }
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

// W8A8 per token (w8_token_linear): exact int32 sums, then float(sum) * d * s as torch's W8A8 computes it.
void w8_token_rows_portable(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                            int64_t K, const Acts& a, const int32_t* xsum, int64_t m0, int64_t M, int64_t N, float* y) {
  const int64_t na = K / ABLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * K;
    for (int64_t m = m0; m < m0 + M; ++m) {
      const int8_t* xq = a.q.data() + m * K;
      int32_t dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += row[k] * xq[k];
      dot -= static_cast<int32_t>(zeros[n]) * xsum[m];
      y[m * N + n] = static_cast<float>(dot) * a.d[m * na] * scales[n];
    }
  }
}

#ifdef LMPRESS_X86

// ---- AVX2 + FMA, then AVX-512 VNNI (kept apart so each file reads in one sitting) ---------------------------------

#include "cpu_int_avx2.h"
#include "cpu_int_avx512.h"

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
template <int M>
struct W8TokenAvx2 {
  template <typename... A>
  static void run(const A&... a) { w8_token_rows_avx2<M>(a...); }
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
                     int64_t isa, int64_t prefetch, int64_t per_token) {
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
  quantize_acts(x.data_ptr<float>(), M, K, isa, isa != 0, isa == 2, per_token, buffer);
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
                         const at::Tensor& zeros, int64_t out_features, int64_t prefetch, int64_t per_token) {
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
  quantize_acts(x.data_ptr<float>(), M, K, 2, false, false, per_token, buffer);
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

// W8A8 with per-token activations: one scale d_m a row, so a row's products sum exactly in int32 across all K and
// y = float(sum (q - z) * xq) * d_m * s_n, what torch._int_mm and int8_linear.w8a8_linear compute (the same
// rounding, in the same order): the runtime then decodes the tokens the evaluator scored. AVX2 for every SIMD level
// (AVX-512 hosts have it); the per-4 scales' float sums of the other W8 paths, reordered, moved SmolLM2 W8A8's
// logits by more than the runtime agreement allows.
void w8_token_linear(const float* x, int64_t M, int64_t K, const uint8_t* c, const float* s, const uint8_t* z,
                     int64_t N, int64_t isa, int64_t prefetch, float* out) {
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  static thread_local std::vector<int32_t> sums;
  const Acts& acts = buffer;
  quantize_acts(x, M, K, isa, false, false, true, buffer);
  sums.assign(M, 0);  // sum(xq) per row: the zero point's term
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) sums[m] += acts.q[m * K + k];
  const int32_t* xsum = sums.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      const int64_t rows = std::min(ROWS, M - m0);
#ifdef LMPRESS_X86
      if (isa >= 1) {
        by_rows<W8TokenAvx2>(rows, c, s, z, n0, n1, K, acts, xsum, m0, N, out, prefetch);
        continue;
      }
#endif
      w8_token_rows_portable(c, s, z, n0, n1, K, acts, xsum, m0, rows, N, out);
    }
  });
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t isa, int64_t prefetch, int64_t per_token) {
  check(x, codes, scales, zeros, isa, prefetch);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && scales.numel() == N && zeros.numel() == N, "w8 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  if (per_token) {
    TORCH_CHECK(K <= 65536, "w8_linear per_token sums in int32: in_features at most 65536, not ", K);
    w8_token_linear(x.data_ptr<float>(), M, K, c, s, z, N, isa, prefetch, out);
    return y;
  }
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, isa, isa != 0, false, false, buffer);
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
                         const at::Tensor& zeros, int64_t out_features, int64_t prefetch, int64_t per_token) {
  check(x, codes, scales, zeros, 2, prefetch);
  TORCH_CHECK(!per_token, "w8_linear_t16: per-token activations run w8_linear's exact int32 path");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), N = out_features;
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == K / BLOCK && codes.size(2) == 16 && codes.size(3) == 64,
              "w8 t16 codes: (tiles, K / 64, 16, 64)");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == T && scales.size(1) == 16 && zeros.sizes() == scales.sizes(),
              "w8 t16 scales and zeros: (tiles, 16)");
  TORCH_CHECK(N > (T - 1) * 16 && N <= T * 16, "w8 t16 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  static thread_local Acts buffer;  // named through a local in the parallel body (see w4_linear)
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, 2, false, false, false, buffer);
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

// `bytes` of memory of its own (uninitialized), aligned to 2 MiB and advised for transparent huge pages (Linux;
// elsewhere just aligned): a weight streamed once per decode step then crosses a page (and its TLB miss) every 2 MiB
// rather than every 4 KiB. Hosts where THP is "madvise" (the default of many distributions) give huge pages only to
// memory so advised, which torch's allocator does not do.
at::Tensor huge_page_empty(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "huge_page_empty: a size in bytes, not ", bytes);
  constexpr size_t HUGE = size_t{2} << 20;
  const size_t size = std::max<size_t>(HUGE, (static_cast<size_t>(bytes) + HUGE - 1) / HUGE * HUGE);
  void* p = std::aligned_alloc(HUGE, size);
  TORCH_CHECK(p != nullptr, "huge_page_empty: out of memory for ", size, " bytes");
#ifdef __linux__
  madvise(p, size, MADV_HUGEPAGE);  // advice: where the kernel declines, the memory is still ordinary memory
#endif
  return at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

// A copy of contiguous t in huge_page_empty's memory.
at::Tensor huge_page_copy(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "huge_page_copy: a contiguous CPU tensor");
  at::Tensor block = huge_page_empty(static_cast<int64_t>(t.nbytes()));
  std::memcpy(block.data_ptr(), t.data_ptr(), t.nbytes());
  return block.view(t.scalar_type()).view(t.sizes());
}

// The activations as the kernels see them (for tests): (q as float, d per block).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa, bool per_token) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % BLOCK == 0,
              "x: contiguous float32 (M, K), K a multiple of 64");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run instruction set level ", isa);
  const int64_t M = x.size(0), K = x.size(1);
  Acts acts;
  quantize_acts(x.data_ptr<float>(), M, K, isa, false, false, per_token, acts);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / ABLOCK}, x.options());
  std::copy(acts.q.begin(), acts.q.end(), q.data_ptr<int8_t>());
  std::copy(acts.d.begin(), acts.d.end(), d.data_ptr<float>());
  return {q, d};
}

int64_t cpu_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY(lmpress_cpu, m) {
  // per_token an int (0 or 1), without a default: a graph compiled with inductor's C++ wrapper (torch 2.13) passed a
  // bool argument to these ops not at all, and the op then read a per_token that was not false (W8 layers ran per
  // token in compiled steps only).
  m.def("w4_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int isa, int prefetch, int per_token) -> "
        "Tensor");
  m.def("w8_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int isa, int prefetch, int per_token) -> "
        "Tensor");
  m.def("w4_linear_t16(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, int prefetch, "
        "int per_token) -> Tensor");
  m.def("w8_linear_t16(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, int prefetch, "
        "int per_token) -> Tensor");
  m.def("quantize_activations(Tensor x, int isa, bool per_token=False) -> (Tensor, Tensor)");
  m.def("huge_page_copy(Tensor t) -> Tensor");
  m.def("huge_page_empty(int bytes) -> Tensor", &huge_page_empty);  // no tensor in: a kernel for every key
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
