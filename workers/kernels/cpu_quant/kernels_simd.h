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

/* Q8_0 straight from its blocks (f16 d | int8 q[32]), no decode buffer: one scale per
 * block, so both halves add up in integers first. */
static float dot_q8_0(const uint8_t *w, const int16_t *q, const float *xd, int64_t n32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < n32; b += 2) {
        const uint8_t *b0 = w + 34 * b, *b1 = b0 + 34;
        __m256i p0 = dot16_acc(dot16(widen16((const int8_t *)b0 + 2), q + 32 * b),
                               widen16((const int8_t *)b0 + 18), q + 32 * b + 16);
        __m256i p1 = dot16_acc(dot16(widen16((const int8_t *)b1 + 2), q + 32 * b + 32),
                               widen16((const int8_t *)b1 + 18), q + 32 * b + 48);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_at(b0) * xd[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(f16_at(b1) * xd[b + 1]), acc1);
    }
    if (b < n32) {
        const uint8_t *b0 = w + 34 * b;
        __m256i p0 = dot16_acc(dot16(widen16((const int8_t *)b0 + 2), q + 32 * b),
                               widen16((const int8_t *)b0 + 18), q + 32 * b + 16);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f16_at(b0) * xd[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

#include "kernels_fused.h"

/* Rows of activations up to which a weight row is unpacked once per activation row (the
 * fused dots); above it, decoded once into the buffer and reused by every row. */
#define PQ_FUSED_MAX_M 4
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
    if (t->id == PQ_Q8_0) {
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            prefetch_ahead(wr, a->row_bytes, end);
            for (int64_t m = 0; m < a->M; m++)
                a->y[m * a->ldy + n] = dot_q8_0(wr, a->q + m * K, a->d + m * n32, n32);
        }
        return;
    }
    if (multi_row_type(t->id)) {
        const pq_rows x = {a->q, a->d, a->gsum, K};
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            prefetch_ahead(wr, a->row_bytes, end);
            fused_rows(t->id, wr, x, a->M, a->y + n, a->ldy);
        }
        return;
    }
    if (a->M <= PQ_FUSED_MAX_M) {
        int done = 1;
        for (int64_t n = n0; n < n1 && done; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            prefetch_ahead(wr, a->row_bytes, end);
            for (int64_t m = 0; m < a->M && done; m++)
                a->y[m * a->ldy + n] = fused_dot(t->id, wr, a->q + m * K, a->d + m * n32, K, &done);
        }
        if (done) return;
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
