/* Float helpers shared by the library's float32 operations (ops.c, gdn.c, layer.c):
 * internal, not part of the API. Reductions keep 16 explicit lanes so the compiler
 * vectorizes them without reordering float sums on its own (-ffp-contract=off). */
#ifndef PQ_OPS_INLINE_H
#define PQ_OPS_INLINE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One binary for every x86-64: the loops are cloned for AVX-512 / AVX2 and picked at load. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define PQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PQ_CLONES
#endif

#define LANES 16

PQ_CLONES __attribute__((unused))
static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for x in [-87, 88], within ~2 ulp: 2^k * e^r, r = x - k ln2 in [-ln2/2, ln2/2], a
 * degree-6 Taylor polynomial. Branch-free, so the loops below vectorize (libm's expf
 * and tanhf do not). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693145751953125f - k * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* 1 / (1 + e^-x) */
static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

static inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

/* A float buffer of at least `elems`, grown on demand (each file's own, static; one caller thread: the worker's). */
typedef struct {
    float *p;
    int64_t elems;
} grown;

static inline float *grow(grown *b, int64_t elems) {
    if (elems > b->elems) {
        free(b->p);
        if (posix_memalign((void **)&b->p, 64, sizeof(float) * (size_t)elems) != 0) b->p = NULL;
        b->elems = b->p != NULL ? elems : 0;
    }
    return b->p;
}

/* y [M, n] = x [M, K] . w [n, K]^T in float32 (a router's logits, Gated DeltaNet's b/a
 * rows), the n outputs split over the threads; each dot adds in the same order
 * whatever the split (ops.c). */
void float_products(const float *w, int64_t n, const float *x, int64_t M, int64_t K, float *y,
                    int nthreads);

#endif
