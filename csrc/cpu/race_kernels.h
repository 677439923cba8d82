// Row kernels of race_sample and race_noise on the CPU (csrc/include/specdec/race_math.h), compiled
// once per CPU capability by race_kernels.cpp and picked with the choice the pooling kernels make
// (pool_kernels.h: ATen's CPU capability, honouring ATEN_CPU_CAPABILITY). Plain structs of raw
// pointers, no torch types: nothing from a torch header is compiled for a wider instruction set.
#pragma once

#include <cstdint>

namespace specdec {
namespace cpu {

// One call's arguments: p [M, V] contiguous float32 (race_sample) or out [M, V] (race_noise);
// images, positions [M] int64; purposes [M] int64 or nullptr (then every row has `purpose`).
struct RaceRows {
  const float* p = nullptr;
  const int64_t* images = nullptr;
  const int64_t* positions = nullptr;
  const int64_t* purposes = nullptr;
  int64_t purpose = 0;
  uint64_t seed = 0;
  int64_t m = 0, v = 0;
  int32_t* tokens = nullptr;
  int32_t* errors = nullptr;  // [M] value-check codes (race_math.h, kBadP), or nullptr: no checks
  float* noise = nullptr;     // race_noise's output
};

struct RaceKernels {
  const char* name;  // "avx512", "avx2" or "default"
  void (*sample_rows)(const RaceRows&, int64_t begin, int64_t end);
  void (*noise_rows)(const RaceRows&, int64_t begin, int64_t end);
};

// The table of the instruction set the pooling kernels use (cpu::kernels().name).
const RaceKernels& race_kernels();

}  // namespace cpu
}  // namespace specdec
