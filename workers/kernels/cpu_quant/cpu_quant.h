/* PocketLLM CPU quantized kernels: the exported C API (called through ctypes by
 * the torch-free worker, workers/lite, bound in workers/kernels/cpu_lib.py; the
 * worker checks every shape and pointer where it binds them).
 *
 * Weights stay in their GGUF block format; activations are quantized to int16
 * per block of 32 (a float32 scale per block); products are integer dot
 * products per block, with the SIMD variant chosen at run time. Sixteen bits,
 * not llama.cpp's eight: 8-bit activations move the top token of a 262k-entry
 * vocabulary at ~3% of positions, 16-bit at ~0.1% (docs/cpu_kernels.md), for
 * the same instruction count per block and a decode step that is bound by
 * reading the weights anyway.
 * Every call returns PQ_OK or a negative PQ_ERR_* code; none prints or aborts.
 * nthreads <= 0 means omp_get_max_threads() (torch.set_num_threads governs it
 * when torch's libgomp is the one loaded).
 */
#ifndef PQ_CPU_QUANT_H
#define PQ_CPU_QUANT_H

#include <stdint.h>

#if defined(__GNUC__)
#define PQ_API __attribute__((visibility("default")))
#else
#define PQ_API
#endif

enum {
    PQ_OK = 0,
    PQ_ERR_TYPE = -1,  /* the type has no decoder/kernel in this build */
    PQ_ERR_ARG = -2,   /* a size or stride is out of range (K not a multiple of the block...) */
    PQ_ERR_ISA = -3,   /* the ISA asked for (API or POCKETLLM_CPU_ISA) is unknown or absent */
    PQ_ERR_NOMEM = -4, /* a scratch buffer could not be allocated */
};

/* Quantize activations. x: float32 [M, K], row stride ldx (elements). Per row m:
 *   q[m*K + i]       int16, per block of 32: d = amax/32767, q = round(x/d) (0 if amax == 0)
 *   d[m*K/32 + b]    float32 block scale
 *   gsum[m*K/16 + g] int32 sum of q over each group of 16 (for the weights' offsets)
 * K must be a positive multiple of 32. */
PQ_API int pq_quantize_act(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *q, float *d,
                           int32_t *gsum, int nthreads);

/* y[m*ldy + n] = sum_k x[m, k] * W[n, k] for m < M, n < N, with x given as
 * pq_quantize_act's (q, d, gsum) of M rows of K, and W as N rows of GGUF blocks
 * of ggml type `type`, row n starting at w + n * row_bytes (row_bytes >= the
 * K / block_elems blocks of a row). K must be a multiple of the type's block. */
PQ_API int pq_mul_mat(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes,
                      const int16_t *q, const float *d, const int32_t *gsum, int64_t M, float *y,
                      int64_t ldy, int nthreads);

/* The most parts one linear layer may stack (q/k/v is three). */
#define PQ_MAX_PARTS 128

/* One stacked part of a linear layer's weight: `rows` rows of GGUF blocks of `type`,
 * row n at w + n * row_bytes, filling output columns [col, col + rows). */
typedef struct {
    int64_t type, rows, row_bytes, col;
    const uint8_t *w;
} pq_part;

/* A whole linear layer in one call: x float32 [M, K] (row stride ldx) is quantized as
 * pq_quantize_act does, then y[m*ldy + parts[j].col + n] = x[m] . W_j[n] for every part,
 * all parts' rows shared out among the threads in one parallel region. */
PQ_API int pq_linear(const pq_part *parts, int nparts, int64_t K, const float *x, int64_t M,
                     int64_t ldx, float *y, int64_t ldy, int nthreads);

/* From how many rows pq_linear takes the many-row product (gemm_i16.c: activations packed
 * by panels, each weight row decoded once) instead of the row dots; rows > 0 sets it.
 * Returns the value before. Both compute the same sums (to float rounding). */
PQ_API int64_t pq_gemm_rows(int64_t rows);

/* pq_linear where each part multiplies its own run of x's rows: part j computes
 * y[m*ldy + parts[j].col + n] = x[m] . W_j[n] for ranges[2j] <= m < ranges[2j] + ranges[2j+1]
 * (a run of at least one row inside [0, M)). Routed experts in one call: a part per
 * expert and projection over that expert's rows (rows sorted by expert), or per (token,
 * expert) pair over the pair's row. */
PQ_API int pq_linear_rows(const pq_part *parts, const int64_t *ranges, int nparts, int64_t K,
                          const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                          int nthreads);

/* out[i*ldo + k] = W[ids[i], k] in float32 for i < n, k < K (bit-exact with
 * ggml's dequantization). The caller checks 0 <= ids[i] < rows. */
PQ_API int pq_dequantize_rows(int type, const uint8_t *w, int64_t K, int64_t row_bytes,
                              const int64_t *ids, int64_t n, float *out, int64_t ldo,
                              int nthreads);

/* ---- ops.c: the float32 operations between the products of a decode step ---- */

/* x is [A, B, D] with strides (sa, sb, 1), res likewise (ra, rb) or NULL; out and
 * res_out are contiguous [A, B, D]. Per row of D: s = x (+ res, written to res_out),
 * out = s / sqrt(mean(s^2) + eps) * w. */
PQ_API int pq_rms_norm(const float *x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
                       const float *res, int64_t ra, int64_t rb, const float *w, float eps,
                       float *out, float *res_out);

/* In place, x [A, B, D] with strides (sa, sb, 1): the two halves of each row rotated by
 * cos/sin [A, D/2] (row stride lc), the "rotate half" layout. */
PQ_API int pq_rotary(float *x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
                     const float *cos, const float *sin, int64_t lc);

enum { PQ_ACT_SILU = 0, PQ_ACT_GELU_TANH = 1, PQ_ACT_GELU_ERF = 2 };

/* out [T, I] = act(gate) * up, gate_up [T, 2I] with row stride ld. */
PQ_API int pq_act_and_mul(int act, const float *gate_up, int64_t T, int64_t I, int64_t ld,
                          float *out);

/* One query row per sequence: q [B, H, D] (strides sqb, sqh, 1) against the cache slots
 * gather[b * Lk + j], j < lengths[b], of k_cache / v_cache ([slots, Hkv, D] contiguous);
 * query head h reads KV head h / (H / Hkv). Scores are scaled, tanh-capped when
 * softcap > 0, and softmaxed; out [B, H, D] contiguous. The slots are the caller's to
 * keep in range. */
PQ_API int pq_decode_attention(const float *q, int64_t B, int64_t H, int64_t D, int64_t sqb,
                               int64_t sqh, const float *k_cache, const float *v_cache,
                               int64_t Hkv, const int64_t *gather, int64_t Lk,
                               const int64_t *lengths, float scale, float softcap, float *out,
                               int nthreads);

/* ---- layer.c: a decoder layer's decode step in one call ---- */

/* A linear layer of block parts (pq_linear's), with an optional bias [N]. */
typedef struct {
    const pq_part *parts;
    int64_t nparts;
    const float *bias;
} pq_layer_linear;

/* ---- gdn.c: Gated DeltaNet ---- */

/* One token of each of M sequences through the gated delta rule: row m's q, k [Hk, Dk]
 * (row stride sqk; L2-normalised here, q also scaled by Dk^-1/2), v [Hv, Dv] (stride sv),
 * decay g and strength beta [Hv] (stride sgb) update its state states[slots[m]]
 * ([Hv, Dk, Dv] float32, in place); value head h reads q/k head h / (Hv / Hk), or
 * h % Hk when `tiled` (llama.cpp's qwen35 order).
 * out [M, Hv, Dv] contiguous. Dk, Dv <= 512; the slots are the caller's to keep in range. */
PQ_API int pq_gated_delta_step(const float *q, const float *k, int64_t sqk, const float *v,
                               int64_t sv, const float *g, const float *beta, int64_t sgb,
                               int64_t M, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                               int64_t tiled, float *states, const int64_t *slots, float *out, int nthreads);

/* T tokens of one sequence (a prompt, or its next chunk) through the same rule, with the
 * same argument layout (row t of q/k/v/g/beta at its stride), from and into its state
 * [Hv, Dk, Dv]; out [T, Hv, Dv] contiguous. Equal to T steps to float rounding. */
PQ_API int pq_gated_delta_prefill(const float *q, const float *k, int64_t sqk, const float *v,
                                  int64_t sv, const float *g, const float *beta, int64_t sgb,
                                  int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                                  int64_t tiled, float *state, float *out, int nthreads);

/* A Gated DeltaNet token mixer (Qwen3.5's linear attention): in_proj's parts give the
 * q, k, v rows (the convolution's channels, C = 2 k_heads k_dim + v_heads v_dim) then z
 * [v_heads v_dim]; ba float32 [2 v_heads, hidden], b's rows then a's; conv_w [kernel, C];
 * a_log, dt_bias [v_heads]; norm [v_dim] (scales by w). `tiled`: as the step's. */
typedef struct {
    int64_t k_heads, v_heads, k_dim, v_dim, kernel, tiled;
    float eps;
    const float *conv_w, *ba, *a_log, *dt_bias, *norm;
    pq_layer_linear in_proj, out;
} pq_layer_gdn;

/* h [M, E] (normed rows) through the mixer into out [M, E]: row m reads and writes the
 * conv state conv_states[slots[m]] ([kernel - 1, C], oldest first) and the recurrent
 * state states[slots[m]] ([v_heads, k_dim, v_dim]). A run of rows with one slot is a
 * prompt's chunk, in order. snapshots (NULL: none) [M]: where snapshots[m] >= 0, both
 * states of row m's slot as they stand after row m are copied into that slot (a prefix
 * cache's snapshot mid-chunk). The slots are the caller's to keep in range. */
PQ_API int pq_gdn_mixer(const pq_layer_gdn *G, const float *h, int64_t M, int64_t E,
                        const int64_t *slots, const int64_t *snapshots, float *conv_states,
                        float *states, float *out, int nthreads);

/* Routed experts (Qwen3-MoE's): router float32 [count, hidden]; each token's routing is a
 * softmax over the count logits in float32, the top_k largest kept (ties: the lower
 * expert), divided by their sum when renormalize; expert e's [gate | up] is the two parts
 * gate_up[2e], gate_up[2e + 1] (columns 0 and inter) and its down the part down[e]; each
 * token's output is the sum over its k experts, in the order chosen, of weight * down(
 * act(gate) * up). inter is the layer's (pq_layer.inter). */
typedef struct {
    int64_t count, top_k, renormalize;
    const float *router;
    const pq_part *gate_up, *down;
    /* shared_inter > 0: a shared expert beside them (Qwen3.5-MoE's), whose output
     * down(act(gate) * up) of width shared_inter, scaled by sigmoid(h . shared_gate)
     * (shared_gate float32 [hidden]), is added to each token's routed sum */
    int64_t shared_inter;
    const float *shared_gate;
    pq_layer_linear shared_gate_up, shared_down;
} pq_layer_experts;

/* A pre-norm decoder layer. Norm weights are float32 [hidden] (q/k norms [head_dim]);
 * NULL where the family has none. The MLP's input norm is ff_norm (Llama's
 * post_attention_layernorm, Gemma's pre_feedforward_layernorm); Gemma's sandwich norms
 * on the sublayers' outputs are post_attn_norm and post_ff_norm. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    int64_t act;               /* PQ_ACT_* */
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ff_norm, *post_ff_norm;
    pq_layer_linear qkv, o, gate_up, down;
    pq_layer_experts experts; /* experts.count > 0: routed experts in place of the MLP */
    /* Qwen3.5's gated attention: q_gate 1: qkv's q rows are, per head, the query then a
     * gate whose sigmoid scales that head's output; rotary_dim (0: head_dim) the leading
     * dims of each head rotated */
    int64_t q_gate, rotary_dim;
    const pq_layer_gdn *gdn; /* not NULL: this Gated DeltaNet in place of attention */
} pq_layer;

/* The decoder stack's decode step in one call. Each layer names its KV cache and which
 * of the step's views (a KV cache group's slots, and one window's gather/Lk/lengths) and
 * rope tables it reads, so a step passes a handful of views instead of a call per layer. */
typedef struct {
    const int64_t *slots, *gather, *lengths;
    int64_t Lk;
    const int64_t *snapshots; /* a state group's: pq_gdn_mixer's (NULL: none) */
} pq_step_view;

typedef struct {
    const float *cos, *sin;
    int64_t lc;
} pq_step_rope;

typedef struct {
    const pq_layer *layer;
    float *k_cache, *v_cache; /* a Gated DeltaNet layer's: its conv states and states */
    int64_t view, rope; /* indices into the step's views (a state group's: slots only) and ropes */
} pq_stack_layer;

/* x [M, hidden] (the embedded tokens) through layers[0..n-1], each a pre-norm layer with
 * the operations above (decoder_layer in layer.c); out [M, hidden] = the last layer's
 * output plus its residual. */
PQ_API int pq_decoder_stack(const pq_stack_layer *layers, int64_t n, const pq_step_view *views,
                            const pq_step_rope *ropes, const float *x, int64_t M, float *out,
                            int nthreads);

/* 1 if `type` has a decoder in this build, 0 if not (unknown type included). */
PQ_API int pq_has_kernel(int type);

/* The active ISA variant's name ("avx512vnni", "avxvnni", "avx2", "scalar"), or
 * "" when POCKETLLM_CPU_ISA asked for one that is unknown or absent. */
PQ_API const char *pq_isa(void);

/* Force a variant by name; NULL or "" or "auto" = the best this CPU supports.
 * PQ_ERR_ISA (and nothing changes) for an unknown name or one the CPU lacks. */
PQ_API int pq_set_isa(const char *name);

/* Comma-separated names of the variants this CPU can run, best first. */
PQ_API const char *pq_supported_isas(void);

/* Comma-separated names of all variants compiled in, best first. */
PQ_API const char *pq_all_isas(void);

#endif
