/* Attention of one new query token per sequence over the paged KV cache (decode steps).
 *
 * query:  float32 [B, Hq, D]
 * caches: [num_blocks, block_size, Hkv, row] (keys and values, one layer) in one of the KV_* formats:
 *         float32, float16 or bfloat16 rows of D values, or int8 rows of D values then their float32
 *         scale (value = q * scale), as engine/ops/kv_format.py writes them
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
#include <string.h>

#include "absolute_max.c"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_INT8 = 3 };

/* Bytes of one token's key (or value) for one head. */
static inline int64_t kv_row_bytes(int format, int64_t head_dim) {
    switch (format) {
    case KV_F16:
    case KV_BF16: return 2 * head_dim;
    case KV_INT8: return head_dim + 4;
    default: return 4 * head_dim;
    }
}

/* Values i..i+7 of a cache row as float32 (an int8 row's before its scale). */
static inline __m256 kv_load8(const void *row, int format, int64_t i) {
    switch (format) {
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    case KV_BF16: {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    case KV_INT8: {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)row + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    default: return _mm256_loadu_ps((const float *)row + i);
    }
}

static inline float kv_load1(const void *row, int format, int64_t i) {
    switch (format) {
    case KV_F16: return _cvtsh_ss(((const uint16_t *)row)[i]);
    case KV_BF16: {
        uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    case KV_INT8: return (float)((const int8_t *)row)[i];
    default: return ((const float *)row)[i];
    }
}

/* What a row's loaded values are multiplied by: an int8 row's scale, else 1. */
static inline float kv_row_scale(const void *row, int format, int64_t head_dim) {
    if (format != KV_INT8) return 1.0f;
    float scale;
    memcpy(&scale, (const int8_t *)row + head_dim, sizeof scale);
    return scale;
}

/* float32 -> bfloat16 bits, rounded to nearest even (quiet NaN kept), as torch converts. */
static inline uint16_t kv_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Store x[0..n) as one cache row in `format` (int8: the row's largest magnitude / 127 as its scale, each
 * value x / scale rounded to nearest even and held to -127..127, a zero row all zeros). */
static void kv_store_row(void *row, const float *x, int format, int64_t n) {
    switch (format) {
    case KV_F16: {
        uint16_t *out = row;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return;
    }
    case KV_BF16: {
        uint16_t *out = row;
        for (int64_t i = 0; i < n; i++) out[i] = kv_bf16_bits(x[i]);
        return;
    }
    case KV_INT8: {
        int8_t *out = row;
        float scale = absolute_max(x, n) / 127.0f;
        for (int64_t i = 0; i < n; i++) {
            float q = scale > 0.0f ? nearbyintf(x[i] / scale) : 0.0f;
            out[i] = (int8_t)fminf(fmaxf(q, -127.0f), 127.0f);
        }
        memcpy(out + n, &scale, sizeof scale);
        return;
    }
    default: memcpy(row, x, (size_t)n * sizeof(float));
    }
}

/* Query heads of one KV head attended together: each key and value row is loaded (and, for a 16-bit or int8
 * cache, converted) once for all of them. On 2 AVX2 cores this took a 32-sequence, 1,024-token step of a
 * SmolLM2-shaped layer (9 / 3 heads of 64) from 7.1 to 2.9 ms over a float32 cache and from 6.3 to 1.9 ms over a
 * float16 one (python -m engine.bench.decode_attention). */
#define HEAD_TILE 4

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[g] = q_g . row for the n query rows q_g = q + g * D (n and format constants at each call; the row's int8
 * scale applied). Each head's sum runs in the same order whatever n is, so a head's score does not depend on the
 * heads beside it. Two accumulators a head (alternate 8-value chunks) keep two multiply-add chains in flight. */
static inline __attribute__((always_inline)) void kv_dot_rows(const float *q, const int n, const void *row,
                                                              const int format, int64_t D, float *s) {
    __m256 acc[HEAD_TILE][2];
    for (int g = 0; g < n; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        __m256 k0 = kv_load8(row, format, i), k1 = kv_load8(row, format, i + 8);
        for (int g = 0; g < n; g++) {
            acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), k0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i + 8), k1, acc[g][1]);
        }
    }
    for (; i + 8 <= D; i += 8) {
        __m256 k0 = kv_load8(row, format, i);
        for (int g = 0; g < n; g++) acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), k0, acc[g][0]);
    }
    float scale = kv_row_scale(row, format, D);
    for (int g = 0; g < n; g++) {
        float total = hsum8(_mm256_add_ps(acc[g][0], acc[g][1]));
        for (int64_t j = i; j < D; j++) total += q[g * D + j] * kv_load1(row, format, j);
        s[g] = total * scale;
    }
}

/* o_g += p[g] * row for the n output rows o_g = o + g * D (the row's int8 scale applied). */
static inline __attribute__((always_inline)) void kv_axpy_rows(float *o, const int n, const float *p, const void *row,
                                                               const int format, int64_t D) {
    float scale = kv_row_scale(row, format, D);
    __m256 w[HEAD_TILE];
    for (int g = 0; g < n; g++) w[g] = _mm256_set1_ps(p[g] * scale);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = kv_load8(row, format, i);
        for (int g = 0; g < n; g++)
            _mm256_storeu_ps(o + g * D + i, _mm256_fmadd_ps(w[g], v, _mm256_loadu_ps(o + g * D + i)));
    }
    for (; i < D; i++) {
        float v = kv_load1(row, format, i);
        for (int g = 0; g < n; g++) o[g * D + i] += p[g] * scale * v;
    }
}

/* e^x for x <= 0 (and -inf), 8 at a time, within 2 ulp of expf: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by
 * its degree-7 polynomial, 2^n put into the exponent; below -87.3 (where e^x leaves float's normal range) 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.33654f);
    __m256 underflows = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lowest);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts: r stays exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflows, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

/* row[k] = e^(row[k] - best) in place for k < n, returning their sum (masked keys hold -inf and give 0). */
static float softmax_weights(float *row, int64_t n, float best) {
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(best);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + k), shift));
        _mm256_storeu_ps(row + k, p);
        sum = _mm256_add_ps(sum, p);
    }
    float total = hsum8(sum);
    for (; k < n; k++) {
        row[k] = _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(row[k] - best)));
        total += row[k];
    }
    return total;
}

/* kv_dot_rows / kv_axpy_rows with n (1..HEAD_TILE) made a constant, so each is compiled for its tile. */
static inline __attribute__((always_inline)) void dot_tile(const float *q, int n, const void *row, const int format,
                                                           int64_t D, float *s) {
    switch (n) {
    case 4: kv_dot_rows(q, 4, row, format, D, s); return;
    case 3: kv_dot_rows(q, 3, row, format, D, s); return;
    case 2: kv_dot_rows(q, 2, row, format, D, s); return;
    default: kv_dot_rows(q, 1, row, format, D, s); return;
    }
}

static inline __attribute__((always_inline)) void axpy_tile(float *o, int n, const float *p, const void *row,
                                                            const int format, int64_t D) {
    switch (n) {
    case 4: kv_axpy_rows(o, 4, p, row, format, D); return;
    case 3: kv_axpy_rows(o, 3, p, row, format, D); return;
    case 2: kv_axpy_rows(o, 2, p, row, format, D); return;
    default: kv_axpy_rows(o, 1, p, row, format, D); return;
    }
}

/* One task: sequence b's query heads g0..g1 of each group of KV heads h0..h1 (the heads of one group sit
 * together in q and out: query head kvh * group + g reads KV head kvh). */
typedef struct {
    const float *q; /* the sequence's query row [Hq, D] */
    float *o;       /* its output row [Hq, D] */
    const char *keys, *values; /* the caches' slot 0 */
    const int64_t *table;      /* the sequence's blocks */
    const uint8_t *visible;    /* the sequence's mask, or NULL */
    int64_t h0, h1, g0, g1, group, num_keys, block_size, slot_stride, row_bytes, head_dim;
    float scale, softcap;
} AttentionTask;

/* scores: scratch for [heads of the task, num_keys]; best and total for [heads]. Keys are walked block by block
 * and each slot's rows for every KV head of the task are read together (a task of every KV head reads a block's
 * bytes in order). */
static inline __attribute__((always_inline)) void attend(const AttentionTask *t, float *scores, float *best,
                                                         float *total, const int format) {
    const int64_t D = t->head_dim, num_keys = t->num_keys, block_size = t->block_size;
    const int64_t per_kv = t->g1 - t->g0, heads = (t->h1 - t->h0) * per_kv;
    for (int64_t i = 0; i < heads; i++) best[i] = -INFINITY;
    for (int64_t blk = 0; blk < num_keys / block_size; blk++) {
        const char *block_keys = t->keys + t->table[blk] * block_size * t->slot_stride;
        for (int64_t j = 0, k = blk * block_size; j < block_size; j++, k++) {
            if (t->visible && !t->visible[k]) {
                for (int64_t i = 0; i < heads; i++) scores[i * num_keys + k] = -INFINITY;
                continue;
            }
            for (int64_t kvh = t->h0; kvh < t->h1; kvh++) {
                const char *row = block_keys + j * t->slot_stride + kvh * t->row_bytes;
                for (int64_t g = 0; g < per_kv; g += HEAD_TILE) {
                    int n = per_kv - g < HEAD_TILE ? (int)(per_kv - g) : HEAD_TILE;
                    int64_t local = (kvh - t->h0) * per_kv + g;
                    float s[HEAD_TILE];
                    dot_tile(t->q + (kvh * t->group + t->g0 + g) * D, n, row, format, D, s);
                    for (int r = 0; r < n; r++) {
                        float score = s[r] * t->scale;
                        if (t->softcap > 0.0f) score = tanhf(score / t->softcap) * t->softcap;
                        scores[(local + r) * num_keys + k] = score;
                        if (score > best[local + r]) best[local + r] = score;
                    }
                }
            }
        }
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t i = 0; i < per_kv * D; i++) t->o[(kvh * t->group + t->g0) * D + i] = 0.0f;
    if (best[0] == -INFINITY) return; /* no visible key: zeros (never happens for real rows) */
    for (int64_t i = 0; i < heads; i++) total[i] = softmax_weights(scores + i * num_keys, num_keys, best[i]);
    for (int64_t blk = 0; blk < num_keys / block_size; blk++) {
        const char *block_values = t->values + t->table[blk] * block_size * t->slot_stride;
        for (int64_t j = 0, k = blk * block_size; j < block_size; j++, k++) {
            if (t->visible && !t->visible[k]) continue;
            for (int64_t kvh = t->h0; kvh < t->h1; kvh++) {
                const char *row = block_values + j * t->slot_stride + kvh * t->row_bytes;
                for (int64_t g = 0; g < per_kv; g += HEAD_TILE) {
                    int n = per_kv - g < HEAD_TILE ? (int)(per_kv - g) : HEAD_TILE;
                    int64_t local = (kvh - t->h0) * per_kv + g;
                    float p[HEAD_TILE];
                    for (int r = 0; r < n; r++) p[r] = scores[(local + r) * num_keys + k];
                    axpy_tile(t->o + (kvh * t->group + t->g0 + g) * D, n, p, row, format, D);
                }
            }
        }
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t g = 0; g < per_kv; g++) {
            float inv = 1.0f / total[(kvh - t->h0) * per_kv + g], *o = t->o + (kvh * t->group + t->g0 + g) * D;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
}

/* attend with the cache format a constant, so each format's loop is compiled on its own. */
static void attend_in_format(const AttentionTask *t, float *scores, float *best, float *total, int format) {
    switch (format) {
    case KV_F16: attend(t, scores, best, total, KV_F16); return;
    case KV_BF16: attend(t, scores, best, total, KV_BF16); return;
    case KV_INT8: attend(t, scores, best, total, KV_INT8); return;
    default: attend(t, scores, best, total, KV_F32); return;
    }
}

/* Attention of rows [b] for all heads; query row b starts at query + b * query_row_stride. A task is one
 * sequence's every head where there are at least 2 sequences a thread (each block read in order); else one KV
 * head's query heads of a sequence, or with fewer of those than 2 a thread, one query head, so every thread has
 * work. A head's numbers are the same in every split. */
static int decode_attention_capped(const float *query, int64_t query_row_stride, const void *key_cache,
                                   const void *value_cache, const int64_t *blocks, const uint8_t *mask, float *out,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks_per_seq, float scale, float softcap,
                                   int kv_format, int num_threads) {
    int64_t num_keys = num_blocks_per_seq * block_size, group = num_heads / num_kv_heads;
    int64_t row_bytes = kv_row_bytes(kv_format, head_dim);
    int64_t enough = 2 * (int64_t)num_threads;
    /* per task: KV heads and query heads of each of their groups */
    int64_t kv_per_task = num_seqs >= enough ? num_kv_heads : 1;
    int64_t q_per_group = num_seqs >= enough || num_seqs * num_kv_heads >= enough ? group : 1;
    int64_t tasks_per_seq = (num_kv_heads / kv_per_task) * (group / q_per_group);
    int64_t task_heads = kv_per_task * q_per_group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc((size_t)(task_heads * (num_keys + 2)) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
            if (!scratch) continue;
            int64_t b = task / tasks_per_seq, part = task % tasks_per_seq;
            int64_t h0 = part / (group / q_per_group) * kv_per_task, g0 = part % (group / q_per_group) * q_per_group;
            AttentionTask t = {query + b * query_row_stride,
                               out + b * num_heads * head_dim,
                               key_cache,
                               value_cache,
                               blocks + b * num_blocks_per_seq,
                               mask ? mask + b * num_keys : NULL,
                               h0,
                               h0 + kv_per_task,
                               g0,
                               g0 + q_per_group,
                               group,
                               num_keys,
                               block_size,
                               num_kv_heads * row_bytes,
                               row_bytes,
                               head_dim,
                               scale,
                               softcap};
            attend_in_format(&t, scratch, scratch + task_heads * num_keys, scratch + task_heads * (num_keys + 1),
                             kv_format);
        }
        free(scratch);
    }
    return failed;
}

/* Returns 0 on success, 1 if a scratch buffer could not be allocated. */
int kv_decode_attention(const float *query, const void *key_cache, const void *value_cache,
                        const int64_t *blocks, const uint8_t *mask, float *out, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t num_blocks_per_seq, float scale, float softcap, int kv_format, int num_threads) {
    return decode_attention_capped(query, num_heads * head_dim, key_cache, value_cache, blocks, mask, out, num_seqs,
                                   num_heads, num_kv_heads, head_dim, block_size, num_blocks_per_seq, scale, softcap,
                                   kv_format, num_threads);
}

/* Store new keys or values x: float32 [T, Hkv, D] into the cache slots slot_mapping [T], in `kv_format`
 * (the rows engine/ops/kv_format.py `store` writes, bit for bit). */
void kv_store_rows(const float *x, void *cache, const int64_t *slot_mapping, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t head_dim, int kv_format) {
    int64_t row_bytes = kv_row_bytes(kv_format, head_dim);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            kv_store_row((char *)cache + (slot_mapping[t] * num_kv_heads + h) * row_bytes,
                         x + (t * num_kv_heads + h) * head_dim, kv_format, head_dim);
}
