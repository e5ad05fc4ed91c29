/* Prefill products in bfloat16 (AVX-512 BF16: Zen 4, Cooper Lake, Sapphire Rapids).
 *
 * A long prompt's product is compute-bound, and vdpbf16ps multiplies twice the pairs
 * per instruction that a float32 FMA does. The activations are rounded to bfloat16 once
 * per product and packed by 32 rows (pq_bf16_pack_act); each thread decodes a chunk of
 * weight rows to bfloat16 rows (pq_bf16_rows) and multiplies them against every packed
 * panel, accumulating in float32: the output is float32, unrounded (rounding it to
 * bfloat16 moved the top token far more often than rounding the inputs; see
 * docs/cpu_kernels.md). A row's sums run in the same order whatever the number of
 * rows, so a prompt computes the same alone as batched.
 */
#include <string.h>

#include "gemm_bf16.h"

/* AVX-512 BF16 intrinsics: GCC 10 and clang 9 onward; an older compiler builds the stubs
 * below (the product is refused, prefill takes sgemm) rather than failing the library. */
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>

int pq_bf16_cpu_has(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* ap[p][kp][r] = the bfloat16 pair (x[32p + r][2kp], x[32p + r][2kp + 1]); rows past M are 0. */
void pq_bf16_pack_act(const float *x, int64_t M, int64_t K, int64_t ldx, uint32_t *ap,
                      int64_t p0, int64_t p1) {
    uint32_t pairs[16] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; p++) {
        uint32_t *panel = ap + p * (K / 2) * PQ_BF16_MR;
        for (int r = 0; r < PQ_BF16_MR; r++) {
            int64_t m = p * PQ_BF16_MR + r;
            const float *xm = x + m * ldx;
            for (int64_t k = 0; k < K; k += 32) { /* 32 floats -> 16 pairs */
                if (m < M) {
                    __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xm + k + 16),
                                                     _mm512_loadu_ps(xm + k));
                    _mm512_store_si512((void *)pairs, (__m512i)h);
                } else {
                    memset(pairs, 0, sizeof pairs);
                }
                for (int i = 0; i < 16; i++) panel[(k / 2 + i) * PQ_BF16_MR + r] = pairs[i];
            }
        }
    }
}

/* One decoded row (canonical form: scale[i/16] * v[i] + offset[i/16]) as bfloat16. */
static void row_to_bf16(const pq_scratch *s, int64_t K, uint16_t *out) {
    for (int64_t g = 0; g < K / 16; g++) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(s->v + 16 * g))));
        __m512 w = _mm512_fmadd_ps(v, _mm512_set1_ps(s->scale[g]), _mm512_set1_ps(s->offset[g]));
        _mm256_storeu_si256((__m256i *)(out + 16 * g), (__m256i)_mm512_cvtneps_pbh(w));
    }
}

/* y[m][0..NW) for the 32 rows of one packed panel against NW bfloat16 weight rows. */
static inline void panel_tile(const uint32_t *panel, const uint32_t *const *w, int64_t kpairs,
                              float *y, int64_t ldy, int64_t rows) {
    __m512 acc[2][PQ_BF16_NW];
    for (int j = 0; j < PQ_BF16_NW; j++) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kpairs; kp++) {
        __m512bh a0 = (__m512bh)_mm512_load_si512((const void *)(panel + kp * PQ_BF16_MR));
        __m512bh a1 = (__m512bh)_mm512_load_si512((const void *)(panel + kp * PQ_BF16_MR + 16));
        for (int j = 0; j < PQ_BF16_NW; j++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[j][kp]);
            acc[0][j] = _mm512_dpbf16_ps(acc[0][j], a0, b);
            acc[1][j] = _mm512_dpbf16_ps(acc[1][j], a1, b);
        }
    }
    float tile[PQ_BF16_NW][PQ_BF16_MR] __attribute__((aligned(64)));
    for (int j = 0; j < PQ_BF16_NW; j++) {
        _mm512_store_ps(tile[j], acc[0][j]);
        _mm512_store_ps(tile[j] + 16, acc[1][j]);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < PQ_BF16_NW; j++) y[r * ldy + j] = tile[j][r];
}

void pq_bf16_rows(const pq_type_info *t, const uint8_t *w, int64_t row_bytes, int64_t n0,
                  int64_t n1, int64_t K, const uint32_t *ap, int64_t M, float *y, int64_t ldy,
                  pq_scratch *s, uint16_t *wb) {
    for (int64_t n = n0; n < n1; n += PQ_BF16_NW) {
        int nw = n1 - n < PQ_BF16_NW ? (int)(n1 - n) : PQ_BF16_NW;
        const uint32_t *rows[PQ_BF16_NW];
        for (int j = 0; j < PQ_BF16_NW; j++) {
            uint16_t *dst = wb + (int64_t)j * K;
            if (j < nw) {
                t->decode(w + (n + j) * row_bytes, K / t->block_elems, s->v, s->scale, s->offset);
                row_to_bf16(s, K, dst);
            } else {
                memset(dst, 0, sizeof(uint16_t) * (size_t)K); /* a short last group: zero rows */
            }
            rows[j] = (const uint32_t *)dst;
        }
        for (int64_t p = 0; p * PQ_BF16_MR < M; p++) {
            int64_t m0 = p * PQ_BF16_MR, rows_here = M - m0 < PQ_BF16_MR ? M - m0 : PQ_BF16_MR;
            if (nw == PQ_BF16_NW) {
                panel_tile(ap + p * (K / 2) * PQ_BF16_MR, rows, K / 2, y + m0 * ldy + n, ldy, rows_here);
            } else { /* into a scratch tile, then only the nw real columns */
                float part[PQ_BF16_MR * PQ_BF16_NW];
                panel_tile(ap + p * (K / 2) * PQ_BF16_MR, rows, K / 2, part, PQ_BF16_NW, rows_here);
                for (int64_t r = 0; r < rows_here; r++)
                    memcpy(y + (m0 + r) * ldy + n, part + r * PQ_BF16_NW, sizeof(float) * (size_t)nw);
            }
        }
    }
}
#pragma GCC pop_options

#else
int pq_bf16_cpu_has(void) { return 0; }
void pq_bf16_pack_act(const float *x, int64_t M, int64_t K, int64_t ldx, uint32_t *ap,
                      int64_t p0, int64_t p1) {
    (void)x, (void)M, (void)K, (void)ldx, (void)ap, (void)p0, (void)p1;
}
void pq_bf16_rows(const pq_type_info *t, const uint8_t *w, int64_t row_bytes, int64_t n0,
                  int64_t n1, int64_t K, const uint32_t *ap, int64_t M, float *y, int64_t ldy,
                  pq_scratch *s, uint16_t *wb) {
    (void)t, (void)w, (void)row_bytes, (void)n0, (void)n1, (void)K, (void)ap, (void)M, (void)y,
        (void)ldy, (void)s, (void)wb;
}
#endif
