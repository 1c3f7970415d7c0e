/* Attention of one new query token per sequence over the paged KV cache (decode steps).
 *
 * query:  float32 [B, Hq, D]
 * caches: float32 [num_blocks, block_size, Hkv, D] (keys and values, one layer)
 * blocks: int64   [B, N]   cache blocks each sequence reads, in logical order
 * mask:   uint8   [B, N * block_size] 1 where the key is visible, or NULL for all visible
 * out:    float32 [B, Hq, D]
 * softcap: > 0 caps every scaled score s to softcap * tanh(s / softcap) before the softmax; 0 is off
 *
 * Query head h reads key/value head h / (Hq / Hkv) (grouped-query attention).
 * Reads keys and values in place, where torch's path gathers whole blocks into
 * a dense copy first and pays a dozen op dispatches per layer. Scores and the
 * softmax are float32 with the max subtracted, like the reference
 * (engine/attention/paged.py: paged_attention; engine/attention/reference.py: dense_reference_attention).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* out[i] += w * v[i] */
static inline void axpy(float *out, float w, const float *v, int64_t n) {
    __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++) out[i] += w * v[i];
}

/* Attention of rows [b] for all heads; query row b starts at query + b * query_row_stride. */
static int decode_attention_capped(const float *query, int64_t query_row_stride, const float *key_cache,
                                   const float *value_cache, const int64_t *blocks, const uint8_t *mask, float *out,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks_per_seq, float scale, float softcap,
                                   int num_threads) {
    int capped = softcap > 0.0f; /* loop-invariant: the branch below costs nothing when off */
    int64_t num_keys = num_blocks_per_seq * block_size;
    int64_t group = num_heads / num_kv_heads;
    int64_t slot_stride = num_kv_heads * head_dim; /* floats between consecutive cache slots */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((size_t)num_keys * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_heads; task++) {
            if (!scores) continue;
            int64_t b = task / num_heads, h = task % num_heads, kvh = h / group;
            const float *q = query + b * query_row_stride + h * head_dim;
            const int64_t *table = blocks + b * num_blocks_per_seq;
            const uint8_t *visible = mask ? mask + b * num_keys : NULL;
            float best = -INFINITY;
            for (int64_t k = 0; k < num_keys; k++) {
                if (visible && !visible[k]) continue;
                int64_t slot = table[k / block_size] * block_size + k % block_size;
                float s = dot(q, key_cache + slot * slot_stride + kvh * head_dim, head_dim) * scale;
                if (capped) s = tanhf(s / softcap) * softcap;
                scores[k] = s;
                if (s > best) best = s;
            }
            float *o = out + (b * num_heads + h) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) o[i] = 0.0f;
            if (best == -INFINITY) continue; /* no visible key: zeros (never happens for real rows) */
            float total = 0.0f;
            for (int64_t k = 0; k < num_keys; k++) {
                if (visible && !visible[k]) continue;
                float p = expf(scores[k] - best);
                total += p;
                int64_t slot = table[k / block_size] * block_size + k % block_size;
                axpy(o, p, value_cache + slot * slot_stride + kvh * head_dim, head_dim);
            }
            float inv = 1.0f / total;
            for (int64_t i = 0; i < head_dim; i++) o[i] *= inv;
        }
        free(scores);
    }
    return failed;
}

/* Returns 0 on success, 1 if a scratch buffer could not be allocated. */
int kv_decode_attention(const float *query, const float *key_cache, const float *value_cache,
                        const int64_t *blocks, const uint8_t *mask, float *out, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t num_blocks_per_seq, float scale, float softcap, int num_threads) {
    return decode_attention_capped(query, num_heads * head_dim, key_cache, value_cache, blocks, mask, out, num_seqs,
                                   num_heads, num_kv_heads, head_dim, block_size, num_blocks_per_seq, scale, softcap,
                                   num_threads);
}
