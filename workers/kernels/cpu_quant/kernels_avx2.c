/* AVX2 + FMA + F16C variant (vpmaddwd products; bytes widened in lane order). */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PQ_LANE_ORDER
#include "kernels_simd.h"

static int cpu_has(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#pragma GCC pop_options

const pq_isa_impl pq_isa_avx2 = {"avx2", cpu_has, mul_rows, 1, gemm_tile, unpack_row};
#endif
