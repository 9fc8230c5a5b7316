// Attention of a few queries over a preallocated KV cache that holds float32 entries or int8 codes with a float32
// scale per slot and KV head (AVX2 + FMA, so every x86-64 host of the last decade).
//
// A decode step at long context reads the whole cache of every layer once: at 4,096 tokens SmolLM2's float32 cache
// is 189 MB a step, more than its W4 weights; int8 codes are a quarter of that. The work is split over the slots
// (flash-decoding): each work item is one (batch row, KV head, chunk of slots), scores the chunk for every
// query row of that KV head (the GQA group's heads times the step's queries), keeps the chunk's maximum, sum of
// weights and weighted values, and a second pass merges the chunks. So every KV head's codes are read once per
// step whatever the group size, and there are more work items than threads even for three KV heads. Slots no query
// of the chunk sees (the empty end of the cache) are never read.
// Built into the library of cpu_int.cpp (one of its sources; the op joins the lmpress_cpu namespace).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t CHUNK = 256;  // slots per work item: a chunk's dequantized keys and values (128 KiB at 64 wide) fit L2
constexpr int64_t MIN_CHUNK = 64;
constexpr int64_t SMALL_MERGE = 1 << 15;  // partial values below which the merge runs on the calling thread

// Slots per work item: CHUNK, or fewer (down to MIN_CHUNK) where CHUNK leaves under 4 items per thread: SmolLM2's
// 3 KV heads over a 256-slot cache were 3 items for 2 threads, one thread idle a third of the op.
int64_t chunk_for(int64_t L, int64_t heads) {
  const int64_t wanted = 4 * at::get_num_threads();
  const int64_t per_head = std::max<int64_t>(1, (wanted + heads - 1) / heads);
  return std::clamp<int64_t>(((L + per_head - 1) / per_head + 15) / 16 * 16, MIN_CHUNK, CHUNK);
}
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

KV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

KV_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KV_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
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

// One query row over the float32 keys and values (8 NV wide) of the slots [lo, hi) of a chunk: its scores (masked
// ones -inf) into sc, then in their place the softmax weights less the chunk's maximum; the maximum and the sum of
// weights into top_out and sum_out, the weighted values into acc. The query and the accumulator stay in registers.
template <int NV>
KV_AVX2 void attend_chunk(const float* q, const float* keys, const float* values, const bool* mask, int64_t lo,
                          int64_t hi, float scale, float* sc, float* acc, float* top_out, float* sum_out) {
  __m256 qv[NV], av[NV];
  for (int j = 0; j < NV; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j), av[j] = _mm256_setzero_ps();
  float top = NEG_INF;
  int64_t s = lo;
  for (; s < hi; ++s) {
    if (!mask[s]) {
      sc[s - lo] = NEG_INF;
      continue;
    }
    const float* k = keys + s * 8 * NV;
    __m256 dot = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int j = 1; j < NV; ++j) dot = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), dot);
    sc[s - lo] = hsum(dot) * scale;
    top = std::max(top, sc[s - lo]);
  }
  float total = 0.f;
  if (top != NEG_INF) {
    __m256 sum = _mm256_setzero_ps();
    s = lo;
    for (; s + 8 <= hi; s += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + s - lo), _mm256_set1_ps(top)));
      _mm256_storeu_ps(sc + s - lo, p);
      sum = _mm256_add_ps(sum, p);
    }
    total = hsum(sum);
    for (; s < hi; ++s) total += (sc[s - lo] = sc[s - lo] == NEG_INF ? 0.f : std::exp(sc[s - lo] - top));
    for (s = lo; s < hi; ++s) {
      if (sc[s - lo] == 0.f) continue;
      const __m256 p = _mm256_set1_ps(sc[s - lo]);
      const float* v = values + s * 8 * NV;
      for (int j = 0; j < NV; ++j) av[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), av[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, av[j]);
  *top_out = top;
  *sum_out = total;
}

using ChunkFn = void (*)(const float*, const float*, const float*, const bool*, int64_t, int64_t, float, float*,
                         float*, float*, float*);

ChunkFn chunk_kernel(int64_t width) {
  if (width % 16) return nullptr;
  switch (width / 8) {
    case 2: return attend_chunk<2>;
    case 4: return attend_chunk<4>;
    case 6: return attend_chunk<6>;
    case 8: return attend_chunk<8>;
    case 12: return attend_chunk<12>;
    case 16: return attend_chunk<16>;
    default: return nullptr;
  }
}

// int8 codes of the slots [lo, hi) times their scales, as float32 rows into out (8 at a time: widths of 8).
KV_AVX2 void dequantize_rows(const int8_t* codes, const float* scales, int64_t lo, int64_t hi, int64_t width,
                             float* out) {
  for (int64_t s = lo; s < hi; ++s) {
    const __m256 scale = _mm256_set1_ps(scales[s]);
    for (int64_t d = 0; d < width; d += 8)
      _mm256_storeu_ps(out + (s - lo) * width + d, _mm256_mul_ps(load8(codes + s * width + d), scale));
  }
}

// Every query row over every chunk: int8 codes are dequantized a chunk at a time into a float32 scratch that the
// chunk's query rows (the GQA group's heads times the step's queries) then read from cache: converting each code
// once, not once per row, is what keeps an int8 cache's step as cheap in instructions as it is in bytes.
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& keys, const float* key_scales, const at::Tensor& values,
                const float* value_scales, const at::Tensor& mask, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), L = keys.size(2);
  const int64_t group = H / KV, rows = group * n, size = chunk_for(L, B * KV), chunks = (L + size - 1) / size;
  const ChunkFn kernel = chunk_kernel(D);
  const float* qp = q.data_ptr<float>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  // per (batch row, KV head, chunk, query row): the chunk's maximum, its sum of weights, its weighted values
  std::vector<float> partial(B * KV * chunks * rows * (2 + D));
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(CHUNK), k_scratch, v_scratch;
    std::vector<int64_t> bounds(2 * rows);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KV * chunks), kv = item / chunks % KV, chunk = item % chunks;
      const int64_t head_slots = (b * KV + kv) * L;
      int64_t first = L, last = 0;  // the slots any row of this chunk sees
      for (int64_t r = 0; r < rows; ++r) {
        const bool* m = mp + (b * n + r % n) * L;
        int64_t lo = chunk * size, hi = std::min(L, lo + size);
        while (hi > lo && !m[hi - 1]) --hi;
        while (lo < hi && !m[lo]) ++lo;
        bounds[2 * r] = lo, bounds[2 * r + 1] = hi;
        if (lo < hi) first = std::min(first, lo), last = std::max(last, hi);
      }
      const float *k = nullptr, *v = nullptr;
      int64_t offset = 0;  // slot s of the chunk is row s - offset of k and v
      if constexpr (std::is_same_v<T, int8_t>) {
        if (first < last) {
          k_scratch.resize((last - first) * D), v_scratch.resize((last - first) * D);
          dequantize_rows(kp + head_slots * D, key_scales + head_slots, first, last, D, k_scratch.data());
          dequantize_rows(vp + head_slots * D, value_scales + head_slots, first, last, D, v_scratch.data());
        }
        k = k_scratch.data(), v = v_scratch.data(), offset = first;
      } else {
        k = kp + head_slots * D, v = vp + head_slots * D;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kv * group + r / n, query = r % n;
        const bool* m = mp + (b * n + query) * L;
        const int64_t lo = bounds[2 * r], hi = bounds[2 * r + 1];
        float* slot = partial.data() + (item * rows + r) * (2 + D);
        if (lo >= hi) {  // nothing visible here: an empty partial
          slot[0] = NEG_INF, slot[1] = 0.f;
          continue;
        }
        kernel(qp + ((b * H + h) * n + query) * D, k, v, m + offset, lo - offset, hi - offset, scale, sc.data(),
               slot + 2, slot, slot + 1);
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

// q (B, H, n, D) float32; keys and values (B, KV, L, D) float32, or int8 with scales (B, KV, L, 1) float32; mask
// (B, 1, n, L) bool; all contiguous. Returns (B, H, n, D) float32.
at::Tensor kv_slots_attention(const at::Tensor& q, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                              const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                              const at::Tensor& mask, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "kv_slots_attention: no AVX2 + FMA");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.is_contiguous(), "kv_slots_attention: q float32");
  const bool codes = keys.scalar_type() == at::kChar;
  for (const at::Tensor* t : {&keys, &values})
    TORCH_CHECK(t->scalar_type() == (codes ? at::kChar : at::kFloat) && t->dim() == 4 && t->is_contiguous(),
                "kv_slots_attention: keys and values both float32 or both int8");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t KV = keys.size(1), L = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && values.sizes() == keys.sizes() && KV > 0 && H % KV == 0 &&
                  chunk_kernel(D) != nullptr,
              "kv_slots_attention: shapes (head dims 16 to 128, multiples of 16, keys as wide as values)");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 4 && mask.size(0) == B &&
                  mask.size(1) == 1 && mask.size(2) == n && mask.size(3) == L,
              "kv_slots_attention: mask (B, 1, n, L) bool");
  at::Tensor out = at::empty({B, H, n, D}, q.options());
  if (!codes) {
    attend_all<float>(q, keys, nullptr, values, nullptr, mask, static_cast<float>(scale), out);
    return out;
  }
  for (const auto* s : {&key_scales, &value_scales})
    TORCH_CHECK(s->has_value() && (*s)->scalar_type() == at::kFloat && (*s)->is_contiguous() &&
                    (*s)->numel() == B * KV * L,
                "kv_slots_attention: int8 codes take float32 scales (B, KV, L, 1)");
  attend_all<int8_t>(q, keys, key_scales->data_ptr<float>(), values, value_scales->data_ptr<float>(), mask,
                     static_cast<float>(scale), out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) {
  m.def(
      "kv_slots_attention(Tensor q, Tensor keys, Tensor? key_scales, Tensor values, Tensor? value_scales, "
      "Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("kv_slots_attention", &kv_slots_attention); }

#endif
