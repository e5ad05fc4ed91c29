/* The exported API (cpu_quant.h): argument checks, ISA choice, threading. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"
#include "kernels.h"

/* best first */
static const pq_isa_impl *const ISAS[] = {
#if defined(__x86_64__)
    &pq_isa_avx512vnni, &pq_isa_avxvnni, &pq_isa_avx2,
#endif
    &pq_isa_scalar,
};
#define N_ISAS ((int)(sizeof ISAS / sizeof ISAS[0]))

/* -1: not chosen yet; -2: POCKETLLM_CPU_ISA named a variant that cannot run */
static int g_isa = -1;
static char g_supported[128], g_all[128];

static int isa_index(const char *name) {
    for (int i = 0; i < N_ISAS; i++)
        if (strcmp(ISAS[i]->name, name) == 0) return i;
    return -1;
}

static int best_isa(void) {
    for (int i = 0; i < N_ISAS; i++)
        if (ISAS[i]->cpu_has()) return i;
    return N_ISAS - 1;
}

static void init_once(void) {
    if (g_isa != -1) return;
    const char *env = getenv("POCKETLLM_CPU_ISA");
    if (env == NULL || env[0] == '\0' || strcmp(env, "auto") == 0) {
        g_isa = best_isa();
    } else {
        int i = isa_index(env);
        g_isa = (i >= 0 && ISAS[i]->cpu_has()) ? i : -2;
    }
}

/* Called once at load (the Python side loads the library on one thread). */
__attribute__((constructor)) static void pq_init(void) { init_once(); }

static int threads(int n) {
#ifdef _OPENMP
    return n > 0 ? n : omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

PQ_API const char *pq_isa(void) {
    init_once();
    return g_isa >= 0 ? ISAS[g_isa]->name : "";
}

PQ_API int pq_set_isa(const char *name) {
    if (name == NULL || name[0] == '\0' || strcmp(name, "auto") == 0) {
        g_isa = best_isa();
        return PQ_OK;
    }
    int i = isa_index(name);
    if (i < 0 || !ISAS[i]->cpu_has()) return PQ_ERR_ISA;
    g_isa = i;
    return PQ_OK;
}

static const char *join_names(char *buf, size_t cap, int only_supported) {
    buf[0] = '\0';
    for (int i = 0; i < N_ISAS; i++) {
        if (only_supported && !ISAS[i]->cpu_has()) continue;
        if (buf[0]) strncat(buf, ",", cap - strlen(buf) - 1);
        strncat(buf, ISAS[i]->name, cap - strlen(buf) - 1);
    }
    return buf;
}

PQ_API const char *pq_supported_isas(void) { return join_names(g_supported, sizeof g_supported, 1); }
PQ_API const char *pq_all_isas(void) { return join_names(g_all, sizeof g_all, 0); }

PQ_API int pq_has_kernel(int type) {
    const pq_type_info *t = pq_type(type);
    return t != NULL && t->decode != NULL;
}

PQ_DECODER
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d, int32_t *gsum) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = xb[i] < 0.0f ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        float db = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        d[b] = db;
        for (int h = 0; h < 2; h++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                float r = xb[16 * h + i] * id; /* round half away from zero, no libm call */
                int v = (int)(r + (r < 0.0f ? -0.5f : 0.5f));
                v = v > 32767 ? 32767 : (v < -32767 ? -32767 : v);
                q[32 * b + 16 * h + i] = (int16_t)v;
                sum += v;
            }
            gsum[2 * b + h] = sum;
        }
    }
}

PQ_API int pq_quantize_act(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *q, float *d,
                           int32_t *gsum, int nthreads) {
    if (M < 0 || K <= 0 || K % 32 != 0 || ldx < K) return PQ_ERR_ARG;
    int nt = threads(nthreads);
    if (M * K < 65536) nt = 1; /* a parallel region costs more than a decode-step row */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, q + m * K, d + m * (K / 32), gsum + m * (K / 16));
    return PQ_OK;
}

static void *aligned(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, (n + 63) / 64 * 64) == 0 ? p : NULL;
}

static int scratch_alloc(pq_scratch *s, int64_t K) {
    s->v = aligned((size_t)K);
    s->scale = aligned(sizeof(float) * (size_t)(K / 16));
    s->offset = aligned(sizeof(float) * (size_t)(K / 16));
    return s->v && s->scale && s->offset;
}

static void scratch_free(pq_scratch *s) {
    free(s->v);
    free(s->scale);
    free(s->offset);
}

static int check_weights(const pq_type_info *t, int64_t K, int64_t row_bytes) {
    if (t == NULL || t->decode == NULL) return PQ_ERR_TYPE;
    if (K <= 0 || K % t->block_elems != 0) return PQ_ERR_ARG;
    if (row_bytes < K / t->block_elems * t->block_bytes) return PQ_ERR_ARG;
    return PQ_OK;
}

PQ_API int pq_mul_mat(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes,
                      const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                      int64_t ldy, int nthreads) {
    init_once();
    if (g_isa < 0) return PQ_ERR_ISA;
    const pq_type_info *t = pq_type(type);
    int rc = check_weights(t, K, row_bytes);
    if (rc != PQ_OK) return rc;
    if (N < 0 || M < 0 || (M > 1 && ldy < N)) return PQ_ERR_ARG;
    if (N == 0 || M == 0) return PQ_OK;
    const pq_isa_impl *isa = ISAS[g_isa];
    pq_mm_args a = {t, w, K, row_bytes, q, d, gsum, M, y, ldy};
    int nt = threads(nthreads);
    if (nt > N) nt = (int)N;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        /* contiguous row ranges, multiples of 16 rows so no two threads share a line of y */
        int64_t chunk = ((N + nth - 1) / nth + 15) / 16 * 16;
        int64_t n0 = tid * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 < n1) {
            pq_scratch s;
            if (scratch_alloc(&s, K))
                isa->mul_rows(&a, n0, n1, &s);
            else
                failed = 1;
            scratch_free(&s);
        }
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}

PQ_API int pq_dequantize_rows(int type, const uint8_t *w, int64_t K, int64_t row_bytes,
                              const int64_t *ids, int64_t n, float *out, int64_t ldo,
                              int nthreads) {
    const pq_type_info *t = pq_type(type);
    int rc = check_weights(t, K, row_bytes);
    if (rc != PQ_OK) return rc;
    if (n < 0 || (n > 1 && ldo < K)) return PQ_ERR_ARG;
    int nt = threads(nthreads);
    if (n * K < 65536) nt = 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        pq_scratch s;
        int ok = scratch_alloc(&s, K); /* every thread still meets the omp for below */
        if (!ok) failed = 1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (!ok) continue;
            t->decode(w + ids[i] * row_bytes, K / t->block_elems, s.v, s.scale, s.offset);
            float *o = out + i * ldo;
            if (t->has_offset)
                for (int64_t k = 0; k < K; k++) o[k] = s.scale[k >> 4] * (float)s.v[k] + s.offset[k >> 4];
            else
                for (int64_t k = 0; k < K; k++) o[k] = s.scale[k >> 4] * (float)s.v[k];
        }
        scratch_free(&s);
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}
