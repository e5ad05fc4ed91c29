/* Gated DeltaNet's decode step (cpu_quant.h, "gated delta"): one token per sequence
 * through the delta rule on the sequence's recurrent state, the arithmetic of
 * workers/layers/gated_delta.py's `recurrent` (its docstring has the update). Each value
 * head's state is a [Dk, Dv] float32 matrix read and written twice per token: decay it
 * and read it at the key, then write the correction and read it at the query. */
#include <math.h>
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

#define PQ_GD_MAX_DIM 512 /* Dk and Dv (Qwen3.5: 128) */
#define L2_EPS 1e-6f     /* inside the rsqrt of q's and k's squared norms, as the reference */

/* 1 / sqrt(sum x^2 + eps), 16 lanes (the float sums in a fixed order) */
static float inv_norm(const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += x[i + l] * x[i + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < n; i++) s += x[i] * x[i];
    return 1.0f / sqrtf(s + L2_EPS);
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
            const float iq = inv_norm(qh, Dk), ik = inv_norm(kh, Dk);
            for (int64_t i = 0; i < Dk; i++) qn[i] = qh[i] * iq * scale, kn[i] = kh[i] * ik;
            head_step(states + (slots[m] * Hv + h) * Dk * Dv, qn, kn, v + m * sv + h * Dv,
                      expf(g[m * sgb + h]), beta[m * sgb + h], Dk, Dv, out + (m * Hv + h) * Dv);
        }
    return PQ_OK;
}
