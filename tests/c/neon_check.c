/* The CPU kernels' NEON variant against the scalar reference variant, in one process.
 *
 * Built for aarch64 together with every .c file of workers/kernels/cpu_quant and run under
 * qemu-aarch64 by tests/test_cpu_quant_neon.py (see there for the command). It also builds
 * and runs natively on x86-64, where only the scalar variant is compared with itself.
 *
 *   neon_check --isa            print the ISA lines and exit
 *   neon_check [DUMP_DIR]       run the checks; with DUMP_DIR, write each type's weight
 *                               bytes and pq_dequantize_rows output there, for the test to
 *                               compare bit for bit with the numpy reference
 *
 * For every type with a decoder and K in 256/640/2048 (those the block divides): 37 rows of
 * random blocks (sane fp16 scale fields), M = 1..17 activation rows (every chunk of the
 * 8/4/2/1-row fused dots), pq_mul_mat on each variant. Each output is checked against the
 * float64 product of the activations the kernels multiply (q * d) with the dequantized
 * weights, within 1e-5 of sum |q d| |w| (only float32 accumulation separates them), and
 * the variants against each other within twice that: the bounds of
 * tests/test_cpu_quant_kernels.py. Then pq_linear (several parts of mixed types, 1 to 40
 * rows, 1 and 2 threads) and pq_linear_rows the same way. The output's fence columns must
 * stay NaN. Exit status 0 only if every check passed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_quant.h"
#include "decode.h"

static int g_failures, g_checks;

#define FAIL(...)                                  \
    do {                                           \
        if (g_failures++ < 40) {                   \
            fprintf(stdout, "FAIL ");              \
            fprintf(stdout, __VA_ARGS__);          \
            fputc('\n', stdout);                   \
        }                                          \
    } while (0)

/* ---- deterministic random numbers (splitmix64) ---- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ULL;

static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double unif(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }

static double gauss(void) {
    double u = unif(), v = unif();
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

/* A normal float (|f| in the half range) -> IEEE half bits, mantissa truncated. */
static uint16_t half_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint32_t sign = (b >> 16) & 0x8000, exp = ((b >> 23) & 0xFF) - 127 + 15;
    return (uint16_t)(sign | (exp << 10) | ((b >> 13) & 0x3FF));
}

/* ---- the types ---- */

typedef struct {
    int id;
    const char *name;
    int f16_at[2], n_f16; /* byte offsets of the fp16 scale fields (d, dmin) in a block */
} type_case;

static const type_case TYPES[] = {
    {PQ_Q4_0, "Q4_0", {0}, 1},       {PQ_Q4_1, "Q4_1", {0, 2}, 2},   {PQ_Q5_0, "Q5_0", {0}, 1},
    {PQ_Q5_1, "Q5_1", {0, 2}, 2},    {PQ_Q8_0, "Q8_0", {0}, 1},      {PQ_Q2_K, "Q2_K", {80, 82}, 2},
    {PQ_Q3_K, "Q3_K", {108}, 1},     {PQ_Q4_K, "Q4_K", {0, 2}, 2},   {PQ_Q5_K, "Q5_K", {0, 2}, 2},
    {PQ_Q6_K, "Q6_K", {208}, 1},     {PQ_IQ4_NL, "IQ4_NL", {0}, 1}, {PQ_IQ4_XS, "IQ4_XS", {0}, 1},
};
#define N_TYPES ((int)(sizeof TYPES / sizeof TYPES[0]))

/* Special fp16 scale values for the dequantization dump: zeros, subnormals, huge, inf, nan. */
static const uint16_t SPECIAL_F16[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x01F7, 0x7BFF, 0xFBFF,
                                       0x7C00, 0xFC00, 0x7E00, 0x1419, 0xC100};

/* N rows of random blocks, row stride row_bytes (>= the blocks' bytes; the gap random too).
 * special: the scale fields from SPECIAL_F16, else d in +-[1e-3, 1e-2]. */
static uint8_t *random_rows(const type_case *tc, const pq_type_info *t, int64_t N, int64_t K,
                            int64_t row_bytes, int special) {
    uint8_t *w = malloc((size_t)(N * row_bytes));
    for (int64_t i = 0; i < N * row_bytes; i++) w[i] = (uint8_t)rnd();
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / t->block_elems; b++) {
            uint8_t *blk = w + n * row_bytes + b * t->block_bytes;
            for (int f = 0; f < tc->n_f16; f++) {
                uint16_t h;
                if (special) {
                    h = SPECIAL_F16[rnd() % (sizeof SPECIAL_F16 / sizeof SPECIAL_F16[0])];
                } else {
                    float v = (float)(1e-3 + 9e-3 * unif());
                    h = half_bits(rnd() & 1 ? -v : v);
                }
                blk[tc->f16_at[f]] = (uint8_t)h;
                blk[tc->f16_at[f] + 1] = (uint8_t)(h >> 8);
            }
        }
    return w;
}

static void dump(const char *dir, const char *name, int64_t K, const char *what, const void *p,
                 size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s_%lld.%s", dir, name, (long long)K, what);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n) FAIL("cannot write %s", path);
    if (f) fclose(f);
}

/* The weight rows (their blocks, without the row gap) and their dequantized values. */
static void dump_rows(const char *dir, const char *name, int64_t K, const char *tag,
                      const pq_type_info *t, const uint8_t *w, int64_t N, int64_t row_bytes,
                      const float *wf) {
    const int64_t used = K / t->block_elems * t->block_bytes;
    uint8_t *packed = malloc((size_t)(N * used));
    for (int64_t n = 0; n < N; n++) memcpy(packed + n * used, w + n * row_bytes, (size_t)used);
    char what[32];
    snprintf(what, sizeof what, "%s.w", tag);
    dump(dir, name, K, what, packed, (size_t)(N * used));
    snprintf(what, sizeof what, "%s.f", tag);
    dump(dir, name, K, what, wf, sizeof(float) * (size_t)(N * K));
    free(packed);
}

/* ---- activations and the float64 reference ---- */

typedef struct {
    int64_t M, K;
    float *x;
    int16_t *q;
    float *d;
    int32_t *gsum;
} acts;

static acts make_acts(int64_t M, int64_t K) {
    acts a = {M, K, malloc(sizeof(float) * (size_t)(M * K)), malloc(sizeof(int16_t) * (size_t)(M * K)),
              malloc(sizeof(float) * (size_t)(M * K / 32)), malloc(sizeof(int32_t) * (size_t)(M * K / 16))};
    for (int64_t m = 0; m < M; m++) {
        const double s = 4.0 * unif() + 1e-3;
        for (int64_t k = 0; k < K; k++) a.x[m * K + k] = (float)(gauss() * s);
    }
    if (M >= 3) memset(a.x + 2 * K + 32, 0, sizeof(float) * 32); /* an all-zero block: d = 0 */
    if (pq_quantize_act(a.x, M, K, K, a.q, a.d, a.gsum, 1) != PQ_OK) FAIL("pq_quantize_act");
    return a;
}

static void free_acts(acts *a) { free(a->x), free(a->q), free(a->d), free(a->gsum); }

/* exact[m][n] = (q d)[m] . wf[n] in float64; tight[m][n] = 1e-5 |q d|[m] . |wf|[n] + 1e-30 */
static void reference(const acts *a, const float *wf, int64_t N, double *exact, double *tight) {
    const int64_t K = a->K;
    double *xq = malloc(sizeof(double) * (size_t)K);
    for (int64_t m = 0; m < a->M; m++) {
        for (int64_t k = 0; k < K; k++) xq[k] = (double)a->q[m * K + k] * (double)a->d[m * (K / 32) + k / 32];
        for (int64_t n = 0; n < N; n++) {
            double s = 0.0, t = 0.0;
            const float *w = wf + n * K;
            for (int64_t k = 0; k < K; k++) s += xq[k] * w[k], t += fabs(xq[k] * w[k]);
            exact[m * N + n] = s;
            tight[m * N + n] = 1e-5 * t + 1e-30;
        }
    }
    free(xq);
}

/* ---- the checks ---- */

static const char *VARIANTS[2] = {"scalar", "neon"};
static int g_nvar = 2;
static double g_worst_ref, g_worst_pair; /* the largest error / bound seen */

/* Checks y ([M][ldy], the product at columns col..col+N-1) of variant v against the
 * reference, and its fence columns; keeps it in out[v] ([M][N]). */
static void check_out(const char *what, int v, const float *y, int64_t M, int64_t N, int64_t ldy,
                      int64_t col, const double *exact, const double *tight, float *out) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < ldy; c++) {
            const float val = y[m * ldy + c];
            if (c < col || c >= col + N) {
                if (!isnan(val)) FAIL("%s %s: fence column %lld of row %lld written", what, VARIANTS[v],
                                      (long long)c, (long long)m);
                continue;
            }
            const int64_t n = c - col;
            const double err = fabs((double)val - exact[m * N + n]), r = err / tight[m * N + n];
            g_checks++;
            if (!(r <= 1.0))
                FAIL("%s %s: row %lld col %lld: %.9g, exact %.9g (error %.3g x the bound)", what,
                     VARIANTS[v], (long long)m, (long long)n, val, exact[m * N + n], r);
            if (r > g_worst_ref) g_worst_ref = r;
            out[m * N + n] = val;
        }
    }
}

static void check_pair(const char *what, const float *a, const float *b, int64_t M, int64_t N,
                       const double *tight) {
    for (int64_t i = 0; i < M * N; i++) {
        const double r = fabs((double)a[i] - (double)b[i]) / (2.0 * tight[i]);
        g_checks++;
        if (!(r <= 1.0))
            FAIL("%s: neon %.9g vs scalar %.9g at %lld (%.3g x the bound)", what, b[i], a[i],
                 (long long)i, r);
        if (r > g_worst_pair) g_worst_pair = r;
    }
}

static int set_isa(int v) {
    if (pq_set_isa(VARIANTS[v]) != PQ_OK || strcmp(pq_isa(), VARIANTS[v]) != 0) {
        FAIL("pq_set_isa(%s)", VARIANTS[v]);
        return 0;
    }
    return 1;
}

static float *nan_buffer(int64_t n) {
    float *y = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) y[i] = NAN;
    return y;
}

static void check_type(const type_case *tc, int64_t K, const char *dump_dir) {
    const pq_type_info *t = pq_type(tc->id);
    const int64_t N = 37, used = K / t->block_elems * t->block_bytes;
    const int64_t row_bytes = K == 640 ? used + 6 : used; /* a row-strided view at 640 */
    uint8_t *w = random_rows(tc, t, N, K, row_bytes, 0);
    float *wf = malloc(sizeof(float) * (size_t)(N * K));
    int64_t ids[37];
    for (int64_t n = 0; n < N; n++) ids[n] = n;
    if (pq_dequantize_rows(tc->id, w, K, row_bytes, ids, N, wf, K, 1) != PQ_OK) FAIL("dequantize %s", tc->name);
    if (dump_dir) dump_rows(dump_dir, tc->name, K, "rand", t, w, N, row_bytes, wf);
    if (dump_dir && K == 2048) { /* special scale fields, dequantization only */
        uint8_t *ws = random_rows(tc, t, 12, K, used, 1);
        float *wsf = malloc(sizeof(float) * (size_t)(12 * K));
        if (pq_dequantize_rows(tc->id, ws, K, used, ids, 12, wsf, K, 2) != PQ_OK) FAIL("dequantize %s", tc->name);
        dump_rows(dump_dir, tc->name, K, "special", t, ws, 12, used, wsf);
        free(ws), free(wsf);
    }
    static const int64_t Ms[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 17};
    for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
        const int64_t M = Ms[i], ldy = N + 5, col = 2;
        acts a = make_acts(M, K);
        double *exact = malloc(sizeof(double) * (size_t)(M * N)), *tight = malloc(sizeof(double) * (size_t)(M * N));
        reference(&a, wf, N, exact, tight);
        float *out[2] = {malloc(sizeof(float) * (size_t)(M * N)), malloc(sizeof(float) * (size_t)(M * N))};
        char what[64];
        snprintf(what, sizeof what, "mul_mat %s K=%lld M=%lld", tc->name, (long long)K, (long long)M);
        for (int v = 0; v < g_nvar; v++) {
            if (!set_isa(v)) continue;
            float *y = nan_buffer(M * ldy);
            const int rc = pq_mul_mat(tc->id, w, N, K, row_bytes, a.q, a.d, a.gsum, M, y + col, ldy,
                                      1 + (int)(i & 1));
            if (rc != PQ_OK) FAIL("%s %s: rc %d", what, VARIANTS[v], rc);
            else check_out(what, v, y, M, N, ldy, col, exact, tight, out[v]);
            free(y);
        }
        if (g_nvar == 2) check_pair(what, out[0], out[1], M, N, tight);
        free(out[0]), free(out[1]), free(exact), free(tight);
        free_acts(&a);
    }
    free(w), free(wf);
}

/* pq_linear over parts of mixed types (K a multiple of every block), and pq_linear_rows. */
static void check_linear(void) {
    const int64_t K = 1024;
    static const int ids[] = {PQ_Q5_0, PQ_Q8_0, PQ_Q4_K, PQ_Q6_K, PQ_Q2_K, PQ_IQ4_XS, PQ_Q4_1};
    static const int64_t rows[] = {40, 24, 33, 20, 9, 17, 5};
    enum { NP = sizeof ids / sizeof ids[0] };
    pq_part parts[NP];
    uint8_t *ws[NP];
    int64_t total = 0;
    for (int j = 0; j < NP; j++) total += rows[j];
    float *wf = malloc(sizeof(float) * (size_t)(total * K));
    int64_t col = 3;
    for (int j = 0; j < NP; j++) {
        const type_case *tc = NULL;
        for (int i = 0; i < N_TYPES; i++)
            if (TYPES[i].id == ids[j]) tc = &TYPES[i];
        const pq_type_info *t = pq_type(ids[j]);
        const int64_t rb = K / t->block_elems * t->block_bytes;
        ws[j] = random_rows(tc, t, rows[j], K, rb, 0);
        int64_t idx[64];
        for (int64_t n = 0; n < rows[j]; n++) idx[n] = n;
        if (pq_dequantize_rows(ids[j], ws[j], K, rb, idx, rows[j], wf + (col - 3) * K, K, 1) != PQ_OK)
            FAIL("dequantize %s", tc->name);
        parts[j] = (pq_part){ids[j], rows[j], rb, col, ws[j]};
        col += rows[j];
    }
    const int64_t ldy = total + 7;
    static const int64_t Ms[] = {1, 3, 8, 13, 16, 24, 40};
    for (size_t i = 0; i < sizeof Ms / sizeof Ms[0]; i++) {
        const int64_t M = Ms[i];
        acts a = make_acts(M, K); /* the same quantization pq_linear makes of x */
        double *exact = malloc(sizeof(double) * (size_t)(M * total)),
               *tight = malloc(sizeof(double) * (size_t)(M * total));
        reference(&a, wf, total, exact, tight);
        float *out[2] = {malloc(sizeof(float) * (size_t)(M * total)), malloc(sizeof(float) * (size_t)(M * total))};
        for (int threads = 1; threads <= 2; threads++) {
            char what[64];
            snprintf(what, sizeof what, "linear M=%lld threads=%d", (long long)M, threads);
            for (int v = 0; v < g_nvar; v++) {
                if (!set_isa(v)) continue;
                float *y = nan_buffer(M * ldy);
                const int rc = pq_linear(parts, NP, K, a.x, M, K, y, ldy, threads);
                if (rc != PQ_OK) FAIL("%s %s: rc %d", what, VARIANTS[v], rc);
                else check_out(what, v, y, M, total, ldy, 3, exact, tight, out[v]);
                free(y);
            }
            if (g_nvar == 2) check_pair(what, out[0], out[1], M, total, tight);
        }
        free(out[0]), free(out[1]), free(exact), free(tight);
        free_acts(&a);
    }
    /* pq_linear_rows: part j on its own run of rows of an 8-row x */
    {
        const int64_t M = 8, ranges[2 * NP] = {0, 8, 2, 1, 4, 3, 7, 1, 1, 5, 0, 2, 6, 2};
        acts a = make_acts(M, K);
        double *exact = malloc(sizeof(double) * (size_t)(M * total)),
               *tight = malloc(sizeof(double) * (size_t)(M * total));
        reference(&a, wf, total, exact, tight);
        float *y[2] = {nan_buffer(M * ldy), nan_buffer(M * ldy)};
        for (int v = 0; v < g_nvar; v++) {
            if (!set_isa(v)) continue;
            const int rc = pq_linear_rows(parts, ranges, NP, K, a.x, M, K, y[v], ldy, 2);
            if (rc != PQ_OK) FAIL("linear_rows %s: rc %d", VARIANTS[v], rc);
        }
        for (int j = 0; j < NP; j++)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < rows[j]; n++) {
                    const int64_t c = parts[j].col + n, e = m * total + (c - 3);
                    const int in = m >= ranges[2 * j] && m < ranges[2 * j] + ranges[2 * j + 1];
                    for (int v = 0; v < g_nvar; v++) {
                        const float val = y[v][m * ldy + c];
                        g_checks++;
                        if (!in) {
                            if (!isnan(val)) FAIL("linear_rows %s: part %d row %lld written", VARIANTS[v], j, (long long)m);
                        } else if (!(fabs((double)val - exact[e]) <= tight[e])) {
                            FAIL("linear_rows %s: part %d row %lld col %lld: %.9g, exact %.9g", VARIANTS[v], j,
                                 (long long)m, (long long)n, val, exact[e]);
                        }
                    }
                    if (in && g_nvar == 2 && !(fabs((double)y[0][m * ldy + c] - y[1][m * ldy + c]) <= 2 * tight[e]))
                        FAIL("linear_rows: part %d row %lld col %lld: variants differ", j, (long long)m, (long long)n);
                }
        free(y[0]), free(y[1]), free(exact), free(tight);
        free_acts(&a);
    }
    for (int j = 0; j < NP; j++) free(ws[j]);
    free(wf);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines survive a crash */
    printf("isa %s\nall %s\nsupported %s\n", pq_isa(), pq_all_isas(), pq_supported_isas());
    if (argc > 1 && strcmp(argv[1], "--isa") == 0) return 0;
    const char *dump_dir = argc > 1 ? argv[1] : NULL;
#if !defined(__aarch64__)
    VARIANTS[1] = "scalar"; /* no NEON here: the driver checks itself against the scalar variant */
#endif
    if (pq_set_isa("neon") != PQ_OK && strcmp(VARIANTS[1], "neon") == 0) FAIL("the neon variant cannot run");
    for (int i = 0; i < N_TYPES; i++) {
        if (!pq_has_kernel(TYPES[i].id)) {
            FAIL("%s has no kernel", TYPES[i].name);
            continue;
        }
        const pq_type_info *t = pq_type(TYPES[i].id);
        const double worst_ref = g_worst_ref, worst_pair = g_worst_pair;
        g_worst_ref = g_worst_pair = 0.0;
        static const int64_t Ks[] = {256, 640, 2048};
        for (int k = 0; k < 3; k++)
            if (Ks[k] % t->block_elems == 0) check_type(&TYPES[i], Ks[k], dump_dir);
        printf("mul_mat %-6s worst error/bound: vs float64 %.3f, %s vs scalar %.3f\n", TYPES[i].name,
               g_worst_ref, VARIANTS[1], g_worst_pair);
        g_worst_ref = g_worst_ref > worst_ref ? g_worst_ref : worst_ref;
        g_worst_pair = g_worst_pair > worst_pair ? g_worst_pair : worst_pair;
    }
    const double worst_ref = g_worst_ref, worst_pair = g_worst_pair;
    g_worst_ref = g_worst_pair = 0.0;
    check_linear();
    printf("linear mixed parts worst error/bound: vs float64 %.3f, %s vs scalar %.3f\n", g_worst_ref,
           VARIANTS[1], g_worst_pair);
    if (worst_ref > g_worst_ref) g_worst_ref = worst_ref;
    if (worst_pair > g_worst_pair) g_worst_pair = worst_pair;
    printf("%s: %d checks, %d failures (worst error/bound %.3f vs float64, %.3f %s vs scalar)\n",
           g_failures ? "FAIL" : "PASS", g_checks, g_failures, g_worst_ref, g_worst_pair, VARIANTS[1]);
    return g_failures ? 1 : 0;
}
