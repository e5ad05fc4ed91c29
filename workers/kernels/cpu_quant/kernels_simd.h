/* The x86 SIMD variants, one body: kernels_<isa>.c set the target pragma and
 * PQ_DOT_* and include this file. All work on 32-element blocks in 256-bit
 * registers: weights int8 (sign-extended to int16), activations int16, one
 * int16 x int16 -> int32 pair-product instruction per 16 elements: vpdpwssd
 * (VNNI) or vpmaddwd (AVX2; exact, since |w| <= 128 keeps a pair below 2^31). */
#include <immintrin.h>

#include "kernels.h"

/* acc + 8 int32 lanes, each the sum of two adjacent products: one group of 16. */
static inline __m256i dot16_acc(__m256i acc, __m256i w16, const int16_t *q) {
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
#if defined(PQ_DOT_VNNI512)
    return _mm256_dpwssd_epi32(acc, w16, x);
#elif defined(PQ_DOT_AVXVNNI)
    return _mm256_dpwssd_avx_epi32(acc, w16, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, x));
#endif
}

static inline __m256i dot16(__m256i w16, const int16_t *q) {
    return dot16_acc(_mm256_setzero_si256(), w16, q);
}

static inline __m256i widen16(const int8_t *v) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)v));
}

/* 32 unsigned bytes u (element order) -> the int16 values u - bias, 16 a register, in the
 * order this variant reads activations: natural (sign-extending vpmovsxbw; u - bias must fit
 * int8), or, with PQ_LANE_ORDER, in-lane unpacks. vpmovsxbw crosses the register's 128-bit
 * lanes, and on Zen 3 the two of them took most of a block's shuffle-pipe time; the
 * unpacks give elements 0-7, 16-23 | 8-15, 24-31, the order of pq_mm_args.qp. */
static inline void widen_u8(__m256i u, int bias, __m256i *w0, __m256i *w1) {
#if defined(PQ_LANE_ORDER)
    const __m256i z = _mm256_setzero_si256();
    *w0 = _mm256_unpacklo_epi8(u, z);
    *w1 = _mm256_unpackhi_epi8(u, z);
    if (bias) {
        *w0 = _mm256_sub_epi16(*w0, _mm256_set1_epi16((short)bias));
        *w1 = _mm256_sub_epi16(*w1, _mm256_set1_epi16((short)bias));
    }
#else
    if (bias) u = _mm256_sub_epi8(u, _mm256_set1_epi8((char)bias));
    *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(u));
    *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(u, 1));
#endif
}

/* 32 signed bytes -> int16, in the same order as widen_u8 (the lane order sign-extends
 * with in-lane unpacks against the sign bytes). */
static inline void widen_s8(__m256i v, __m256i *w0, __m256i *w1) {
#if defined(PQ_LANE_ORDER)
    const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
    *w0 = _mm256_unpacklo_epi8(v, sign);
    *w1 = _mm256_unpackhi_epi8(v, sign);
#else
    *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float dot_decoded(const int8_t *v, const float *scale, const int16_t *q, const float *xd,
                         int64_t n32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < n32; b++) {
        __m256i p0 = dot16(widen16(v + 32 * b), q + 32 * b);
        __m256i p1 = dot16(widen16(v + 32 * b + 16), q + 32 * b + 16);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(scale[2 * b] * xd[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(scale[2 * b + 1] * xd[b]), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#include "kernels_fused.h"

/* Bytes ahead of the row being multiplied that are prefetched: the hardware prefetchers
 * stop at each 4 KiB page, and a decode step streams every weight from memory once. */
#define PQ_PREFETCH_BYTES 2048

static inline void prefetch_ahead(const uint8_t *row, int64_t row_bytes, const uint8_t *end) {
    for (int64_t o = 0; o < row_bytes; o += 64)
        if (row + PQ_PREFETCH_BYTES + o < end) __builtin_prefetch(row + PQ_PREFETCH_BYTES + o);
}

static void mul_rows(const pq_mm_args *a, int64_t n0, int64_t n1, pq_scratch *s) {
    const pq_type_info *t = a->t;
    int64_t K = a->K, n32 = K / 32;
    const uint8_t *end = a->w_end;
#if defined(PQ_LANE_ORDER)
    const int16_t *qf = a->qp; /* what the multi-row types' fused dots read */
#else
    const int16_t *qf = a->q;
#endif
    /* One row takes the fused dots too (a Q8_0 row of its own, two accumulators over block
     * pairs, was 40% faster in cache but summed in another order): a row's logits are then
     * the same whatever else shares its step below the many-row product, which speculative
     * decoding's exactness rests on (docs/speculative.md). */
    if (multi_row_type(t->id)) {
        const pq_rows x = {qf, a->d, a->gsum, K, a->qlo, a->qhi};
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            prefetch_ahead(wr, a->row_bytes, end);
            fused_rows(t->id, wr, x, a->M, a->y + n, a->ldy);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        t->decode(a->w + n * a->row_bytes, K / t->block_elems, s->v, s->scale, s->offset);
        for (int64_t m = 0; m < a->M; m++) {
            const float *xd = a->d + m * n32;
            float r = dot_decoded(s->v, s->scale, a->q + m * K, xd, n32);
            if (t->has_offset) r += pq_offset_term(s->offset, a->gsum + m * (K / 16), xd, K / 16);
            a->y[m * a->ldy + n] = r;
        }
    }
}

#include "gemm_tile_simd.h"
