/* The many-row product's register tile for the x86 variants (included by kernels_simd.h):
 * 16 activation rows (two 8-lane registers; one 16-lane register on AVX-512) against
 * PQ_GEMM_NW weight rows. Per group of
 * 16 or 32 elements the int16 pairs are summed exactly in int32 (vpdpwssd, or vpmaddwd
 * and an add), then scaled once into float32: the integer kernels' arithmetic, so a
 * prompt's products are as exact as a decode step's. */

/* acc + the pair products of 8 lanes of activation pairs a and one broadcast weight pair b */
static inline __m256i pair_dot(__m256i acc, __m256i a, __m256i b) {
#if defined(PQ_DOT_VNNI512)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(PQ_DOT_AVXVNNI)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* The float sums live in the output tile (L1), touched once per group: the int32 sums of
 * 4 weight rows x 2 registers take 8 of AVX2's 16 registers, which leaves no room for 8
 * float accumulators without spills in the inner loop. */
__attribute__((always_inline)) static inline void gemm_tile_g(const pq_gemm_act *a, int64_t p,
                                                              const pq_gemm_w *w, const int G,
                                                              const int OFF, const int V,
                                                              float *out, int64_t ld) {
    enum { NW = PQ_GEMM_NW, MR = PQ_GEMM_MR };
    const int64_t K = a->K;
    const uint32_t *ap = a->ap + p * (K / 2) * MR;
    const float *xs = a->xs + p * (K / 32) * MR, *xg = a->xg + p * (K / 16) * MR;
    for (int j = 0; j < NW; j++) {
        _mm256_storeu_ps(out + j * ld, _mm256_setzero_ps());
        _mm256_storeu_ps(out + j * ld + 8, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < K / G; g++) {
        __m256i acc[NW][2];
        for (int j = 0; j < NW; j++) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
        for (int64_t kp = g * (G / 2); kp < (g + 1) * (G / 2); kp++) {
            const __m256i a0 = _mm256_load_si256((const __m256i *)(ap + kp * MR));
            const __m256i a1 = V == 2 ? _mm256_load_si256((const __m256i *)(ap + kp * MR + 8)) : a0;
            for (int j = 0; j < NW; j++) {
                int32_t pair;
                memcpy(&pair, w->q + j * K + 2 * kp, 4);
                const __m256i b = _mm256_set1_epi32(pair);
                acc[j][0] = pair_dot(acc[j][0], a0, b);
                if (V == 2) acc[j][1] = pair_dot(acc[j][1], a1, b);
            }
        }
        const int64_t blk = g * G / 32, g16 = g * G / 16;
        const __m256 s0 = _mm256_load_ps(xs + blk * MR), s1 = _mm256_load_ps(xs + blk * MR + 8);
        for (int j = 0; j < NW; j++) {
            const __m256 ws = _mm256_set1_ps(w->scale[j * (K / 16) + g16]);
            __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][0]), _mm256_mul_ps(s0, ws),
                                        _mm256_loadu_ps(out + j * ld));
            __m256 f1 = V == 2 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][1]), _mm256_mul_ps(s1, ws),
                                                 _mm256_loadu_ps(out + j * ld + 8))
                               : _mm256_setzero_ps();
            if (OFF)
                for (int64_t h = g16; h < g16 + G / 16; h++) {
                    const __m256 wo = _mm256_set1_ps(w->offset[j * (K / 16) + h]);
                    f0 = _mm256_fmadd_ps(_mm256_load_ps(xg + h * MR), wo, f0);
                    if (V == 2) f1 = _mm256_fmadd_ps(_mm256_load_ps(xg + h * MR + 8), wo, f1);
                }
            _mm256_storeu_ps(out + j * ld, f0);
            if (V == 2) _mm256_storeu_ps(out + j * ld + 8, f1);
        }
    }
}

#if defined(PQ_DOT_VNNI512)
/* The same tile in 512-bit registers, a panel's 16 rows to one: vpdpwssd on zmm did ~1.6x
 * the products a second of ymm on the Sapphire Rapids VM. V panels (1 or 2) at once. */
__attribute__((always_inline)) static inline void gemm_tile_z(const pq_gemm_act *a, int64_t p,
                                                              const pq_gemm_w *w, const int G,
                                                              const int OFF, const int V,
                                                              float tile[PQ_GEMM_NW][PQ_GEMM_TILE_ROWS]) {
    enum { NW = PQ_GEMM_NW, MR = PQ_GEMM_MR };
    const int64_t K = a->K, pa = (K / 2) * MR, ps = (K / 32) * MR, pg = (K / 16) * MR;
    const uint32_t *ap = a->ap + p * pa;
    const float *xs = a->xs + p * ps, *xg = a->xg + p * pg;
    __m512 f[NW][2];
    for (int j = 0; j < NW; j++) f[j][0] = f[j][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / G; g++) {
        __m512i acc[NW][2];
        for (int j = 0; j < NW; j++) acc[j][0] = acc[j][1] = _mm512_setzero_si512();
        for (int64_t kp = g * (G / 2); kp < (g + 1) * (G / 2); kp++) {
            const __m512i a0 = _mm512_load_si512((const void *)(ap + kp * MR));
            const __m512i a1 = V == 2 ? _mm512_load_si512((const void *)(ap + pa + kp * MR)) : a0;
            for (int j = 0; j < NW; j++) {
                int32_t pair;
                memcpy(&pair, w->q + j * K + 2 * kp, 4);
                const __m512i b = _mm512_set1_epi32(pair);
                acc[j][0] = _mm512_dpwssd_epi32(acc[j][0], a0, b);
                if (V == 2) acc[j][1] = _mm512_dpwssd_epi32(acc[j][1], a1, b);
            }
        }
        const int64_t blk = g * G / 32, g16 = g * G / 16;
        const __m512 s0 = _mm512_load_ps(xs + blk * MR);
        const __m512 s1 = V == 2 ? _mm512_load_ps(xs + ps + blk * MR) : s0;
        for (int j = 0; j < NW; j++) {
            const __m512 ws = _mm512_set1_ps(w->scale[j * (K / 16) + g16]);
            f[j][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][0]), _mm512_mul_ps(s0, ws), f[j][0]);
            if (V == 2)
                f[j][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][1]), _mm512_mul_ps(s1, ws), f[j][1]);
        }
        if (OFF)
            for (int64_t h = g16; h < g16 + G / 16; h++) {
                const __m512 g0 = _mm512_load_ps(xg + h * MR);
                const __m512 g1 = V == 2 ? _mm512_load_ps(xg + pg + h * MR) : g0;
                for (int j = 0; j < NW; j++) {
                    const __m512 wo = _mm512_set1_ps(w->offset[j * (K / 16) + h]);
                    f[j][0] = _mm512_fmadd_ps(g0, wo, f[j][0]);
                    if (V == 2) f[j][1] = _mm512_fmadd_ps(g1, wo, f[j][1]);
                }
            }
    }
    for (int j = 0; j < NW; j++) {
        _mm512_storeu_ps(tile[j], f[j][0]);
        if (V == 2) _mm512_storeu_ps(tile[j] + MR, f[j][1]);
    }
}

static void gemm_tile(const pq_gemm_act *a, int64_t p, const pq_gemm_w *w, int64_t rows,
                      float tile[PQ_GEMM_NW][PQ_GEMM_TILE_ROWS]) {
#define PQ_TILE(G, OFF) \
    (rows <= PQ_GEMM_MR ? gemm_tile_z(a, p, w, G, OFF, 1, tile) : gemm_tile_z(a, p, w, G, OFF, 2, tile))
#else
/* Each of the (up to two) panels on its own; a panel of at most 8 rows skips its second
 * register, which would hold only padding. */
static void gemm_tile(const pq_gemm_act *a, int64_t p, const pq_gemm_w *w, int64_t rows,
                      float tile[PQ_GEMM_NW][PQ_GEMM_TILE_ROWS]) {
#define PQ_PANEL(G, OFF, i, n) \
    ((n) <= 8 ? gemm_tile_g(a, p + (i), w, G, OFF, 1, tile[0] + 16 * (i), PQ_GEMM_TILE_ROWS) \
              : gemm_tile_g(a, p + (i), w, G, OFF, 2, tile[0] + 16 * (i), PQ_GEMM_TILE_ROWS))
#define PQ_TILE(G, OFF) \
    do { \
        PQ_PANEL(G, OFF, 0, rows); \
        if (rows > PQ_GEMM_MR) PQ_PANEL(G, OFF, 1, rows - PQ_GEMM_MR); \
    } while (0)
#endif
    if (w->group == 32) {
        if (w->has_offset) PQ_TILE(32, 1);
        else PQ_TILE(32, 0);
    } else {
        if (w->has_offset) PQ_TILE(16, 1);
        else PQ_TILE(16, 0);
    }
#undef PQ_TILE
#undef PQ_PANEL
}

/* One weight row straight to the tile's int16 values and per-16 scales and offsets, for
 * the types the fused dots unpack in registers (the canonical decoder and a widening pass
 * took 3x as long, which a short prompt's product pays once per weight row). */
static inline void store_natural(int16_t *q, __m256i w0, __m256i w1) {
#if defined(PQ_LANE_ORDER) /* w0 = elements 0-7 | 16-23, w1 = 8-15 | 24-31 */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
#else
    _mm256_storeu_si256((__m256i *)q, w0);
    _mm256_storeu_si256((__m256i *)(q + 16), w1);
#endif
}

__attribute__((always_inline)) static inline void legacy_unpack(int id, const uint8_t *w,
                                                                int64_t n32, int16_t *q,
                                                                float *scale, float *offset) {
    const int bytes = id == PQ_Q4_0 ? 18 : id == PQ_Q4_1 ? 20 : id == PQ_Q5_0 ? 22
                    : id == PQ_Q5_1 ? 24 : 34;
    const int eight = id == PQ_Q8_0;
    const int has_min = id == PQ_Q4_1 || id == PQ_Q5_1, five = id == PQ_Q5_0 || id == PQ_Q5_1;
    const int qs_at = 2 + 2 * has_min + 4 * five;
    const int bias = has_min ? 0 : (five ? 16 : 8);
    for (int64_t b = 0; b < n32; b++) {
        const uint8_t *blk = w + bytes * b;
        __m256i w0, w1;
        if (eight) {
            widen_s8(_mm256_loadu_si256((const __m256i *)(blk + 2)), &w0, &w1);
        } else {
            __m256i v = nibbles32(blk + qs_at);
            if (five) v = _mm256_or_si256(v, fifth_bits(blk + 2 + 2 * has_min));
            widen_u8(v, bias, &w0, &w1);
        }
        store_natural(q + 32 * b, w0, w1);
        scale[2 * b] = scale[2 * b + 1] = pq_f16(blk);
        offset[2 * b] = offset[2 * b + 1] = has_min ? pq_f16(blk + 2) : 0.0f;
    }
}

static void q4_k_unpack(const uint8_t *w, int64_t n256, int16_t *q, float *scale, float *offset) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 144 * sb;
        pq_k_factors(blk + 4, pq_f16(blk), pq_f16(blk + 2), scale + 16 * sb, offset + 16 * sb);
        for (int i = 0; i < 4; i++) {
            const __m256i run = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * i));
            __m256i w0, w1;
            widen_u8(_mm256_and_si256(run, lo4), 0, &w0, &w1);
            store_natural(q + 256 * sb + 64 * i, w0, w1);
            widen_u8(_mm256_and_si256(_mm256_srli_epi16(run, 4), lo4), 0, &w0, &w1);
            store_natural(q + 256 * sb + 64 * i + 32, w0, w1);
        }
    }
}

static void q6_k_unpack(const uint8_t *w, int64_t n256, int16_t *q, float *scale, float *offset) {
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 210 * sb;
        const float d = pq_f16(blk + 208);
        for (int g = 0; g < 16; g++) {
            scale[16 * sb + g] = d * (float)(int8_t)blk[192 + g];
            offset[16 * sb + g] = 0.0f;
        }
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int k = 0; k < 4; k++) {
                __m256i w0, w1;
                widen_u8(q6_k_values(l0, l1, hb, k), 32, &w0, &w1);
                store_natural(q + 256 * sb + 128 * h + 32 * k, w0, w1);
            }
        }
    }
}

/* 1: the row is in q/scale/offset; 0: this type takes the canonical decoder. */
static int unpack_row(int id, const uint8_t *w, int64_t K, int16_t *q, float *scale, float *offset) {
    switch (id) {
    case PQ_Q4_0: legacy_unpack(PQ_Q4_0, w, K / 32, q, scale, offset); return 1;
    case PQ_Q4_1: legacy_unpack(PQ_Q4_1, w, K / 32, q, scale, offset); return 1;
    case PQ_Q5_0: legacy_unpack(PQ_Q5_0, w, K / 32, q, scale, offset); return 1;
    case PQ_Q5_1: legacy_unpack(PQ_Q5_1, w, K / 32, q, scale, offset); return 1;
    case PQ_Q8_0: legacy_unpack(PQ_Q8_0, w, K / 32, q, scale, offset); return 1;
    case PQ_Q4_K: q4_k_unpack(w, K / 256, q, scale, offset); return 1;
    case PQ_Q6_K: q6_k_unpack(w, K / 256, q, scale, offset); return 1;
    default: return 0;
    }
}
