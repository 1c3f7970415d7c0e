/* Every layer of a LLaMA-family decode step (one new token per sequence) in one call,
 * for float32 CPU models whose linear layers are int8 (engine/ops/int8_linear.py) or
 * GGUF blocks (engine/ops/gguf_linear.py), in any mix.
 *
 * Why: after the int8 kernel, a SmolLM2 batch-1 step spent more time dispatching ~25
 * torch ops per layer (RoPE, residual adds, SiLU, views) than computing them. This runs
 * the same steps as engine/models/llama.py's LlamaLayer.forward, with the same kernels
 * (the int8 product, RMSNorm, paged decode attention, included below), and plain loops
 * for RoPE (HF's rotate-half convention), the cache writes, SiLU * up and the residuals.
 * Qwen3's per-head RMSNorm of queries and keys (before RoPE) runs when a layer has one.
 * The torch path stays the reference; tests/engine/test_fused_decode.py holds them equal.
 */
#include "decode_attention.c"
#include "gguf_blocks.c"
#include "int8_gemm.c"
#include "rms_norm.c"

typedef struct {
    const void *weight; /* int8 [out_features, in_features], or GGUF blocks of block_type */
    const float *scale; /* int8: one per output channel; unused for blocks */
    const float *bias;  /* NULL: no bias */
    int64_t out_features;
    int block_type; /* 0: int8 per channel; else the GGML type id of the blocks */
} Int8Weight;

typedef struct {
    const float *input_norm;
    const float *post_attention_norm;
    const float *q_norm, *k_norm; /* [D] each, over every query / key head; NULL: no per-head norm */
    Int8Weight qkv, o, gate_up, down;
    float *key_cache;   /* [num_blocks, block_size, Hkv, D] */
    float *value_cache; /* same */
} LlamaLayer;

typedef struct {
    int64_t num_seqs, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim;
    int64_t block_size, num_blocks_per_seq;
    float eps, scale;
    const float *cos, *sin;      /* [B, D] */
    const int64_t *slot_mapping; /* [B] cache slot of each new token */
    const int64_t *blocks;       /* [B, N] */
    const uint8_t *mask;         /* [B, N * block_size], or NULL when every key is visible */
    int num_threads;
} DecodeStep;

static int linear(const float *x, const Int8Weight *w, int64_t rows, int64_t in_features, float *out, int threads) {
    if (w->block_type != 0)
        return kv_gguf_gemm(x, rows, in_features, w->block_type, w->weight, w->bias, out, w->out_features, threads);
    return kv_int8_gemm(x, rows, in_features, w->weight, w->scale, w->bias, out, w->out_features, threads);
}

/* hidden: float32 [B, hidden_size], updated in place through every layer.
 * Returns 0 on success, 1 if a scratch buffer could not be allocated. */
int kv_llama_decode_layers(const LlamaLayer *layers, int64_t num_layers, const DecodeStep *step, float *hidden) {
    const int64_t B = step->num_seqs, H = step->hidden_size, I = step->intermediate_size, D = step->head_dim;
    const int64_t q_size = step->num_heads * D, kv_size = step->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    const int threads = step->num_threads;
    /* normed [B, H] | qkv [B, qkv] | attn [B, q] | gate_up [B, 2I] | act [B, I] | delta [B, H] */
    float *normed = malloc((size_t)B * (H + qkv_size + q_size + 3 * I + H) * sizeof(float));
    if (!normed) return 1;
    float *qkv = normed + B * H, *attn = qkv + B * qkv_size, *gate_up = attn + B * q_size;
    float *act = gate_up + B * 2 * I, *delta = act + B * I;
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const LlamaLayer *layer = &layers[l];
        kv_rms_norm(hidden, layer->input_norm, normed, B, H, step->eps);
        failed |= linear(normed, &layer->qkv, B, H, qkv, threads);
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * qkv_size;
            const float *cos = step->cos + b * D, *sin = step->sin + b * D;
            int64_t half = D / 2;
            if (layer->q_norm) { /* in place: each row's sum of squares is taken before it is written */
                kv_rms_norm(row, layer->q_norm, row, step->num_heads, D, step->eps);
                kv_rms_norm(row + q_size, layer->k_norm, row + q_size, step->num_kv_heads, D, step->eps);
            }
            for (int64_t head = 0; head < step->num_heads + step->num_kv_heads; head++) {
                float *x = row + head * D; /* query heads, then key heads */
                for (int64_t i = 0; i < half; i++) {
                    float x1 = x[i], x2 = x[i + half];
                    x[i] = x1 * cos[i] - x2 * sin[i];
                    x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
                }
            }
            int64_t slot = step->slot_mapping[b];
            for (int64_t i = 0; i < kv_size; i++) {
                layer->key_cache[slot * kv_size + i] = row[q_size + i];
                layer->value_cache[slot * kv_size + i] = row[q_size + kv_size + i];
            }
        }
        failed |= decode_attention_strided(qkv, qkv_size, layer->key_cache, layer->value_cache, step->blocks,
                                           step->mask, attn, B, step->num_heads, step->num_kv_heads, D,
                                           step->block_size, step->num_blocks_per_seq, step->scale, threads);
        failed |= linear(attn, &layer->o, B, q_size, delta, threads);
        for (int64_t i = 0; i < B * H; i++) hidden[i] += delta[i];
        kv_rms_norm(hidden, layer->post_attention_norm, normed, B, H, step->eps);
        failed |= linear(normed, &layer->gate_up, B, H, gate_up, threads);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < I; i++) {
                float g = gate_up[b * 2 * I + i], u = gate_up[b * 2 * I + I + i];
                act[b * I + i] = g / (1.0f + expf(-g)) * u;
            }
        failed |= linear(act, &layer->down, B, I, delta, threads);
        for (int64_t i = 0; i < B * H; i++) hidden[i] += delta[i];
    }
    free(normed);
    return failed;
}
