// The vector work of cpu_kv_attention.cpp: R query rows (a KV head's GQA group times a step's queries) scored
// against a chunk of one KV head's cached keys, their softmax, and the values they weight, over float32 entries,
// int8 codes with a scale per slot or FP8 codes with a static scale. Included once per instruction set by
// cpu_kv_attention.cpp, inside a namespace compiled for that set which defines `V`: the vector type `vec` of `W`
// floats, its register count `REGS` and its operations (`load` of W floats or of W int8 or FP8 codes as floats,
// `zero`, `set1`, `mul`, `fma`, `sum_each` (W vectors' sums as one), `store`).
//
// Each cached entry is loaded (and for codes converted) once for all R query rows, straight into a register that
// every row's running sums then take: the GQA group reads a KV head's entries once, and a cache of codes costs one
// conversion per code, not one per row. The loops are shaped to keep their running sums, the rows' query vectors
// or weights and the entry in registers on AVX2's 16 as well as AVX-512's 32: loads and spills cost AMD's Zen 1
// (one 256-bit load and half a 256-bit store a cycle) more than the products themselves.

// Slots one pass of row_scores dots at once: the most (a divisor of W) whose R x S running sums, the R rows' query
// vectors and one key vector fit the register file (R = 3 on AVX2: 4 slots, all 16 registers).
template <int R>
constexpr int score_slots() {
  int s = V::W;
  while (s > 1 && (V::W % s || R * s + R + 1 > V::REGS)) --s;
  return s;
}

// Row r's dot products q[r] . key_s over n slots of `keys` (entries of type K, PER<K> to a stored element, the first
// slot's first), finished as out[r][i] = finish(r, i, dot) (the scales: inlined into the loop that stores them);
// `ahead`: the same slots' values (ahead_bytes a slot) to ask for meanwhile, or null. W slots at a time, S (score_slots) a pass: each key vector is loaded (and for codes converted) once,
// straight into a register, and multiplied into all R rows' sums while the R query vectors stay in registers, so a
// pass makes R x S products for every R + S loads. Each row's W dot products are then summed across lanes together
// (V::sum_each), not one horizontal sum per slot. (Converting a block of keys into float32 rows in L1 first, and
// every row reading them back, made a load per product and a store per key vector: Zen 1's one 256-bit load and
// half a 256-bit store a cycle bound the op there, not its products.)
template <typename K, int NV, int R, typename Finish>
void dot_rows(const float* const* q, const K* keys, int64_t n, float* const* out, const char* ahead,
              int64_t ahead_bytes, Finish finish) {
  constexpr int D = NV * V::W, S = score_slots<R>();
  constexpr int64_t ROW = D / PER<K>, STEP = V::W / PER<K>;  // stored elements of an entry, of a vector
  alignas(64) K padded[V::W * ROW];  // a short last block's entries, zeros after them
  alignas(64) float sums[V::W];
  for (int64_t s0 = 0; s0 < n; s0 += V::W) {
    const int count = static_cast<int>(std::min<int64_t>(V::W, n - s0));
    const K* block = keys + s0 * ROW;
    // Codes: the same slots' values, which row_values reads next, asked for now so they arrive while the keys are
    // dotted (op A/B on a Zen 4 EPYC, 300 of 528 slots: int8 0.88x the time, FP8 0.85x; float32 rows, four times
    // the lines, ran 1.13x slower with it: their requests crowd out the keys' own).
    if (ahead)
      for (int64_t b = 0; b < count * ahead_bytes; b += 64) _mm_prefetch(ahead + s0 * ahead_bytes + b, _MM_HINT_T0);
    if (count < V::W) {  // zero codes are 0.0 in every stored type
      std::copy(block, block + count * ROW, padded);
      std::fill(padded + count * ROW, padded + V::W * ROW, K{});
      block = padded;
    }
    typename V::vec dot[R][V::W];
    for (int i0 = 0; i0 < V::W; i0 += S) {
      typename V::vec acc[R][S];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < S; ++i) acc[r][i] = V::zero();
      for (int j = 0; j < NV; ++j) {
        typename V::vec qv[R];
        for (int r = 0; r < R; ++r) qv[r] = V::load(q[r] + j * V::W);
        for (int i = 0; i < S; ++i) {
          const typename V::vec key = V::load(block + (i0 + i) * ROW + j * STEP);
          for (int r = 0; r < R; ++r) acc[r][i] = V::fma(qv[r], key, acc[r][i]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < S; ++i) dot[r][i0 + i] = acc[r][i];
    }
    for (int r = 0; r < R; ++r) {
      V::store(sums, V::sum_each(dot[r]));
      for (int i = 0; i < count; ++i) out[r][s0 + i] = finish(r, s0 + i, sums[i]);
    }
  }
}

// The R rows' scores over the group's slots [g.first, g.last) into g.scores[r][s - g.first]: q . key x (the slot's
// scale for int8 codes) x scale; INT4 codes with a step and minimum per slot: (q . codes x step + minimum x the sum
// of q) x scale; INT4 keys with a step and minimum per channel and group of slots (KIVI): the group's query
// q o step dotted with the codes, plus q . minimum, and from g.whole on the float keys of the unfinished group.
template <typename T, int NV, int R>
void row_scores(const RowGroup<T>& g) {
  constexpr int64_t D = NV * V::W, ROW = D / PER<T>;
  const int64_t lo = g.first, n = g.last - g.first;
  const char* ahead = std::is_same_v<T, float> ? nullptr : reinterpret_cast<const char*>(g.values + lo * ROW);
  const int64_t ahead_bytes = ROW * static_cast<int64_t>(sizeof(T));
  const float scale = g.scale;
  const auto scaled = [scale](int, int64_t, float dot) { return dot * scale; };
  if (!g.key_groups) {
    const T* keys = g.keys + lo * ROW;
    if (g.key_scales) {
      const float* slot_scales = g.key_scales + lo;
      dot_rows<T, NV, R>(g.q, keys, n, g.scores, ahead, ahead_bytes,
                         [=](int, int64_t i, float dot) { return dot * (slot_scales[i] * scale); });
    } else if (g.key_step) {
      const float *step = g.key_step, *low = g.key_low, *qsum = g.qsum;
      dot_rows<T, NV, R>(g.q, keys, n, g.scores, ahead, ahead_bytes,
                         [=](int r, int64_t i, float dot) { return (dot * step[i] + low[i] * qsum[r]) * scale; });
    } else {
      dot_rows<T, NV, R>(g.q, keys, n, g.scores, ahead, ahead_bytes, scaled);
    }
    return;
  }
  alignas(64) float stepped[R][D];
  const float* queries[R];
  float* out[R];
  for (int r = 0; r < R; ++r) queries[r] = stepped[r];
  for (int64_t a = lo; a < std::min(g.last, g.whole);) {  // the quantized groups, one at a time
    const int64_t group = a / g.group, b = std::min({(group + 1) * g.group, g.last, g.whole});
    const at::Half* steps = g.key_groups + group * 2 * D;
    float bias[R];  // q . minima
    for (int r = 0; r < R; ++r) {
      typename V::vec low = V::zero();
      for (int j = 0; j < NV; ++j) {
        const typename V::vec x = V::load(g.q[r] + j * V::W);
        V::store(stepped[r] + j * V::W, V::mul(x, V::load(steps + j * V::W)));
        low = V::fma(x, V::load(steps + D + j * V::W), low);
      }
      alignas(64) float lanes[V::W];
      V::store(lanes, low);
      bias[r] = std::accumulate(lanes, lanes + V::W, 0.f);
      out[r] = g.scores[r] + (a - lo);
    }
    dot_rows<T, NV, R>(queries, g.keys + a * ROW, b - a, out, ahead + (a - lo) * ahead_bytes, ahead_bytes,
                       [&bias, scale](int r, int64_t, float dot) { return (dot + bias[r]) * scale; });
    a = b;
  }
  const int64_t start = std::max(lo, g.whole);
  if (start >= g.last) return;
  // the unfinished group's float keys: slot s at s % ring, contiguous there (the group starts at a multiple of it)
  for (int r = 0; r < R; ++r) out[r] = g.scores[r] + (start - lo);
  dot_rows<float, NV, R>(g.q, g.recent + (start % g.ring) * D, g.last - start, out, nullptr, 0, scaled);
}

// Vectors of a value row one pass over the slots accumulates: the most (a divisor of NV) whose R x C running sums,
// the R rows' broadcast weights and one value vector fit the register file (R = 3 on AVX2: 4 of 8, 16 registers).
template <int NV, int R>
constexpr int value_columns() {
  int c = NV;
  while (c > 1 && (NV % c || R * c + R + 1 > V::REGS)) --c;
  return c;
}

// The R rows' weighted values over the slots [lo, hi): sum over s of weights[r][s - lo] x value_s, into g.acc[r]
// (the weights hold each code row's scale already). A pass accumulates C columns of vectors (value_columns), so
// its running sums stay in registers, over a tile of TILE slots, so the codes the next pass reads are still in L1
// at any head width; each value entry is still loaded (and converted) once, and each slot's R weights are
// broadcast once a pass, not once per row and value vector.
template <typename T, int NV, int R>
void row_values(const RowGroup<T>& g, int64_t lo, int64_t hi) {
  // float32 rows go whole (C = NV: the running sums spill, but the step waits on memory, and whole rows stream;
  // column passes over float32 rows read each row a cache line at a time and ran slower)
  constexpr int C = std::is_same_v<T, float> ? NV : value_columns<NV, R>();
  constexpr int64_t TILE = 32;
  for (int r = 0; r < R; ++r) std::fill(g.acc[r], g.acc[r] + NV * V::W, 0.f);
  for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
    const int64_t t1 = std::min(hi, t0 + TILE);
    for (int c0 = 0; c0 < NV; c0 += C) {
      typename V::vec acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < C; ++j) acc[r][j] = V::load(g.acc[r] + (c0 + j) * V::W);
      for (int64_t s = t0; s < t1; ++s) {
        const T* value = g.values + (s * NV + c0) * V::W / PER<T>;
        typename V::vec p[R];
        for (int r = 0; r < R; ++r) p[r] = V::set1(g.scores[r][s - lo]);
        for (int j = 0; j < C; ++j) {
          const typename V::vec v = V::load(value + j * V::W / PER<T>);
          for (int r = 0; r < R; ++r) acc[r][j] = V::fma(p[r], v, acc[r][j]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < C; ++j) V::store(g.acc[r] + (c0 + j) * V::W, acc[r][j]);
    }
  }
}

// One group of R rows over the slots [g.first, g.last) of a chunk: scores, each row's softmax over what its mask
// shows (its maximum and sum of weights into g.top and g.total), the weighted values into g.acc.
template <typename T, int NV, int R>
void attend_rows(const RowGroup<T>& g) {
  row_scores<T, NV, R>(g);
  for (int r = 0; r < R; ++r) row_softmax(g, r);
  row_values<T, NV, R>(g, g.first, g.last);
  if (g.value_step)  // INT4 values: the minima's share, sum over s of weight_s x minimum_s, in every channel
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < NV * V::W; ++d) g.acc[r][d] += g.low_sum[r];
  if (g.value_scale != 1.f)
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < NV * V::W; ++d) g.acc[r][d] *= g.value_scale;
}

// attend_rows for a head width (NV vectors) and a number of rows (1 to MAX_ROWS); null for other widths.
template <typename T>
RowsFn<T> rows_kernel(int64_t width, int64_t rows) {
  if (width % V::W) return nullptr;
  const auto by_rows = [rows](auto nv) -> RowsFn<T> {
    constexpr int NV = decltype(nv)::value;
    switch (rows) {
      case 1: return attend_rows<T, NV, 1>;
      case 2: return attend_rows<T, NV, 2>;
      case 3: return attend_rows<T, NV, 3>;
      default: return attend_rows<T, NV, 4>;
    }
  };
  switch (width / V::W) {
    case 1: return by_rows(std::integral_constant<int, 1>());
    case 2: return by_rows(std::integral_constant<int, 2>());
    case 3: return by_rows(std::integral_constant<int, 3>());
    case 4: return by_rows(std::integral_constant<int, 4>());
    case 6: return by_rows(std::integral_constant<int, 6>());
    case 8: return by_rows(std::integral_constant<int, 8>());
    case 12: return by_rows(std::integral_constant<int, 12>());
    case 16: return by_rows(std::integral_constant<int, 16>());
    default: return nullptr;
  }
}
