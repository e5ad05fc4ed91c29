/* The many-row product: a prompt's rows against block weights with no per-call fixed cost
 * beyond decoding each weight row once.
 *
 * The activations (int16 per block of 32, as pq_quantize_act makes them) are packed by
 * panels of PQ_GEMM_MR rows: int16 pairs interleaved across the panel's rows, so that one
 * register holds the same pair of elements of 8 rows. Each thread takes chunks of weight
 * rows, decodes PQ_GEMM_NW of them at a time to int16 with their per-group scales and
 * offsets (up to 16 KiB, which stay in L1), and runs the variant's tile (gemm_tile) over every
 * panel. The sums are the row dots' (exact integers per group, one float scale per
 * group), so a prompt computes what decode computes, to float rounding.
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm_i16.h"

static void *aligned64(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, (n + 63) / 64 * 64) == 0 ? p : NULL;
}

/* One panel: rows 16p.. of (q, d, gsum), zero past M. */
static void pack_panel(const int16_t *q, const float *d, const int32_t *gsum, int64_t M,
                       int64_t K, int64_t p, uint32_t *ap, float *xs, float *xg) {
    enum { MR = PQ_GEMM_MR };
    ap += p * (K / 2) * MR, xs += p * (K / 32) * MR, xg += p * (K / 16) * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t m = p * MR + r;
        if (m >= M) {
            for (int64_t kp = 0; kp < K / 2; kp++) ap[kp * MR + r] = 0;
            for (int64_t b = 0; b < K / 32; b++) xs[b * MR + r] = 0.0f;
            for (int64_t h = 0; h < K / 16; h++) xg[h * MR + r] = 0.0f;
            continue;
        }
        const int16_t *qm = q + m * K;
        for (int64_t kp = 0; kp < K / 2; kp++)
            ap[kp * MR + r] = (uint32_t)(uint16_t)qm[2 * kp] | ((uint32_t)(uint16_t)qm[2 * kp + 1] << 16);
        for (int64_t b = 0; b < K / 32; b++) xs[b * MR + r] = d[m * (K / 32) + b];
        for (int64_t h = 0; h < K / 16; h++)
            xg[h * MR + r] = d[m * (K / 32) + h / 2] * (float)gsum[m * (K / 16) + h];
    }
}

/* A thread's decoded tile: PQ_GEMM_NW rows of int16 values, scales and offsets, and the
 * canonical decode buffer they come from. */
typedef struct {
    int16_t *q;
    float *scale, *offset;
    int8_t *v;
    int64_t K;
} tile_buf;

static __thread tile_buf t_tile;

static tile_buf *thread_tile(int64_t K) {
    if (t_tile.K >= K) return &t_tile;
    free(t_tile.q), free(t_tile.scale), free(t_tile.offset), free(t_tile.v);
    t_tile.q = aligned64(sizeof(int16_t) * (size_t)(PQ_GEMM_NW * K));
    t_tile.scale = aligned64(sizeof(float) * (size_t)(PQ_GEMM_NW * K / 16));
    t_tile.offset = aligned64(sizeof(float) * (size_t)(PQ_GEMM_NW * K / 16));
    t_tile.v = aligned64((size_t)K);
    t_tile.K = (t_tile.q && t_tile.scale && t_tile.offset && t_tile.v) ? K : 0;
    return t_tile.K ? &t_tile : NULL;
}

/* The types whose decoders write one scale and offset per 32 elements (twice): their
 * integer sums run over 32 elements; Q2_K, Q3_K and Q6_K scale every 16. */
static int group_of(int id) {
    return id == PQ_Q2_K || id == PQ_Q3_K || id == PQ_Q6_K ? 16 : 32;
}

/* Weight rows n..n+nw-1 (nw <= NW; the rest zero) into the tile. */
static void decode_tile(const pq_isa_impl *isa, const pq_type_info *t, const uint8_t *w,
                        int64_t row_bytes, int64_t n, int nw, int64_t K, tile_buf *b) {
    for (int j = 0; j < PQ_GEMM_NW; j++) {
        int16_t *q = b->q + j * K;
        float *sc = b->scale + j * (K / 16), *off = b->offset + j * (K / 16);
        if (j >= nw) {
            memset(q, 0, sizeof(int16_t) * (size_t)K);
            memset(sc, 0, sizeof(float) * (size_t)(K / 16));
            memset(off, 0, sizeof(float) * (size_t)(K / 16));
            continue;
        }
        const uint8_t *row = w + (n + j) * row_bytes;
        if (isa->unpack_row != NULL && isa->unpack_row(t->id, row, K, q, sc, off)) continue;
        t->decode(row, K / t->block_elems, b->v, sc, off);
        for (int64_t k = 0; k < K; k++) q[k] = b->v[k];
    }
}

static uint32_t *g_ap; /* the packed activations of the last call (one caller thread) */
static float *g_xs, *g_xg;
static int64_t g_panel_k, g_panels;

static int panel_buffers(int64_t panels, int64_t K) {
    if (panels <= g_panels && K <= g_panel_k) return 1;
    const int64_t np = panels > g_panels ? panels : g_panels, nk = K > g_panel_k ? K : g_panel_k;
    free(g_ap), free(g_xs), free(g_xg);
    g_ap = aligned64(sizeof(uint32_t) * (size_t)(np * (nk / 2) * PQ_GEMM_MR));
    g_xs = aligned64(sizeof(float) * (size_t)(np * (nk / 32) * PQ_GEMM_MR));
    g_xg = aligned64(sizeof(float) * (size_t)(np * (nk / 16) * PQ_GEMM_MR));
    const int ok = g_ap && g_xs && g_xg;
    g_panels = ok ? np : 0, g_panel_k = ok ? nk : 0;
    return ok;
}

int pq_gemm_parts(const pq_isa_impl *isa, const pq_part *parts, int nparts, int64_t K,
                  const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                  int64_t ldy, int nthreads) {
    enum { NW = PQ_GEMM_NW, MR = PQ_GEMM_MR };
    const int64_t panels = (M + MR - 1) / MR;
    if (!panel_buffers(panels, K)) return PQ_ERR_NOMEM;
    const pq_gemm_act act = {g_ap, g_xs, g_xg, K};
    /* chunks of 16 weight rows (whole cache lines of y), taken in turn */
    const int64_t chunk = 16;
    int64_t first[PQ_MAX_PARTS + 1];
    first[0] = 0;
    for (int j = 0; j < nparts; j++) first[j + 1] = first[j] + (parts[j].rows + chunk - 1) / chunk;
    const int64_t chunks = first[nparts];
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        tile_buf *b = thread_tile(K);
        if (b == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) pack_panel(q, d, gsum, M, K, p, g_ap, g_xs, g_xg);
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (b == NULL) continue;
            int j = 0;
            while (c >= first[j + 1]) j++;
            const pq_part *pt = &parts[j];
            const pq_type_info *t = pq_type((int)pt->type);
            const int64_t n0 = (c - first[j]) * chunk,
                          n1 = n0 + chunk < pt->rows ? n0 + chunk : pt->rows;
            const pq_gemm_w w = {b->q, b->scale, b->offset, group_of(t->id), t->has_offset};
            float tile[NW][PQ_GEMM_TILE_ROWS] __attribute__((aligned(64)));
            for (int64_t n = n0; n < n1; n += NW) {
                const int nw = n1 - n < NW ? (int)(n1 - n) : NW;
                decode_tile(isa, t, pt->w, pt->row_bytes, n, nw, K, b);
                for (int64_t p = 0; p < panels; p += 2) {
                    const int64_t rows = M - p * MR < 2 * MR ? M - p * MR : 2 * MR;
                    isa->gemm_tile(&act, p, &w, rows, tile);
                    float *yp = y + p * MR * ldy + pt->col + n;
                    for (int64_t r = 0; r < rows; r++)
                        for (int jj = 0; jj < nw; jj++) yp[r * ldy + jj] = tile[jj][r];
                }
            }
        }
    }
    return failed ? PQ_ERR_NOMEM : PQ_OK;
}
