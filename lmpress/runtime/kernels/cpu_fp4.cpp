// FP4 weights (NVFP4, MXFP4) times int8-quantized activations on the CPU: y = x W^T, for decode (cpu_fp4.py).
//
// The W4 kernels of cpu_int.cpp with one more step. Activations are quantized exactly as there (int8 per block of 4,
// d = max|x| / 127, round half to even), so the two are comparable. Each weight nibble is an E2M1 code
// (sign << 3 | index into 0, .5, 1, 1.5, 2, 3, 4, 6); a 16-entry byte lookup (vpshufb) turns it into the unsigned
// integer u = 2 * e2m1 + 12, in 0..24, which the unsigned x signed int8 dot products take (vpdpbusd, vpmaddubsw;
// 24 * 127 * 2 fits vpmaddubsw's int16 pairs). The offset 12 is taken out per activation block as the W4 kernels
// take out their zero points: dot(u, q) - 12 * sum(q). Per weight block (16 columns for NVFP4, 32 for MXFP4):
//   y = row_scale * 1/2 * sum_blocks scale_blk * sum_{activation blocks b in blk} d_b * (dot_b(u, q) - 12 * sum_b(q))
// with scale_blk the block's E4M3 value (NVFP4) or 2^(e - 127) (MXFP4, an E8M0 byte) and row_scale the output
// row's 1 / global_scale (NVFP4; 1 for MXFP4). Block scales stay the checkpoint's bytes (4.5 and 4.25 bits per
// weight in all), decoded in the kernel.
//
// Layouts (repacked once at load, cpu_fp4.py), scales (out, in / block) bytes as stored:
//   AVX2 and portable ("wide", cpu_fp4.repack_fp4): per row, superblocks of 8 blocks (128 columns for NVFP4, 256 for
//   MXFP4; 4 * block bytes), then 64-column superblocks for the columns left (in / 64 is all that K promises). A
//   superblock's 32-byte vectors v hold, at byte 4i + c, int32 lane i's codes of two "steps" (s = 2v: low nibbles,
//   2v + 1: high). Lane i of every step belongs to block i mod nb of the superblock's nb blocks, at the block's
//   columns 4r + c, r = (i / nb) * steps + s. So one vector of scales (lane i: block i mod nb) multiplies a
//   superblock's lane sums once, as the W4 kernel's group scale does: the natural order (byte j: column j low,
//   j + 32 high) needs a scale vector and a multiply-add per half, and ran NVFP4 at 0.82-0.88x the W4 kernel's speed
//   where this layout runs at 0.9-1x (one-row products, bench/fp4_kernel.py). The activations are put in the same
//   order per call (Acts::qn, dn).
//   AVX-512 VNNI: outputs in lanes, tiles of 16 rows (cpu_int.repack_w4_t16): per tile and 64 columns 8 vectors of
//   64 bytes, vector j's byte 4l + i holding code 4j + i of the tile's row l (low nibble) and 32 + 4j + i (high).
//   Scales (tiles, in / block, 16) bytes, row scales (tiles, 16); rows past out_features padded with zeros.
// The SIMD paths decode NVFP4 scales through float16 (tile_scales) and MXFP4's as float32 exponents, exactly for
// non-negative, non-NaN E4M3 and for 1 <= e <= 254 (cpu_fp4.py refuses layers with other scale bytes).
//
// What is duplicated from cpu_int.cpp (its helpers sit in an anonymous namespace of another translation unit): the
// activation quantizer (quantize16_*: the same operations, so the same codes and scales).
// The instruction-set detection is cpu_int.cpp's, reached through its op lmpress_cpu::cpu_isa.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(LMPRESS_FP4_SIMDE)
// Tests only (tests/runtime/test_cpu_fp4.py): the AVX-512 paths through SIMDe's portable intrinsics, so a host
// without AVX-512 checks their arithmetic. Built apart under the op namespace lmpress_cpu_simde.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#define LMPRESS_X86 1
#define TARGET_AVX512
#define TARGET_AVX2
#ifndef _MM_HINT_T0
#define _MM_HINT_T0 SIMDE_MM_HINT_T0
#endif
// Two that SIMDe 0.8.2 lacks, from ones it has; and a masked store that writes only its lanes (SIMDe's stores all
// 16, zeros in the others: past the end of the output on the last tile).
#define _mm512_permute_ps(a, imm) _mm512_shuffle_ps((a), (a), (imm))
#define _mm512_cvtepu8_epi32(b) \
  _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi32(b)), _mm256_cvtepu8_epi32(_mm_srli_si128((b), 8)), 1)
static inline void simde_masked_store(float* p, __mmask16 k, __m512 a) {
  float lanes[16];
  _mm512_storeu_ps(lanes, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) p[i] = lanes[i];
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) simde_masked_store((p), (k), (a))
#elif defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMPRESS_X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#ifndef LMPRESS_FP4_NAMESPACE
#define LMPRESS_FP4_NAMESPACE lmpress_cpu
#endif

namespace {

constexpr int64_t SUPER = 64;  // columns per superblock of codes (32 bytes); in_features is a multiple of it
constexpr int64_t ABLOCK = 4;  // activation block, as in cpu_int.cpp
constexpr int64_t ROWS = 8;    // input rows per pass over the weights
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int32_t OFFSET = 12;  // u = 2 * e2m1 + OFFSET is unsigned

// u = 2 * e2m1 + 12 of each code (sign << 3 | index): 12 + {0, 1, 2, 3, 4, 6, 8, 12}, then 12 - the same.
constexpr int8_t U_OF_CODE[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// ---- block scales ------------------------------------------------------------------------------------------------

float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<float>::quiet_NaN();  // E4M3FN has no infinities; S.1111.111 is NaN
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -9);  // subnormal: m / 8 * 2^-6
  else
    v = std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

float e8m0_value(uint8_t b) {
  return b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.f, static_cast<int>(b) - 127);
}

// The value of each scale byte (the portable path's decoding; the SIMD paths decode in registers).
struct ScaleTable {
  float v[256];
  explicit ScaleTable(bool nvfp4) {
    for (int b = 0; b < 256; ++b) v[b] = nvfp4 ? e4m3_value(static_cast<uint8_t>(b)) : e8m0_value(static_cast<uint8_t>(b));
  }
};

const ScaleTable& scale_table(bool nvfp4) {
  static const ScaleTable nv(true), mx(false);
  return nvfp4 ? nv : mx;
}

// ---- activations -------------------------------------------------------------------------------------------------

struct Acts {
  std::vector<int8_t> q;   // (M, K)
  std::vector<float> d;    // (M, K / 4): each block's scale
  std::vector<float> z;    // (M, K / 4): -12 * d * sum(q) of each activation block (the offset's term)
  std::vector<float> zb;   // (M, K / block): z summed over each weight block
  std::vector<int8_t> qn;  // "wide" layout, (M, K): q in each superblock's order (steps, then lanes)
  std::vector<float> dn;   // ... (M, K / 4): d in that order
};

// A superblock of the "wide" layout at its first column: its blocks and steps (the whole ones: 8 blocks; the rest:
// 64 columns).
struct Super {
  int64_t blocks, steps;
};
inline Super super_at(int64_t col, int64_t K, int64_t block) {
  return col < K / (8 * block) * 8 * block ? Super{8, block / ABLOCK} : Super{SUPER / block, 2};
}

// The column (of its superblock) of lane i's code c in step s: block i mod nb, its columns 4r + c.
inline int64_t lane_column(Super sb, int64_t block, int64_t i, int64_t s, int64_t c) {
  return block * (i % sb.blocks) + ABLOCK * ((i / sb.blocks) * sb.steps + s) + c;
}

#include "cpu_quantize_acts.h"  // quantize16_portable / _avx512 / _avx2, as cpu_int.cpp's

// q, d, z and zb of M rows of x (zb per weight block of block columns); wide: also qn and dn.
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t isa, bool wide, int64_t block, Acts& a) {
  const int64_t na = K / ABLOCK;
  a.q.resize(M * K);
  a.d.resize(M * na);
  a.z.resize(M * na);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < K / 16; ++c) {
      const float* xc = x + m * K + c * 16;
      int8_t* qc = a.q.data() + m * K + c * 16;
      float* d = a.d.data() + m * na + c * (16 / ABLOCK);
      float* s = a.z.data() + m * na + c * (16 / ABLOCK);  // d * sum(q) for now
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
  for (float& v : a.z) v *= -static_cast<float>(OFFSET);
  const int64_t per = block / ABLOCK, nblk = K / block;
  a.zb.assign(M * nblk, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < na; ++b) a.zb[m * nblk + b / per] += a.z[m * na + b];
  if (!wide) return;
  a.qn.resize(M * K);
  a.dn.resize(M * na);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t col = 0; col < K;) {
      const Super sb = super_at(col, K, block);
      for (int64_t s = 0, p = m * na + col / ABLOCK; s < sb.steps; ++s)
        for (int64_t i = 0; i < 8; ++i, ++p) {
          const int64_t src = m * na + (col + lane_column(sb, block, i, s, 0)) / ABLOCK;
          std::memcpy(&a.qn[p * ABLOCK], &a.q[src * ABLOCK], ABLOCK);
          a.dn[p] = a.d[src];
        }
      col += sb.blocks * block;
    }
}

// ---- portable ----------------------------------------------------------------------------------------------------

// Signed values 2 * e2m1 (no offset to take out): the integer dots are exact either way.
void fp4_rows_portable(const uint8_t* codes, const uint8_t* scales, const float* row_scale, int64_t block,
                       int64_t n0, int64_t n1, int64_t K, const Acts& a, int64_t m0, int64_t M, int64_t N, float* y) {
  const ScaleTable& table = scale_table(block == 16);
  const int64_t na = K / ABLOCK, nblk = K / block, per = block / ABLOCK;
  std::vector<int32_t> dot(na);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    for (int64_t m = m0; m < m0 + M; ++m) {
      const int8_t* xq = a.q.data() + m * K;
      std::fill(dot.begin(), dot.end(), 0);
      for (int64_t col0 = 0; col0 < K;) {
        const Super sb = super_at(col0, K, block);
        for (int64_t j = 0; j < sb.steps * 16; ++j) {  // 16 bytes per step: 8 lanes of 4 codes, two steps a vector
          const uint8_t byte = row[col0 / 2 + j];
          for (int64_t high = 0; high < 2; ++high) {
            const int64_t col = col0 + lane_column(sb, block, (j % 32) / 4, 2 * (j / 32) + high, j % 4);
            dot[col / ABLOCK] += (U_OF_CODE[high ? byte >> 4 : byte & 15] - OFFSET) * xq[col];
          }
        }
        col0 += sb.blocks * block;
      }
      float acc = 0.f;
      for (int64_t k = 0; k < nblk; ++k) {
        float part = 0.f;
        for (int64_t i = 0; i < per; ++i) part += a.d[m * na + k * per + i] * static_cast<float>(dot[k * per + i]);
        acc += table.v[scales[n * nblk + k]] * part;
      }
      y[m * N + n] = 0.5f * row_scale[n] * acc;
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

// The 32 code bytes of a superblock as u (two lookups): low nibbles, high nibbles.
TARGET_AVX2 inline void unpack_avx2(const uint8_t* p, __m256i lut, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(w, low));
  hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(w, 4), low));
}

// int32 lanes of dot(u, x) per 4 codes (u <= 24, so vpmaddubsw's int16 pairs do not saturate), as float.
TARGET_AVX2 inline __m256 dot4_avx2(__m256i u, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1)));
}

// A superblock's scale bytes as float32 lanes (lane i: block i mod nb): NVFP4 through float16 as in tile_scales
// (2^-8 times the value), MXFP4 as float32 exponents. Whole superblocks: 8 bytes, one per lane.
template <bool NV>
TARGET_AVX2 inline __m256 wide_scales(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (NV) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 7));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(b), 23));
}

// 64-column superblocks: NVFP4's 4 bytes to lanes [A B C D A B C D], MXFP4's 2 to [A B A B A B A B] (each byte the
// top byte of its lane, shifted down by one into the exponent field). -1 in a shuffle's control: a zero byte.
template <bool NV>
TARGET_AVX2 inline __m256 tail_scales(const uint8_t* p) {
  if constexpr (NV) {
    int32_t four;
    std::memcpy(&four, p, 4);
    const __m128i spread = _mm_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 0, -1, 1, -1, 2, -1, 3, -1);
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread), 7));
  }
  uint16_t two;
  std::memcpy(&two, p, 2);
  const __m128i spread = _mm_setr_epi8(-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 0, -1, -1, -1, 1);
  const __m128i e = _mm_srli_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(two), spread), 1);
  return _mm256_castsi256_ps(_mm256_set_m128i(e, e));
}

// One superblock's steps for M input rows: per 4 codes of a lane, its activation block's d times the integer dot,
// summed per lane into t[m].
template <int M, int STEPS>
TARGET_AVX2 inline void steps_avx2(const uint8_t* w, __m256i lut, const int8_t* x, const float* d, int64_t K,
                                   int64_t na, __m256* t) {
  for (int v = 0; v < STEPS / 2; ++v) {
    __m256i lo, hi;
    unpack_avx2(w + 32 * v, lut, lo, hi);
    for (int m = 0; m < M; ++m) {
      const int8_t* xm = x + m * K + 64 * v;
      const float* dm = d + m * na + 16 * v;
      t[m] = _mm256_fmadd_ps(dot4_avx2(lo, xm), _mm256_loadu_ps(dm), t[m]);
      t[m] = _mm256_fmadd_ps(dot4_avx2(hi, xm + 32), _mm256_loadu_ps(dm + 8), t[m]);
    }
  }
}

// Weight row n times input rows m0..m0+M-1: per superblock, the lane sums start at the z of the lanes' blocks (each
// block's in one of its lanes), gather the steps, and go into the accumulator times the scales, once: per 64 columns
// two conversions and two multiply-adds and a part of one, the W4 kernel's float work.
template <int M, bool NV>
TARGET_AVX2 inline void fp4_row_avx2(const uint8_t* row, const uint8_t* sc, float rs, int64_t K, const Acts& a,
                                     int64_t m0, int64_t n, int64_t N, float* y) {
  constexpr int64_t block = NV ? 16 : 32, span = 8 * block;
  const int64_t na = K / ABLOCK, nblk = K / block, whole = K / span * span;
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U_OF_CODE)));
  const int8_t* xn = a.qn.data() + m0 * K;
  const float* dn = a.dn.data() + m0 * na;
  const float* zb = a.zb.data() + m0 * nblk;
  __m256 acc[M], t[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  int64_t col = 0;
  for (; col < whole; col += span) {
    for (int m = 0; m < M; ++m) t[m] = _mm256_loadu_ps(zb + m * nblk + col / block);
    steps_avx2<M, block / ABLOCK>(row + col / 2, lut, xn + col, dn + col / ABLOCK, K, na, t);
    const __m256 s = wide_scales<NV>(sc + col / block);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(t[m], s, acc[m]);
  }
  for (; col < K; col += SUPER) {
    for (int m = 0; m < M; ++m) {  // the 4 (2) blocks' z in lanes 0-3 (0-1)
      const float* z = zb + m * nblk + col / block;
      const __m128 zs = NV ? _mm_loadu_ps(z) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(z)));
      t[m] = _mm256_insertf128_ps(_mm256_setzero_ps(), zs, 0);
    }
    steps_avx2<M, 2>(row + col / 2, lut, xn + col, dn + col / ABLOCK, K, na, t);
    const __m256 s = tail_scales<NV>(sc + col / block);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(t[m], s, acc[m]);
  }
  for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = rs * hsum256(acc[m]);
}

// Rows n0..n1 of the weight times input rows m0..m0+M-1. More than 4 input rows go through each weight row in two
// groups (the second reads it from L1): 8 rows' sums and accumulators at once would not fit AVX2's 16 registers, and
// spilling them ran 8 rows at 0.8x the W4 kernel's speed.
template <int M, bool NV>
TARGET_AVX2 void fp4_rows_avx2(const uint8_t* codes, const uint8_t* scales, const float* row_scale, int64_t n0,
                               int64_t n1, int64_t K, const Acts& a, int64_t m0, int64_t N, float* y) {
  constexpr int64_t block = NV ? 16 : 32;
  constexpr int first = M > 4 ? 4 : M;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const uint8_t* sc = scales + n * (K / block);
    const float rs = (NV ? 128.f : 0.5f) * row_scale[n];  // 1/2 for u's factor 2; NVFP4's scales were 2^-8 theirs
    fp4_row_avx2<first, NV>(row, sc, rs, K, a, m0, n, N, y);
    if constexpr (M > 4) fp4_row_avx2<M - 4, NV>(row, sc, rs, K, a, m0 + 4, n, N, y);
  }
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------------------------

// 16 scale bytes (one block of a tile's 16 rows) as float32. NVFP4: E4M3 S.EEEE.MMM shifted into float16's bits as
// 0.0EEEE.MMM0000000 is the value times 2^-8 (subnormals too; the 2^8 goes into the row scale), for scales whose sign
// bit is clear (cpu_fp4.py checks). MXFP4: the byte as float32's exponent field is 2^(e - 127), for 1 <= e <= 254.
template <bool NV>
TARGET_AVX512 inline __m512 tile_scales(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (NV) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23));
}

// Outputs in lanes: each vector's nibbles to u (two lookups), then per half one vpdpbusd of 4 codes of the tile's 16
// rows against 4 activations broadcast, scaled by the activation block's d into the half's running block sum. A
// block sum starts at the block's z summed (the offset's term) and is multiplied into the accumulator by the 16
// rows' block scales when the block ends: every 4 vectors for NVFP4 (the halves' blocks of 16 columns), once per
// superblock for MXFP4.
template <int M, bool NV>
TARGET_AVX512 void fp4_tiles_avx512(const uint8_t* codes, const uint8_t* scales, const float* row_scale, int64_t t0,
                                    int64_t t1, int64_t K, const Acts& a, int64_t m0, int64_t N, float* y) {
  constexpr int64_t block = NV ? 16 : 32, per_super = SUPER / block;
  const int64_t nb = K / SUPER, na = K / ABLOCK, nblk = K / block, tile_bytes = nb * 8 * 64;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(U_OF_CODE)));
  const int8_t* xq = a.q.data() + m0 * K;
  const float* xd = a.d.data() + m0 * na;
  const float* zb = a.zb.data() + m0 * nblk;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * tile_bytes;
    const uint8_t* tsc = scales + t * nblk * 16;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      // Weight blocks of this superblock: the low nibbles' (columns 0:32) and the high nibbles' (32:64); NVFP4 has
      // two of each, vectors 0-3 and 4-7.
      const int64_t lo_blk = b * per_super, hi_blk = lo_blk + per_super / 2;
      __m512 part_lo[M], part_hi[M];
      for (int m = 0; m < M; ++m) {
        part_lo[m] = _mm512_set1_ps(zb[m * nblk + lo_blk]);
        part_hi[m] = _mm512_set1_ps(zb[m * nblk + hi_blk]);
      }
      const uint8_t* blk = tile + b * 512;
      for (int64_t j = 0; j < 8; ++j) {
        if (NV && j == 4) {  // the first NVFP4 block of each half ends
          const __m512 s_lo = tile_scales<NV>(tsc + lo_blk * 16), s_hi = tile_scales<NV>(tsc + hi_blk * 16);
          for (int m = 0; m < M; ++m) {
            acc[m] = _mm512_fmadd_ps(part_hi[m], s_hi, _mm512_fmadd_ps(part_lo[m], s_lo, acc[m]));
            part_lo[m] = _mm512_set1_ps(zb[m * nblk + lo_blk + 1]);
            part_hi[m] = _mm512_set1_ps(zb[m * nblk + hi_blk + 1]);
          }
        }
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES + j * 64), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(blk + j * 64);
        const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, low));
        const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xq + m * K + b * SUPER + 4 * j;
          const float* d = xd + m * na + b * (SUPER / ABLOCK) + j;
          int32_t x0, x1;
          std::memcpy(&x0, x, 4);
          std::memcpy(&x1, x + 32, 4);
          const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi32(x0));
          const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_set1_epi32(x1));
          part_lo[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(d[0]), part_lo[m]);
          part_hi[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_set1_ps(d[32 / ABLOCK]), part_hi[m]);
        }
      }
      const int64_t lo_last = lo_blk + (NV ? 1 : 0), hi_last = hi_blk + (NV ? 1 : 0);
      const __m512 s_lo = tile_scales<NV>(tsc + lo_last * 16), s_hi = tile_scales<NV>(tsc + hi_last * 16);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(part_hi[m], s_hi, _mm512_fmadd_ps(part_lo[m], s_lo, acc[m]));
    }
    // 1/2 for u's factor 2; NVFP4's scales came out 2^-8 times their value
    const __m512 rs = _mm512_mul_ps(_mm512_loadu_ps(row_scale + t * 16), _mm512_set1_ps(NV ? 128.f : 0.5f));
    const int64_t valid = std::min<int64_t>(16, N - t * 16);
    const __mmask16 k = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + t * 16, k, _mm512_mul_ps(acc[m], rs));
  }
}

#endif  // LMPRESS_X86

// ---- dispatch ----------------------------------------------------------------------------------------------------

#ifdef LMPRESS_X86
// The kernels for passes of 1..8 input rows (the row count is a template parameter: accumulators in registers), by
// format ([1]: NVFP4).
using Kernel = void (*)(const uint8_t*, const uint8_t*, const float*, int64_t, int64_t, int64_t, const Acts&, int64_t,
                        int64_t, float*);
#define LMPRESS_FP4_BY_ROWS(f, nv) {f<1, nv>, f<2, nv>, f<3, nv>, f<4, nv>, f<5, nv>, f<6, nv>, f<7, nv>, f<8, nv>}
constexpr Kernel AVX2_ROWS[2][ROWS] = {LMPRESS_FP4_BY_ROWS(fp4_rows_avx2, false), LMPRESS_FP4_BY_ROWS(fp4_rows_avx2, true)};
constexpr Kernel AVX512_TILES[2][ROWS] = {LMPRESS_FP4_BY_ROWS(fp4_tiles_avx512, false),
                                          LMPRESS_FP4_BY_ROWS(fp4_tiles_avx512, true)};
#undef LMPRESS_FP4_BY_ROWS
#endif

// The host's level (cpu_int.cpp detects it once; its op cpu_isa reports it).
int64_t best_isa() {
#ifdef LMPRESS_FP4_SIMDE
  return 2;
#else
  static const int64_t level = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("lmpress_cpu::cpu_isa", "")
                                   .typed<int64_t()>()
                                   .call();
  return level;
#endif
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale,
           int64_t block, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous(), "scales: contiguous uint8 (E4M3 or E8M0)");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale: contiguous float32");
  TORCH_CHECK(block == 16 || block == 32, "block: 16 (NVFP4) or 32 (MXFP4)");
  TORCH_CHECK(x.size(1) % SUPER == 0, "in_features must be a multiple of 64");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run instruction set level ", isa);
}

// codes (N, K / 2) in the "wide" layout (cpu_fp4.repack_fp4), scales (N, K / block) bytes, row_scale (N,). isa picks
// the path (2 runs AVX2's: the outputs-in-lanes layout has its own op).
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& row_scale, int64_t block, int64_t isa) {
  check(x, codes, scales, row_scale, block, isa);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == K / 2, "fp4 codes: (out, in / 2)");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / block, "fp4 scales: (out, in / block)");
  TORCH_CHECK(row_scale.numel() == N, "fp4 row_scale: (out,)");
  at::Tensor y = at::empty({M, N}, x.options());
  // Kept per calling thread (a decode step calls this some hundred times with the same sizes), named in the
  // parallel body through a local: in another thread the thread_local name would be that thread's own.
  static thread_local Acts buffer;
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, isa, isa >= 1, block, buffer);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  const float* rs = row_scale.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      const int64_t rows = std::min(ROWS, M - m0);
#ifdef LMPRESS_X86
      if (isa >= 1) {
        AVX2_ROWS[block == 16][rows - 1](c, s, rs, n0, n1, K, acts, m0, N, out);
        continue;
      }
#endif
      fp4_rows_portable(c, s, rs, block, n0, n1, K, acts, m0, rows, N, out);
    }
  });
  return y;
}

// Outputs in lanes (AVX-512 VNNI only): codes (tiles, K / 64, 8, 64) as cpu_int.repack_w4_t16, scales
// (tiles, K / block, 16) bytes, row_scale (tiles, 16); rows past out_features padded.
at::Tensor fp4_linear_t16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& row_scale, int64_t block, int64_t out_features) {
  check(x, codes, scales, row_scale, block, 2);
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), N = out_features;
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == K / SUPER && codes.size(2) == 8 && codes.size(3) == 64,
              "fp4 t16 codes: (tiles, in / 64, 8, 64)");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == T && scales.size(1) == K / block && scales.size(2) == 16,
              "fp4 t16 scales: (tiles, in / block, 16)");
  TORCH_CHECK(row_scale.numel() == T * 16 && N > (T - 1) * 16 && N <= T * 16, "fp4 t16 shapes");
  at::Tensor y = at::empty({M, N}, x.options());
  static thread_local Acts buffer;  // named through a local in the parallel body (see fp4_linear)
  const Acts& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, K, 2, false, block, buffer);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  const float* rs = row_scale.data_ptr<float>();
  float* out = y.data_ptr<float>();
#ifdef LMPRESS_X86
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      AVX512_TILES[block == 16][std::min(ROWS, M - m0) - 1](c, s, rs, t0, t1, K, acts, m0, N, out);
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LMPRESS_FP4_NAMESPACE, m) {
  m.def("fp4_linear(Tensor x, Tensor codes, Tensor scales, Tensor row_scale, int block, int isa) -> Tensor");
  m.def("fp4_linear_t16(Tensor x, Tensor codes, Tensor scales, Tensor row_scale, int block, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(LMPRESS_FP4_NAMESPACE, CPU, m) {
  m.impl("fp4_linear", &fp4_linear);
  m.impl("fp4_linear_t16", &fp4_linear_t16);
}
