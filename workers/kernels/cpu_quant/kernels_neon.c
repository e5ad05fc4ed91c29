/* ARM NEON variant (aarch64, plain Armv8.0 Advanced SIMD: no dotprod or i8mm needed).
 *
 * The activations are int16, so the int8 x int8 dot instructions (sdot) do not apply:
 * the weights are sign-extended to int16 (sxtl) and multiplied with the activations by
 * widening multiply-accumulates into int32 lanes (smull/smlal/smlal2), four products an
 * instruction. Exact: |w| <= 128 and |q| <= 32767 keep each product below 2^22 and a
 * lane's sum over a group below 2^26. Each group's int32 sums are converted to float32
 * and scaled once, as in the x86 variants; only the order of the float additions differs
 * from the scalar variant. Elements stay in their natural order (no lane order).
 *
 * The same paths as kernels_simd.h / kernels_fused.h: fused row dots (a block unpacked
 * once in registers for up to 8 activation rows) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * IQ4_NL (a table lookup), Q4_K and Q6_K; the decode-then-dot path (decode.h's
 * canonical form) for every other type; and the many-row product's tile (gemm_i16.c).
 * Tested against the scalar variant under qemu (tests/test_cpu_quant_neon.py). */
#if defined(__aarch64__)
#if defined(__AARCH64EB__)
#error "kernels_neon.c assumes little-endian aarch64 (block fields are read as LE words)"
#endif
#include <arm_neon.h>
#include <string.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif

#include "kernels.h"

/* No scheduling before register allocation in this file's functions: GCC 12's scheduler
 * hoisted the loads of the 8-row dots far enough to spill their accumulators to the stack
 * (17-24 stack loads and stores per block of 8 rows); without it none are spilled and the
 * 8-row loops are 8-19% fewer instructions (Q4_K to Q5_0). Functions compiled under the
 * pragma were not inlined into each other by the usual heuristics, so every helper below
 * is always_inline. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-schedule-insns")
#endif
#define PQ_INLINE __attribute__((always_inline)) static inline

/* ---- 16 and 32 element products ---- */

/* 16 int8 weights -> two int16x8 halves */
PQ_INLINE void widen_s8(int8x16_t v, int16x8_t *lo, int16x8_t *hi) {
    *lo = vmovl_s8(vget_low_s8(v));
    *hi = vmovl_high_s8(v);
}

/* The int32 sums (4 lanes) of 16 products: weights (w0, w1) times activations q[0..15]. */
PQ_INLINE int32x4_t dot16(int16x8_t w0, int16x8_t w1, const int16_t *q) {
    const int16x8_t x0 = vld1q_s16(q), x1 = vld1q_s16(q + 8);
    int32x4_t a = vmull_s16(vget_low_s16(w0), vget_low_s16(x0));
    int32x4_t b = vmull_s16(vget_low_s16(w1), vget_low_s16(x1));
    a = vmlal_high_s16(a, w0, x0);
    b = vmlal_high_s16(b, w1, x1);
    return vaddq_s32(a, b);
}

/* A block of 32: elements 0-15 in v0, 16-31 in v1 (int8), widened once for every row. */
typedef struct {
    int16x8_t w[4];
} pq_w32;

PQ_INLINE pq_w32 widen32(int8x16_t v0, int8x16_t v1) {
    pq_w32 r;
    widen_s8(v0, &r.w[0], &r.w[1]);
    widen_s8(v1, &r.w[2], &r.w[3]);
    return r;
}

/* The int32 sums of a block's 32 products (one scale for the block). */
PQ_INLINE int32x4_t dot32(const pq_w32 *w, const int16_t *q) {
    return vaddq_s32(dot16(w->w[0], w->w[1], q), dot16(w->w[2], w->w[3], q + 16));
}

PQ_INLINE float f16_at(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h; /* fcvt: exact, subnormals and inf/nan included */
}

/* ---- the decode-then-dot path (the types without a fused dot) ---- */

static float dot_decoded(const int8_t *v, const float *scale, const int16_t *q, const float *xd,
                         int64_t n32) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < n32; b++) {
        int16x8_t a0, a1, b0, b1;
        widen_s8(vld1q_s8(v + 32 * b), &a0, &a1);
        widen_s8(vld1q_s8(v + 32 * b + 16), &b0, &b1);
        const int32x4_t p0 = dot16(a0, a1, q + 32 * b), p1 = dot16(b0, b1, q + 32 * b + 16);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), scale[2 * b] * xd[b]);
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(p1), scale[2 * b + 1] * xd[b]);
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1));
}

/* ---- fused row dots ---- */

/* Every loop over the R activation rows is unrolled, and the per-row arrays have the fixed
 * size 8 (not R), so that all the accumulators become registers. */
#define PQ_UNROLL_R _Pragma("GCC unroll 8")

/* The activation rows of one call: row r's int16 values at q + r * K, its block scales at
 * xd + r * K/32, its group sums at gs + r * K/16. */
typedef struct {
    const int16_t *q;
    const float *xd;
    const int32_t *gs;
    int64_t K;
} pq_rows;

/* Bits 0-15 (half 0) or 16-31 (half 1) of a Q5 block's little-endian u32 of fifth bits ->
 * 0xFF in byte j where bit j of the half is set, else 0. */
PQ_INLINE uint8x16_t fifth_bits(uint32_t qh, int half) {
    static const uint8_t pick[2][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
                                        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3}};
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bytes = vqtbl1q_u8(vreinterpretq_u8_u32(vdupq_n_u32(qh)), vld1q_u8(pick[half]));
    return vtstq_u8(bytes, vld1q_u8(bit));
}

/* The legacy 32-element types, f16 d [| f16 m] [| u32 qh] | q[16] (nibbles: element j low
 * nibble of q[j], element 16+j the high one), IQ4_NL (f16 d | q[16], nibbles index the 16
 * levels) and Q8_0 (f16 d | int8 q[32]). Each block is unpacked once and multiplied with
 * R activation rows (a constant at each call site: the accumulators stay in registers);
 * a row's arithmetic is the same whatever R is. */
__attribute__((always_inline)) static inline void legacy_rows(int id, const uint8_t *w, pq_rows x,
                                                              const int R, float *out) {
    const int bytes = id == PQ_Q4_0 || id == PQ_IQ4_NL ? 18 : id == PQ_Q4_1 ? 20
                    : id == PQ_Q5_0 ? 22 : id == PQ_Q5_1 ? 24 : 34;
    const int eight = id == PQ_Q8_0, nl = id == PQ_IQ4_NL;
    const int has_min = id == PQ_Q4_1 || id == PQ_Q5_1, five = id == PQ_Q5_0 || id == PQ_Q5_1;
    const int qs_at = 2 + 2 * has_min + 4 * five;
    const int64_t n32 = x.K / 32;
    const int bias = has_min || nl ? 0 : (five ? 16 : 8);
    const int8x16_t levels = vld1q_s8(pq_iq4nl_levels);
    float32x4_t acc[8]; /* R <= 8 */
    float off[8];
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) acc[r] = vdupq_n_f32(0.0f), off[r] = 0.0f;
    for (int64_t b = 0; b < n32; b++) {
        const uint8_t *blk = w + bytes * b;
        int8x16_t v0, v1;
        if (eight) {
            v0 = vld1q_s8((const int8_t *)blk + 2);
            v1 = vld1q_s8((const int8_t *)blk + 18);
        } else {
            const uint8x16_t qs = vld1q_u8(blk + qs_at);
            uint8x16_t lo = vandq_u8(qs, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(qs, 4);
            if (nl) {
                v0 = vqtbl1q_s8(levels, lo);
                v1 = vqtbl1q_s8(levels, hi);
            } else if (five && !has_min) { /* Q5_0: q - 16 where the fifth bit is clear */
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                const uint8x16_t k16 = vdupq_n_u8(16);
                v0 = vreinterpretq_s8_u8(vsubq_u8(lo, vbicq_u8(k16, fifth_bits(qh, 0))));
                v1 = vreinterpretq_s8_u8(vsubq_u8(hi, vbicq_u8(k16, fifth_bits(qh, 1))));
            } else {
                if (five) { /* Q5_1: the fifth bits as 16 */
                    uint32_t qh;
                    memcpy(&qh, blk + 4, 4);
                    lo = vorrq_u8(lo, vandq_u8(fifth_bits(qh, 0), vdupq_n_u8(16)));
                    hi = vorrq_u8(hi, vandq_u8(fifth_bits(qh, 1), vdupq_n_u8(16)));
                }
                v0 = vreinterpretq_s8_u8(lo), v1 = vreinterpretq_s8_u8(hi);
                if (bias) {
                    v0 = vsubq_s8(v0, vdupq_n_s8((int8_t)bias));
                    v1 = vsubq_s8(v1, vdupq_n_s8((int8_t)bias));
                }
            }
        }
        const pq_w32 wb = widen32(v0, v1);
        const float d = f16_at(blk), mn = has_min ? f16_at(blk + 2) : 0.0f;
        PQ_UNROLL_R
        for (int r = 0; r < R; r++) {
            const float xd = x.xd[r * n32 + b];
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(dot32(&wb, x.q + r * x.K + 32 * b)), d * xd);
            if (has_min) {
                const int32_t *g = x.gs + r * (x.K / 16) + 2 * b;
                off[r] += mn * (float)(g[0] + g[1]) * xd;
            }
        }
    }
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) out[r] = vaddvq_f32(acc[r]) + off[r];
}

/* 8 unsigned bytes -> two float32x4 */
PQ_INLINE void u8x8_f32(const uint8_t *p, float32x4_t *lo, float32x4_t *hi) {
    const uint16x8_t v = vmovl_u8(vld1_u8(p));
    *lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(v)));
    *hi = vcvtq_f32_u32(vmovl_high_u16(v));
}

/* Q4_K: f16 d | f16 dmin | scales[12] | q[128]; sub-block j of 32 has scale d*sc_j and min
 * dmin*m_j; 32-byte run i holds sub-blocks 2i (low nibbles) and 2i+1 (high nibbles). */
__attribute__((always_inline)) static inline void q4_k_rows(const uint8_t *w, pq_rows x,
                                                            const int R, float *out) {
    const uint8x16_t lo4 = vdupq_n_u8(0x0F);
    const int64_t n256 = x.K / 256;
    float32x4_t acc[8], off[8];
    float f[8][8];
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) acc[r] = off[r] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 144 * sb;
        uint8_t sc[8], m[8];
        pq_k_scales_mins(blk + 4, sc, m);
        float32x4_t sc0, sc1, m0, m1;
        u8x8_f32(sc, &sc0, &sc1);
        u8x8_f32(m, &m0, &m1);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        const float32x4_t dsc0 = vmulq_n_f32(sc0, d), dsc1 = vmulq_n_f32(sc1, d);
        const float32x4_t dm0 = vmulq_n_f32(m0, dmin), dm1 = vmulq_n_f32(m1, dmin);
        PQ_UNROLL_R
        for (int r = 0; r < R; r++) {
            const float *xb = x.xd + r * (x.K / 32) + 8 * sb;
            const float32x4_t xb0 = vld1q_f32(xb), xb1 = vld1q_f32(xb + 4);
            vst1q_f32(f[r], vmulq_f32(dsc0, xb0));
            vst1q_f32(f[r] + 4, vmulq_f32(dsc1, xb1));
            /* group sums of 16 -> of 32 (g0+g1, g2+g3, ...): one per sub-block */
            const int32_t *g = x.gs + r * (x.K / 16) + 16 * sb;
            const float32x4_t g0 = vcvtq_f32_s32(vpaddq_s32(vld1q_s32(g), vld1q_s32(g + 4)));
            const float32x4_t g1 = vcvtq_f32_s32(vpaddq_s32(vld1q_s32(g + 8), vld1q_s32(g + 12)));
            off[r] = vaddq_f32(off[r], vmulq_f32(vmulq_f32(dm0, g0), xb0));
            off[r] = vaddq_f32(off[r], vmulq_f32(vmulq_f32(dm1, g1), xb1));
        }
        for (int i = 0; i < 4; i++) {
            const uint8x16_t a = vld1q_u8(blk + 16 + 32 * i), c = vld1q_u8(blk + 32 + 32 * i);
            /* nibbles 0..15: positive as int8, so the sign-extension widens them right */
            const pq_w32 l = widen32(vreinterpretq_s8_u8(vandq_u8(a, lo4)),
                                     vreinterpretq_s8_u8(vandq_u8(c, lo4)));
            const pq_w32 h = widen32(vreinterpretq_s8_u8(vshrq_n_u8(a, 4)),
                                     vreinterpretq_s8_u8(vshrq_n_u8(c, 4)));
            PQ_UNROLL_R
            for (int r = 0; r < R; r++) {
                const int16_t *q = x.q + r * x.K + 256 * sb + 64 * i;
                acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(dot32(&l, q)), f[r][2 * i]);
                acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(dot32(&h, q + 32)), f[r][2 * i + 1]);
            }
        }
    }
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) out[r] = vaddvq_f32(acc[r]) - vaddvq_f32(off[r]);
}

/* Q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d; in half h, block k (0..3) of 32 is
 * nibble k>>1 of ql[64h + 32(k&1) + j] with bits 2k..2k+1 of qh[32h + j] above it, minus 32;
 * one scale per 16, so block 4h+k's two groups take scales 8h+2k and 8h+2k+1. */
__attribute__((always_inline)) static inline void q6_k_rows(const uint8_t *w, pq_rows x,
                                                            const int R, float *out) {
    const uint8x16_t lo4 = vdupq_n_u8(0x0F), hi2 = vdupq_n_u8(0x30);
    const int8x16_t k32 = vdupq_n_s8(32);
    const int64_t n256 = x.K / 256, n32 = x.K / 32;
    float32x4_t acc[8]; /* R <= 8 */
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < n256; sb++) {
        const uint8_t *blk = w + 210 * sb;
        const float d = f16_at(blk + 208);
        for (int h = 0; h < 2; h++) {
            /* this half's 8 scales times d */
            float s[8];
            const int16x8_t sc16 = vmovl_s8(vld1_s8((const int8_t *)blk + 192 + 8 * h));
            vst1q_f32(s, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc16))), d));
            vst1q_f32(s + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(sc16)), d));
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const uint8x16_t hb0 = vld1q_u8(qh), hb1 = vld1q_u8(qh + 16);
            for (int k = 0; k < 4; k++) {
                const uint8x16_t l0 = vld1q_u8(ql + 32 * (k & 1)), l1 = vld1q_u8(ql + 32 * (k & 1) + 16);
                const uint8x16_t lo0 = k < 2 ? vandq_u8(l0, lo4) : vshrq_n_u8(l0, 4);
                const uint8x16_t lo1 = k < 2 ? vandq_u8(l1, lo4) : vshrq_n_u8(l1, 4);
                const uint8x16_t hi0 = k == 0 ? vshlq_n_u8(hb0, 4) : k == 1 ? vshlq_n_u8(hb0, 2)
                                     : k == 2 ? hb0 : vshrq_n_u8(hb0, 2);
                const uint8x16_t hi1 = k == 0 ? vshlq_n_u8(hb1, 4) : k == 1 ? vshlq_n_u8(hb1, 2)
                                     : k == 2 ? hb1 : vshrq_n_u8(hb1, 2);
                const int8x16_t v0 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo0, vandq_u8(hi0, hi2))), k32);
                const int8x16_t v1 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo1, vandq_u8(hi1, hi2))), k32);
                const pq_w32 wb = widen32(v0, v1);
                const int64_t b = 8 * sb + 4 * h + k;
                PQ_UNROLL_R
                for (int r = 0; r < R; r++) {
                    const int16_t *q = x.q + r * x.K + 32 * b;
                    const float xd = x.xd[r * n32 + b];
                    acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(dot16(wb.w[0], wb.w[1], q)), s[2 * k] * xd);
                    acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(dot16(wb.w[2], wb.w[3], q + 16)),
                                         s[2 * k + 1] * xd);
                }
            }
        }
    }
    PQ_UNROLL_R
    for (int r = 0; r < R; r++) out[r] = vaddvq_f32(acc[r]);
}

/* R rows (1, 2, 4 or 8) of the types whose weight blocks are unpacked once for all of them. */
__attribute__((always_inline)) static inline void rows_of(int id, const uint8_t *w, pq_rows x,
                                                          const int R, float *out) {
    switch (id) {
    case PQ_Q4_0: legacy_rows(PQ_Q4_0, w, x, R, out); break;
    case PQ_Q4_1: legacy_rows(PQ_Q4_1, w, x, R, out); break;
    case PQ_Q5_0: legacy_rows(PQ_Q5_0, w, x, R, out); break;
    case PQ_Q5_1: legacy_rows(PQ_Q5_1, w, x, R, out); break;
    case PQ_Q8_0: legacy_rows(PQ_Q8_0, w, x, R, out); break;
    case PQ_IQ4_NL: legacy_rows(PQ_IQ4_NL, w, x, R, out); break;
    case PQ_Q6_K: q6_k_rows(w, x, R, out); break;
    default: q4_k_rows(w, x, R, out);
    }
}

PQ_INLINE int multi_row_type(int id) {
    return id == PQ_Q4_0 || id == PQ_Q4_1 || id == PQ_Q5_0 || id == PQ_Q5_1 || id == PQ_Q8_0 ||
           id == PQ_IQ4_NL || id == PQ_Q4_K || id == PQ_Q6_K;
}

/* y[m*ldy] = row m . W's row for all M rows, in chunks of 8, 4, 2 and 1 rows. */
static void fused_rows(int id, const uint8_t *w, pq_rows x, int64_t M, float *y, int64_t ldy) {
    float out[8];
    for (int64_t m = 0; m < M;) {
        const int R = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
        pq_rows at = {x.q + m * x.K, x.xd + m * (x.K / 32), x.gs + m * (x.K / 16), x.K};
        switch (R) {
        case 8: rows_of(id, w, at, 8, out); break;
        case 4: rows_of(id, w, at, 4, out); break;
        case 2: rows_of(id, w, at, 2, out); break;
        default: rows_of(id, w, at, 1, out);
        }
        for (int r = 0; r < R; r++) y[(m + r) * ldy] = out[r];
        m += R;
    }
}

/* Bytes ahead of the row being multiplied that are prefetched, as on x86 (there the
 * hardware prefetchers stop at each 4 KiB page); not measured on an ARM core. */
#define PQ_PREFETCH_BYTES 2048

PQ_INLINE void prefetch_ahead(const uint8_t *row, int64_t row_bytes, const uint8_t *end) {
    for (int64_t o = 0; o < row_bytes; o += 64)
        if (row + PQ_PREFETCH_BYTES + o < end) __builtin_prefetch(row + PQ_PREFETCH_BYTES + o);
}

static void mul_rows(const pq_mm_args *a, int64_t n0, int64_t n1, pq_scratch *s) {
    const pq_type_info *t = a->t;
    const int64_t K = a->K, n32 = K / 32;
    if (multi_row_type(t->id)) {
        const pq_rows x = {a->q, a->d, a->gsum, K};
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = a->w + n * a->row_bytes;
            prefetch_ahead(wr, a->row_bytes, a->w_end);
            fused_rows(t->id, wr, x, a->M, a->y + n, a->ldy);
        }
        return;
    }
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

/* The many-row product's tile (gemm_i16.c; the interface in kernels.h): PQ_GEMM_NW decoded
 * weight rows against `rows` activation rows from panel p on (row r of the tile is row
 * r % PQ_GEMM_MR of panel p + r / PQ_GEMM_MR), exact int32 sums per group of 16 or 32,
 * scaled once per group into float32 (the scalar variant's gemm_tile). The packed
 * activations hold each row's int16 pair (q[2kp], q[2kp+1]) in one 32-bit word, so one
 * 128-bit load is a pair of 4 rows; times the weight pair broadcast to every word, the
 * products of each row's even and odd elements accumulate in adjacent int32 lanes (smlal
 * for rows 0-1 of the 4, smlal2 for rows 2-3), and one pairwise add per group gives the
 * 4 rows' sums. */
#if defined(PQ_GEMM_TILE_ROWS)
#define PQ_NEON_TILE_ROWS PQ_GEMM_TILE_ROWS
#else
#define PQ_NEON_TILE_ROWS PQ_GEMM_MR
#endif

__attribute__((always_inline)) static inline void gemm_tile_g(const pq_gemm_act *a, int64_t p0,
                                                              const pq_gemm_w *w, int64_t rows,
                                                              const int G, const int OFF,
                                                              float tile[PQ_GEMM_NW][PQ_NEON_TILE_ROWS]) {
    enum { NW = PQ_GEMM_NW, MR = PQ_GEMM_MR };
    const int64_t K = a->K;
    for (int rr = 0; rr < rows; rr += 4) { /* 4 activation rows at a time (past rows: undefined) */
        const int64_t p = p0 + rr / MR, i = rr % MR;
        const uint32_t *ap = a->ap + p * (K / 2) * MR + i;
        const float *xs = a->xs + p * (K / 32) * MR + i, *xg = a->xg + p * (K / 16) * MR + i;
        float32x4_t f[NW];
        for (int j = 0; j < NW; j++) f[j] = vdupq_n_f32(0.0f);
        for (int64_t g = 0; g < K / G; g++) {
            int32x4_t lo[NW], hi[NW];
            for (int j = 0; j < NW; j++) lo[j] = hi[j] = vdupq_n_s32(0);
            for (int64_t kp = g * (G / 2); kp < (g + 1) * (G / 2); kp++) {
                const int16x8_t av = vreinterpretq_s16_u32(vld1q_u32(ap + kp * MR));
                for (int j = 0; j < NW; j++) {
                    uint32_t pair;
                    memcpy(&pair, w->q + j * K + 2 * kp, 4);
                    const int16x8_t wp = vreinterpretq_s16_u32(vdupq_n_u32(pair));
                    lo[j] = vmlal_s16(lo[j], vget_low_s16(av), vget_low_s16(wp));
                    hi[j] = vmlal_high_s16(hi[j], av, wp);
                }
            }
            const int64_t blk = g * G / 32, g16 = g * G / 16;
            const float32x4_t s = vld1q_f32(xs + blk * MR);
            for (int j = 0; j < NW; j++)
                f[j] = vfmaq_f32(f[j], vcvtq_f32_s32(vpaddq_s32(lo[j], hi[j])),
                                 vmulq_n_f32(s, w->scale[j * (K / 16) + g16]));
            if (OFF)
                for (int64_t h = g16; h < g16 + G / 16; h++) {
                    const float32x4_t xh = vld1q_f32(xg + h * MR);
                    for (int j = 0; j < NW; j++)
                        f[j] = vfmaq_n_f32(f[j], xh, w->offset[j * (K / 16) + h]);
                }
        }
        for (int j = 0; j < NW; j++) vst1q_f32(tile[j] + rr, f[j]);
    }
}

static void gemm_tile(const pq_gemm_act *a, int64_t p0, const pq_gemm_w *w, int64_t rows,
                      float tile[PQ_GEMM_NW][PQ_NEON_TILE_ROWS]) {
    if (w->group == 32) {
        if (w->has_offset) gemm_tile_g(a, p0, w, rows, 32, 1, tile);
        else gemm_tile_g(a, p0, w, rows, 32, 0, tile);
    } else {
        if (w->has_offset) gemm_tile_g(a, p0, w, rows, 16, 1, tile);
        else gemm_tile_g(a, p0, w, rows, 16, 0, tile);
    }
}

/* A change of gemm_i16's interface must reach this file: */
_Static_assert(__builtin_types_compatible_p(__typeof__(((pq_isa_impl *)0)->gemm_tile),
                                            __typeof__(&gemm_tile)),
               "kernels_neon.c: gemm_tile no longer matches pq_isa_impl.gemm_tile (kernels.h)");

static int cpu_has(void) {
#if defined(__linux__)
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#else
    return 1; /* Advanced SIMD is part of every aarch64 core */
#endif
}

const pq_isa_impl pq_isa_neon = {.name = "neon", .cpu_has = cpu_has, .mul_rows = mul_rows,
                                 .lane_order = 0, .gemm_tile = gemm_tile,
                                 .unpack_row = NULL /* gemm_i16's canonical decode */};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif
