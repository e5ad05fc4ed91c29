/* Gated DeltaNet (cpu_quant.h, "gdn"): the delta rule's step and chunk forms over
 * per-sequence recurrent states, and a whole linear-attention token mixer (in
 * projection, causal convolution, the rule, gated norm, out projection) that the decoder
 * stack (layer.c) runs in place of attention on a hybrid model's linear layers. The
 * arithmetic is workers/layers/gated_delta.py's, whose docstrings derive it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"
#include "ops_inline.h"

/* Which q/k head value head h reads: HF's order groups the value heads of a q/k head
 * together (h / group); llama.cpp's qwen35 files tile them (h % Hk), for ggml's
 * broadcast, in every tensor that holds value heads, so reading them as stored needs
 * only this map. */
static inline int64_t key_head(int64_t h, int64_t Hk, int64_t group, int64_t tiled) {
    return tiled ? h % Hk : h / group;
}

/* The decode step: one token per sequence through the delta rule on the
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
                               int64_t tiled, float *states, const int64_t *slots, float *out, int nthreads) {
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
            const int64_t kh0 = key_head(h, Hk, group, tiled) * Dk;
            const float *qh = q + m * sqk + kh0, *kh = k + m * sqk + kh0;
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
                                  int64_t tiled, float *state, float *out, int nthreads) {
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
        const int64_t kh = key_head(h, Hk, group, tiled) * Dk;
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

/* ---- the token mixer ---- */

static grown g_mix; /* the mixer's rows: projections, conv outputs, gates, outputs */

/* SiLU of the depthwise causal convolution of each row's q/k/v channels x (row stride
 * ld) over its slot's conv state ([channels, kernel - 1], oldest first), which then
 * shifts in x. A channel's rows go in order (a prompt's rows follow one another), the
 * channels split over the threads. */
static void conv_rows(const float *w, int64_t K, int64_t C, const float *x, int64_t ld,
                      int64_t M, const int64_t *slots, float *conv_states, float *y,
                      int nthreads) {
    const int64_t keep = K - 1;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (M * C * K >= (1 << 16))
#endif
    for (int64_t c = 0; c < C; c++) {
        const float *wc = w + c * K;
        for (int64_t m = 0; m < M; m++) {
            float *s = conv_states + (slots[m] * C + c) * keep;
            const float xc = x[m * ld + c];
            float acc = 0.0f;
            for (int64_t j = 0; j < keep; j++) acc += wc[j] * s[j];
            acc += wc[keep] * xc;
            y[m * C + c] = silu(acc);
            if (keep > 0) {
                memmove(s, s + 1, sizeof(float) * (size_t)(keep - 1));
                s[keep - 1] = xc;
            }
        }
    }
}

/* softplus as torch computes it: x past 20 is its own value */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

PQ_API int pq_gdn_mixer(const pq_layer_gdn *G, const float *h, int64_t M, int64_t E,
                        const int64_t *slots, float *conv_states, float *states, float *out,
                        int nthreads) {
    const int64_t Hk = G->k_heads, Hv = G->v_heads, Dk = G->k_dim, Dv = G->v_dim;
    if (M <= 0 || E <= 0 || Hk <= 0 || Hv <= 0 || Hv % Hk != 0 || Dk <= 0 || Dv <= 0 ||
        G->kernel < 1)
        return PQ_ERR_ARG;
    const int64_t key = Hk * Dk, C = 2 * key + Hv * Dv, V = Hv * Dv, P = C + V;
    /* proj [M, C + V] (q/k/v channels, then z) | y [M, C] | ba [M, 2 Hv] | core, normed [M, V] */
    float *proj = grow(&g_mix, M * (P + C + 2 * Hv + 2 * V));
    if (proj == NULL) return PQ_ERR_NOMEM;
    float *y = proj + M * P, *ba = y + M * C, *core = ba + M * 2 * Hv, *normed = core + M * V;
    int rc = pq_linear(G->in_proj.parts, (int)G->in_proj.nparts, E, h, M, E, proj, P, nthreads);
    if (rc != PQ_OK) return rc;
    conv_rows(G->conv_w, G->kernel, C, proj, P, M, slots, conv_states, y, nthreads);
    float_products(G->ba, 2 * Hv, h, M, E, ba, nthreads);
    for (int64_t m = 0; m < M; m++) /* [b | a] -> [beta | g] */
        for (int64_t i = 0; i < Hv; i++) {
            float *b = ba + m * 2 * Hv + i, *a = b + Hv;
            *b = 1.0f / (1.0f + expf(-*b));
            *a = -expf(G->a_log[i]) * softplus(*a + G->dt_bias[i]);
        }
    /* the rule: a run of rows with one slot is a prompt's chunk (the chunk form); the
     * one-row runs between are decodes, stepped together */
    const int64_t S = Hv * Dk * Dv;
    for (int64_t m0 = 0; m0 < M && rc == PQ_OK;) {
        int64_t m1 = m0 + 1;
        while (m1 < M && slots[m1] == slots[m0]) m1++;
        if (m1 - m0 > 1) {
            rc = pq_gated_delta_prefill(y + m0 * C, y + m0 * C + key, C, y + m0 * C + 2 * key, C,
                                        ba + m0 * 2 * Hv + Hv, ba + m0 * 2 * Hv, 2 * Hv, m1 - m0,
                                        Hk, Hv, Dk, Dv, G->tiled, states + slots[m0] * S,
                                        core + m0 * V, nthreads);
        } else {
            while (m1 < M && (m1 + 1 >= M || slots[m1 + 1] != slots[m1])) m1++;
            rc = pq_gated_delta_step(y + m0 * C, y + m0 * C + key, C, y + m0 * C + 2 * key, C,
                                     ba + m0 * 2 * Hv + Hv, ba + m0 * 2 * Hv, 2 * Hv, m1 - m0,
                                     Hk, Hv, Dk, Dv, G->tiled, states, slots + m0,
                                     core + m0 * V, nthreads);
        }
        m0 = m1;
    }
    if (rc != PQ_OK) return rc;
    for (int64_t r = 0; r < M * Hv; r++) { /* each head normed, scaled by w, gated by SiLU(z) */
        const float *x = core + r * Dv, *z = proj + (r / Hv) * P + C + (r % Hv) * Dv;
        const float inv = 1.0f / sqrtf(dot(x, x, Dv) / (float)Dv + G->eps);
        float *o = normed + r * Dv;
        for (int64_t j = 0; j < Dv; j++) o[j] = x[j] * inv * G->norm[j] * silu(z[j]);
    }
    return pq_linear(G->out.parts, (int)G->out.nparts, V, normed, M, V, out, E, nthreads);
}
