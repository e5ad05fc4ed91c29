/* AVX-VNNI variant (VEX vpdpwssd: Alder Lake and later without AVX-512). */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define PQ_DOT_AVXVNNI
#define PQ_BYTE_PLANES
#include "kernels_simd.h"

static int cpu_has(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avxvnni");
}
#pragma GCC pop_options

const pq_isa_impl pq_isa_avxvnni = {"avxvnni", cpu_has, mul_rows, 0, gemm_tile, unpack_row, 1};
#endif
