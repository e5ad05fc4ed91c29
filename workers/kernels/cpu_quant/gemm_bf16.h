/* The bfloat16 prefill product's pieces (gemm_bf16.c), driven by pq_linear_bf16 (api.c). */
#ifndef PQ_GEMM_BF16_H
#define PQ_GEMM_BF16_H

#include <stdint.h>

#include "kernels.h"

#define PQ_BF16_MR 32 /* activation rows per packed panel (two 16-lane registers) */
#define PQ_BF16_NW 8  /* weight rows per register tile: 2 x 8 float32 accumulators */

/* The CPU has AVX-512 BF16 (and this build has the code for it). */
int pq_bf16_cpu_has(void);

/* Panels p0..p1-1 of the activations x float32 [M, K] (row stride ldx) packed as
 * bfloat16 pairs: ap[p][kp][r] holds (x[32p + r][2kp], x[32p + r][2kp + 1]), rows
 * past M zero. ap holds ceil(M / 32) panels of K/2 * 32 words. */
void pq_bf16_pack_act(const float *x, int64_t M, int64_t K, int64_t ldx, uint32_t *ap,
                      int64_t p0, int64_t p1);

/* y[m*ldy + n] = x[m] . W[n] for n0 <= n < n1, every m < M, W the rows of GGUF blocks
 * of type t at w (row n at w + n * row_bytes), each decoded (s) then rounded to
 * bfloat16 into wb (PQ_BF16_NW rows of K). */
void pq_bf16_rows(const pq_type_info *t, const uint8_t *w, int64_t row_bytes, int64_t n0,
                  int64_t n1, int64_t K, const uint32_t *ap, int64_t M, float *y, int64_t ldy,
                  pq_scratch *s, uint16_t *wb);

#endif
