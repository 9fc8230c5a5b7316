// Attention of a few queries over a preallocated KV cache that holds float32 entries, int8 codes with a float32
// scale per slot and KV head, FP8 codes with static scales, or INT4 codes two a byte with a float16 step and minimum
// per slot (or, for keys, per channel and group of slots: KIVI) (AVX-512, or AVX2 + FMA: every x86-64 host of the
// last decade).
//
// A decode step at long context reads the whole cache of every layer once: at 4,096 tokens SmolLM2's float32 cache
// is 189 MB a step, more than its W4 weights; int8 codes are a quarter of that. The work is split over the slots
// (flash-decoding): each work item is one (batch row, KV head, chunk of slots), scores the chunk for every
// query row of that KV head (the GQA group's heads times the step's queries), keeps the chunk's maximum, sum of
// weights and weighted values, and a second pass merges the chunks. So every KV head's codes are read once per
// step whatever the group size, and there are more work items than threads even for three KV heads. The chunks
// split the slots some query sees, not the cache: its empty end is never read nor handed to a thread. The vector
// work over a chunk (cpu_kv_rows.h) is compiled once per instruction set from one body, each set's vector type and
// operations given as `V`.
// Built into the library of cpu_int.cpp (one of its sources; the op joins the lmpress_cpu namespace).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t CHUNK = 256;  // slots per work item at most: its keys and values (128 KiB float32, 64 wide) fit L2
constexpr int64_t MIN_CHUNK = 32;
constexpr int64_t SMALL_MERGE = 1 << 15;  // partial values below which the merge runs on the calling thread

// Chunks per KV head over `span` visible slots: about 4 work items per thread where chunks of MIN_CHUNK slots allow
// it, as many items for every thread (SmolLM2's 3 KV heads on 2 threads: 4 chunks a head, 6 items a thread; 3
// chunks a head left one thread 5 items and the other 4), and none over CHUNK slots once bounds round to 16 slots.
// Chunked by the cache's size instead, a 528-slot cache holding 192 tokens gave one thread twice the other's slots.
int64_t chunk_count(int64_t span, int64_t heads) {
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t chunks = std::min((4 * threads + heads - 1) / heads, std::max<int64_t>(1, span / MIN_CHUNK));
  chunks = std::max(chunks, (span + CHUNK - 17) / (CHUNK - 16));
  if (chunks > 1)
    while ((heads * chunks) % threads) ++chunks;
  return chunks;
}

// The slots some query row sees: [first, last) over the rows of a (rows, L) mask; first = last = 0 if none.
std::pair<int64_t, int64_t> visible_span(const bool* mask, int64_t rows, int64_t L) {
  int64_t first = L, last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool* m = mask + r * L;
    int64_t hi = L, lo = 0;
    while (hi > 0 && !m[hi - 1]) --hi;
    while (lo < hi && !m[lo]) ++lo;
    if (lo < hi) first = std::min(first, lo), last = std::max(last, hi);
  }
  return first < last ? std::make_pair(first, last) : std::make_pair(int64_t{0}, int64_t{0});
}
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

KV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (scores less their maximum), -inf to 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error under 2e-7), 2^n built in the exponent bits (x >= -87: n >= -126, normal).
KV_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 visible = _mm256_cmp_ps(x, _mm256_set1_ps(NEG_INF), _CMP_NEQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact product, then rest
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  for (float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(visible, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Two INT4 codes in a byte, the even entry's in the low bits (kv_quant.py's packing).
struct Int4Pair {
  uint8_t bits;
};

// Cache entries a stored element holds.
template <typename T>
constexpr int64_t PER = std::is_same_v<T, Int4Pair> ? 2 : 1;

// R query rows of one chunk (at most MAX_ROWS; more rows go by groups): their queries, the KV head's keys and
// values (float32, int8 codes with a scale per slot, FP8 codes, or INT4 codes), each row's mask and visible slots
// [lo, hi) (empty: lo >= hi) within the group's [first, last); scratch for the rows' scores (then weights), and
// where each row's maximum, sum of weights and weighted values go.
constexpr int MAX_ROWS = 4;

template <typename T>
struct RowGroup {
  const float* q[MAX_ROWS];
  const T* keys;
  const float* key_scales;  // per slot (int8 codes); null for float32 entries and FP8 codes
  const T* values;
  const float* value_scales;
  float value_scale;  // FP8 codes' static scale of this KV head's values (1 otherwise)
  // INT4 codes with a step and minimum per slot: theirs over [first, last) in float32, the keys' (null where they
  // go by groups) and the values'
  const float *key_step, *key_low, *value_step, *value_low;
  float qsum[MAX_ROWS];  // each row's sum of its query's entries (INT4 keys with a minimum per slot)
  mutable float low_sum[MAX_ROWS];  // each row's sum of weight x value minimum (INT4 values)
  // INT4 keys by groups (KIVI): [steps (D), minima (D)] per group of `group` slots; the slots from `whole` on are
  // the unfinished group's float keys in `recent`, slot s at s % ring
  const at::Half* key_groups;
  const float* recent;
  int64_t group, ring, whole;
  const bool* mask[MAX_ROWS];
  int64_t lo[MAX_ROWS], hi[MAX_ROWS], first, last;
  float scale;
  float* scores[MAX_ROWS];
  float* acc[MAX_ROWS];
  float* top[MAX_ROWS];
  float* total[MAX_ROWS];
};

template <typename T>
using RowsFn = void (*)(const RowGroup<T>&);

// Row r's scores over [g.first, g.last) in place: -inf where its mask hides a slot or outside [lo, hi), then the
// softmax's weights less its maximum (times the slot's value scale for codes); its maximum and sum of weights out.
template <typename T>
KV_AVX2 void row_softmax(const RowGroup<T>& g, int r) {
  float* sc = g.scores[r];
  const int64_t n = g.last - g.first;
  const int64_t lo = std::clamp<int64_t>(g.lo[r] - g.first, 0, n), hi = std::clamp<int64_t>(g.hi[r] - g.first, lo, n);
  const bool* mask = g.mask[r] + g.first;
  std::fill(sc, sc + lo, NEG_INF);
  std::fill(sc + hi, sc + n, NEG_INF);
  __m256 most = _mm256_set1_ps(NEG_INF);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {  // -inf where the mask hides a slot (bools are 0 or 1)
    const __m256i shown = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask + i)));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(shown, _mm256_setzero_si256()));
    const __m256 x = _mm256_blendv_ps(_mm256_loadu_ps(sc + i), _mm256_set1_ps(NEG_INF), hidden);
    _mm256_storeu_ps(sc + i, x);
    most = _mm256_max_ps(most, x);
  }
  float top = NEG_INF;
  for (; i < hi; ++i) {
    if (!mask[i]) sc[i] = NEG_INF;
    top = std::max(top, sc[i]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  top = std::max(top, _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  float total = 0.f, low = 0.f;
  if (top != NEG_INF) {
    __m256 sum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + i), _mm256_set1_ps(top)));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(sc + i, g.value_scales ? _mm256_mul_ps(p, _mm256_loadu_ps(g.value_scales + g.first + i)) : p);
    }
    total = hsum(sum);
    for (; i < n; ++i) {
      const float p = sc[i] == NEG_INF ? 0.f : std::exp(sc[i] - top);
      total += p;
      sc[i] = g.value_scales ? p * g.value_scales[g.first + i] : p;
    }
    if (g.value_step)  // INT4 values: weight x step for the codes, weight x minimum summed apart
      for (i = 0; i < n; ++i) {
        low += sc[i] * g.value_low[i];
        sc[i] *= g.value_step[i];
      }
  } else {
    std::fill(sc, sc + n, 0.f);
  }
  g.low_sum[r] = low;
  *g.top[r] = top;
  *g.total[r] = total;
}

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct V {
  using vec = __m256;
  static constexpr int W = 8;
  static constexpr int REGS = 16;
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static vec load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // FP8 E4M3 bytes: sign and the 7 exponent-mantissa bits placed as float16's (exponent bias 15, not 7: times
  // 2^8 after), converted exactly (subnormals too: the half-precision conversion ignores denormals-are-zero).
  static vec load(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  }
  // INT4: 4 bytes' low and high nibbles interleaved into the 8 entries' order
  static vec load(const Int4Pair* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    const __m128i b = _mm_cvtsi32_si128(word), nibble = _mm_set1_epi8(0x0F);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  }
  static vec load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float x) { return _mm256_set1_ps(x); }
  static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  // lane i: the sum of v[i]'s lanes
  static vec sum_each(const vec* v) {
    const vec a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const vec b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // [a.lo, b.lo] + [a.hi, b.hi] by inserts and an extract: vperm2f128 is 8 micro-ops on AMD's Zen 1
    const vec lows = _mm256_insertf128_ps(a, _mm256_castps256_ps128(b), 1);
    const vec highs = _mm256_insertf128_ps(b, _mm256_extractf128_ps(a, 1), 0);
    return _mm256_add_ps(lows, highs);
  }
  static void store(float* p, vec a) { _mm256_storeu_ps(p, a); }
};
#include "cpu_kv_rows.h"
#pragma GCC pop_options
}  // namespace avx2

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
struct V {
  using vec = __m512;
  static constexpr int W = 16;
  static constexpr int REGS = 32;
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static vec load(const uint8_t* p) {  // FP8 E4M3 bytes, as avx2::V's
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  }
  static vec load(const Int4Pair* p) {  // INT4: 8 bytes' nibbles, as avx2::V's
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0F);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  }
  static vec load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float x) { return _mm512_set1_ps(x); }
  static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  // lane i: the sum of v[i]'s lanes. Within each 128-bit lane, pairs and then quads of vectors are summed into
  // one vector per 4 (c[k]: lane L holds v[4k..4k+3]'s partial sums over their lane L); then the 4 x 4 lanes of
  // c[0..3] are transposed and summed.
  static vec sum_each(const vec* v) {
    vec c[4];
    for (int k = 0; k < 4; ++k) {
      const vec* x = v + 4 * k;
      const vec a = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
      const vec b = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
      c[k] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    }
    const vec e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const vec e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
  }
  static void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
};
#include "cpu_kv_rows.h"
#pragma GCC pop_options
}  // namespace avx512

bool runs(int64_t isa) {
  if (isa == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return isa == 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

template <typename T>
RowsFn<T> rows_kernel(int64_t isa, int64_t width, int64_t rows) {
  return isa == 2 ? avx512::rows_kernel<T>(width, rows) : avx2::rows_kernel<T>(width, rows);
}

// n slots' float16 [step, minimum] pairs as float32 steps and minima.
__attribute__((target("avx2,fma,f16c"))) void split_affine(const at::Half* pairs, int64_t n, float* steps,
                                                          float* lows) {
  const auto* bits = reinterpret_cast<const __m128i*>(pairs);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8, bits += 2) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(bits)), b = _mm256_cvtph_ps(_mm_loadu_si128(bits + 1));
    // per 128-bit lane [s m s m] of a and b -> [s s (a) s s (b)]; then the 64-bit quarters into slot order
    const __m256 s = _mm256_shuffle_ps(a, b, 0x88), m = _mm256_shuffle_ps(a, b, 0xDD);
    _mm256_storeu_ps(steps + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8)));
    _mm256_storeu_ps(lows + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(m), 0xD8)));
  }
  for (; i < n; ++i) steps[i] = static_cast<float>(pairs[2 * i]), lows[i] = static_cast<float>(pairs[2 * i + 1]);
}

// Where a cache's scales live: none (float32 entries), one per slot and KV head (int8 codes), FP8's static ones:
// one per KV head, or one for all (count 1), or INT4's float16 [step, minimum] per slot and KV head (affine).
struct Scales {
  const float* data = nullptr;
  bool per_slot = false;
  int64_t count = 0;
  const at::Half* affine = nullptr;
  float of_head(int64_t kv) const { return count == 1 ? data[0] : data[kv]; }
};

// INT4 keys by groups of slots (KIVI): [steps, minima] per group and KV head, the unfinished group's float keys in a
// ring of slots per KV head, and the first slot they hold (the slots before it are whole groups).
struct KeyGroups {
  const at::Half* data = nullptr;
  const float* recent = nullptr;
  int64_t group = 0, ring = 0, whole = 0;
};

// Every query row over every chunk, MAX_ROWS rows at a time: each group reads the chunk's keys and values once
// (codes converted in registers) for all of its rows. T: float (float32 entries), int8_t, uint8_t (FP8 E4M3 bytes),
// Int4Pair.
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& keys, Scales key_scales, const at::Tensor& values,
                Scales value_scales, const at::Tensor& mask, float scale, int64_t isa, at::Tensor& out,
                KeyGroups grouped = {}) {
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), L = values.size(2), key_len = keys.size(2);
  const bool* mp = mask.data_ptr<bool>();
  const auto [first, last] = visible_span(mp, B * n, L);
  const int64_t group = H / KV, rows = group * n, chunks = chunk_count(last - first, B * KV);
  const auto bound = [&](int64_t c) { return c == chunks ? last : first + c * (last - first) / chunks / 16 * 16; };
  const float* qp = q.data_ptr<float>();
  const T* kp = static_cast<const T*>(keys.const_data_ptr());
  const T* vp = static_cast<const T*>(values.const_data_ptr());
  // per (batch row, KV head, chunk, query row): the chunk's maximum, its sum of weights, its weighted values
  std::vector<float> partial(B * KV * chunks * rows * (2 + D));
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(MAX_ROWS * CHUNK), affine(4 * CHUNK);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KV * chunks), kv = item / chunks % KV, chunk = item % chunks;
      const int64_t head = b * KV + kv, head_slots = head * L;
      RowGroup<T> g;
      g.keys = kp + head * key_len * D / PER<T>, g.values = vp + head_slots * D / PER<T>;
      g.key_scales = key_scales.per_slot ? key_scales.data + head_slots : nullptr;
      g.value_scales = value_scales.per_slot ? value_scales.data + head_slots : nullptr;
      const at::Half* key_affine = key_scales.affine ? key_scales.affine + 2 * head_slots : nullptr;
      const at::Half* value_affine = value_scales.affine ? value_scales.affine + 2 * head_slots : nullptr;
      g.key_step = g.key_low = g.value_step = g.value_low = nullptr;
      g.key_groups = grouped.data ? grouped.data + head * (key_len / grouped.group) * 2 * D : nullptr;
      g.recent = grouped.recent ? grouped.recent + head * grouped.ring * D : nullptr;
      g.group = grouped.group, g.ring = grouped.ring, g.whole = grouped.whole;
      const bool fixed = key_scales.data && !key_scales.per_slot;  // FP8: the head's scales fold into the sums
      g.scale = fixed ? scale * key_scales.of_head(kv) : scale;
      g.value_scale = fixed ? value_scales.of_head(kv) : 1.f;
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t R = std::min<int64_t>(MAX_ROWS, rows - r0);
        g.first = L, g.last = 0;  // the slots any row of the group sees
        for (int64_t i = 0; i < R; ++i) {
          const int64_t r = r0 + i, h = kv * group + r / n, query = r % n;
          const bool* m = mp + (b * n + query) * L;
          int64_t lo = bound(chunk), hi = bound(chunk + 1);
          while (hi > lo && !m[hi - 1]) --hi;
          while (lo < hi && !m[lo]) ++lo;
          float* slot = partial.data() + (item * rows + r) * (2 + D);
          g.q[i] = qp + ((b * H + h) * n + query) * D, g.mask[i] = m, g.lo[i] = lo, g.hi[i] = hi;
          g.top[i] = slot, g.total[i] = slot + 1, g.acc[i] = slot + 2, g.scores[i] = sc.data() + i * CHUNK;
          g.qsum[i] = key_affine ? std::accumulate(g.q[i], g.q[i] + D, 0.f) : 0.f;
          if (lo < hi) g.first = std::min(g.first, lo), g.last = std::max(g.last, hi);
        }
        if (g.first >= g.last) {  // nothing visible to the group here: empty partials
          for (int64_t i = 0; i < R; ++i)
            *g.top[i] = NEG_INF, *g.total[i] = 0.f, std::fill(g.acc[i], g.acc[i] + D, 0.f);
          continue;
        }
        float* steps = affine.data();  // INT4's per-slot steps and minima in float32, once for the group's rows
        if (key_affine) {
          g.key_step = steps, g.key_low = steps + CHUNK;
          split_affine(key_affine + 2 * g.first, g.last - g.first, steps, steps + CHUNK);
        }
        if (value_affine) {
          g.value_step = steps + 2 * CHUNK, g.value_low = steps + 3 * CHUNK;
          split_affine(value_affine + 2 * g.first, g.last - g.first, steps + 2 * CHUNK, steps + 3 * CHUNK);
        }
        rows_kernel<T>(isa, D, R)(g);
      }
    }
  });
  float* op = out.data_ptr<float>();
  const auto merge = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (KV * rows), kv = i / rows % KV, r = i % rows;
      const int64_t h = kv * group + r / n, query = r % n;
      const float* first = partial.data() + ((b * KV + kv) * chunks * rows + r) * (2 + D);
      float top = NEG_INF;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, first[c * rows * (2 + D)]);
      float* o = op + ((b * H + h) * n + query) * D;
      std::fill(o, o + D, 0.f);
      if (top == NEG_INF) continue;
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = first + c * rows * (2 + D);
        if (part[0] == NEG_INF) continue;
        const float w = std::exp(part[0] - top);
        total += w * part[1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[2 + d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  };
  if (static_cast<int64_t>(partial.size()) < SMALL_MERGE)
    merge(0, B * KV * rows);  // a decode step's few partials: handing them to the threads costs more than merging
  else
    at::parallel_for(0, B * KV * rows, 1, merge);
}

// q (B, H, n, D) float32; keys and values (B, KV, L, D) float32, int8 with scales (B, KV, L, 1) float32, FP8
// E4M3 with static scales (KV) or (1) float32, or INT4 (B, KV, L, D / 2) uint8 (two codes a byte) with float16
// [step, minimum] (B, KV, L, 2); INT4 keys by groups (KIVI): (B, KV, Lk, D / 2), Lk >= L a multiple of the group G,
// with [steps, minima] (B, KV, Lk / G, 2, D) float16, the float keys of the last slots `recent_keys` (B, KV, ring, D)
// float32 (slot s at s % ring) and the step's slots `pos` (n) int64: the slots from the last whole group of pos's
// last on are read from the ring. mask (B, 1, n, L) bool; all contiguous; isa 2 AVX-512, 1 AVX2, -1 the best this
// CPU runs. Returns (B, H, n, D) float32.
at::Tensor kv_slots_attention(const at::Tensor& q, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                              const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                              const at::Tensor& mask, double scale, int64_t isa,
                              const std::optional<at::Tensor>& recent_keys, const std::optional<at::Tensor>& pos) {
  if (isa == -1) isa = runs(2) ? 2 : 1;
  TORCH_CHECK(runs(isa), "kv_slots_attention: this CPU cannot run instruction set level ", isa,
              " (2 AVX-512, 1 AVX2 + FMA + F16C)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.is_contiguous(), "kv_slots_attention: q float32");
  const at::ScalarType stored = keys.scalar_type();
  for (const at::Tensor* t : {&keys, &values})
    TORCH_CHECK(t->scalar_type() == stored && t->dim() == 4 && t->is_contiguous() &&
                    (stored == at::kFloat || stored == at::kChar || stored == at::kFloat8_e4m3fn ||
                     stored == at::kByte),
                "kv_slots_attention: keys and values both float32, both int8, both float8_e4m3fn or both uint8 "
                "(INT4 pairs)");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), L = values.size(2), per = stored == at::kByte ? 2 : 1;
  const bool grouped = key_scales.has_value() && key_scales->dim() == 5;
  TORCH_CHECK(keys.size(0) == B && keys.size(3) * per == D && values.size(0) == B && values.size(1) == KV &&
                  values.size(3) * per == D && (grouped ? keys.size(2) >= L : keys.size(2) == L) && KV > 0 &&
                  H % KV == 0 && (D == 16 || D == 32 || D == 48 || D == 64 || D == 96 || D == 128),
              "kv_slots_attention: shapes (head dims 16 to 128, multiples of 16, keys as wide as values)");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 4 && mask.size(0) == B &&
                  mask.size(1) == 1 && mask.size(2) == n && mask.size(3) == L,
              "kv_slots_attention: mask (B, 1, n, L) bool");
  at::Tensor out = at::empty({B, H, n, D}, q.options());
  const float s = static_cast<float>(scale);
  if (stored == at::kFloat) {
    attend_all<float>(q, keys, Scales(), values, Scales(), mask, s, isa, out);
    return out;
  }
  if (stored == at::kByte) {
    Scales scales[2];
    for (int i = 0; i < 2; ++i) {
      const auto& given = i == 0 ? key_scales : value_scales;
      const bool ok = given.has_value() && given->scalar_type() == at::kHalf && given->is_contiguous();
      if (i == 0 && grouped) continue;  // checked below
      TORCH_CHECK(ok && given->dim() == 4 && given->numel() == B * KV * L * 2,
                  "kv_slots_attention: INT4 codes take float16 [step, minimum] (B, KV, L, 2)");
      scales[i].affine = given->data_ptr<at::Half>();
    }
    KeyGroups groups;
    if (grouped) {
      const at::Tensor& g = *key_scales;
      const int64_t count = g.size(2), group = count ? keys.size(2) / count : 0;
      TORCH_CHECK(g.size(0) == B && g.size(1) == KV && group > 0 && count * group == keys.size(2) && g.size(3) == 2 &&
                      g.size(4) == D,
                  "kv_slots_attention: INT4 keys by groups take float16 [steps, minima] (B, KV, slots / group, 2, D)");
      TORCH_CHECK(recent_keys.has_value() && recent_keys->scalar_type() == at::kFloat && recent_keys->is_contiguous() &&
                      recent_keys->dim() == 4 && recent_keys->size(0) == B && recent_keys->size(1) == KV &&
                      recent_keys->size(2) % group == 0 && recent_keys->size(2) >= 2 * group &&
                      recent_keys->size(3) == D,
                  "kv_slots_attention: INT4 keys by groups take their float recent keys (B, KV, ring, D), the ring "
                  "whole groups, at least two");
      TORCH_CHECK(pos.has_value() && pos->scalar_type() == at::kLong && pos->dim() == 1 && pos->numel() == n,
                  "kv_slots_attention: INT4 keys by groups take the step's slots pos (n) int64");
      const int64_t end = pos->data_ptr<int64_t>()[n - 1] + 1;
      TORCH_CHECK(end >= 1 && end <= L, "kv_slots_attention: pos past the cache");
      groups = KeyGroups{g.data_ptr<at::Half>(), recent_keys->data_ptr<float>(), group, recent_keys->size(2),
                         end / group * group};
    }
    attend_all<Int4Pair>(q, keys, scales[0], values, scales[1], mask, s, isa, out, groups);
    return out;
  }
  const bool int8 = stored == at::kChar;
  Scales scales[2];
  for (int i = 0; i < 2; ++i) {
    const auto& given = i == 0 ? key_scales : value_scales;
    const int64_t count = given.has_value() ? given->numel() : -1;
    TORCH_CHECK(given.has_value() && given->scalar_type() == at::kFloat && given->is_contiguous() &&
                    (int8 ? count == B * KV * L : count == KV || count == 1),
                int8 ? "kv_slots_attention: int8 codes take float32 scales (B, KV, L, 1)"
                     : "kv_slots_attention: FP8 codes take float32 scales (KV) or (1)");
    scales[i] = Scales{given->data_ptr<float>(), int8, count};
  }
  if (int8)
    attend_all<int8_t>(q, keys, scales[0], values, scales[1], mask, s, isa, out);
  else
    attend_all<uint8_t>(q, keys, scales[0], values, scales[1], mask, s, isa, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) {
  m.def(
      "kv_slots_attention(Tensor q, Tensor keys, Tensor? key_scales, Tensor values, Tensor? value_scales, "
      "Tensor mask, float scale, int isa=-1, Tensor? recent_keys=None, Tensor? pos=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("kv_slots_attention", &kv_slots_attention); }

#endif
