/* Fused row dots for the common types: each block is unpacked to 32 int8 weights
 * in a register and multiplied at once, never written to the decode buffer. One
 * pass over the row's bytes, which is what a decode step (one activation row)
 * is bound by. Included by kernels_simd.h (which defines dot16, widen16, hsum,
 * f16_at); the other types take the decode-then-dot path there.
 *
 * Each returns sum_k x[k] * W[row, k] for one activation row (q, xd, gs as in
 * pq_mm_args, already offset to the row). */

/* The two groups of 16 of one 32-element block: 8 int32 lanes each. */
static inline void block_dot(__m256i w8, const int16_t *q, __m256i *g0, __m256i *g1) {
    *g0 = dot16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w8)), q);
    *g1 = dot16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(w8, 1)), q + 16);
}

static inline __m256i block_sum(__m256i w8, const int16_t *q) {
    /* the second group's products summed into the first's by the dot instruction itself */
    return dot16_acc(dot16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w8)), q),
                     _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w8, 1)), q + 16);
}

/* 8 bytes -> 8 floats */
static inline __m256 u8x8_ps(const uint8_t *v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)v)));
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones (the order of
 * Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL elements). */
static inline __m256i nibbles32(const uint8_t *p) {
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
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

/* The legacy 32-element types: f16 d [| f16 m] [| u32 qh] | q[16]. Inlined into each
 * case of fused_dot, so that every type's loop is compiled with its layout constant. */
__attribute__((always_inline)) static inline float dot_legacy(int id, const uint8_t *w, const int16_t *q, const float *xd,
                        const int32_t *gs, int64_t n32) {
    const int bytes = id == PQ_Q4_0 ? 18 : id == PQ_Q4_1 ? 20 : id == PQ_Q5_0 ? 22 : 24;
    const int has_min = id == PQ_Q4_1 || id == PQ_Q5_1, five = id == PQ_Q5_0 || id == PQ_Q5_1;
    const int qs_at = 2 + 2 * has_min + 4 * five;
    const __m256i bias = _mm256_set1_epi8(has_min ? 0 : (five ? 16 : 8));
    __m256 acc = _mm256_setzero_ps();
    float off = 0.0f;
    for (int64_t b = 0; b < n32; b++) {
        const uint8_t *blk = w + bytes * b;
        __m256i v = nibbles32(blk + qs_at);
#if defined(PQ_DOT_VNNI512)
        if (five && !has_min) { /* q - 16 where the fifth bit is clear, else q: one masked sub */
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            v = _mm256_mask_sub_epi8(v, (__mmask32)~qh, v, bias);
        } else {
            if (five) v = _mm256_or_si256(v, fifth_bits(blk + 2 + 2 * has_min));
            v = _mm256_sub_epi8(v, bias);
        }
#else
        if (five) v = _mm256_or_si256(v, fifth_bits(blk + 2 + 2 * has_min));
        v = _mm256_sub_epi8(v, bias);
#endif
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sum(v, q + 32 * b)),
                              _mm256_set1_ps(f16_at(blk) * xd[b]), acc);
        if (has_min) off += f16_at(blk + 2) * (float)(gs[2 * b] + gs[2 * b + 1]) * xd[b];
    }
    return hsum(acc) + off;
}

/* Q4_K: f16 d | f16 dmin | scales[12] | q[128]; sub-block j of 32 has scale d*sc_j, min
 * dmin*m_j; 32-byte run i holds sub-blocks 2i (low nibbles) and 2i+1 (high). The eight
 * sub-blocks' factors are formed as vectors once per super-block: their scalar forms
 * cost more than the products themselves. */
static float dot_q4_k(const uint8_t *w, const int16_t *q, const float *xd, const int32_t *gs,
                      int64_t n256) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    float f[8];
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 144 * sb;
        const int16_t *qb = q + 256 * sb;
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) pq_k_scale_min(blk + 4, j, &sc[j], &m[j]);
        __m256 xb = _mm256_loadu_ps(xd + 8 * sb);
        __m256 scale = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16_at(blk)), u8x8_ps(sc)), xb);
        _mm256_storeu_ps(f, scale);
        /* group sums of 16 -> of 32: (g0+g1, g2+g3, ...) in sub-block order */
        const __m256i g16a = _mm256_loadu_si256((const __m256i *)(gs + 16 * sb)),
                      g16b = _mm256_loadu_si256((const __m256i *)(gs + 16 * sb + 8));
        __m256 g32 = _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(_mm256_hadd_epi32(g16a, g16b), 0xD8));
        off = _mm256_add_ps(off, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(
                  _mm256_set1_ps(f16_at(blk + 2)), u8x8_ps(m)), g32), xb));
        for (int i = 0; i < 4; i++) {
            __m256i run = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i));
            __m256i p0 = block_sum(_mm256_and_si256(run, lo4), qb + 64 * i);
            __m256i p1 = block_sum(_mm256_and_si256(_mm256_srli_epi16(run, 4), lo4), qb + 64 * i + 32);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(f[2 * i]), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(f[2 * i + 1]), acc);
        }
    }
    return hsum(acc) - hsum(off);
}

/* Q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d; in half h, block k (0..3) of 32 is
 * nibble k>>1 of ql[64h + 32(k&1) + j] with bits 2k..2k+1 of qh[32h + j] above it, minus 32;
 * one scale per 16. */
static float dot_q6_k(const uint8_t *w, const int16_t *q, const float *xd, int64_t n256) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30),
                  bias = _mm256_set1_epi8(32);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 210 * sb;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = f16_at(blk + 208);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), hi2)),
                _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), _mm256_and_si256(hb, hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), hi2)),
            };
            for (int k = 0; k < 4; k++) {
                int blk32 = 8 * (int)sb + 4 * h + k, g = 8 * h + 2 * k;
                __m256i g0, g1;
                block_dot(_mm256_sub_epi8(v[k], bias), q + 32 * blk32, &g0, &g1);
                float x = d * xd[blk32];
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g0), _mm256_set1_ps(x * sc[g]), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1), _mm256_set1_ps(x * sc[g + 1]), acc1);
            }
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* The fused dot of one row, or 0 (and *done = 0) for a type without one. */
static inline float fused_dot(int id, const uint8_t *w, const int16_t *q, const float *xd,
                              const int32_t *gs, int64_t K, int *done) {
    *done = 1;
    switch (id) {
    case PQ_Q4_0:
        return dot_legacy(PQ_Q4_0, w, q, xd, gs, K / 32);
    case PQ_Q4_1:
        return dot_legacy(PQ_Q4_1, w, q, xd, gs, K / 32);
    case PQ_Q5_0:
        return dot_legacy(PQ_Q5_0, w, q, xd, gs, K / 32);
    case PQ_Q5_1:
        return dot_legacy(PQ_Q5_1, w, q, xd, gs, K / 32);
    case PQ_Q4_K:
        return dot_q4_k(w, q, xd, gs, K / 256);
    case PQ_Q6_K:
        return dot_q6_k(w, q, xd, K / 256);
    default:
        *done = 0;
        return 0.0f;
    }
}
