/* The decoder stack's step in one call (cpu_quant.h, "layer"): the products and the
 * float work between them run back to back in C, so a step makes one library call
 * instead of ~15 Python-level calls a layer, each of which came back to an interpreter
 * whose code and data the weight stream had evicted (docs/cpu_kernels.md).
 *
 * It composes the library's own exported operations (pq_linear, pq_rms_norm, pq_rotary,
 * pq_act_and_mul, pq_decode_attention) in the order a pre-norm layer applies them: the
 * torch-free worker's float path (workers/lite/prefill.py) runs the same operations,
 * with attention as matrix products instead. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "cpu_quant.h"
#include "ops_inline.h"

static grown g_work;   /* a layer's intermediate rows */
static grown g_attn;   /* attention's */
static grown g_stream; /* the stack's residual stream: two (x, residual) pairs, in turn */
static grown g_experts; /* a routed-experts MLP's logits, weights and pair rows */
static grown g_shared;  /* a shared expert's rows */

static int linear(const pq_layer_linear *l, int64_t K, const float *x, int64_t M, float *y,
                  int64_t N, int nthreads) {
    int rc = pq_linear(l->parts, (int)l->nparts, K, x, M, K, y, N, nthreads);
    if (rc == PQ_OK && l->bias != NULL)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += l->bias[n];
    return rc;
}

static void add_norm(const float *x, const float *res, int64_t M, int64_t D, const float *w,
                     float eps, float *out, float *res_out) {
    pq_rms_norm(x, M, 1, D, D, 0, res, D, 0, w, eps, out, res_out);
}

/* Softmax top-k of one row of router logits (pq_layer_experts' rule). */
static void route(const float *logits, int64_t n, int64_t k, int renormalize, float *w,
                  int64_t *ids) {
    float mx = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < n; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int64_t e = 0; e < n; e++) sum += expf(logits[e] - mx);
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
        w[j] = expf(logits[best] - mx) / sum;
        total += w[j];
    }
    if (renormalize)
        for (int64_t j = 0; j < k; j++) w[j] /= total;
}

/* out [M, E] += sigmoid(h . shared_gate) * the shared expert's output (Qwen3.5-MoE). */
static int shared_expert(const pq_layer *L, const float *h, int64_t M, float *out, int nthreads) {
    const pq_layer_experts *X = &L->experts;
    const int64_t E = L->hidden, I = X->shared_inter;
    float *gu = grow(&g_shared, M * (3 * I + E));
    if (gu == NULL) return PQ_ERR_NOMEM;
    float *act = gu + M * 2 * I, *y = act + M * I;
    int rc;
    if ((rc = linear(&X->shared_gate_up, E, h, M, gu, 2 * I, nthreads)) != PQ_OK) return rc;
    if ((rc = pq_act_and_mul(L->act, gu, M, I, 2 * I, act)) != PQ_OK) return rc;
    if ((rc = linear(&X->shared_down, I, act, M, y, E, nthreads)) != PQ_OK) return rc;
    for (int64_t m = 0; m < M; m++) {
        const float s = sigmoid(dot(h + m * E, X->shared_gate, E));
        for (int64_t c = 0; c < E; c++) out[m * E + c] += s * y[m * E + c];
    }
    return PQ_OK;
}

/* h [M, E] (the normed rows) through the routed experts into out [M, E]. Each (token,
 * choice) pair is a row of the scratch rows: one pq_linear_rows call for every pair's
 * [gate | up] and one for their down products, at most PQ_MAX_PARTS parts a call. */
static int experts_mlp(const pq_layer *L, const float *h, int64_t M, float *out, int nthreads) {
    const pq_layer_experts *X = &L->experts;
    const int64_t E = L->hidden, I = L->inter, k = X->top_k, P = M * k;
    float *buf = grow(&g_experts, M * X->count + P * (E + 3 * I + E) + P);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)P);
    if (buf == NULL || ids == NULL) {
        free(ids);
        return PQ_ERR_NOMEM;
    }
    float *logits = buf, *w = logits + M * X->count, *xp = w + P, *gu = xp + P * E,
          *act = gu + P * 2 * I, *y = act + P * I;
    float_products(X->router, X->count, h, M, E, logits, nthreads);
    for (int64_t m = 0; m < M; m++) {
        route(logits + m * X->count, X->count, k, (int)X->renormalize, w + m * k, ids + m * k);
        for (int64_t j = 0; j < k; j++)
            memcpy(xp + (m * k + j) * E, h + m * E, sizeof(float) * (size_t)E);
    }
    pq_part parts[PQ_MAX_PARTS];
    int64_t rows[2 * PQ_MAX_PARTS]; /* each part's run of rows: (first, 1) */
    int rc = PQ_OK;
    for (int64_t p0 = 0; p0 < P && rc == PQ_OK; p0 += PQ_MAX_PARTS / 2) {
        const int64_t n = P - p0 < PQ_MAX_PARTS / 2 ? P - p0 : PQ_MAX_PARTS / 2;
        for (int64_t p = 0; p < n; p++) {
            parts[2 * p] = X->gate_up[2 * ids[p0 + p]];
            parts[2 * p + 1] = X->gate_up[2 * ids[p0 + p] + 1];
            rows[4 * p] = rows[4 * p + 2] = p;
            rows[4 * p + 1] = rows[4 * p + 3] = 1;
        }
        rc = pq_linear_rows(parts, rows, (int)(2 * n), E, xp + p0 * E, n, E, gu + p0 * 2 * I,
                            2 * I, nthreads);
        if (rc == PQ_OK) rc = pq_act_and_mul(L->act, gu + p0 * 2 * I, n, I, 2 * I, act + p0 * I);
        for (int64_t p = 0; p < n; p++)
            parts[p] = X->down[ids[p0 + p]], rows[2 * p] = p, rows[2 * p + 1] = 1;
        if (rc == PQ_OK)
            rc = pq_linear_rows(parts, rows, (int)n, I, act + p0 * I, n, I, y + p0 * E, E,
                                nthreads);
    }
    free(ids);
    if (rc != PQ_OK) return rc;
    for (int64_t m = 0; m < M; m++) { /* each token's k rows, scaled, summed in order */
        float *o = out + m * E;
        for (int64_t c = 0; c < E; c++) o[c] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float *r = y + (m * k + j) * E, wj = w[m * k + j];
            for (int64_t c = 0; c < E; c++) o[c] += r[c] * wj;
        }
    }
    return X->shared_inter > 0 ? shared_expert(L, h, M, out, nthreads) : PQ_OK;
}

/* attn [M, H, D] *= sigmoid(gate), head h's gate at gate + m * lg + h * lh */
PQ_CLONES
static void gate_heads(float *attn, const float *gate, int64_t lg, int64_t M, int64_t H,
                       int64_t D, int64_t lh) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < H; h++) {
            float *a = attn + (m * H + h) * D;
            const float *g = gate + m * lg + h * lh;
            for (int64_t d = 0; d < D; d++) a[d] *= sigmoid(g[d]);
        }
}

/* Attention of the normed rows h [M, E] into o [M, E]: q/k/v -> (q/k norms) -> rotary
 * (of each head's first rotary_dim) -> row m's k/v to cache slot slots[m] of k_cache /
 * v_cache ([slots, kv_heads, head_dim]) -> attend as pq_decode_attention does over
 * gather/Lk/lengths -> (Qwen3.5's output gate) -> o. */
static int attention(const pq_layer *L, const float *h, int64_t M, const float *cos,
                     const float *sin, int64_t lc, float *k_cache, float *v_cache,
                     const int64_t *slots, const int64_t *gather, int64_t Lk,
                     const int64_t *lengths, float *o, int nthreads) {
    const int64_t E = L->hidden, H = L->heads, Hkv = L->kv_heads, D = L->head_dim,
                  qw = H * D, kvw = Hkv * D, qd = L->q_gate ? 2 * D : D, qkvw = H * qd + 2 * kvw,
                  rot = L->rotary_dim > 0 ? L->rotary_dim : D;
    if (H <= 0 || Hkv <= 0 || D <= 0 || H % Hkv != 0 || rot > D || rot % 2 != 0) return PQ_ERR_ARG;
    /* qkv [M,qkvw] | q,k normed [M,qw+kvw] | attn [M,qw] */
    float *qkv = grow(&g_attn, M * (qkvw + 2 * qw + kvw));
    if (qkv == NULL) return PQ_ERR_NOMEM;
    float *qk = qkv + M * qkvw, *attn = qk + M * (qw + kvw);
    int rc;
    if ((rc = linear(&L->qkv, E, h, M, qkv, qkvw, nthreads)) != PQ_OK) return rc;
    /* q's head h at q + h * sqh (a row at q + m * sq), k's rows at stride sk */
    float *q = qkv, *k = qkv + H * qd, *v = k + kvw;
    int64_t sq = qkvw, sqh = qd, sk = qkvw;
    if (L->q_norm != NULL) { /* per head, into contiguous rows (as the module's norm returns) */
        pq_rms_norm(qkv, M, H, D, qkvw, qd, NULL, 0, 0, L->q_norm, L->eps, qk, NULL);
        pq_rms_norm(k, M, Hkv, D, qkvw, D, NULL, 0, 0, L->k_norm, L->eps, qk + M * qw, NULL);
        q = qk, k = qk + M * qw, sq = qw, sqh = D, sk = kvw;
    }
    pq_rotary(q, M, H, rot, sq, sqh, cos, sin, lc);
    pq_rotary(k, M, Hkv, rot, sk, D, cos, sin, lc);
    for (int64_t m = 0; m < M; m++) {
        memcpy(k_cache + slots[m] * kvw, k + m * sk, sizeof(float) * (size_t)kvw);
        memcpy(v_cache + slots[m] * kvw, v + m * qkvw, sizeof(float) * (size_t)kvw);
    }
    rc = pq_decode_attention(q, M, H, D, sq, sqh, k_cache, v_cache, Hkv, gather, Lk, lengths,
                             L->scale, L->softcap, attn, nthreads);
    if (rc != PQ_OK) return rc;
    if (L->q_gate) gate_heads(attn, qkv + D, qkvw, M, H, D, qd);
    return linear(&L->o, qw, attn, M, o, E, nthreads);
}

/* M rows through layer L: x [M, hidden] and res_in (NULL for the first layer: the
 * residual is x) -> x_out (the layer's output) and res_out (the residual after it), both
 * [M, hidden] contiguous. The token mixer is attention (its arguments as `attention`'s)
 * or, for a Gated DeltaNet layer, pq_gdn_mixer over the rows' state slots `slots` in
 * k_cache (conv states) and v_cache (states), with its `snapshots`. */
static int decoder_layer(const pq_layer *L, const float *x, const float *res_in, int64_t M,
                         const float *cos, const float *sin, int64_t lc, float *k_cache,
                         float *v_cache, const int64_t *slots, const int64_t *gather,
                         int64_t Lk, const int64_t *lengths, const int64_t *snapshots,
                         float *x_out, float *res_out, int nthreads) {
    const int64_t E = L->hidden, I = L->inter;
    if (M <= 0 || E <= 0 || I <= 0) return PQ_ERR_ARG;
    /* h [M,E] | o [M,E] | res1 [M,E] | gate_up [M,2I] | act [M,I] */
    float *h = grow(&g_work, M * (3 * E + 3 * I));
    if (h == NULL) return PQ_ERR_NOMEM;
    float *o = h + M * E, *res1 = o + M * E, *gu = res1 + M * E, *act = gu + M * 2 * I;
    int rc;

    /* the mixer: norm(x + residual) -> attention or Gated DeltaNet -> (its norm) */
    if (res_in != NULL) add_norm(x, res_in, M, E, L->attn_norm, L->eps, h, res1);
    else {
        add_norm(x, NULL, M, E, L->attn_norm, L->eps, h, NULL);
        memcpy(res1, x, sizeof(float) * (size_t)(M * E));
    }
    rc = L->gdn != NULL
             ? pq_gdn_mixer(L->gdn, h, M, E, slots, snapshots, k_cache, v_cache, o, nthreads)
             : attention(L, h, M, cos, sin, lc, k_cache, v_cache, slots, gather, Lk, lengths,
                         o, nthreads);
    if (rc != PQ_OK) return rc;
    if (L->post_attn_norm != NULL) { /* Gemma's sandwich: the sublayer's output normed */
        add_norm(o, NULL, M, E, L->post_attn_norm, L->eps, h, NULL);
        memcpy(o, h, sizeof(float) * (size_t)(M * E));
    }

    /* MLP: norm(o + residual) -> gate/up -> act(gate) * up -> down (-> its norm) */
    add_norm(o, res1, M, E, L->ff_norm, L->eps, h, res_out);
    if (L->experts.count > 0) return experts_mlp(L, h, M, x_out, nthreads);
    if ((rc = linear(&L->gate_up, E, h, M, gu, 2 * I, nthreads)) != PQ_OK) return rc;
    if ((rc = pq_act_and_mul(L->act, gu, M, I, 2 * I, act)) != PQ_OK) return rc;
    float *down = L->post_ff_norm != NULL ? o : x_out;
    if ((rc = linear(&L->down, I, act, M, down, E, nthreads)) != PQ_OK) return rc;
    if (L->post_ff_norm != NULL) add_norm(down, NULL, M, E, L->post_ff_norm, L->eps, x_out, NULL);
    return PQ_OK;
}

PQ_API int pq_decoder_stack(const pq_stack_layer *layers, int64_t n, const pq_step_view *views,
                            const pq_step_rope *ropes, const float *x, int64_t M, float *out,
                            int nthreads) {
    if (n <= 0 || M <= 0) return PQ_ERR_ARG;
    const int64_t E = layers[0].layer->hidden;
    float *stream = grow(&g_stream, 4 * M * E);
    if (stream == NULL) return PQ_ERR_NOMEM;
    const float *xi = x, *ri = NULL;
    for (int64_t i = 0; i < n; i++) {
        const pq_stack_layer *l = &layers[i];
        if (l->layer->hidden != E) return PQ_ERR_ARG;
        const pq_step_view *v = &views[l->view];
        const pq_step_rope *r = &ropes[l->rope];
        float *xo = stream + (i % 2) * 2 * M * E, *ro = xo + M * E;
        int rc = decoder_layer(l->layer, xi, ri, M, r->cos, r->sin, r->lc, l->k_cache,
                               l->v_cache, v->slots, v->gather, v->Lk, v->lengths,
                               v->snapshots, xo, ro, nthreads);
        if (rc != PQ_OK) return rc;
        xi = xo, ri = ro;
    }
    for (int64_t k = 0; k < M * E; k++) out[k] = xi[k] + ri[k];
    return PQ_OK;
}
