/* What each ISA variant (kernels_<isa>.c) provides to api.c. */
#ifndef PQ_KERNELS_H
#define PQ_KERNELS_H

#include <stdint.h>

#include "decode.h"

/* One product call, as the variants see it (api.c checked the arguments). */
typedef struct {
    const pq_type_info *t;
    const uint8_t *w;
    int64_t K, row_bytes;
    const int16_t *q;
    const int16_t *qp; /* q in lane order (pq_lane_order), for a variant that asks for it */
    const uint8_t *qlo; /* q's byte planes (pq_byte_planes), for a variant that asks: */
    const int8_t *qhi;  /* q = 256 * qhi + qlo, qlo unsigned */
    const float *d;
    const int32_t *gsum;
    int64_t M;
    float *y;
    int64_t ldy;
    const uint8_t *w_end; /* the end of the part's rows: how far ahead a variant may prefetch */
} pq_mm_args;

/* Per-thread scratch for decoding one weight row into the canonical form. */
typedef struct {
    int8_t *v;
    float *scale, *offset;
} pq_scratch;

/* The many-row product (gemm_i16.c): activations packed by panels of PQ_GEMM_MR rows,
 * weight rows decoded to int16 a tile of PQ_GEMM_NW rows at a time. */
#define PQ_GEMM_MR 16
#define PQ_GEMM_NW 4
#define PQ_GEMM_TILE_ROWS (2 * PQ_GEMM_MR) /* the rows of one tile call: two panels */

typedef struct {
    const uint32_t *ap; /* [panel][K/2][MR]: the int16 pair (q[m][2kp], q[m][2kp+1]) */
    const float *xs;    /* [panel][K/32][MR]: each row's block scale (0 past M) */
    const float *xg;    /* [panel][K/16][MR]: scale * group sum (the offsets' factor) */
    int64_t K;
} pq_gemm_act;

typedef struct {
    const int16_t *q;             /* [NW][K] the rows' integer values */
    const float *scale, *offset;  /* [NW][K/16] per group of 16 */
    int group;                    /* 32: a scale covers two groups (integer sums over 32) */
    int has_offset;
} pq_gemm_w;

typedef struct {
    const char *name;
    int (*cpu_has)(void);
    /* rows n0..n1-1 of the output, all M activation rows */
    void (*mul_rows)(const pq_mm_args *a, int64_t n0, int64_t n1, pq_scratch *s);
    int lane_order; /* reads pq_mm_args.qp as well as q */
    /* tile[j][r] = activation row 16p + r . weight row j for the PQ_GEMM_NW rows of w and
     * r < rows <= PQ_GEMM_TILE_ROWS (panels p and p + 1; the rest of the tile undefined) */
    void (*gemm_tile)(const pq_gemm_act *a, int64_t p, const pq_gemm_w *w, int64_t rows,
                      float tile[PQ_GEMM_NW][PQ_GEMM_TILE_ROWS]);
    /* a weight row as int16 values, scales and offsets per 16 (the canonical form's, values
     * widened); 0 where the type takes the canonical decoder instead. NULL: always that. */
    int (*unpack_row)(int id, const uint8_t *w, int64_t K, int16_t *q, float *scale,
                      float *offset);
    int byte_planes; /* reads pq_mm_args.qlo/qhi as well as q */
} pq_isa_impl;

/* The int16 activations as two byte planes, q = 256 * hi + lo with lo unsigned: a
 * variant with an unsigned-by-signed byte dot (vpdpbusd) multiplies 4-bit weights with
 * each plane and never widens the weights, the same integer sums as the 16-bit dot. */
static inline void pq_byte_planes(const int16_t *q, int64_t n, uint8_t *lo, int8_t *hi) {
    for (int64_t i = 0; i < n; i++) {
        lo[i] = (uint8_t)(q[i] & 0xFF);
        hi[i] = (int8_t)(q[i] >> 8);
    }
}

/* The order in which a lane-order variant reads each block of 32 activations: 0-7, 16-23,
 * 8-15, 24-31, the order in-lane byte unpacks give a 256-bit register's 32 weights. */
static inline void pq_lane_order(const int16_t *q, int64_t n, int16_t *qp) {
    for (int64_t b = 0; b < n; b += 32)
        for (int i = 0; i < 8; i++) {
            qp[b + i] = q[b + i];
            qp[b + 8 + i] = q[b + 16 + i];
            qp[b + 16 + i] = q[b + 8 + i];
            qp[b + 24 + i] = q[b + 24 + i];
        }
}

extern const pq_isa_impl pq_isa_scalar;
#if defined(__x86_64__)
extern const pq_isa_impl pq_isa_avx2, pq_isa_avxvnni, pq_isa_avx512vnni;
#endif
#if defined(__aarch64__)
extern const pq_isa_impl pq_isa_neon;
#endif

/* The generic dot of one decoded row (canonical form) with one activation row:
 * sum over groups g of xd[g/2] * (scale[g] * sum(v*q) + offset[g] * gsum[g]).
 * The offset part is plain C, shared by all variants. */
static inline float pq_offset_term(const float *offset, const int32_t *gsum, const float *xd,
                                   int64_t n16) {
    float acc = 0.0f;
    for (int64_t g = 0; g < n16; g++) acc += offset[g] * (float)gsum[g] * xd[g >> 1];
    return acc;
}

#endif
