/* Every layer of a decoder's decode step (one new query row per token) in one call, for float32 CPU
 * models whose linear layers are int8 (engine/ops/int8_linear.py) or GGUF blocks
 * (engine/ops/gguf_linear.py), in any mix.
 *
 * Why: after the int8 kernel, a SmolLM2 batch-1 step spent more time dispatching ~25 torch ops per
 * layer (RoPE, residual adds, SiLU, views) than computing them. This runs the same steps as the
 * families' torch layers, with the same kernels (the int8 product, RMSNorm, paged decode attention,
 * included below), and plain loops for RoPE (HF's rotate-half convention), the cache writes, the gated
 * activation and the residuals. One layer shape covers the families that take this path:
 *
 *   LLaMA / Qwen / Phi-3: h += o(attn(attn_norm(h)));            h += down(act(gate) * up)(ffn_norm(h))
 *   Gemma 2 / 3:          h += attn_out_norm(o(attn(attn_norm(h)))); h += ffn_out_norm(down(...)(ffn_norm(h)))
 *
 * with optional per-head RMSNorms of queries and keys before RoPE (Qwen3, Gemma 3), RoPE over the first
 * rotary_dim values of each head (Phi-3 rotates part of it), each layer's own attention group (its
 * block table, mask and cache slots: layers that slide and layers that see every key), its own RoPE
 * (Gemma 3 rotates sliding and full layers differently) and its own attention-score softcap.
 * The torch layers stay the reference; tests/engine/test_fused_decode.py holds them equal.
 */
#include <string.h>

#include "decode_attention.c"
#include "gguf_blocks.c"
#include "int8_gemm.c"
#include "rms_norm.c"
#include "silu.c"

typedef struct Int8Weight {
    const void *weight; /* int8 [out_features, in_features], or GGUF blocks of block_type */
    const float *scale; /* int8: one per output channel; unused for blocks */
    const float *bias;  /* NULL: no bias */
    int64_t out_features;
    int block_type; /* 0: int8 per channel; else the GGML type id of the blocks */
    /* NULL, or the projection's next rows in a type of their own (a GGUF file's q, k and v in different
     * types): the projection's outputs are this part's columns, then the next part's, and so on. */
    const struct Int8Weight *next;
} Int8Weight;

/* RMSNorm weights are the multipliers the kernel applies (a Gemma norm's 1 + w). NULL: no such norm. */
typedef struct {
    const float *attn_norm;     /* [hidden] before attention */
    const float *attn_out_norm; /* [hidden] on attention's projected output, before the residual add */
    const float *ffn_norm;      /* [hidden] before the MLP */
    const float *ffn_out_norm;  /* [hidden] on the MLP's output, before the residual add */
    const float *q_norm, *k_norm; /* [D] each, over every query / key head */
    Int8Weight qkv, o, gate_up, down;
    void *key_cache;   /* [num_blocks, block_size, Hkv, row] in DecodeStep.kv_format (decode_attention.c) */
    void *value_cache; /* same */
    int64_t group;      /* index into DecodeStep.groups: the block tables, mask and slots this layer uses */
    int64_t rope;       /* index into DecodeStep.ropes */
    float softcap;      /* > 0: attention scores capped to softcap * tanh(s / softcap); 0: off */
} DecoderLayer;

/* One attention group's view of the step. */
typedef struct {
    const int64_t *blocks;       /* [B, N] the cache blocks each row reads */
    const uint8_t *mask;         /* [B, N * block_size], or NULL when every key is visible */
    const int64_t *slot_mapping; /* [B] the cache slot of each row's new key and value */
    int64_t num_blocks_per_seq;  /* N */
} GroupStep;

typedef struct {
    const float *cos, *sin; /* [B, rotary_dim] */
} RopeStep;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };

typedef struct {
    int64_t num_seqs, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rotary_dim;
    int64_t block_size;
    float eps, scale;
    int activation; /* ACT_*: the gate's activation */
    int kv_format;  /* KV_*: how every layer's cache stores its rows */
    const GroupStep *groups;
    const RopeStep *ropes;
    int num_threads;
} DecodeStep;

static int linear_part(const float *x, const Int8Weight *w, int64_t rows, int64_t in_features, float *out,
                       int threads) {
    if (w->block_type != 0)
        return kv_gguf_gemm(x, rows, in_features, w->block_type, w->weight, w->bias, out, w->out_features, threads);
    return kv_int8_gemm(x, rows, in_features, w->weight, w->scale, w->bias, out, w->out_features, threads);
}

/* out [rows, sum of the parts' out_features] = x times the projection, part by part. */
static int linear(const float *x, const Int8Weight *w, int64_t rows, int64_t in_features, float *out, int threads) {
    if (!w->next) return linear_part(x, w, rows, in_features, out, threads);
    int64_t total = 0, widest = 0;
    for (const Int8Weight *part = w; part; part = part->next) {
        total += part->out_features;
        widest = part->out_features > widest ? part->out_features : widest;
    }
    float *scratch = malloc((size_t)(rows * widest) * sizeof(float));
    if (!scratch) return 1;
    int64_t column = 0;
    int failed = 0;
    for (const Int8Weight *part = w; part && !failed; part = part->next) {
        failed = linear_part(x, part, rows, in_features, scratch, threads);
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + r * total + column, scratch + r * part->out_features, (size_t)part->out_features * sizeof(float));
        column += part->out_features;
    }
    free(scratch);
    return failed;
}

/* A GELU gate (ACT_GELU or ACT_GELU_TANH), as torch computes it in float32 (F.gelu, exact or approximate="tanh");
 * SiLU gates go through silu.c. */
static inline float gelu(float g, int activation) {
    if (activation == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
}

/* hidden += delta, after an RMSNorm of delta where the layer has one. */
static void add_residual(float *hidden, float *delta, const float *norm, int64_t rows, int64_t H, float eps) {
    if (norm) kv_rms_norm(delta, norm, delta, rows, H, eps); /* in place: a row's sum is taken before it is written */
    for (int64_t i = 0; i < rows * H; i++) hidden[i] += delta[i];
}

/* hidden: float32 [B, hidden_size], updated in place through every layer.
 * Returns 0 on success, 1 if a scratch buffer could not be allocated. */
int kv_fused_decode_layers(const DecoderLayer *layers, int64_t num_layers, const DecodeStep *step, float *hidden) {
    const int64_t B = step->num_seqs, H = step->hidden_size, I = step->intermediate_size, D = step->head_dim;
    const int64_t q_size = step->num_heads * D, kv_size = step->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    const int64_t R = step->rotary_dim, half = R / 2, row_bytes = kv_row_bytes(step->kv_format, D);
    const int threads = step->num_threads;
    /* normed [B, H] | qkv [B, qkv] | attn [B, q] | gate_up [B, 2I] | act [B, I] | delta [B, H] */
    float *normed = malloc((size_t)B * (H + qkv_size + q_size + 3 * I + H) * sizeof(float));
    if (!normed) return 1;
    float *qkv = normed + B * H, *attn = qkv + B * qkv_size, *gate_up = attn + B * q_size;
    float *act = gate_up + B * 2 * I, *delta = act + B * I;
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const DecoderLayer *layer = &layers[l];
        const GroupStep *group = &step->groups[layer->group];
        const RopeStep *rope = &step->ropes[layer->rope];
        kv_rms_norm(hidden, layer->attn_norm, normed, B, H, step->eps);
        failed |= linear(normed, &layer->qkv, B, H, qkv, threads);
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * qkv_size;
            const float *cos = rope->cos + b * R, *sin = rope->sin + b * R;
            if (layer->q_norm) { /* in place, as above */
                kv_rms_norm(row, layer->q_norm, row, step->num_heads, D, step->eps);
                kv_rms_norm(row + q_size, layer->k_norm, row + q_size, step->num_kv_heads, D, step->eps);
            }
            for (int64_t head = 0; head < step->num_heads + step->num_kv_heads; head++) {
                float *x = row + head * D; /* query heads, then key heads; values past R pass through */
                for (int64_t i = 0; i < half; i++) {
                    float x1 = x[i], x2 = x[i + half];
                    x[i] = x1 * cos[i] - x2 * sin[i];
                    x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
                }
            }
            int64_t slot = group->slot_mapping[b];
            for (int64_t head = 0; head < step->num_kv_heads; head++) {
                int64_t offset = (slot * step->num_kv_heads + head) * row_bytes;
                kv_store_row((char *)layer->key_cache + offset, row + q_size + head * D, step->kv_format, D);
                kv_store_row((char *)layer->value_cache + offset, row + q_size + kv_size + head * D, step->kv_format, D);
            }
        }
        failed |= decode_attention_capped(qkv, qkv_size, layer->key_cache, layer->value_cache, group->blocks,
                                          group->mask, attn, B, step->num_heads, step->num_kv_heads, D,
                                          step->block_size, group->num_blocks_per_seq, step->scale, layer->softcap,
                                          step->kv_format, threads);
        failed |= linear(attn, &layer->o, B, q_size, delta, threads);
        add_residual(hidden, delta, layer->attn_out_norm, B, H, step->eps);
        kv_rms_norm(hidden, layer->ffn_norm, normed, B, H, step->eps);
        failed |= linear(normed, &layer->gate_up, B, H, gate_up, threads);
        if (step->activation == ACT_SILU) {
            /* silu.c: e^-g in double precision, rounded once (expf's correctly rounded value), 8 gates at a time;
             * chunks of 512 gates over the threads once there are values enough */
            const int64_t chunk = 512, per_row = (I + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * I >= 4096)
            for (int64_t task = 0; task < B * per_row; task++) {
                const int64_t b = task / per_row, i0 = task % per_row * chunk, n = I - i0 < chunk ? I - i0 : chunk;
                silu_times(gate_up + b * 2 * I + i0, gate_up + b * 2 * I + I + i0, act + b * I + i0, n);
            }
        } else {
            /* GELU: libm's tanhf / erff, on every thread once there are values enough */
#pragma omp parallel for num_threads(threads) schedule(static) if (B * I >= 4096)
            for (int64_t bi = 0; bi < B * I; bi++) {
                const int64_t b = bi / I, i = bi % I;
                act[bi] = gelu(gate_up[b * 2 * I + i], step->activation) * gate_up[b * 2 * I + I + i];
            }
        }
        failed |= linear(act, &layer->down, B, I, delta, threads);
        add_residual(hidden, delta, layer->ffn_out_norm, B, H, step->eps);
    }
    free(normed);
    return failed;
}

/* The rows a greedy step reads its next tokens' hidden states from: an embedding table of float32 rows
 * (embed_type 0) or of GGUF blocks (their kernel type), each looked-up row times embed_scale where has_scale. */
typedef struct {
    const void *embedding; /* [vocab, hidden] */
    int embed_type;
    int has_scale;
    float embed_scale;
    const float *final_norm; /* [hidden] the final RMSNorm's multipliers */
    float final_eps;
    Int8Weight head;    /* [vocab, hidden] the output head */
    int64_t vocab_size; /* the head's rows */
} GreedyTail;

/* A run of greedy decode steps in one call: step k reads its groups at groups[k * num_groups] and its RoPE rows at
 * ropes[k * num_ropes]; each step's input token is the one the step before it chose (the first step's: first_ids). */
typedef struct {
    int64_t num_steps, num_groups, num_ropes;
    const GroupStep *groups;
    const RopeStep *ropes;
    const int64_t *stop_ids; /* the run ends after a step that chose one of these for any row */
    int64_t num_stop_ids;
    const volatile int32_t *interrupt; /* nonzero: end the run after the step under way (NULL: never) */
} GreedyRun;

/* The first maximum of row[0 .. n-1], a NaN counting as the maximum (numpy's argmax). */
static int64_t first_argmax(const float *row, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (row[i] != row[i]) return i;
        if (row[i] > row[best]) best = i;
    }
    return best;
}

static int embed_rows(const GreedyTail *tail, const int64_t *ids, int64_t B, int64_t H, float *hidden, int threads) {
    if (tail->embed_type != 0) {
        int status = kv_gguf_dequantize(tail->embed_type, tail->embedding, H, ids, B, hidden, threads);
        if (status != 0) return status;
    } else {
        for (int64_t b = 0; b < B; b++)
            memcpy(hidden + b * H, (const float *)tail->embedding + ids[b] * H, (size_t)H * sizeof(float));
    }
    if (tail->has_scale)
        for (int64_t i = 0; i < B * H; i++) hidden[i] *= tail->embed_scale;
    return 0;
}

/* Up to run->num_steps greedy decode steps of B sequences: out_ids [num_steps, B] gets each step's chosen tokens
 * and *steps_done how many steps ran (fewer after a stop token or an interrupt). Each step computes what the step
 * by step path does (embedding rows, kv_fused_decode_layers, the final RMSNorm, the head, the first maximum), with
 * the same kernels. Returns 0, 1 if a buffer could not be allocated, or a product's status. */
int kv_fused_decode_greedy(const DecoderLayer *layers, int64_t num_layers, const DecodeStep *step,
                           const GreedyTail *tail, const GreedyRun *run, const int64_t *first_ids, int64_t *out_ids,
                           int64_t *steps_done) {
    const int64_t B = step->num_seqs, H = step->hidden_size, V = tail->vocab_size;
    float *hidden = malloc((size_t)B * (2 * H + V) * sizeof(float));
    if (!hidden) return 1;
    float *normed = hidden + B * H, *logits = normed + B * H;
    DecodeStep this_step = *step;
    int failed = 0;
    *steps_done = 0;
    for (int64_t k = 0; k < run->num_steps && !failed; k++) {
        const int64_t *ids = k == 0 ? first_ids : out_ids + (k - 1) * B;
        failed = embed_rows(tail, ids, B, H, hidden, step->num_threads);
        if (failed) break;
        this_step.groups = run->groups + k * run->num_groups;
        this_step.ropes = run->ropes + k * run->num_ropes;
        failed = kv_fused_decode_layers(layers, num_layers, &this_step, hidden);
        if (failed) break;
        kv_rms_norm(hidden, tail->final_norm, normed, B, H, tail->final_eps);
        failed = linear(normed, &tail->head, B, H, logits, step->num_threads);
        if (failed) break;
        int stop = run->interrupt && *run->interrupt;
        for (int64_t b = 0; b < B; b++) {
            const int64_t id = first_argmax(logits + b * V, V);
            out_ids[k * B + b] = id;
            for (int64_t s = 0; s < run->num_stop_ids; s++) stop |= id == run->stop_ids[s];
        }
        *steps_done = k + 1;
        if (stop) break;
    }
    free(hidden);
    return failed;
}
