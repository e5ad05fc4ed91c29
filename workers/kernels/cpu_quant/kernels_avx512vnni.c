/* AVX-512 VNNI variant (EVEX vpdpwssd on 256-bit registers: Ice Lake,
 * Sapphire Rapids, Zen 4). */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define PQ_DOT_VNNI512
#define PQ_BYTE_PLANES
#include "kernels_simd.h"

static int cpu_has(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}
#pragma GCC pop_options

const pq_isa_impl pq_isa_avx512vnni = {"avx512vnni", cpu_has, mul_rows, 0, gemm_tile, unpack_row, 1};
#endif
