// The fast Walsh-Hadamard transform in power-of-two blocks, float32: the runtime's online rotations (R4 before
// down_proj, the rotate stage's input blocks before every linear; online_rotation.py).
//
// Each block of ``block`` values of a row becomes H x / sqrt(block), H the Sylvester matrix in natural order. The
// butterfly is hadamard.hadamard_transform's, operation for operation: stages h = 1, 2, 4, ... turn each pair
// (x[j], x[j + h]) of a run of 2h into (a + b, a - b), then one multiply by the float32 value of 1 / sqrt(block).
// Float additions are the same in any order of independent pairs, so the op's output equals the torch butterfly's
// bit for bit: the runtime turns inputs exactly as the evaluator's hooks do. log2(block) passes over the block in
// the L1 cache, about block * log2(block) additions; stages with h of 8 or more run as whole vectors (the compiler
// widens the inner loop), the first three stay scalar. Portable C++: the op builds on every host the library does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t PARALLEL_VALUES = 1 << 16;  // values per thread's share at least: a decode row runs on one thread

inline void butterfly(float* __restrict x, int64_t block, float scale) {
  for (int64_t h = 1; h < block; h *= 2)
    for (int64_t run = 0; run < block; run += 2 * h) {
      float* __restrict a = x + run;
      float* __restrict b = x + run + h;
      for (int64_t j = 0; j < h; ++j) {
        const float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
      }
    }
  for (int64_t j = 0; j < block; ++j) x[j] *= scale;
}

at::Tensor hadamard_blocks(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "hadamard_blocks: x is a contiguous float32 tensor");
  TORCH_CHECK(block >= 2 && (block & (block - 1)) == 0, "hadamard_blocks: a block is a power of two >= 2, not ",
              block);
  TORCH_CHECK(x.size(-1) % block == 0, "hadamard_blocks: blocks of ", block, " do not divide the last dimension (",
              x.size(-1), ")");
  at::Tensor y = x.clone();
  float* out = y.data_ptr<float>();
  const int64_t blocks = y.numel() / block;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  at::parallel_for(0, blocks, std::max<int64_t>(1, PARALLEL_VALUES / block), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) butterfly(out + i * block, block, scale);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmpress_cpu, m) { m.def("hadamard_blocks(Tensor x, int block) -> Tensor"); }

TORCH_LIBRARY_IMPL(lmpress_cpu, CPU, m) { m.impl("hadamard_blocks", &hadamard_blocks); }
