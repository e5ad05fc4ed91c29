/* The portable variant: plain C over the canonical decoded form (decode.h).
 * It is also the reference the SIMD variants are tested against. */
#include "kernels.h"

static float dot_decoded(const int8_t *v, const float *scale, const int16_t *q, const float *xd,
                         int64_t n32) {
    float acc = 0.0f;
    for (int64_t b = 0; b < n32; b++) {
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 16; i++) s0 += (int32_t)v[32 * b + i] * q[32 * b + i];
        for (int i = 16; i < 32; i++) s1 += (int32_t)v[32 * b + i] * q[32 * b + i];
        acc += xd[b] * (scale[2 * b] * (float)s0 + scale[2 * b + 1] * (float)s1);
    }
    return acc;
}

static void mul_rows(const pq_mm_args *a, int64_t n0, int64_t n1, pq_scratch *s) {
    const pq_type_info *t = a->t;
    int64_t K = a->K, n32 = K / 32;
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

/* The many-row product's tile (gemm_i16.c), as the SIMD variants compute it: exact int32
 * sums per group of 16 or 32, scaled once per group into float32. */
static void gemm_tile(const pq_gemm_act *a, int64_t p0, const pq_gemm_w *w, int64_t rows,
                      float tile[PQ_GEMM_NW][PQ_GEMM_TILE_ROWS]) {
    enum { NW = PQ_GEMM_NW, MR = PQ_GEMM_MR };
    const int64_t K = a->K, G = w->group;
    for (int j = 0; j < NW; j++)
        for (int rr = 0; rr < rows; rr++) {
            const int64_t p = p0 + rr / MR, r = rr % MR;
            const uint32_t *ap = a->ap + p * (K / 2) * MR;
            const float *xs = a->xs + p * (K / 32) * MR, *xg = a->xg + p * (K / 16) * MR;
            const int16_t *wq = w->q + j * K;
            float f = 0.0f;
            for (int64_t g = 0; g < K / G; g++) {
                int32_t acc = 0;
                for (int64_t kp = g * (G / 2); kp < (g + 1) * (G / 2); kp++) {
                    uint32_t pair = ap[kp * MR + r];
                    acc += (int32_t)(int16_t)(pair & 0xFFFF) * wq[2 * kp] +
                           (int32_t)(int16_t)(pair >> 16) * wq[2 * kp + 1];
                }
                const int64_t g16 = g * G / 16;
                f += (float)acc * (xs[(g * G / 32) * MR + r] * w->scale[j * (K / 16) + g16]);
                if (w->has_offset)
                    for (int64_t h = g16; h < g16 + G / 16; h++)
                        f += xg[h * MR + r] * w->offset[j * (K / 16) + h];
            }
            tile[j][rr] = f;
        }
}

static int always(void) { return 1; }

const pq_isa_impl pq_isa_scalar = {"scalar", always, mul_rows, 0, gemm_tile, NULL};
