/* The many-row product (gemm_i16.c), driven by pq_linear (api.c) from PQ_GEMM_ROWS rows. */
#ifndef PQ_GEMM_I16_H
#define PQ_GEMM_I16_H

#include "cpu_quant.h"
#include "kernels.h"

/* From this many activation rows a product packs them by panels and decodes each weight
 * row once for all of them (below, the fused row dots unpack a block once per 8 rows). */
#define PQ_GEMM_ROWS 12

/* y[m*ldy + parts[j].col + n] = x[m] . W_j[n] for every part, with x given as
 * pq_quantize_act's (q, d, gsum) of M rows of K; the arithmetic of the row dots (exact
 * int32 sums of int16 products per group, then float32), tiled by isa->gemm_tile. */
int pq_gemm_parts(const pq_isa_impl *isa, const pq_part *parts, int nparts, int64_t K,
                  const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                  int64_t ldy, int nthreads);

#endif
