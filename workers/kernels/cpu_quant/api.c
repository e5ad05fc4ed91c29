/* The exported API (cpu_quant.h): argument checks, ISA choice, threading. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_quant.h"
#include "gemm_i16.h"
#include "kernels.h"

/* best first */
static const pq_isa_impl *const ISAS[] = {
#if defined(__x86_64__)
    &pq_isa_avx512vnni, &pq_isa_avxvnni, &pq_isa_avx2,
#endif
#if defined(__aarch64__)
    &pq_isa_neon,
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

/* A thread's decode buffer, kept between calls (a call of one decode step is ~10 us). */
static __thread pq_scratch t_scratch;
static __thread int64_t t_scratch_k;

static pq_scratch *thread_scratch(int64_t K) {
    if (t_scratch_k < K) {
        scratch_free(&t_scratch);
        t_scratch_k = scratch_alloc(&t_scratch, K) ? K : 0;
        if (t_scratch_k == 0) {
            scratch_free(&t_scratch);
            memset(&t_scratch, 0, sizeof t_scratch);
            return NULL;
        }
    }
    return &t_scratch;
}

/* The activations of the last pq_linear call (one caller thread: the worker's). */
static int16_t *g_q;
static float *g_d;
static int32_t *g_gsum;
static int64_t g_act_elems;

static int act_buffers(int64_t elems) {
    if (elems <= g_act_elems) return 1;
    free(g_q);
    free(g_d);
    free(g_gsum);
    g_q = aligned(sizeof(int16_t) * (size_t)elems);
    g_d = aligned(sizeof(float) * (size_t)(elems / 32));
    g_gsum = aligned(sizeof(int32_t) * (size_t)(elems / 16));
    g_act_elems = (g_q && g_d && g_gsum) ? elems : 0;
    return g_act_elems != 0;
}

/* The activations of the last product in a lane-order variant's order, or as a byte-plane
 * variant's two planes (one caller thread). */
static int16_t *g_qp;
static int64_t g_qp_elems;
static uint8_t *g_qlo;
static int8_t *g_qhi;
static int64_t g_planes_elems;

static int check_parts(const pq_part *parts, int nparts, int64_t K, int64_t M, int64_t ldy,
                       int64_t *total) {
    if (nparts <= 0 || nparts > PQ_MAX_PARTS || M < 0 || K <= 0 || K % 32 != 0) return PQ_ERR_ARG;
    *total = 0;
    for (int j = 0; j < nparts; j++) {
        int rc = check_weights(pq_type((int)parts[j].type), K, parts[j].row_bytes);
        if (rc != PQ_OK) return rc;
        if (parts[j].rows < 0 || parts[j].col < 0 || (M > 1 && parts[j].col + parts[j].rows > ldy))
            return PQ_ERR_ARG;
        *total += parts[j].rows;
    }
    return PQ_OK;
}

/* Every part's rows against M quantized activation rows, in one parallel region. The
 * rows are cut into chunks (a multiple of 16 rows, so that no two threads write one cache
 * line of y; ~8 per thread) that the threads take in turn: on a machine whose cores also
 * run the engine's other processes, a thread that loses its core for a while no longer
 * holds every other thread at the region's end. */
static int run_parts(const pq_part *parts, const int64_t *ranges, int nparts, int64_t K,
                     const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                     int64_t ldy, int64_t total, int nthreads) {
    const pq_isa_impl *isa = ISAS[g_isa];
    int nt = threads(nthreads);
    if (nt > total) nt = (int)total;
    int64_t chunk = (total / ((int64_t)nt * 8) + 15) / 16 * 16;
    if (chunk < 16) chunk = 16;
    int64_t first[PQ_MAX_PARTS + 1];
    first[0] = 0;
    for (int j = 0; j < nparts; j++) first[j + 1] = first[j] + (parts[j].rows + chunk - 1) / chunk;
    const int64_t chunks = first[nparts];
    const int16_t *qp = NULL;
    if (isa->lane_order) {
        if (M * K > g_qp_elems) {
            free(g_qp);
            g_qp = aligned(sizeof(int16_t) * (size_t)(M * K));
            g_qp_elems = g_qp != NULL ? M * K : 0;
            if (g_qp == NULL) return PQ_ERR_NOMEM;
        }
        pq_lane_order(q, M * K, g_qp);
        qp = g_qp;
    }
    if (isa->byte_planes) {
        if (M * K > g_planes_elems) {
            free(g_qlo);
            free(g_qhi);
            g_qlo = aligned((size_t)(M * K));
            g_qhi = aligned((size_t)(M * K));
            g_planes_elems = g_qlo != NULL && g_qhi != NULL ? M * K : 0;
            if (g_planes_elems == 0) return PQ_ERR_NOMEM;
        }
        pq_byte_planes(q, M * K, g_qlo, g_qhi);
    }
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        pq_scratch *s = thread_scratch(K);
        if (s == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (s == NULL) continue;
            int j = 0;
            while (c >= first[j + 1]) j++;
            const pq_part *p = &parts[j];
            int64_t n0 = (c - first[j]) * chunk, n1 = n0 + chunk < p->rows ? n0 + chunk : p->rows;
            /* ranges: the part multiplies its own run of activation rows, into those of y */
            const int64_t r = ranges != NULL ? ranges[2 * j] : 0,
                          m = ranges != NULL ? ranges[2 * j + 1] : M;
            pq_mm_args a = {pq_type((int)p->type), p->w, K, p->row_bytes, q + r * K,
                            qp != NULL ? qp + r * K : NULL,
                            isa->byte_planes ? g_qlo + r * K : NULL,
                            isa->byte_planes ? g_qhi + r * K : NULL, d + r * (K / 32),
                            gsum + r * (K / 16), m, y + r * ldy + p->col, ldy,
                            p->w + p->rows * p->row_bytes};
            isa->mul_rows(&a, n0, n1, s);
        }
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}

PQ_API int pq_mul_mat(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes,
                      const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                      int64_t ldy, int nthreads) {
    init_once();
    if (g_isa < 0) return PQ_ERR_ISA;
    if (N < 0 || (M > 1 && ldy < N)) return PQ_ERR_ARG;
    pq_part part = {type, N, row_bytes, 0, w};
    int64_t total;
    int rc = check_parts(&part, 1, K, M, ldy, &total);
    if (rc != PQ_OK || M == 0 || total == 0) return rc;
    return run_parts(&part, NULL, 1, K, q, d, gsum, M, y, ldy, total, nthreads);
}

static int64_t g_gemm_rows = PQ_GEMM_ROWS;

PQ_API int64_t pq_gemm_rows(int64_t rows) {
    const int64_t before = g_gemm_rows;
    if (rows > 0) g_gemm_rows = rows;
    return before;
}

/* pq_linear, and with ranges (not NULL) pq_linear_rows: quantize x's M rows once, then
 * every part's rows against all of them or against its own run of them. */
static int linear_parts(const pq_part *parts, const int64_t *ranges, int nparts, int64_t K,
                        const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                        int nthreads) {
    init_once();
    if (g_isa < 0) return PQ_ERR_ISA;
    if (M > 1 && ldx < K) return PQ_ERR_ARG;
    int64_t total;
    int rc = check_parts(parts, nparts, K, M, ldy, &total);
    if (rc != PQ_OK || M == 0 || total == 0) return rc;
    for (int j = 0; ranges != NULL && j < nparts; j++)
        if (ranges[2 * j] < 0 || ranges[2 * j + 1] < 1 || ranges[2 * j] + ranges[2 * j + 1] > M)
            return PQ_ERR_ARG;
    if (!act_buffers(M * K)) return PQ_ERR_NOMEM;
    /* a prompt's rows on every thread (a 502-row down projection's are 1 M elements) */
    const int qt = M * K < 65536 ? 1 : threads(nthreads);
#pragma omp parallel for num_threads(qt) schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, g_q + m * K, g_d + m * (K / 32), g_gsum + m * (K / 16));
    if (ranges == NULL && M >= g_gemm_rows && ISAS[g_isa]->gemm_tile != NULL)
        return pq_gemm_parts(ISAS[g_isa], parts, nparts, K, g_q, g_d, g_gsum, M, y, ldy,
                             threads(nthreads));
    return run_parts(parts, ranges, nparts, K, g_q, g_d, g_gsum, M, y, ldy, total, nthreads);
}

PQ_API int pq_linear(const pq_part *parts, int nparts, int64_t K, const float *x, int64_t M,
                     int64_t ldx, float *y, int64_t ldy, int nthreads) {
    return linear_parts(parts, NULL, nparts, K, x, M, ldx, y, ldy, nthreads);
}

PQ_API int pq_linear_rows(const pq_part *parts, const int64_t *ranges, int nparts, int64_t K,
                          const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                          int nthreads) {
    if (ranges == NULL) return PQ_ERR_ARG;
    return linear_parts(parts, ranges, nparts, K, x, M, ldx, y, ldy, nthreads);
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
        pq_scratch *s = thread_scratch(K); /* every thread still meets the omp for below */
        if (s == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (s == NULL) continue;
            t->decode(w + ids[i] * row_bytes, K / t->block_elems, s->v, s->scale, s->offset);
            float *o = out + i * ldo;
            if (t->has_offset)
                for (int64_t k = 0; k < K; k++) o[k] = s->scale[k >> 4] * (float)s->v[k] + s->offset[k >> 4];
            else
                for (int64_t k = 0; k < K; k++) o[k] = s->scale[k >> 4] * (float)s->v[k];
        }
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}
