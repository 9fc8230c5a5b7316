// cpu_int.cpp's AVX-512 VNNI kernels (vpdpbusd): W4 and W8 per row in the natural layout, and outputs in lanes
// ("t16": 16 weight rows per tile). Included once by cpu_int.cpp inside its anonymous namespace, after the AVX2
// kernels (it uses their hsum256, and cpu_int.cpp's Acts, group_of, log2_or_minus1 and rows_ahead); the layouts
// and the sums they compute are described at the top of cpu_int.cpp.

// The lane sums of up to 4 rows' accumulators, each by the same tree whatever the other slots hold (so a row's result
// does not depend on how many rows share the pass): 128-bit blocks 0+2 and 1+3, their sum, then within the block.
// 13 operations for 4 rows where one reduction per row takes 8.
TARGET_AVX512 inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  store_block_firsts(out, u);  // rows a, b, c, d
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
