/* 512-bit forms of the byte-plane dots, for the AVX-512 VNNI variant. A zmm vpdpbusd does
 * twice a ymm one's work at nearly the same rate (1.6x the bytes per ns measured on this
 * project's Sapphire Rapids-class machine), so a Q4_K run of 64 weights, or two Q6_K blocks,
 * is one product per plane. The integer sums are dot_planes'; only the order of the float
 * additions differs. Included by kernels_fused.h after the 256-bit forms. */

/* 16 int32 lanes, lane j the sum over elements 4j..4j+3 of u * q (u 64 unsigned bytes below
 * 128, q = 256 * hi + lo the 64 activations at lo/hi). */
static inline __m512i dot_planes512(__m512i u, const uint8_t *lo, const int8_t *hi) {
    const __m512i h = _mm512_loadu_si512(hi), l = _mm512_loadu_si512(lo);
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, h), 8),
                               l, u);
}

/* Lanes 0-7 take factor a of f, lanes 8-15 factor b (f's 8 floats in its low half). */
static inline __m512 spread2(__m512 f, int a, int b) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a), f);
}

/* Q4_K with byte planes (layout as q4_k_rows): run i is broadcast to both halves and the
 * upper one shifted by 4, so one register holds sub-blocks 2i and 2i+1 in element order. */
__attribute__((always_inline)) static inline void q4_k_rows512(const uint8_t *w, pq_rows x,
                                                               const int R, float *out) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), halves = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const int64_t n256 = x.K / 256;
    __m512 acc[R], acc_odd[R];
    __m256 off[R];
    for (int r = 0; r < R; r++) acc[r] = acc_odd[r] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 144 * sb;
        __m256 dsc, dmin;
        q4_k_scales(blk, &dsc, &dmin);
        __m512 f[R]; /* the 8 sub-blocks' d * sc * xd, low half */
        for (int r = 0; r < R; r++)
            f[r] = _mm512_castps256_ps512(q4_k_row_factors(dsc, dmin, x, r, sb, &off[r]));
        for (int i = 0; i < 4; i++) {
            const __m512i run = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i)));
            const __m512i u = _mm512_and_si512(_mm512_srlv_epi64(run, halves), lo4);
            for (int r = 0; r < R; r++) {
                const int64_t at = r * x.K + 256 * sb + 64 * i;
                const __m512 p = _mm512_cvtepi32_ps(dot_planes512(u, x.lo + at, x.hi + at));
                if (i & 1)
                    acc_odd[r] = _mm512_fmadd_ps(p, spread2(f[r], 2 * i, 2 * i + 1), acc_odd[r]);
                else
                    acc[r] = _mm512_fmadd_ps(p, spread2(f[r], 2 * i, 2 * i + 1), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc_odd[r])) - hsum(off[r]);
}

/* Q6_K with byte planes (layout as q6_k_rows): a half's two runs of low nibbles are one
 * register, so its blocks 0|1 are their low nibbles and 2|3 their high ones; the high bit
 * pairs are broadcast and shifted per half into place. One factor per group of 16. */
__attribute__((always_inline)) static inline void q6_k_rows512(const uint8_t *w, pq_rows x,
                                                               const int R, float *out) {
    const int64_t n256 = x.K / 256, n32 = x.K / 32;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    const __m512i up01 = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), down23 = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i groups01 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                  groups23 = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    const __m256i pairs = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    __m512 acc[R], acc23[R];
    __m256 off[R];
    for (int r = 0; r < R; r++) acc[r] = acc23[r] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 210 * sb;
        for (int h = 0; h < 2; h++) {
            const __m256 sc = q6_k_half_scales(blk, h);
            const __m512i l = _mm512_loadu_si512(blk + 64 * h);
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            /* A | (B & C): the low nibbles or'ed with the masked bit pairs, one instruction */
            const __m512i u01 = _mm512_ternarylogic_epi32(_mm512_and_si512(l, lo4), _mm512_sllv_epi64(hb, up01), hi2, 0xF8);
            const __m512i u23 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo4),
                                                          _mm512_srlv_epi64(hb, down23), hi2, 0xF8);
            const int64_t b0 = 8 * sb + 4 * h;
            for (int r = 0; r < R; r++) {
                /* group j's factor d * sc_j * xd of its block, and the 32s through the sums */
                const __m256 xd = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(x.xd + r * n32 + b0)), pairs);
                const __m256 fg = _mm256_mul_ps(sc, xd);
                const __m256 g = _mm256_cvtepi32_ps(
                    _mm256_loadu_si256((const __m256i *)(x.gs + r * (x.K / 16) + 2 * b0)));
                off[r] = _mm256_fmadd_ps(fg, g, off[r]);
                const __m512 f = _mm512_castps256_ps512(fg);
                const int64_t at = r * x.K + 32 * b0;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_planes512(u01, x.lo + at, x.hi + at)),
                                         _mm512_permutexvar_ps(groups01, f), acc[r]);
                acc23[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_planes512(u23, x.lo + at + 64, x.hi + at + 64)),
                                           _mm512_permutexvar_ps(groups23, f), acc23[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc23[r])) - 32.0f * hsum(off[r]);
}
