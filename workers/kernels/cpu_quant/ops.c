/* The float32 operations between a CPU decode step's products (cpu_quant.h, "ops"):
 * RMSNorm (with the residual add), rotary, the gated activations and decode attention
 * (Gated DeltaNet's are in gdn.c).
 * Each is a short loop over a few thousand values; in torch each is several eager ops
 * of ~10-30 us apiece, which added up to a third of the embedded model's step.
 *
 * The elementwise ops round exactly as torch's do (rotary: the same products and sums,
 * bit for bit); reductions as ops_inline.h says. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"
#include "ops_inline.h"

/* From this many elements (a prompt's rows) an op shares its rows out among the threads;
 * a decode step's few rows stay on the calling thread (a parallel region costs ~µs). */
#define PQ_OPS_PARALLEL 65536
#define PQ_MAX_GROUP 16 /* query heads of one KV head attended in one pass */

PQ_CLONES
static void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

PQ_CLONES
static void norm_row(const float *x, const float *res, const float *w, float eps, int64_t D,
                     float *out, float *res_out) {
    const float *s = x;
    if (res != NULL) {
        for (int64_t i = 0; i < D; i++) res_out[i] = x[i] + res[i];
        s = res_out;
    }
    float inv = 1.0f / sqrtf(dot(s, s, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = s[i] * inv * w[i];
}

PQ_API int pq_rms_norm(const float *x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
                       const float *res, int64_t ra, int64_t rb, const float *w, float eps,
                       float *out, float *res_out) {
    if (A < 0 || B < 0 || D <= 0 || (res != NULL && res_out == NULL)) return PQ_ERR_ARG;
#pragma omp parallel for if (A * B * D >= PQ_OPS_PARALLEL) schedule(static)
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++) {
            int64_t o = (a * B + b) * D;
            norm_row(x + a * sa + b * sb, res != NULL ? res + a * ra + b * rb : NULL, w, eps, D,
                     out + o, res_out != NULL ? res_out + o : NULL);
        }
    return PQ_OK;
}

PQ_CLONES
static void rotate(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c[i] - x2 * s[i];
        x[half + i] = x2 * c[i] + x1 * s[i];
    }
}

PQ_API int pq_rotary(float *x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
                     const float *cos, const float *sin, int64_t lc) {
    if (A < 0 || B < 0 || D <= 0 || D % 2 != 0 || lc < D / 2) return PQ_ERR_ARG;
#pragma omp parallel for if (A * B * D >= PQ_OPS_PARALLEL) schedule(static)
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++) rotate(x + a * sa + b * sb, cos + a * lc, sin + a * lc, D / 2);
    return PQ_OK;
}

/* x * sigmoid(z) = x / (1 + e^-z): SiLU with z = x; torch's tanh GELU with
 * z = 2 sqrt(2/pi) (x + 0.044715 x^3), since 0.5 (1 + tanh(z/2)) = sigmoid(z). */
static inline float gelu_tanh(float x) {
    const float two_beta = 1.5957691216057308f, kappa = 0.044715f;
    return x / (1.0f + exp_approx(-two_beta * (x + kappa * x * x * x)));
}


static inline float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

PQ_CLONES
static void act_mul_row(int act, const float *g, const float *u, float *o, int64_t n) {
    switch (act) {
    case PQ_ACT_SILU:
        for (int64_t i = 0; i < n; i++) o[i] = silu(g[i]) * u[i];
        break;
    case PQ_ACT_GELU_TANH:
        for (int64_t i = 0; i < n; i++) o[i] = gelu_tanh(g[i]) * u[i];
        break;
    default:
        for (int64_t i = 0; i < n; i++) o[i] = gelu_erf(g[i]) * u[i];
    }
}

PQ_API int pq_act_and_mul(int act, const float *gate_up, int64_t T, int64_t I, int64_t ld,
                          float *out) {
    if (T < 0 || I <= 0 || ld < 2 * I || act < PQ_ACT_SILU || act > PQ_ACT_GELU_ERF) return PQ_ERR_ARG;
#pragma omp parallel for if (T * I >= PQ_OPS_PARALLEL) schedule(static)
    for (int64_t t = 0; t < T; t++) act_mul_row(act, gate_up + t * ld, gate_up + t * ld + I, out + t * I, I);
    return PQ_OK;
}

/* A thread's scores of one query against its keys (grown on demand). */
static __thread float *t_scores;
static __thread int64_t t_scores_cap;

static float *scores_buffer(int64_t n) {
    if (n > t_scores_cap) {
        free(t_scores);
        t_scores = malloc(sizeof(float) * (size_t)n);
        t_scores_cap = t_scores != NULL ? n : 0;
    }
    return t_scores;
}

/* nh query heads that share one KV head, against its L keys: each key and value row is
 * read once for all of them (a row of the 256-wide heads of Gemma 3 is 1 KiB; at a few
 * hundred keys a KV head's rows no longer fit in L2, and one head at a time read them
 * once per query head). Each head's arithmetic is the one-head loop's, in its order.
 * out is each head's softmax-weighted sum over these keys; top and total (nh each) are
 * its largest score and sum of e^(score - top), which merge_parts needs. */
PQ_CLONES
static int attend_heads(const float *q, int64_t sqh, int nh, const float *kc, const float *vc,
                        int64_t slot_stride, const int64_t *slots, int64_t L, int64_t D,
                        float scale, float softcap, float *out, float *top, float *total) {
    for (int64_t i = 0; i < nh * D; i++) out[i] = 0.0f;
    for (int h = 0; h < nh; h++) top[h] = -INFINITY, total[h] = 0.0f;
    if (L == 0) return PQ_OK;
    float *p = scores_buffer(nh * L);
    if (p == NULL) return PQ_ERR_NOMEM;
    for (int64_t j = 0; j < L; j++) {
        const float *k = kc + slots[j] * slot_stride;
        for (int h = 0; h < nh; h++) {
            float s = dot(q + h * sqh, k, D) * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            p[h * L + j] = s;
            top[h] = s > top[h] ? s : top[h];
        }
    }
    for (int h = 0; h < nh; h++) {
        float *ph = p + h * L;
        for (int64_t j = 0; j < L; j++) ph[j] = exp_approx(ph[j] - top[h]); /* vectorized */
        for (int64_t j = 0; j < L; j++) total[h] += ph[j];
    }
    for (int64_t j = 0; j < L; j++) {
        const float *v = vc + slots[j] * slot_stride;
        for (int h = 0; h < nh; h++) axpy(out + h * D, p[h * L + j] / total[h], v, D);
    }
    return PQ_OK;
}

/* One head's ks parts (each over its own keys, as attend_heads leaves them) -> its
 * softmax over all of them: part i weighs total_i e^(top_i - max top), normalized. */
static void merge_parts(const float *parts, const float *top, const float *total, int64_t ks,
                        int64_t stride, int64_t D, float *out) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < ks; i++) m = top[i * stride] > m ? top[i * stride] : m;
    for (int64_t i = 0; i < ks; i++)
        if (total[i * stride] > 0.0f) sum += total[i * stride] * exp_approx(top[i * stride] - m);
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t i = 0; i < ks; i++)
        if (total[i * stride] > 0.0f)
            axpy(out, total[i * stride] * exp_approx(top[i * stride] - m) / sum,
                 parts + i * stride * D, D);
}

/* Keys a task takes at least when a row's keys are split across threads. */
#define PQ_MIN_SPLIT_KEYS 64

/* Which query heads unit u attends: row b, KV head kvh, heads h0 .. h0 + nh - 1 (its
 * group cut into parts of `per`, hs parts a group). */
typedef struct {
    int64_t b, kvh, h0, nh;
} heads_unit;

static heads_unit unit_of(int64_t u, int64_t Hkv, int64_t hs, int64_t group, int64_t per) {
    heads_unit w;
    w.b = u / (Hkv * hs);
    w.kvh = u / hs % Hkv;
    w.h0 = w.kvh * group + u % hs * per;
    w.nh = w.kvh * group + group - w.h0 < per ? w.kvh * group + group - w.h0 : per;
    return w;
}

PQ_API int pq_decode_attention(const float *q, int64_t B, int64_t H, int64_t D, int64_t sqb,
                               int64_t sqh, const float *k_cache, const float *v_cache,
                               int64_t Hkv, const int64_t *gather, int64_t Lk,
                               const int64_t *lengths, float scale, float softcap, float *out,
                               int nthreads) {
    if (B < 0 || H <= 0 || D <= 0 || Hkv <= 0 || H % Hkv != 0 || Lk < 0) return PQ_ERR_ARG;
    for (int64_t b = 0; b < B; b++)
        if (lengths[b] < 0 || lengths[b] > Lk) return PQ_ERR_ARG;
    int64_t pairs = B * H, group = H / Hkv, slot_stride = Hkv * D;
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads > 0 ? nthreads : omp_get_max_threads();
#endif
    if (pairs * Lk * D < (1 << 18)) nt = 1; /* a parallel region costs more than this */
    /* a task: one unit's heads over one of `ks` runs of its row's keys. With fewer units
     * than threads the keys split, not the heads: no two threads read the same rows. */
    const int64_t per = group < PQ_MAX_GROUP ? group : PQ_MAX_GROUP;
    const int64_t hs = (group + per - 1) / per, units = B * Hkv * hs;
    int64_t ks = units < nt ? (nt + units - 1) / units : 1;
    if (ks > Lk / PQ_MIN_SPLIT_KEYS) ks = Lk / PQ_MIN_SPLIT_KEYS > 1 ? Lk / PQ_MIN_SPLIT_KEYS : 1;
    const int64_t tasks = units * ks;
    /* one run: straight into out; several: each task's rows, tops and totals, merged after */
    float *parts = NULL;
    if (ks > 1 && (parts = malloc(sizeof(float) * (size_t)(tasks * per * (D + 2)))) == NULL)
        return PQ_ERR_NOMEM;
    float *tops = parts != NULL ? parts + tasks * per * D : NULL;
    float *totals = tops != NULL ? tops + tasks * per : NULL;
    int failed = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : failed)
    for (int64_t t = 0; t < tasks; t++) {
        const heads_unit w = unit_of(t / ks, Hkv, hs, group, per);
        const int64_t run = t % ks, n = lengths[w.b], step = (n + ks - 1) / ks;
        const int64_t j0 = run * step < n ? run * step : n, len = j0 + step < n ? step : n - j0;
        float top[PQ_MAX_GROUP], total[PQ_MAX_GROUP];
        if (attend_heads(q + w.b * sqb + w.h0 * sqh, sqh, (int)w.nh, k_cache + w.kvh * D,
                         v_cache + w.kvh * D, slot_stride, gather + w.b * Lk + j0, len, D, scale,
                         softcap, ks > 1 ? parts + t * per * D : out + (w.b * H + w.h0) * D,
                         ks > 1 ? tops + t * per : top, ks > 1 ? totals + t * per : total) != PQ_OK)
            failed = 1;
    }
    if (ks > 1 && !failed)
        for (int64_t u = 0; u < units; u++) {
            const heads_unit w = unit_of(u, Hkv, hs, group, per);
            for (int64_t h = 0; h < w.nh; h++) {
                const int64_t first = u * ks * per + h; /* the unit's first run, head h */
                merge_parts(parts + first * D, tops + first, totals + first, ks, per, D,
                            out + (w.b * H + w.h0 + h) * D);
            }
        }
    free(parts);
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}

void float_products(const float *w, int64_t n, const float *x, int64_t M, int64_t K, float *y,
                    int nthreads) {
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) schedule(static) collapse(2) if (M * n * K >= (1 << 16))
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t e = 0; e < n; e++) y[m * n + e] = dot(w + e * K, x + m * K, K);
}
