/* Fused row dots for the common types: each block is unpacked to 32 int8 weights
 * in a register and multiplied at once with up to 8 activation rows, never written to
 * the decode buffer. One pass over the row's bytes, which is what a decode step (one
 * activation row) is bound by. Included by kernels_simd.h (which defines dot16,
 * widen16, hsum, f16_at); the other types take the decode-then-dot path there. */

/* 8 bytes -> 8 floats */
static inline __m256 u8x8_ps(const uint8_t *v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)v)));
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones (the order of
 * Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL elements). */
static inline __m256i nibbles32(const uint8_t *p) {
#if defined(PQ_LANE_ORDER)
    /* the 16 bytes in both lanes (a load, no shuffle), the upper lane shifted by 4 */
    __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i v = _mm256_srlv_epi32(x, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
#else
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
#endif
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Bit j of the little-endian u32 at p -> 0x10 in byte j, else 0 (Q5_0/Q5_1's fifth bits). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i pick = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* The activation rows of one call, as the fused dots read them: row r's int16 values at
 * q + r * K, its block scales at xd + r * K/32, its group sums at gs + r * K/16. */
typedef struct {
    const int16_t *q;
    const float *xd;
    const int32_t *gs;
    int64_t K;
    const uint8_t *lo; /* q's byte planes (PQ_BYTE_PLANES variants), row r at + r * K */
    const int8_t *hi;
} pq_rows;

#if defined(PQ_BYTE_PLANES)
/* 8 int32 lanes, lane j the sum over elements 4j..4j+3 of u * q, u 32 unsigned bytes
 * (values < 128) and q = 256 * hi + lo the row's 32 activations at lo/hi: the exact sums
 * of the 16-bit dot, two vpdpbusd and a shift, no widening of u. */
static inline __m256i dot_planes(__m256i u, const uint8_t *lo, const int8_t *hi) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)hi),
                  l = _mm256_loadu_si256((const __m256i *)lo), z = _mm256_setzero_si256();
#if defined(PQ_DOT_VNNI512)
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(_mm256_dpbusd_epi32(z, u, h), 8), l, u);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(_mm256_dpbusd_avx_epi32(z, u, h), 8), l, u);
#endif
}
#endif

/* Whether this call's rows come with byte planes (only a PQ_BYTE_PLANES variant asks). */
static inline int has_planes(pq_rows x) {
#if defined(PQ_BYTE_PLANES)
    return x.lo != NULL;
#else
    (void)x;
    return 0;
#endif
}

/* The legacy 32-element types, f16 d [| f16 m] [| u32 qh] | q[16] (nibbles), and Q8_0,
 * f16 d | int8 q[32]. Each weight block is unpacked once and multiplied with R activation
 * rows (R a constant at each call site, so that the accumulators stay in registers),
 * out[r] = row r . W's row; a row's arithmetic is the same whatever R is. Inlined into
 * each case of fused_rows, so that every type's loop is compiled with its layout constant. */
__attribute__((always_inline)) static inline void legacy_rows(int id, const uint8_t *w, pq_rows x,
                                                              const int R, float *out) {
    const int bytes = id == PQ_Q4_0 ? 18 : id == PQ_Q4_1 ? 20 : id == PQ_Q5_0 ? 22
                    : id == PQ_Q5_1 ? 24 : 34;
    const int eight = id == PQ_Q8_0;
    const int has_min = id == PQ_Q4_1 || id == PQ_Q5_1, five = id == PQ_Q5_0 || id == PQ_Q5_1;
    const int qs_at = 2 + 2 * has_min + 4 * five;
    const int64_t n32 = x.K / 32;
    const int bias = has_min ? 0 : (five ? 16 : 8);
    __m256 acc[R];
    float off[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), off[r] = 0.0f;
    for (int64_t b = 0; b < n32; b++) {
        const uint8_t *blk = w + bytes * b;
        __m256i w0, w1;
        __m256i v = eight ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : nibbles32(blk + qs_at);
        if (eight) {
            widen_s8(v, &w0, &w1);
        } else
#if defined(PQ_DOT_VNNI512)
        if (five && !has_min) { /* q - 16 where the fifth bit is clear, else q: one masked sub */
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            v = _mm256_mask_sub_epi8(v, (__mmask32)~qh, v, _mm256_set1_epi8(16));
            widen_u8(v, 0, &w0, &w1); /* signed already: the natural order sign-extends */
        } else
#endif
        {
            if (five) v = _mm256_or_si256(v, fifth_bits(blk + 2 + 2 * has_min));
            widen_u8(v, bias, &w0, &w1);
        }
        const float d = f16_at(blk), mn = has_min ? f16_at(blk + 2) : 0.0f;
        for (int r = 0; r < R; r++) {
            const int16_t *q = x.q + r * x.K + 32 * b;
            const float xd = x.xd[r * n32 + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16_acc(dot16(w0, q), w1, q + 16)),
                                     _mm256_set1_ps(d * xd), acc[r]);
            if (has_min) {
                const int32_t *g = x.gs + r * (x.K / 16) + 2 * b;
                off[r] += mn * (float)(g[0] + g[1]) * xd;
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + off[r];
}

/* A Q4_K super-block's sub-block scales d*sc and mins dmin*m (8 floats each, sub-block
 * order), and row r's share of it: the factors d*sc*xd (returned) and the mins' term,
 * dmin*m * (group sums of 32) * xd, added to *off. */
static inline void q4_k_scales(const uint8_t *blk, __m256 *dsc, __m256 *dmin) {
    uint8_t sc[8], m[8];
    pq_k_scales_mins(blk + 4, sc, m);
    *dsc = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)), u8x8_ps(sc));
    *dmin = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 2)), u8x8_ps(m));
}

static inline __m256 q4_k_row_factors(__m256 dsc, __m256 dmin, pq_rows x, int r, int64_t sb,
                                      __m256 *off) {
    const __m256 xb = _mm256_loadu_ps(x.xd + r * (x.K / 32) + 8 * sb);
    /* group sums of 16 -> of 32: (g0+g1, g2+g3, ...) in sub-block order */
    const int32_t *g = x.gs + r * (x.K / 16) + 16 * sb;
    const __m256i ga = _mm256_loadu_si256((const __m256i *)g),
                  gb = _mm256_loadu_si256((const __m256i *)(g + 8));
    const __m256 g32 = _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(ga, gb), 0xD8));
    *off = _mm256_add_ps(*off, _mm256_mul_ps(_mm256_mul_ps(dmin, g32), xb));
    return _mm256_mul_ps(dsc, xb);
}

/* Q4_K: f16 d | f16 dmin | scales[12] | q[128]; sub-block j of 32 has scale d*sc_j, min
 * dmin*m_j; 32-byte run i holds sub-blocks 2i (low nibbles) and 2i+1 (high). The eight
 * sub-blocks' factors are formed as vectors once per super-block: their scalar forms
 * cost more than the products themselves. */
__attribute__((always_inline)) static inline void q4_k_rows(const uint8_t *w, pq_rows x,
                                                            const int R, float *out) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const int64_t n256 = x.K / 256;
    const int planes = has_planes(x);
    __m256 acc[R], acc_hi[R], off[R]; /* two chains of dependent adds, not one */
    float f[R][8];
    for (int r = 0; r < R; r++) acc[r] = acc_hi[r] = off[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 144 * sb;
        __m256 dsc, dmin;
        q4_k_scales(blk, &dsc, &dmin);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(f[r], q4_k_row_factors(dsc, dmin, x, r, sb, &off[r]));
        for (int i = 0; i < 4; i++) {
            const __m256i run = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i));
            const __m256i lo = _mm256_and_si256(run, lo4),
                          hi = _mm256_and_si256(_mm256_srli_epi16(run, 4), lo4);
            __m256i l0 = lo, l1 = lo, h0 = hi, h1 = hi;
            if (!planes) {
                widen_u8(lo, 0, &l0, &l1);
                widen_u8(hi, 0, &h0, &h1);
            }
            for (int r = 0; r < R; r++) {
                const int64_t at = r * x.K + 256 * sb + 64 * i;
                const int16_t *q = x.q + at;
#if defined(PQ_BYTE_PLANES)
                const __m256i pl = planes ? dot_planes(lo, x.lo + at, x.hi + at)
                                          : dot16_acc(dot16(l0, q), l1, q + 16),
                              ph = planes ? dot_planes(hi, x.lo + at + 32, x.hi + at + 32)
                                          : dot16_acc(dot16(h0, q + 32), h1, q + 48);
#else
                const __m256i pl = dot16_acc(dot16(l0, q), l1, q + 16),
                              ph = dot16_acc(dot16(h0, q + 32), h1, q + 48);
#endif
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), _mm256_set1_ps(f[r][2 * i]), acc[r]);
                acc_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), _mm256_set1_ps(f[r][2 * i + 1]), acc_hi[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(acc[r], acc_hi[r])) - hsum(off[r]);
}

/* The sums of one 32-element block's two groups of 16, four int32 lanes each: group one in
 * the low 128-bit lane, group two in the high one (so that a per-16 scale is one vector
 * [s0 x4 | s1 x4]). With the lane order the unpacks already put elements 0-7 and 16-23 in
 * w0, so the two products add lane by lane; natural order moves the halves across. */
static inline __m256i group_pair_dot(__m256i w0, __m256i w1, const int16_t *q) {
#if defined(PQ_LANE_ORDER)
    return dot16_acc(dot16(w0, q), w1, q + 16);
#else
    const __m256i p0 = dot16(w0, q), p1 = dot16(w1, q + 16);
    return _mm256_add_epi32(_mm256_blend_epi32(p0, p1, 0xF0), _mm256_permute2x128_si256(p0, p1, 0x21));
#endif
}

/* Block k (0..3) of one half of a Q6_K super-block as its 32 unsigned values q + 32
 * (0..63, element order), from the half's two 32-byte runs of low nibbles and its run of
 * high bit pairs. */
static inline __m256i q6_k_values(__m256i l0, __m256i l1, __m256i hb, int k) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i l = k & 1 ? l1 : l0;
    const __m256i lo = k < 2 ? _mm256_and_si256(l, lo4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), lo4);
    const __m256i hi = k == 0 ? _mm256_slli_epi16(hb, 4)
                     : k == 1 ? _mm256_slli_epi16(hb, 2)
                     : k == 2 ? hb : _mm256_srli_epi16(hb, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, hi2));
}

/* A Q6_K super-block's half h's 8 scales (one per 16) times d, as floats. */
static inline __m256 q6_k_half_scales(const uint8_t *blk, int h) {
    return _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 208)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h)))));
}

/* Q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d; in half h, block k (0..3) of 32 is
 * nibble k>>1 of ql[64h + 32(k&1) + j] with bits 2k..2k+1 of qh[32h + j] above it, minus 32;
 * one scale per 16, so block 4h+k's two groups take scales 8h+2k and 8h+2k+1. The byte-plane
 * variants multiply the unsigned values and take 32 times the scaled group sums off. */
__attribute__((always_inline)) static inline void q6_k_rows(const uint8_t *w, pq_rows x,
                                                            const int R, float *out) {
    const int64_t n256 = x.K / 256, n32 = x.K / 32;
    const int planes = has_planes(x); /* u = q + 32 by planes, the 32s through the group sums */
    const __m256i pairs = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    __m256 acc[R], off[R];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 210 * sb;
        for (int h = 0; h < 2; h++) {
            /* block k's pair of scales spread as [s_2k x4 | s_2k+1 x4] below */
            const __m256 sc = q6_k_half_scales(blk, h);
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const int64_t b0 = 8 * sb + 4 * h; /* the half's first block of 32 */
            for (int r = 0; planes && r < R; r++) { /* sum over its 8 groups of scale * sum * xd */
                const __m256 g = _mm256_cvtepi32_ps(
                    _mm256_loadu_si256((const __m256i *)(x.gs + r * (x.K / 16) + 2 * b0)));
                const __m256 xd = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(x.xd + r * n32 + b0)), pairs);
                off[r] = _mm256_fmadd_ps(_mm256_mul_ps(sc, g), xd, off[r]);
            }
            for (int k = 0; k < 4; k++) {
                const __m256i u = q6_k_values(l0, l1, hb, k);
                __m256i w0 = u, w1 = u;
                if (!planes) widen_u8(u, 32, &w0, &w1);
                const __m256 s = _mm256_permutevar8x32_ps(
                    sc, _mm256_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k));
                const int64_t b = b0 + k;
                for (int r = 0; r < R; r++) {
#if defined(PQ_BYTE_PLANES)
                    const int64_t at = r * x.K + 32 * b;
                    const __m256i p = planes ? dot_planes(u, x.lo + at, x.hi + at)
                                             : group_pair_dot(w0, w1, x.q + at);
#else
                    const __m256i p = group_pair_dot(w0, w1, x.q + r * x.K + 32 * b);
#endif
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                             _mm256_mul_ps(s, _mm256_broadcast_ss(x.xd + r * n32 + b)), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) - 32.0f * hsum(off[r]);
}

#if defined(PQ_DOT_VNNI512)
#include "kernels_zmm.h"
#endif

/* R rows (1, 2, 4 or 8) of the types whose weight blocks are unpacked once for all of them. */
__attribute__((always_inline)) static inline void rows_of(int id, const uint8_t *w, pq_rows x,
                                                          const int R, float *out) {
#if defined(PQ_DOT_VNNI512)
    if (has_planes(x) && (id == PQ_Q4_K || id == PQ_Q6_K)) {
        if (id == PQ_Q4_K) q4_k_rows512(w, x, R, out);
        else q6_k_rows512(w, x, R, out);
        return;
    }
#endif
    switch (id) {
    case PQ_Q4_0: legacy_rows(PQ_Q4_0, w, x, R, out); break;
    case PQ_Q4_1: legacy_rows(PQ_Q4_1, w, x, R, out); break;
    case PQ_Q5_0: legacy_rows(PQ_Q5_0, w, x, R, out); break;
    case PQ_Q5_1: legacy_rows(PQ_Q5_1, w, x, R, out); break;
    case PQ_Q8_0: legacy_rows(PQ_Q8_0, w, x, R, out); break;
    case PQ_Q6_K: q6_k_rows(w, x, R, out); break;
    default: q4_k_rows(w, x, R, out);
    }
}

static inline int multi_row_type(int id) {
    return id == PQ_Q4_0 || id == PQ_Q4_1 || id == PQ_Q5_0 || id == PQ_Q5_1 || id == PQ_Q8_0 ||
           id == PQ_Q4_K || id == PQ_Q6_K;
}

/* y[m*ldy] = row m . W's row for all M rows, in chunks of 8, 4, 2 and 1 rows. */
static void fused_rows(int id, const uint8_t *w, pq_rows x, int64_t M, float *y, int64_t ldy) {
    float out[8];
    for (int64_t m = 0; m < M;) {
        const int R = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
        pq_rows at = {x.q + m * x.K, x.xd + m * (x.K / 32), x.gs + m * (x.K / 16), x.K,
                      x.lo != NULL ? x.lo + m * x.K : NULL, x.hi != NULL ? x.hi + m * x.K : NULL};
        switch (R) {
        case 8: rows_of(id, w, at, 8, out); break;
        case 4: rows_of(id, w, at, 4, out); break;
        case 2: rows_of(id, w, at, 2, out); break;
        default: rows_of(id, w, at, 1, out);
        }
        for (int r = 0; r < R; r++) y[(m + r) * ldy] = out[r];
        m += R;
    }
}
