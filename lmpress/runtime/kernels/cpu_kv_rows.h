// The vector work of cpu_kv_attention.cpp: R query rows (a KV head's GQA group times a step's queries) scored
// against a chunk of one KV head's cached keys, their softmax, and the values they weight, over float32 entries,
// int8 codes with a scale per slot or FP8 codes with a static scale. Included once per instruction set by
// cpu_kv_attention.cpp, inside a namespace compiled for that set which defines `V`: the vector type `vec` of `W`
// floats, its register count `REGS` and its operations (`load` of W floats or of W int8 or FP8 codes as floats,
// `zero`, `set1`, `mul`, `fma`, `sum_each` (W vectors' sums as one), `store`).
//
// Each cached entry is loaded (and for codes converted) once for all R query rows: keys into a block of W float32
// rows in L1 that every row then reads, values in registers used by every row. The GQA group reads a KV head's
// entries once, and a cache of codes costs one conversion per code, not one per row. The loops are shaped to keep
// their running sums in registers on AVX2's 16 as well as AVX-512's 32: spills cost AMD's Zen 1 (one 256-bit
// load and half a 256-bit store a cycle) more than the products themselves.

// The R rows' scores over the slots [lo, hi): q . key x (the slot's scale for codes) x scale, into sc[r][s - lo].
// W slots at a time: their keys (converted once for codes, into a block of float32 rows), each row's W dot products
// summed across lanes together (V::sum_each), not one horizontal sum per slot. A row's W running sums and one query
// vector are all the registers the inner loop holds (W + 1: 9 of AVX2's 16), so nothing spills: holding every row's
// query in registers as well (R x NV vectors) spilled on AVX2, two loads per product, which AMD's Zen cores (one
// 256-bit load a cycle) paid for at every product.
template <typename T, int NV, int R>
void row_scores(const RowGroup<T>& g, int64_t lo, int64_t hi) {
  constexpr int D = NV * V::W;
  alignas(64) float converted[V::W * D];
  alignas(64) float sums[V::W];
  for (int64_t s0 = lo; s0 < hi; s0 += V::W) {
    const int count = static_cast<int>(std::min<int64_t>(V::W, hi - s0));
    const float* block = converted;  // the block's keys as W float32 rows (a short last block padded with zeros)
    if constexpr (std::is_same_v<T, float>) {
      if (count == V::W)
        block = g.keys + s0 * D;
      else
        std::copy(g.keys + s0 * D, g.keys + (s0 + count) * D, converted);
    } else {
      for (int i = 0; i < count; ++i)
        for (int j = 0; j < NV; ++j) V::store(converted + i * D + j * V::W, V::load(g.keys + (s0 + i) * D + j * V::W));
    }
    if (count < V::W) std::fill(converted + count * D, converted + V::W * D, 0.f);
    for (int r = 0; r < R; ++r) {
      typename V::vec dot[V::W];
      for (int i = 0; i < V::W; ++i) dot[i] = V::zero();
      for (int j = 0; j < NV; ++j) {
        const typename V::vec qj = V::load(g.q[r] + j * V::W);
        for (int i = 0; i < V::W; ++i) dot[i] = V::fma(qj, V::load(block + i * D + j * V::W), dot[i]);
      }
      V::store(sums, V::sum_each(dot));
      float* out = g.scores[r] + (s0 - lo);
      for (int i = 0; i < count; ++i) out[i] = sums[i] * (g.key_scales ? g.key_scales[s0 + i] * g.scale : g.scale);
    }
  }
}

// Vectors of a value row one pass over the slots accumulates: the most (a divisor of NV) whose R x C running sums,
// C value vectors and a broadcast weight fit the register file.
template <int NV, int R>
constexpr int value_columns() {
  int c = NV;
  while (c > 1 && (NV % c || (R + 1) * c + 1 > V::REGS)) --c;
  return c;
}

// The R rows' weighted values over the slots [lo, hi): sum over s of weights[r][s - lo] x value_s, into g.acc[r]
// (the weights hold each code row's scale already). A pass accumulates C columns of vectors (value_columns), so
// its running sums stay in registers, over a tile of TILE slots, so the codes the next pass reads are still in L1
// at any head width; each value entry is still loaded (and converted) once.
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
        const T* value = g.values + (s * NV + c0) * V::W;
        typename V::vec v[C];
        for (int j = 0; j < C; ++j) v[j] = V::load(value + j * V::W);
        for (int r = 0; r < R; ++r) {
          const typename V::vec p = V::set1(g.scores[r][s - lo]);
          for (int j = 0; j < C; ++j) acc[r][j] = V::fma(p, v[j], acc[r][j]);
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
  row_scores<T, NV, R>(g, g.first, g.last);
  for (int r = 0; r < R; ++r) row_softmax(g, r);
  row_values<T, NV, R>(g, g.first, g.last);
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
