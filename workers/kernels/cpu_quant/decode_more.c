/* Decoders of the other block types: Q4_0, Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS
 * (canonical form and contract: decode.h; the factors follow workers/loader/gguf_quants.py). */
#include "decode.h"

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* One scale (and offset) for the two groups of 16 of 32-element block b. */
static inline void put32(float *scale, float *offset, int64_t b, float s, float off) {
    scale[2 * b] = scale[2 * b + 1] = s;
    offset[2 * b] = offset[2 * b + 1] = off;
}

PQ_DECODER
void pq_decode_q4_0(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | q[16]: element j < 16 low nibble of q[j], j >= 16 high nibble of q[j-16]; w = d * (q - 8) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 18 * b, *qs = blk + 2;
        int8_t *o = v + 32 * b;
        for (int j = 0; j < 16; j++) {
            o[j] = (int8_t)((qs[j] & 0x0F) - 8);
            o[j + 16] = (int8_t)((qs[j] >> 4) - 8);
        }
        put32(scale, offset, b, pq_f16(blk), 0.0f);
    }
}

PQ_DECODER
void pq_decode_q4_1(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | f16 m | q[16] nibbles as in Q4_0; w = d * q + m */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 20 * b, *qs = blk + 4;
        int8_t *o = v + 32 * b;
        for (int j = 0; j < 16; j++) {
            o[j] = (int8_t)(qs[j] & 0x0F);
            o[j + 16] = (int8_t)(qs[j] >> 4);
        }
        put32(scale, offset, b, pq_f16(blk), pq_f16(blk + 2));
    }
}

PQ_DECODER
void pq_decode_q5_1(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | f16 m | u32 high bits (bit j -> bit 4 of element j) | q[16] nibbles as in Q4_0; w = d * q + m */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 24 * b, *qs = blk + 8;
        uint32_t qh = le32(blk + 4);
        int8_t *o = v + 32 * b;
        for (int j = 0; j < 16; j++) {
            o[j] = (int8_t)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
            o[j + 16] = (int8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        put32(scale, offset, b, pq_f16(blk), pq_f16(blk + 2));
    }
}

PQ_DECODER
void pq_decode_iq4_nl(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | q[16] nibbles as in Q4_0, indices into the 16 levels; w = d * level */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 18 * b, *qs = blk + 2;
        int8_t *o = v + 32 * b;
        for (int j = 0; j < 16; j++) {
            o[j] = pq_iq4nl_levels[qs[j] & 0x0F];
            o[j + 16] = pq_iq4nl_levels[qs[j] >> 4];
        }
        put32(scale, offset, b, pq_f16(blk), 0.0f);
    }
}

PQ_DECODER
void pq_decode_q2_k(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* scales[16] (low nibble sc, high nibble m, per 16) | q[64] | f16 d | f16 dmin; element
     * 128h + 32k + j is bits 2k..2k+1 of q[32h + j]; w = (d*sc) * q - (dmin*m) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 84 * b, *qs = blk + 16;
        float d = pq_f16(blk + 80), dmin = pq_f16(blk + 82);
        int8_t *o = v + PQ_QK_K * b;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int j = 0; j < 32; j++) o[128 * h + 32 * k + j] = (int8_t)((qs[32 * h + j] >> (2 * k)) & 3);
        for (int g = 0; g < 16; g++) {
            scale[16 * b + g] = d * (float)(blk[g] & 0x0F);
            offset[16 * b + g] = -(dmin * (float)(blk[g] >> 4));
        }
    }
}

PQ_DECODER
void pq_decode_q3_k(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* hmask[32] | q[64] | scales[12] | f16 d; element e = 128h + 32k + j is bits 2k..2k+1 of
     * q[32h + j], minus 4 where bit e/32 of hmask[j] is clear; 6-bit scale g is nibble g/8 of
     * scales[g%8] | bits 2(g/4).. of scales[8 + g%4] << 4; w = (d * (sc - 32)) * q */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 110 * b, *hm = blk, *qs = blk + 32, *sc = blk + 96;
        float d = pq_f16(blk + 108);
        int8_t *o = v + PQ_QK_K * b;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int j = 0; j < 32; j++) {
                    int q = (qs[32 * h + j] >> (2 * k)) & 3;
                    int hi = (hm[j] >> (4 * h + k)) & 1;
                    o[128 * h + 32 * k + j] = (int8_t)(q - (hi ? 0 : 4));
                }
        for (int g = 0; g < 16; g++) {
            int low = (sc[g & 7] >> (4 * (g >> 3))) & 0x0F;
            int high = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
            scale[16 * b + g] = d * (float)((low | (high << 4)) - 32);
            offset[16 * b + g] = 0.0f;
        }
    }
}

PQ_DECODER
void pq_decode_q5_k(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | f16 dmin | scales[12] (as Q4_K) | qh[32] | q[128]: nibbles as Q4_K, bit s of qh[j]
     * is bit 4 of element j of sub-block s; w = (d*sc) * q - (dmin*m) */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 176 * b, *qh = blk + 16, *qs = blk + 48;
        float d = pq_f16(blk), dmin = pq_f16(blk + 2);
        int8_t *o = v + PQ_QK_K * b;
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 32; j++) {
                o[64 * i + j] = (int8_t)((qs[32 * i + j] & 0x0F) | (((qh[j] >> (2 * i)) & 1) << 4));
                o[64 * i + 32 + j] = (int8_t)((qs[32 * i + j] >> 4) | (((qh[j] >> (2 * i + 1)) & 1) << 4));
            }
        pq_k_factors(blk + 4, d, dmin, scale + 16 * b, offset + 16 * b);
    }
}

PQ_DECODER
void pq_decode_iq4_xs(const uint8_t *src, int64_t n_blocks, int8_t *v, float *scale, float *offset) {
    /* f16 d | u16 scales_h | scales_l[4] | q[128]; sub-block s of 32: scale = nibble s%2 of
     * scales_l[s/2] | bits 2s..2s+1 of scales_h << 4, q[16s..16s+15] nibbles as Q4_0;
     * w = (d * (scale - 32)) * level */
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = src + 136 * b, *sl = blk + 4, *qs = blk + 8;
        float d = pq_f16(blk);
        unsigned sh = (unsigned)blk[2] | ((unsigned)blk[3] << 8);
        int8_t *o = v + PQ_QK_K * b;
        for (int s = 0; s < 8; s++) {
            for (int j = 0; j < 16; j++) {
                o[32 * s + j] = pq_iq4nl_levels[qs[16 * s + j] & 0x0F];
                o[32 * s + 16 + j] = pq_iq4nl_levels[qs[16 * s + j] >> 4];
            }
            int ls = (int)(((sl[s >> 1] >> (4 * (s & 1))) & 0x0F) | (((sh >> (2 * s)) & 3) << 4));
            put32(scale, offset, 8 * b + s, d * (float)(ls - 32), 0.0f);
        }
    }
}
