/* The float32 operations between a CPU decode step's products (cpu_quant.h, "ops"):
 * RMSNorm (with the residual add), rotary, the gated activations, decode attention and
 * Gated DeltaNet's decode step.
 * Each is a short loop over a few thousand values; in torch each is several eager ops
 * of ~10-30 us apiece, which added up to a third of the embedded model's step.
 *
 * Reductions keep 16 explicit lanes so the compiler vectorizes them without reordering
 * float sums on its own (-ffp-contract=off, no -ffast-math); the elementwise ops round
 * exactly as torch's do (rotary: the same products and sums, bit for bit). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"

/* One binary for every x86-64: the loops are cloned for AVX-512 / AVX2 and picked at load. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define PQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PQ_CLONES
#endif

#define LANES 16
/* From this many elements (a prompt's rows) an op shares its rows out among the threads;
 * a decode step's few rows stay on the calling thread (a parallel region costs ~µs). */
#define PQ_OPS_PARALLEL 65536
#define PQ_MAX_GROUP 16 /* query heads of one KV head attended in one pass */

PQ_CLONES
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

/* x * sigmoid(z) = x / (1 + e^-z): SiLU with z = x; torch's tanh GELU with
 * z = 2 sqrt(2/pi) (x + 0.044715 x^3), since 0.5 (1 + tanh(z/2)) = sigmoid(z). */
static inline float gelu_tanh(float x) {
    const float two_beta = 1.5957691216057308f, kappa = 0.044715f;
    return x / (1.0f + exp_approx(-two_beta * (x + kappa * x * x * x)));
}

static inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

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

/* Gated DeltaNet's decode step: one token per sequence through the delta rule on the
 * sequence's recurrent state, the arithmetic of workers/layers/gated_delta.py's
 * `recurrent` (its docstring has the update). Each value head's state is a [Dk, Dv]
 * float32 matrix read and written twice per token: decay it and read it at the key,
 * then write the correction and read it at the query. */
#define PQ_GD_MAX_DIM 512 /* Dk and Dv (Qwen3.5: 128) */
#define L2_EPS 1e-6f /* inside the rsqrt of q's and k's squared norms, as the reference */

/* q and k L2-normalised (the reference's eps inside), q also scaled. */
static void normalise_qk(const float *q, const float *k, int64_t Dk, float scale, float *qn,
                         float *kn) {
    const float iq = 1.0f / sqrtf(dot(q, q, Dk) + L2_EPS), ik = 1.0f / sqrtf(dot(k, k, Dk) + L2_EPS);
    for (int64_t i = 0; i < Dk; i++) qn[i] = q[i] * iq * scale, kn[i] = k[i] * ik;
}

/* One value head: S [Dk, Dv] in place, out [Dv]; qn/kn normalised (qn also scaled). */
PQ_CLONES
static void head_step(float *S, const float *qn, const float *kn, const float *v, float decay,
                      float beta, int64_t Dk, int64_t Dv, float *out) {
    float kv[PQ_GD_MAX_DIM] = {0}, u[PQ_GD_MAX_DIM];
    for (int64_t i = 0; i < Dk; i++) { /* S <- decay S; kv = S^T kn */
        float *row = S + i * Dv;
        for (int64_t j = 0; j < Dv; j++) {
            row[j] *= decay;
            kv[j] += kn[i] * row[j];
        }
    }
    for (int64_t j = 0; j < Dv; j++) u[j] = beta * (v[j] - kv[j]), out[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) { /* S <- S + kn u^T; out = S^T qn */
        float *row = S + i * Dv;
        for (int64_t j = 0; j < Dv; j++) {
            row[j] += kn[i] * u[j];
            out[j] += qn[i] * row[j];
        }
    }
}

PQ_API int pq_gated_delta_step(const float *q, const float *k, int64_t sqk, const float *v,
                               int64_t sv, const float *g, const float *beta, int64_t sgb,
                               int64_t M, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                               float *states, const int64_t *slots, float *out, int nthreads) {
    if (M < 0 || Hk <= 0 || Hv <= 0 || Hv % Hk != 0 || Dk <= 0 || Dv <= 0 ||
        Dk > PQ_GD_MAX_DIM || Dv > PQ_GD_MAX_DIM || sqk < Hk * Dk || sv < Hv * Dv || sgb < Hv)
        return PQ_ERR_ARG;
    const int64_t group = Hv / Hk;
    const float scale = 1.0f / sqrtf((float)Dk);
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (M * Hv * Dk * Dv >= (1 << 18))
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < Hv; h++) {
            const float *qh = q + m * sqk + (h / group) * Dk, *kh = k + m * sqk + (h / group) * Dk;
            float qn[PQ_GD_MAX_DIM], kn[PQ_GD_MAX_DIM];
            normalise_qk(qh, kh, Dk, scale, qn, kn);
            head_step(states + (slots[m] * Hv + h) * Dk * Dv, qn, kn, v + m * sv + h * Dv,
                      expf(g[m * sgb + h]), beta[m * sgb + h], Dk, Dv, out + (m * Hv + h) * Dv);
        }
    return PQ_OK;
}

/* A prompt's chunk form (gated_delta.py's `chunked`, whose docstring derives it): per
 * chunk of PQ_GD_CHUNK tokens, the written values by forward substitution of the unit
 * lower-triangular system, then the outputs and the state, with products over the chunk
 * instead of a pass over the state per token. */
#define PQ_GD_CHUNK 64

typedef struct {
    float *qn, *kn, *ks, *qs, *u, *kk; /* [C, Dk] x2, [C, Dv] x3, [C, C] */
} gd_scratch;

PQ_CLONES
static void head_chunk(float *S, const float *qn, const float *kn, const float *v, int64_t sv,
                       const float *g, const float *beta, int64_t sgb, int64_t n, int64_t Dk,
                       int64_t Dv, gd_scratch *w, float *out, int64_t so) {
    float cum[PQ_GD_CHUNK];
    for (int64_t t = 0; t < n; t++) cum[t] = (t ? cum[t - 1] : 0.0f) + g[t * sgb];
    for (int64_t t = 0; t < n; t++) { /* S^T k_t and S^T q_t, the state the chunk starts from */
        float *ks = w->ks + t * Dv, *qs = w->qs + t * Dv;
        for (int64_t j = 0; j < Dv; j++) ks[j] = qs[j] = 0.0f;
        for (int64_t i = 0; i < Dk; i++) {
            const float *row = S + i * Dv, a = kn[t * Dk + i], b = qn[t * Dk + i];
            for (int64_t j = 0; j < Dv; j++) ks[j] += a * row[j], qs[j] += b * row[j];
        }
    }
    for (int64_t t = 0; t < n; t++) /* k_t . k_s, s < t */
        for (int64_t r = 0; r < t; r++) w->kk[t * PQ_GD_CHUNK + r] = dot(kn + t * Dk, kn + r * Dk, Dk);
    for (int64_t t = 0; t < n; t++) { /* u_t = beta_t (v_t - e^G_t S^T k_t - sum_s<t ...) */
        float *u = w->u + t * Dv;
        const float et = expf(cum[t]), bt = beta[t * sgb];
        for (int64_t j = 0; j < Dv; j++) u[j] = v[t * sv + j] - et * w->ks[t * Dv + j];
        for (int64_t r = 0; r < t; r++) {
            const float a = expf(cum[t] - cum[r]) * w->kk[t * PQ_GD_CHUNK + r];
            const float *ur = w->u + r * Dv;
            for (int64_t j = 0; j < Dv; j++) u[j] -= a * ur[j];
        }
        for (int64_t j = 0; j < Dv; j++) u[j] *= bt;
    }
    for (int64_t t = 0; t < n; t++) { /* out_t = e^G_t S^T q_t + sum_s<=t e^(G_t-G_s) (q_t.k_s) u_s */
        float *o = out + t * so;
        const float et = expf(cum[t]);
        for (int64_t j = 0; j < Dv; j++) o[j] = et * w->qs[t * Dv + j];
        for (int64_t r = 0; r <= t; r++) {
            const float a = expf(cum[t] - cum[r]) * dot(qn + t * Dk, kn + r * Dk, Dk);
            const float *ur = w->u + r * Dv;
            for (int64_t j = 0; j < Dv; j++) o[j] += a * ur[j];
        }
    }
    const float last = cum[n - 1], el = expf(last); /* S = e^G_n S + sum_s e^(G_n-G_s) k_s u_s^T */
    for (int64_t i = 0; i < Dk; i++) {
        float *row = S + i * Dv;
        for (int64_t j = 0; j < Dv; j++) row[j] *= el;
        for (int64_t r = 0; r < n; r++) {
            const float a = expf(last - cum[r]) * kn[r * Dk + i];
            const float *ur = w->u + r * Dv;
            for (int64_t j = 0; j < Dv; j++) row[j] += a * ur[j];
        }
    }
}

PQ_API int pq_gated_delta_prefill(const float *q, const float *k, int64_t sqk, const float *v,
                                  int64_t sv, const float *g, const float *beta, int64_t sgb,
                                  int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                                  float *state, float *out, int nthreads) {
    if (T < 0 || Hk <= 0 || Hv <= 0 || Hv % Hk != 0 || Dk <= 0 || Dv <= 0 ||
        Dk > PQ_GD_MAX_DIM || Dv > PQ_GD_MAX_DIM || sqk < Hk * Dk || sv < Hv * Dv || sgb < Hv)
        return PQ_ERR_ARG;
    const int64_t group = Hv / Hk, C = PQ_GD_CHUNK;
    const float scale = 1.0f / sqrtf((float)Dk);
    int failed = 0;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(| : failed) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (T * Hv * Dk * Dv >= (1 << 18))
#endif
    for (int64_t h = 0; h < Hv; h++) {
        float *buf = malloc(sizeof(float) * (size_t)(2 * C * Dk + 3 * C * Dv + C * C));
        if (buf == NULL) {
            failed = 1;
            continue;
        }
        gd_scratch w = {buf, buf + C * Dk, buf + 2 * C * Dk, buf + 2 * C * Dk + C * Dv,
                        buf + 2 * C * Dk + 2 * C * Dv, buf + 2 * C * Dk + 3 * C * Dv};
        const int64_t kh = (h / group) * Dk;
        for (int64_t c0 = 0; c0 < T; c0 += C) {
            const int64_t n = T - c0 < C ? T - c0 : C;
            for (int64_t t = 0; t < n; t++)
                normalise_qk(q + (c0 + t) * sqk + kh, k + (c0 + t) * sqk + kh, Dk, scale,
                             w.qn + t * Dk, w.kn + t * Dk);
            head_chunk(state + h * Dk * Dv, w.qn, w.kn, v + c0 * sv + h * Dv, sv,
                       g + c0 * sgb + h, beta + c0 * sgb + h, sgb, n, Dk, Dv, &w,
                       out + (c0 * Hv + h) * Dv, Hv * Dv);
        }
        free(buf);
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}
