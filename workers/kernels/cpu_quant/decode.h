/* The per-type block decoders: one signature, one table.
 *
 * Every supported GGUF type is decoded to one canonical form that the ISA
 * kernels (kernels_*.c) multiply against the 8-bit activations:
 *
 *     w[i] = scale[i / 16] * v[i] + offset[i / 16]      (i = 0 .. 32*n32 - 1)
 *
 * with v int8 (any value, -128 included), and scale/offset float32 per group of
 * 16 consecutive elements (types with one scale per 32 write it twice). For
 * dequantize_rows the float arithmetic above must reproduce the reference
 * (workers/loader/gguf_quants.py) bit for bit: compute scale and offset exactly
 * as the reference computes its float32 factors (e.g. scale = d * sc in float32,
 * offset = -(dmin * m)); the library is built with -ffp-contract=off so
 * scale * v + offset is rounded twice, like numpy. A type with no offset term
 * writes offset = 0 and sets has_offset = 0 in its table row (the product then
 * skips that term).
 *
 * A decoder:
 *
 *     void pq_decode_<type>(const uint8_t *src, int64_t n_blocks,
 *                           int8_t *v, float *scale, float *offset);
 *
 *   src      n_blocks consecutive GGUF blocks of the type (one weight row, or a
 *            run of it); no alignment guaranteed.
 *   v        n_blocks * block_elems int8 values (64-byte aligned buffer).
 *   scale,   n_blocks * block_elems / 16 floats each.
 *   offset
 *
 * It must not read past src + n_blocks * block_bytes, must be pure (no state,
 * thread-safe) and must handle any bytes (random fp16 scale fields included:
 * inf/nan in, inf/nan out, never a crash).
 *
 * Plugging in a type: write pq_decode_<type> (names below) in any new .c file
 * of this directory (setup.py compiles every *.c here), prefixed with
 * PQ_DECODER. The table (types.c) references each decoder weakly, so a type
 * whose decoder is not linked in has decode == NULL: the product and
 * dequantize calls refuse it with PQ_ERR_TYPE, never wrong numbers.
 */
#ifndef PQ_DECODE_H
#define PQ_DECODE_H

#include <stdint.h>
#include <string.h>

/* Decoders are plain C; on x86-64 Linux GCC also compiles AVX-512/AVX2 clones
 * of them, picked by the loader (ifunc), so simple loops get vectorized. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define PQ_DECODER __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PQ_DECODER
#endif

typedef void (*pq_decode_fn)(const uint8_t *src, int64_t n_blocks, int8_t *v,
                             float *scale, float *offset);

/* ggml type ids (ggml.h enum ggml_type) */
enum {
    PQ_Q4_0 = 2, PQ_Q4_1 = 3, PQ_Q5_0 = 6, PQ_Q5_1 = 7, PQ_Q8_0 = 8,
    PQ_Q2_K = 10, PQ_Q3_K = 11, PQ_Q4_K = 12, PQ_Q5_K = 13, PQ_Q6_K = 14,
    PQ_IQ4_NL = 20, PQ_IQ4_XS = 23,
};

#define PQ_QK_K 256 /* elements per k-quant super-block */

void pq_decode_q4_0(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q4_1(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q5_0(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q5_1(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q8_0(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q2_k(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q3_k(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q4_k(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q5_k(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_q6_k(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_iq4_nl(const uint8_t *, int64_t, int8_t *, float *, float *);
void pq_decode_iq4_xs(const uint8_t *, int64_t, int8_t *, float *, float *);

/* One row of the type table (types.c). */
typedef struct {
    int id;            /* ggml type id */
    const char *name;  /* "Q4_K" */
    int block_elems;   /* 32 or 256 */
    int block_bytes;
    int has_offset;    /* decoder writes non-zero offsets */
    pq_decode_fn decode; /* NULL: no decoder linked in */
} pq_type_info;

/* The table row of a ggml type id, NULL for a type the library does not know. */
const pq_type_info *pq_type(int id);

/* IEEE half -> float, exact (subnormals, inf, nan), no F16C needed. */
static inline float pq_f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The j-th (0..7) 6-bit scale and min of a Q4_K/Q5_K super-block (12 packed bytes). */
static inline void pq_k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* All 8 (scale, min) pairs of pq_k_scale_min at once, four bytes to a 32-bit word: bytes
 * 0-3 hold the low 6 bits of scales 0-3, bytes 4-7 of mins 0-3, and bytes 8-11 the low 4
 * bits of scale j+4 | min j+4 << 4, whose top 2 bits are the top bits of bytes j and j+4.
 * A fraction of the per-byte form's instructions: the fused Q4_K dot runs this for every
 * super-block of a row. Little-endian words: the x86 kernels' only. */
static inline void pq_k_scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
    const uint32_t words[4] = {a & low6, (c & low4) | (((a >> 6) & top2) << 4),
                               b & low6, ((c >> 4) & low4) | (((b >> 6) & top2) << 4)};
    memcpy(sc, words, 8);
    memcpy(m, words + 2, 8);
}

/* The factors of the 8 sub-blocks of 32 of a Q4_K/Q5_K super-block (12 packed scale bytes):
 * scale d*sc and offset -(dmin*m), each written for both of the sub-block's groups of 16. */
static inline void pq_k_factors(const uint8_t *s, float d, float dmin, float *scale, float *offset) {
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        pq_k_scale_min(s, j, &sc, &m);
        scale[2 * j] = scale[2 * j + 1] = d * (float)sc;
        offset[2 * j] = offset[2 * j + 1] = -(dmin * (float)m);
    }
}

/* The 16 levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl). */
static const int8_t pq_iq4nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};

#endif
