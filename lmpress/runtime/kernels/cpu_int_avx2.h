// cpu_int.cpp's AVX2 + FMA kernels (vpmaddubsw): W4 per row in the natural layout, W8 per row. Included once by
// cpu_int.cpp inside its anonymous namespace (it uses cpu_int.cpp's Acts, group_of and log2_or_minus1); the
// layouts and the sums they compute are described at the top of cpu_int.cpp.

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

// 64 weight codes as w8_rows_avx2 and w8_token_rows_avx2 take them: maddubs takes unsigned x signed bytes into
// saturating int16 pairs, and 255 * 127 * 2 overflows, so the codes go in as q - 128 (signed) through the sign trick:
// |w| * sign(x, w) = w * x, at most 128 * 127 * 2 per pair.
struct W8Block {
  __m256i w0, w1, a0, a1;  // codes 0:32 and 32:64 as q - 128, and their magnitudes
};

TARGET_AVX2 inline W8Block load_w8_block(const uint8_t* codes) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  W8Block w;
  w.w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), flip);
  w.w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32)), flip);
  w.a0 = _mm256_abs_epi8(w.w0), w.a1 = _mm256_abs_epi8(w.w1);
  return w;
}

// The block's products with 64 activation codes xq as int32 lanes, each the sum of 4: d0 over codes 0:32, d1 32:64.
TARGET_AVX2 inline void w8_block_dots(const W8Block& w, const int8_t* xq, __m256i& d0, __m256i& d1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), w.w0);
  const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)), w.w1);
  d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w.a0, x0), ones);
  d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w.a1, x1), ones);
}

template <int M>
TARGET_AVX2 void w8_rows_avx2(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0, int64_t n1,
                              int64_t K, const Acts& a, int64_t m0, int64_t N, float* y, int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK;
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
      const W8Block w = load_w8_block(row + b * BLOCK);
      for (int m = 0; m < M; ++m) {
        __m256i d0, d1;
        w8_block_dots(w, a.q.data() + (m0 + m) * K + b * BLOCK, d0, d1);
        const float* f = a.fb.data() + ((m0 + m) * nb + b) * 16;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_loadu_ps(f), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_loadu_ps(f + 8), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)  // sum d * dot(q - 128, x) + 128 * xs = sum d * dot(q, x)
      y[(m0 + m) * N + n] = scales[n] * (hsum256(acc[m]) + (128.f - static_cast<float>(zeros[n])) * xs[m]);
  }
}

TARGET_AVX2 inline int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// W8A8 per token (cpu_int.cpp's w8_token_linear): w8_rows_avx2's products, summed exactly in int32 across the row
// (each pair sum fits int16, two of them need not: they meet widened); then float(sum) * d * s as torch's W8A8.
template <int M>
TARGET_AVX2 void w8_token_rows_avx2(const uint8_t* codes, const float* scales, const uint8_t* zeros, int64_t n0,
                                    int64_t n1, int64_t K, const Acts& a, const int32_t* xsum, int64_t m0, int64_t N,
                                    float* y, int64_t ahead_bytes) {
  const int64_t nb = K / BLOCK, na = K / ABLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * K;
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; ++b) {
      if (ahead_bytes) _mm_prefetch(reinterpret_cast<const char*>(row + b * BLOCK) + ahead_bytes, _MM_HINT_T0);
      const W8Block w = load_w8_block(row + b * BLOCK);
      for (int m = 0; m < M; ++m) {
        __m256i d0, d1;
        w8_block_dots(w, a.q.data() + (m0 + m) * K + b * BLOCK, d0, d1);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(d0, d1));
      }
    }
    for (int m = 0; m < M; ++m) {  // sum (q - 128) * x + (128 - z) * sum(x) = sum (q - z) * x
      const int32_t dot = hsum256_epi32(acc[m]) + (128 - static_cast<int32_t>(zeros[n])) * xsum[m0 + m];
      y[(m0 + m) * N + n] = static_cast<float>(dot) * a.d[(m0 + m) * na] * scales[n];
    }
  }
}
