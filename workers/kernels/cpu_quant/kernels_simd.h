/* The x86 SIMD variants, one body: kernels_<isa>.c set the target pragma and
 * PQ_DOT_* and include this file. All work on 32-element blocks in 256-bit
 * registers: weights int8 (signed), activations int8 (signed), multiplied with
 * the sign trick (|w| unsigned times sign(w)*q signed) so one u8 x s8 product
 * instruction serves: vpdpbusd (VNNI) or vpmaddubsw + vpmaddwd (AVX2; no
 * saturation since |w| <= 128 and |q| <= 127). */
#include <immintrin.h>

#include "kernels.h"

/* 8 int32 lanes; lane i = sum of the products of bytes 4i..4i+3, so lanes 0-3
 * cover elements 0-15 and lanes 4-7 elements 16-31. */
static inline __m256i dot_s8(__m256i w, __m256i q) {
    __m256i aw = _mm256_abs_epi8(w), sq = _mm256_sign_epi8(q, w);
#if defined(PQ_DOT_VNNI512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sq);
#elif defined(PQ_DOT_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sq);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sq), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* [s[0] x4 | s[1] x4] times x: the factors of a block's two groups of 16 */
static inline __m256 pair_scale(const float *s, float x) {
    __m256 p = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s[0])), _mm_set1_ps(s[1]), 1);
    return _mm256_mul_ps(p, _mm256_set1_ps(x));
}

static float dot_decoded(const int8_t *v, const float *scale, const int8_t *q, const float *xd,
                         int64_t n32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < n32; b += 2) {
        __m256 p0 = _mm256_cvtepi32_ps(dot_s8(load32(v + 32 * b), load32(q + 32 * b)));
        __m256 p1 = _mm256_cvtepi32_ps(dot_s8(load32(v + 32 * b + 32), load32(q + 32 * b + 32)));
        acc0 = _mm256_fmadd_ps(p0, pair_scale(scale + 2 * b, xd[b]), acc0);
        acc1 = _mm256_fmadd_ps(p1, pair_scale(scale + 2 * b + 2, xd[b + 1]), acc1);
    }
    if (b < n32) {
        __m256 p0 = _mm256_cvtepi32_ps(dot_s8(load32(v + 32 * b), load32(q + 32 * b)));
        acc0 = _mm256_fmadd_ps(p0, pair_scale(scale + 2 * b, xd[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q8_0 straight from its blocks (f16 d | int8 q[32]), no decode buffer. */
static float dot_q8_0(const uint8_t *w, const int8_t *q, const float *xd, int64_t n32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < n32; b += 2) {
        const uint8_t *b0 = w + 34 * b, *b1 = b0 + 34;
        __m256 p0 = _mm256_cvtepi32_ps(dot_s8(load32(b0 + 2), load32(q + 32 * b)));
        __m256 p1 = _mm256_cvtepi32_ps(dot_s8(load32(b1 + 2), load32(q + 32 * b + 32)));
        acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(f16_at(b0) * xd[b]), acc0);
        acc1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(f16_at(b1) * xd[b + 1]), acc1);
    }
    if (b < n32) {
        const uint8_t *b0 = w + 34 * b;
        __m256 p0 = _mm256_cvtepi32_ps(dot_s8(load32(b0 + 2), load32(q + 32 * b)));
        acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(f16_at(b0) * xd[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

static void mul_rows(const pq_mm_args *a, int64_t n0, int64_t n1, pq_scratch *s) {
    const pq_type_info *t = a->t;
    int64_t K = a->K, n32 = K / 32;
    if (t->id == PQ_Q8_0) {
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            for (int64_t m = 0; m < a->M; m++)
                a->y[m * a->ldy + n] = dot_q8_0(wr, a->q + m * K, a->d + m * n32, n32);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        t->decode(a->w + n * a->row_bytes, K / t->block_elems, s->v, s->scale, s->offset);
        for (int64_t m = 0; m < a->M; m++) {
            const float *xd = a->d + m * n32;
            float r = dot_decoded(s->v, s->scale, a->q + m * K, xd, n32);
            if (t->has_offset) r += pq_offset_term(s->offset, a->s16 + m * (K / 16), xd, K / 16);
            a->y[m * a->ldy + n] = r;
        }
    }
}
