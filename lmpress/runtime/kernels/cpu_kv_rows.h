// The vector work of cpu_kv_attention.cpp: R query rows (a KV head's GQA group times a step's queries) scored
// against a chunk of one KV head's cached keys, their softmax, and the values they weight, over float32 entries,
// int8 codes with a scale per slot or FP8 codes with a static scale. Included once per instruction set by
// cpu_kv_attention.cpp, inside a namespace compiled for that set which defines `V`: the vector type `vec` of `W`
// floats and its operations (`load` of W floats or of W int8 or FP8 codes as floats, `zero`, `set1`, `mul`, `fma`,
// `sum_each` (W vectors' sums as one), `store`).
//
// Each cached row is loaded (and for codes converted) once and used by all R query rows while it is in registers:
// the GQA group reads a KV head's entries once, and a cache of codes costs one conversion per code, not one per row.

// The R rows' scores over the slots [lo, hi): q . key x (the slot's scale for codes) x scale, into sc[r][s - lo].
// W slots at a time: their keys (converted once for codes), each row's W dot products summed across lanes together
// (V::sum_each), not one horizontal sum per slot.
template <typename T, int NV, int R>
void row_scores(const RowGroup<T>& g, int64_t lo, int64_t hi) {
  constexpr int D = NV * V::W;
  typename V::vec qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) qv[r][j] = V::load(g.q[r] + j * V::W);
  alignas(64) float converted[V::W * D];
  alignas(64) float sums[V::W];
  for (int64_t s0 = lo; s0 < hi; s0 += V::W) {
    const int count = static_cast<int>(std::min<int64_t>(V::W, hi - s0));
    const float* block = nullptr;  // the block's keys as float32 rows
    if constexpr (std::is_same_v<T, float>) {
      block = g.keys + s0 * D;
    } else {
      for (int i = 0; i < count; ++i)
        for (int j = 0; j < NV; ++j) V::store(converted + i * D + j * V::W, V::load(g.keys + (s0 + i) * D + j * V::W));
      block = converted;
    }
    for (int r = 0; r < R; ++r) {
      typename V::vec dot[V::W];
      for (int i = 0; i < V::W; ++i) {
        if (i >= count) {
          dot[i] = V::zero();
          continue;
        }
        dot[i] = V::mul(qv[r][0], V::load(block + i * D));
        for (int j = 1; j < NV; ++j) dot[i] = V::fma(qv[r][j], V::load(block + i * D + j * V::W), dot[i]);
      }
      V::store(sums, V::sum_each(dot));
      float* out = g.scores[r] + (s0 - lo);
      for (int i = 0; i < count; ++i) out[i] = sums[i] * (g.key_scales ? g.key_scales[s0 + i] * g.scale : g.scale);
    }
  }
}

// The R rows' weighted values over the slots [lo, hi): sum over s of weights[r][s - lo] x value_s, into g.acc[r]
// (the weights hold each code row's scale already).
template <typename T, int NV, int R>
void row_values(const RowGroup<T>& g, int64_t lo, int64_t hi) {
  typename V::vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  for (int64_t s = lo; s < hi; ++s) {
    const T* value = g.values + s * NV * V::W;
    typename V::vec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = V::load(value + j * V::W);
    for (int r = 0; r < R; ++r) {
      const typename V::vec p = V::set1(g.scores[r][s - lo]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(p, v[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) V::store(g.acc[r] + j * V::W, acc[r][j]);
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
