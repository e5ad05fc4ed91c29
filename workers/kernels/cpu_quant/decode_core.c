/* Decoders of the types the default model uses: Q8_0, Q5_0, Q4_K, Q6_K
 * (canonical form and contract: decode.h). */
#include "decode.h"

PQ_DECODER
void pq_decode_q8_0(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | int8 q[32]; w = d * q */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 34 * b;
        float d = pq_f16(blk);
        memcpy(v + 32 * b, blk + 2, 32);
        scale[2 * b] = scale[2 * b + 1] = d;
        offset[2 * b] = offset[2 * b + 1] = 0.0f;
    }
}

PQ_DECODER
void pq_decode_q5_0(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | u32 high bits (little endian) | q[16]: element j < 16 low nibble of q[j],
     * j >= 16 high nibble of q[j-16]; bit j of the u32 is bit 4 of element j; w = d * (q - 16) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 22 * b;
        uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                      ((uint32_t)blk[5] << 24);
        const uint8_t *qs = blk + 6;
        int8_t *o = v + 32 * b;
        for (int j = 0; j < 16; j++) {
            o[j] = (int8_t)(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
            o[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
        float d = pq_f16(blk);
        scale[2 * b] = scale[2 * b + 1] = d;
        offset[2 * b] = offset[2 * b + 1] = 0.0f;
    }
}

PQ_DECODER
void pq_decode_q4_k(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | f16 dmin | scales[12] | q[128]: four 32-byte runs, each giving sub-block 2i
     * (low nibbles) and 2i+1 (high nibbles); w = (d*sc) * q - (dmin*m) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 144 * b;
        float d = pq_f16(blk), dmin = pq_f16(blk + 2);
        const uint8_t *qs = blk + 16;
        int8_t *o = v + PQ_QK_K * b;
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 32; j++) {
                o[64 * i + j] = (int8_t)(qs[32 * i + j] & 0x0F);
                o[64 * i + 32 + j] = (int8_t)(qs[32 * i + j] >> 4);
            }
        pq_k_factors(blk + 4, d, dmin, scale + 16 * b, offset + 16 * b);
    }
}

PQ_DECODER
void pq_decode_q6_k(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* ql[128] | qh[64] | int8 scales[16] | f16 d. Two halves of 128 elements; in half h,
     * element 32*k + j (k = 0..3) is nibble (k >> 1) of ql[64h + 32*(k&1) + j] with
     * high bits 2k..2k+1 of qh[32h + j]; w = (d * s[e/16]) * (q - 32) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 210 * b;
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = pq_f16(blk + 208);
        int8_t *o = v + PQ_QK_K * b;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 32; j++) {
                uint8_t l0 = ql[64 * h + j], l1 = ql[64 * h + 32 + j], hb = qh[32 * h + j];
                o[128 * h + j] = (int8_t)(((l0 & 0x0F) | ((hb & 3) << 4)) - 32);
                o[128 * h + 32 + j] = (int8_t)(((l1 & 0x0F) | (((hb >> 2) & 3) << 4)) - 32);
                o[128 * h + 64 + j] = (int8_t)(((l0 >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                o[128 * h + 96 + j] = (int8_t)(((l1 >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        for (int g = 0; g < 16; g++) {
            scale[16 * b + g] = d * (float)sc[g];
            offset[16 * b + g] = 0.0f;
        }
    }
}
