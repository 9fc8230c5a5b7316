// The activations' int8 quantizer the int8-activation kernels share (cpu_int.cpp's W4 and W8, cpu_fp4.cpp's FP4):
// per block of ABLOCK values, scale d = max|x| / 127, codes round-half-even(x / d), and s = d * sum(q); 16 values a
// call, portable C++, AVX-512 and AVX2 alike. Included inside each source's anonymous namespace, after it defines
// ABLOCK, LMPRESS_X86 (x86-64) and the TARGET_AVX512 / TARGET_AVX2 attributes and includes the intrinsics.

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

// One row of K values at one scale (W4A8's per-token activations): d = max|x| / 127 (1 for a zero row) and codes
// round-half-even(x / d), as lmpress.weights.int8_linear.quantize_per_token computes them; every block of the row
// gets that d, and its s = d * sum(q) over the block.
void quantize_row_per_token(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  float amax = 0.f;
  for (int64_t i = 0; i < K; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  for (int64_t b = 0; b < K / ABLOCK; ++b) {
    int32_t sum = 0;
    for (int64_t i = b * ABLOCK; i < (b + 1) * ABLOCK; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] / scale));
      q[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
      sum += q[i];
    }
    d[b] = scale;
    s[b] = static_cast<float>(sum) * scale;
  }
}

// 16 values (16 / ABLOCK blocks): codes q, each block's d and s = d * sum(q).
void quantize16_portable(const float* x, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < 16 / ABLOCK; ++b)
    s[b] = static_cast<float>(quantize_block_portable(x + b * ABLOCK, q + b * ABLOCK, d + b)) * d[b];
}

#ifdef LMPRESS_X86
static_assert(ABLOCK == 4, "the SIMD quantizers take blocks of 4 (one per 128-bit lane)");

// Lane 0 of each 128-bit block of v to out[0:4]. Compressed in a register, then stored: AMD's Zen 4 runs a compress
// with a memory destination in microcode (about 110 cycles a call against 3.5, measured on an EPYC, issue 55).
TARGET_AVX512 inline void store_block_firsts(float* out, __m512 v) {
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, v)));
}

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
  store_block_firsts(d, dv);
  store_block_firsts(s, _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv));
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
