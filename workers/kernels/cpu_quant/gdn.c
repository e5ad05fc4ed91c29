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

/* Decays multiply a state toward zero (a head's e^G over a chunk can reach 1e-40), and
 * x86 takes a slow microcoded path for every operation on a subnormal float: a synthetic
 * Qwen3.5's prompt spent 3x longer in the rule than with them flushed. So the rule's
 * threads flush subnormal results and operands to zero (MXCSR FTZ | DAZ), restored after:
 * a difference below 1.2e-38 per value. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_BEGIN const unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040)
#define FLUSH_END _mm_setcsr(csr_)
#else
#define FLUSH_BEGIN (void)0
#define FLUSH_END (void)0
#endif

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
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (M * Hv * Dk * Dv >= (1 << 18))
#endif
    {
        FLUSH_BEGIN;
#ifdef _OPENMP
#pragma omp for collapse(2) schedule(static)
#endif
        for (int64_t m = 0; m < M; m++)
            for (int64_t h = 0; h < Hv; h++) {
                const int64_t kh0 = key_head(h, Hk, group, tiled) * Dk;
                const float *qh = q + m * sqk + kh0, *kh = k + m * sqk + kh0;
                float qn[PQ_GD_MAX_DIM], kn[PQ_GD_MAX_DIM];
                normalise_qk(qh, kh, Dk, scale, qn, kn);
                head_step(states + (slots[m] * Hv + h) * Dk * Dv, qn, kn, v + m * sv + h * Dv,
                          expf(g[m * sgb + h]), beta[m * sgb + h], Dk, Dv,
                          out + (m * Hv + h) * Dv);
            }
        FLUSH_END;
    }
    return PQ_OK;
}

/* A prompt's chunk form (gated_delta.py's `chunked`, whose docstring derives it): per
 * chunk of PQ_GD_CHUNK tokens, the written values by forward substitution of the unit
 * lower-triangular system, then the outputs and the state, with products over the chunk
 * instead of a pass over the state per token. Chunks of 16, the default KV block: a run
 * cut at a block boundary (a state snapshot, a prefix hit) computes the same chunks as
 * one that is not, so a snapshot changes no bit of a prompt's outputs; and 16 measured
 * faster than 32 or 64 here (502 tokens, 0.8B shape: 135 / 178 / 220 ms for 18 layers). */
#define PQ_GD_CHUNK 16

typedef struct {
    float *qn, *kn, *ks, *qs, *u, *kk, *wt; /* [C, Dk] x2, [C, Dv] x3, [C, C], [Dk, C] */
} gd_scratch;

typedef float v16 __attribute__((vector_size(64)));
#define load16(p) ({ v16 v_; memcpy(&v_, (p), sizeof v_); v_; })

/* C [M, N] = A [M, K] . B [K, N] (+ C when `add`), row-major with strides: blocks of 4
 * rows x 32 columns of C held in registers over the whole k loop, where the loops this
 * replaced streamed a row of C through memory per k. Each element sums in k order. */
PQ_CLONES
static void gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                    const float *B, int64_t ldb, float *C, int64_t ldc, int add) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) {
        int64_t j0 = 0;
        for (; j0 + 32 <= N; j0 += 32) {
            v16 c[4][2];
            for (int r = 0; r < 4; r++)
                for (int h = 0; h < 2; h++)
                    c[r][h] = add ? load16(C + (m0 + r) * ldc + j0 + 16 * h) : (v16){0};
            for (int64_t k = 0; k < K; k++) {
                const v16 b0 = load16(B + k * ldb + j0), b1 = load16(B + k * ldb + j0 + 16);
                for (int r = 0; r < 4; r++) {
                    const float x = A[(m0 + r) * lda + k];
                    c[r][0] += x * b0;
                    c[r][1] += x * b1;
                }
            }
            for (int r = 0; r < 4; r++)
                for (int h = 0; h < 2; h++) memcpy(C + (m0 + r) * ldc + j0 + 16 * h, &c[r][h], sizeof(v16));
        }
        for (int64_t r = 0; r < 4 && j0 < N; r++) { /* the columns past the last 32 */
            float *cr = C + (m0 + r) * ldc;
            for (int64_t j = j0; j < N; j++) {
                float sum = add ? cr[j] : 0.0f;
                for (int64_t k = 0; k < K; k++) sum += A[(m0 + r) * lda + k] * B[k * ldb + j];
                cr[j] = sum;
            }
        }
    }
    for (; m0 < M; m0++) { /* the rows past the last 4 */
        float *cr = C + m0 * ldc;
        if (!add)
            for (int64_t j = 0; j < N; j++) cr[j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float x = A[m0 * lda + k];
            for (int64_t j = 0; j < N; j++) cr[j] += x * B[k * ldb + j];
        }
    }
}

PQ_CLONES
static void head_chunk(float *S, const float *qn, const float *kn, const float *v, int64_t sv,
                       const float *g, const float *beta, int64_t sgb, int64_t n, int64_t Dk,
                       int64_t Dv, gd_scratch *w, float *out, int64_t so) {
    enum { C = PQ_GD_CHUNK };
    float cum[C], ecum[C];
    if (n <= 0) return;
    for (int64_t t = 0; t < n; t++) {
        cum[t] = (t ? cum[t - 1] : 0.0f) + g[t * sgb];
        ecum[t] = expf(cum[t]);
    }
    /* S^T k_t and S^T q_t, the state the chunk starts from */
    gemm_nn(n, Dv, Dk, kn, Dk, S, Dv, w->ks, Dv, 0);
    gemm_nn(n, Dv, Dk, qn, Dk, S, Dv, w->qs, Dv, 0);
    for (int64_t t = 0; t < n; t++) /* k_t . k_s, s < t */
        for (int64_t r = 0; r < t; r++) w->kk[t * C + r] = dot(kn + t * Dk, kn + r * Dk, Dk);
    for (int64_t t = 0; t < n; t++) { /* u_t = beta_t (v_t - e^G_t S^T k_t - sum_s<t ...) */
        float *u = w->u + t * Dv;
        const float bt = beta[t * sgb];
        for (int64_t j = 0; j < Dv; j++) u[j] = v[t * sv + j] - ecum[t] * w->ks[t * Dv + j];
        for (int64_t r = 0; r < t; r++) {
            const float a = expf(cum[t] - cum[r]) * w->kk[t * C + r];
            const float *ur = w->u + r * Dv;
            for (int64_t j = 0; j < Dv; j++) u[j] -= a * ur[j];
        }
        for (int64_t j = 0; j < Dv; j++) u[j] *= bt;
    }
    /* out_t = e^G_t S^T q_t + sum_s<=t e^(G_t-G_s) (q_t.k_s) u_s: the weights of the
     * sum as a lower-triangular [n, n] matrix (in kk's place) times u */
    for (int64_t t = 0; t < n; t++) {
        float *a = w->kk + t * C, *o = out + t * so;
        for (int64_t r = 0; r < n; r++)
            a[r] = r <= t ? expf(cum[t] - cum[r]) * dot(qn + t * Dk, kn + r * Dk, Dk) : 0.0f;
        for (int64_t j = 0; j < Dv; j++) o[j] = ecum[t] * w->qs[t * Dv + j];
    }
    gemm_nn(n, Dv, n, w->kk, C, w->u, Dv, out, so, 1);
    /* S = e^G_n S + sum_s e^(G_n-G_s) k_s u_s^T: the decayed keys transposed, times u */
    const float last = cum[n - 1], el = expf(last);
    for (int64_t r = 0; r < n; r++) {
        const float e = expf(last - cum[r]);
        for (int64_t i = 0; i < Dk; i++) w->wt[i * C + r] = e * kn[r * Dk + i];
    }
    for (int64_t i = 0; i < Dk * Dv; i++) S[i] *= el;
    gemm_nn(Dk, Dv, n, w->wt, C, w->u, Dv, S, Dv, 1);
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
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) reduction(| : failed) if (T * Hv * Dk * Dv >= (1 << 18))
#endif
    {
        FLUSH_BEGIN;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t h = 0; h < Hv; h++) {
            float *buf = malloc(sizeof(float) * (size_t)(3 * C * Dk + 3 * C * Dv + C * C));
            if (buf == NULL) {
                failed = 1;
                continue;
            }
            gd_scratch w = {buf, buf + C * Dk, buf + 2 * C * Dk, buf + 2 * C * Dk + C * Dv,
                            buf + 2 * C * Dk + 2 * C * Dv, buf + 2 * C * Dk + 3 * C * Dv,
                            buf + 2 * C * Dk + 3 * C * Dv + C * C};
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
        FLUSH_END;
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}

/* ---- the token mixer ---- */

static grown g_mix; /* the mixer's rows: projections, conv outputs, gates, outputs */

/* SiLU of the depthwise causal convolution of each row's q/k/v channels x (row stride
 * ld) over its slot's conv state ([kernel - 1, C], oldest input first), which then
 * shifts in x; w [kernel, C]. Rows go in order (a prompt's rows follow one another),
 * each a few passes over contiguous channels; blocks of channels split over the threads. */
#define CONV_BLOCK 512
PQ_CLONES
static void conv_block(const float *w, int64_t K, int64_t C, int64_t c0, int64_t c1,
                       const float *x, int64_t ld, int64_t M, const int64_t *slots,
                       const int64_t *snapshots, float *conv_states, float *y) {
    const int64_t keep = K - 1;
    for (int64_t m = 0; m < M; m++) {
        float *s = conv_states + slots[m] * keep * C;
        const float *xm = x + m * ld;
        float *ym = y + m * C;
        for (int64_t c = c0; c < c1; c++) ym[c] = 0.0f;
        for (int64_t j = 0; j < keep; j++)
            for (int64_t c = c0; c < c1; c++) ym[c] += w[j * C + c] * s[j * C + c];
        for (int64_t c = c0; c < c1; c++) ym[c] = silu(ym[c] + w[keep * C + c] * xm[c]);
        for (int64_t j = 0; j + 1 < keep; j++)
            memcpy(s + j * C + c0, s + (j + 1) * C + c0, sizeof(float) * (size_t)(c1 - c0));
        if (keep > 0) memcpy(s + (keep - 1) * C + c0, xm + c0, sizeof(float) * (size_t)(c1 - c0));
        if (snapshots != NULL && snapshots[m] >= 0)
            for (int64_t j = 0; j < keep; j++)
                memcpy(conv_states + (snapshots[m] * keep + j) * C + c0, s + j * C + c0,
                       sizeof(float) * (size_t)(c1 - c0));
    }
}

static void conv_rows(const float *w, int64_t K, int64_t C, const float *x, int64_t ld,
                      int64_t M, const int64_t *slots, const int64_t *snapshots,
                      float *conv_states, float *y, int nthreads) {
    const int64_t blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (M * C * K >= (1 << 18))
#endif
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t c0 = b * CONV_BLOCK, c1 = c0 + CONV_BLOCK < C ? c0 + CONV_BLOCK : C;
        conv_block(w, K, C, c0, c1, x, ld, M, slots, snapshots, conv_states, y);
    }
}

/* Each head's output x (rows of `heads` heads of D) normed, scaled by w, gated by
 * SiLU(z) (z's rows at stride lz) into out. */
PQ_CLONES
static void gated_norm_rows(const float *x, const float *z, int64_t lz, int64_t m0, int64_t m1,
                            int64_t heads, int64_t D, const float *w, float eps, float *out) {
    for (int64_t r = m0 * heads; r < m1 * heads; r++) {
        const float *xr = x + r * D, *zr = z + (r / heads) * lz + (r % heads) * D;
        const float inv = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
        float *o = out + r * D;
        for (int64_t j = 0; j < D; j++) o[j] = xr[j] * inv * w[j] * silu(zr[j]);
    }
}

static void gated_norm(const float *x, const float *z, int64_t lz, int64_t M, int64_t heads,
                       int64_t D, const float *w, float eps, float *out, int nthreads) {
    (void)nthreads;
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : omp_get_max_threads()) if (M * heads * D >= (1 << 16))
#endif
    {
        int64_t m0 = 0, m1 = M;
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        m0 = M * t / nt, m1 = M * (t + 1) / nt;
#endif
        gated_norm_rows(x, z, lz, m0, m1, heads, D, w, eps, out);
    }
}

/* softplus as torch computes it: x past 20 is its own value */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Where a run of rows through the rule ends: at a change of slot (the next sequence) or
 * after a row whose state is snapshotted. */
static int64_t run_end(const int64_t *slots, const int64_t *snapshots, int64_t M, int64_t m0) {
    int64_t m1 = m0 + 1;
    while (m1 < M && slots[m1] == slots[m0] && (snapshots == NULL || snapshots[m1 - 1] < 0)) m1++;
    return m1;
}

PQ_API int pq_gdn_mixer(const pq_layer_gdn *G, const float *h, int64_t M, int64_t E,
                        const int64_t *slots, const int64_t *snapshots, float *conv_states,
                        float *states, float *out, int nthreads) {
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
    conv_rows(G->conv_w, G->kernel, C, proj, P, M, slots, snapshots, conv_states, y, nthreads);
    float_products(G->ba, 2 * Hv, h, M, E, ba, nthreads);
    for (int64_t m = 0; m < M; m++) /* [b | a] -> [beta | g] */
        for (int64_t i = 0; i < Hv; i++) {
            float *b = ba + m * 2 * Hv + i, *a = b + Hv;
            *b = 1.0f / (1.0f + expf(-*b));
            *a = -expf(G->a_log[i]) * softplus(*a + G->dt_bias[i]);
        }
    /* the rule: a run of rows of one slot is a prompt's chunk (the chunk form), cut
     * after a snapshotted row; consecutive one-row runs of distinct sequences (decodes)
     * step together */
    const int64_t S = Hv * Dk * Dv;
    for (int64_t m0 = 0; m0 < M && rc == PQ_OK;) {
        int64_t m1 = run_end(slots, snapshots, M, m0);
        if (m1 - m0 > 1) {
            rc = pq_gated_delta_prefill(y + m0 * C, y + m0 * C + key, C, y + m0 * C + 2 * key, C,
                                        ba + m0 * 2 * Hv + Hv, ba + m0 * 2 * Hv, 2 * Hv, m1 - m0,
                                        Hk, Hv, Dk, Dv, G->tiled, states + slots[m0] * S,
                                        core + m0 * V, nthreads);
        } else {
            while (m1 < M && slots[m1] != slots[m1 - 1] && run_end(slots, snapshots, M, m1) == m1 + 1)
                m1++;
            rc = pq_gated_delta_step(y + m0 * C, y + m0 * C + key, C, y + m0 * C + 2 * key, C,
                                     ba + m0 * 2 * Hv + Hv, ba + m0 * 2 * Hv, 2 * Hv, m1 - m0,
                                     Hk, Hv, Dk, Dv, G->tiled, states, slots + m0,
                                     core + m0 * V, nthreads);
        }
        for (int64_t m = m0; snapshots != NULL && m < m1; m++) /* each run's last row at most */
            if (snapshots[m] >= 0)
                memcpy(states + snapshots[m] * S, states + slots[m] * S, sizeof(float) * (size_t)S);
        m0 = m1;
    }
    if (rc != PQ_OK) return rc;
    gated_norm(core, proj + C, P, M, Hv, Dv, G->norm, G->eps, normed, nthreads);
    return pq_linear(G->out.parts, (int)G->out.nparts, V, normed, M, V, out, E, nthreads);
}
