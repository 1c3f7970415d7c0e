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

/* Ways through a task's keys, each with the query heads of one KV head attended together (each key and value
 * row loaded, and for a 16-bit or int8 cache converted, once for all of them), chosen by the head size (and for
 * heads of 96, 128 or 256 values by the machine: decode_attention_wide.c) so that a head's numbers do not depend
 * on the heads beside it or on the batch:
 *
 * Heads of up to 64 values take keys and values 8 at a time ("tiles"). A tile's rows are converted to float32
 * once into a small buffer, and each query head then
 *   - scores the 8 keys with 8 accumulators over the head's dimensions, reduced together by one horizontal-add
 *     tree (not a horizontal sum per key), and
 *   - adds the 8 weighted value rows to its output held in registers (not a load and store of the output per key);
 *   while the rows of the next tile are asked for ahead (a sequence's blocks sit anywhere in the cache, where the
 *   hardware prefetchers do not follow).
 * Longer heads go key by key (attend_per_key, in 8-wide vectors; in 512-bit registers where decode_attention_wide.c
 * takes them): their horizontal sums are fewer per multiply-add, and there the tiles measured no faster (0.65-1.1x
 * at 128 and 256 values). On 2 cores of a Zen 5, the two ways built side by
 * side and called in turn in one process, the tiles against key by key: 1.2-1.4x for SmolLM2's 9 / 3 heads of 64
 * and a 1.1B LLaMA's 32 / 4 at 32 sequences of 208 or 1,024 keys (every cache format), 1.4-1.6x for 1 to 4
 * sequences of the latter (python -m engine.bench.decode_attention times one build per cache format). */
#define TILE 8
#define AHEAD 1 /* tiles ahead whose rows are asked for */
#define TILE_FLOATS 4096 /* a tile buffer's float32 values, at most (16 KiB: it stays in the first-level cache) */
#define HEAD_TILE 4 /* query heads a key-by-key step takes together */

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

/* n rounded up to a multiple of 8: a tile's keys (TILE), a head's values in 8-wide vectors. */
static inline int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

/* Where key k's slot (every KV head's row of it) sits in a cache. */
static inline const char *slot_of(const AttentionTask *t, const char *cache, int64_t k) {
    return cache + (t->table[k / t->block_size] * t->block_size + k % t->block_size) * t->slot_stride;
}

/* Lanes 0 .. count - 1 of a mask for maskload / maskstore (count below 8). */
static inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Asks for the rows of the task's KV heads in keys k0 .. k0 + TILE - 1 (a sequence's blocks sit anywhere in the
 * cache, where the hardware prefetchers do not follow). */
static inline void prefetch_tile(const AttentionTask *t, const char *cache, int64_t k0) {
    for (int64_t k = k0; k < k0 + TILE && k < t->num_keys; k++) {
        const char *first = slot_of(t, cache, k) + t->h0 * t->row_bytes;
        const char *end = first + (t->h1 - t->h0) * t->row_bytes;
        for (const char *line = first; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
    }
}

/* tile [KV heads c0..c1, TILE, padded D] = keys k0 .. k0 + TILE - 1 of KV heads c0..c1 as float32 and row_scales
 * [KV heads c0..c1, TILE] what each row's values are multiplied by (an int8 row's scale, else 1), read slot by slot
 * (a slot's heads sit together in the cache); zero rows for keys past the end or masked off, so that a masked
 * key's weight, 0, never meets a stale row. Returns the lanes that are real keys (bit r: key k0 + r). */
static inline __attribute__((always_inline)) int load_tile(const AttentionTask *t, const char *cache, int64_t k0,
                                                           int64_t c0, int64_t c1, float *tile, float *row_scales,
                                                           const int64_t D, const int64_t padded, const int format) {
    int lanes = 0;
    for (int r = 0; r < TILE; r++) {
        const int64_t k = k0 + r;
        const int real = k < t->num_keys && (!t->visible || t->visible[k]);
        const char *slot = real ? slot_of(t, cache, k) : NULL;
        lanes |= real << r;
        for (int64_t kvh = c0; kvh < c1; kvh++) {
            float *out = tile + ((kvh - c0) * TILE + r) * padded;
            row_scales[(kvh - c0) * TILE + r] = 0.0f;
            if (!real) {
                for (int64_t i = 0; i < padded; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
                continue;
            }
            const char *row = slot + kvh * t->row_bytes;
            row_scales[(kvh - c0) * TILE + r] = kv_row_scale(row, format, D);
            int64_t i = 0;
            for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, kv_load8(row, format, i));
            for (; i < padded; i++) out[i] = i < D ? kv_load1(row, format, i) : 0.0f;
        }
    }
    return lanes;
}

/* The first 8 values of x from i on, or those below n and zeros past it. */
static inline __m256 load_upto(const float *x, int64_t i, int64_t n) {
    return i + 8 <= n ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, first_lanes(n - i));
}

/* [sum(a[0]), ..., sum(a[7])]: the lanes of each of 8 vectors summed, by one horizontal-add tree. */
static inline __m256 sum_lanes8(const __m256 a[TILE]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[0..8) = scale * row_scales[r] * q . tile row r (capped, -inf where the lane is not a real key). */
static inline __attribute__((always_inline)) void score_tile(const float *q, const float *tile,
                                                            const float *row_scales, int64_t D, int64_t padded,
                                                            float scale, float softcap, int lanes, float *scores) {
    __m256 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
        const __m256 x = load_upto(q, i, D);
        for (int r = 0; r < TILE; r++) acc[r] = _mm256_fmadd_ps(x, _mm256_loadu_ps(tile + r * padded + i), acc[r]);
    }
    const __m256 scales = _mm256_mul_ps(_mm256_loadu_ps(row_scales), _mm256_set1_ps(scale));
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum_lanes8(acc), scales));
    for (int r = 0; r < TILE; r++) {
        if (!(lanes >> r & 1))
            scores[r] = -INFINITY;
        else if (softcap > 0.0f)
            scores[r] = tanhf(scores[r] / softcap) * softcap;
    }
}

/* o[0..D) += sum over r of p[r] * row_scales[r] * tile row r, 64 dimensions at a time in registers. */
static inline __attribute__((always_inline)) void add_tile(float *o, const float *p, const float *tile,
                                                          const float *row_scales, int64_t D, int64_t padded) {
    __m256 weight[TILE];
    for (int r = 0; r < TILE; r++) weight[r] = _mm256_set1_ps(p[r] * row_scales[r]);
    for (int64_t i0 = 0; i0 < padded; i0 += 64) {
        const int chunks = (int)((padded - i0) / 8 < 8 ? (padded - i0) / 8 : 8);
        __m256 acc[8];
        for (int c = 0; c < chunks; c++) acc[c] = load_upto(o, i0 + 8 * c, D);
        for (int r = 0; r < TILE; r++)
            for (int c = 0; c < chunks; c++)
                acc[c] = _mm256_fmadd_ps(weight[r], _mm256_loadu_ps(tile + r * padded + i0 + 8 * c), acc[c]);
        for (int c = 0; c < chunks; c++) {
            const int64_t i = i0 + 8 * c;
            if (i + 8 <= D)
                _mm256_storeu_ps(o + i, acc[c]);
            else
                _mm256_maskstore_ps(o + i, first_lanes(D - i), acc[c]);
        }
    }
}

/* KV heads whose tile is converted at a time: as many as fill TILE_FLOATS (at least one), so that the tile stays in
 * the first-level cache beside the rows asked for ahead. */
static inline int64_t heads_per_tile(int64_t padded) {
    return TILE_FLOATS / (TILE * padded) > 1 ? TILE_FLOATS / (TILE * padded) : 1;
}

/* scores: scratch for [heads of the task, num_keys rounded up to TILE]; best and total for [heads]; tile for
 * [heads_per_tile, TILE, D rounded up to 8] and its row scales [heads_per_tile, TILE]. */
static inline __attribute__((always_inline)) void attend_tiled(const AttentionTask *t, float *scores, float *best,
                                                               float *total, float *tile, const int format,
                                                               const int64_t fixed_head_dim) {
    const int64_t D = fixed_head_dim ? fixed_head_dim : t->head_dim, padded = round_up8(D);
    const int64_t stride = round_up8(t->num_keys), chunk = heads_per_tile(padded);
    const int64_t per_kv = t->g1 - t->g0, heads = (t->h1 - t->h0) * per_kv;
    float *row_scales = tile + chunk * TILE * padded;
    for (int64_t k0 = 0; k0 < t->num_keys; k0 += TILE) {
        prefetch_tile(t, t->keys, k0 + AHEAD * TILE);
        for (int64_t c0 = t->h0; c0 < t->h1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < t->h1 ? c0 + chunk : t->h1;
            const int lanes = load_tile(t, t->keys, k0, c0, c1, tile, row_scales, D, padded, format);
            for (int64_t kvh = c0; kvh < c1; kvh++)
                for (int64_t g = 0; g < per_kv; g++) {
                    const int64_t local = (kvh - t->h0) * per_kv + g;
                    score_tile(t->q + (kvh * t->group + t->g0 + g) * D, tile + (kvh - c0) * TILE * padded,
                               row_scales + (kvh - c0) * TILE, D, padded, t->scale, t->softcap, lanes,
                               scores + local * stride + k0);
                }
        }
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t i = 0; i < per_kv * D; i++) t->o[(kvh * t->group + t->g0) * D + i] = 0.0f;
    for (int64_t i = 0; i < heads; i++) {
        __m256 most = _mm256_set1_ps(-INFINITY);
        for (int64_t k = 0; k < stride; k += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(scores + i * stride + k));
        float lanes[8];
        _mm256_storeu_ps(lanes, most);
        best[i] = lanes[0];
        for (int l = 1; l < 8; l++) best[i] = lanes[l] > best[i] ? lanes[l] : best[i];
    }
    if (best[0] == -INFINITY) return; /* no visible key: zeros (never happens for real rows) */
    for (int64_t i = 0; i < heads; i++) total[i] = softmax_weights(scores + i * stride, stride, best[i]);
    for (int64_t k0 = 0; k0 < t->num_keys; k0 += TILE) {
        prefetch_tile(t, t->values, k0 + AHEAD * TILE);
        for (int64_t c0 = t->h0; c0 < t->h1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < t->h1 ? c0 + chunk : t->h1;
            load_tile(t, t->values, k0, c0, c1, tile, row_scales, D, padded, format);
            for (int64_t kvh = c0; kvh < c1; kvh++)
                for (int64_t g = 0; g < per_kv; g++) {
                    const int64_t local = (kvh - t->h0) * per_kv + g;
                    add_tile(t->o + (kvh * t->group + t->g0 + g) * D, scores + local * stride + k0,
                             tile + (kvh - c0) * TILE * padded, row_scales + (kvh - c0) * TILE, D, padded);
                }
        }
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t g = 0; g < per_kv; g++) {
            float inv = 1.0f / total[(kvh - t->h0) * per_kv + g], *o = t->o + (kvh * t->group + t->g0 + g) * D;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
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

/* For heads longer than 64 values. scores: scratch for [heads of the task, num_keys]; best and total for [heads].
 * Keys are walked block by block and each slot's rows for every KV head of the task are read together (a task of
 * every KV head reads a block's bytes in order). */
static inline __attribute__((always_inline)) void attend_per_key(const AttentionTask *t, float *scores, float *best,
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

#include "decode_attention_wide.c"

/* A task by tiles (heads of up to 64 values) or key by key (in 512-bit registers where takes_wide), with the cache
 * format (and the usual tiled head size) a constant: each is compiled on its own, its loops over a head's
 * dimensions unrolled. */
static inline __attribute__((always_inline)) void attend_in_size(const AttentionTask *t, float *scores, float *best,
                                                                 float *total, float *tile, const int format) {
    if (t->head_dim == 64)
        attend_tiled(t, scores, best, total, tile, format, 64);
    else if (t->head_dim < 64)
        attend_tiled(t, scores, best, total, tile, format, 0);
    else if (takes_wide(t->head_dim))
        attend_wide(t, scores, best, total, format);
    else
        attend_per_key(t, scores, best, total, format);
}

static void attend_in_format(const AttentionTask *t, float *scores, float *best, float *total, float *tile,
                             int format) {
    switch (format) {
    case KV_F16: attend_in_size(t, scores, best, total, tile, KV_F16); return;
    case KV_BF16: attend_in_size(t, scores, best, total, tile, KV_BF16); return;
    case KV_INT8: attend_in_size(t, scores, best, total, tile, KV_INT8); return;
    default: attend_in_size(t, scores, best, total, tile, KV_F32); return;
    }
}

/* Keys one task takes of a sequence at most: SPAN_KEYS rounded down to whole blocks (at least one block). A task of
 * one sequence's every head over a span reads whole blocks in order, where a task of one KV head over all keys
 * reads a row of every slot, and a thread has the spans of a long sequence to share. On 2 cores of a Zen 5, old and
 * new builds alternating in one process: 1 or 2 sequences of 2,048-16,384 keys 1.04-2.4x faster (Qwen3, LLaMA 3,
 * Gemma 3, SmolLM2 and 1.1B LLaMA shapes), 32 sequences of 1,024 keys 0.98-1.08x. */
#define SPAN_KEYS 512

static inline int64_t span_keys(int64_t block_size) {
    return SPAN_KEYS >= block_size ? SPAN_KEYS / block_size * block_size : block_size;
}

/* One query head's output out [D] from its spans' outputs, each already divided by its own softmax total: span s
 * weighs e^(best_s - most) * total_s of all spans' sum, added in span order; spans with no visible key are passed
 * over. With one visible span its weight is exactly 1 and the output that span's, bit for bit: a sequence whose
 * keys fit in one span gets the same numbers whether the step's widest sequence splits into spans or not.
 * partial [num_spans, span_stride] (a head's D values first), best and total [num_spans, span_stride / D]. */
static void merge_spans(const float *partial, const float *best, const float *total, int64_t num_spans,
                        int64_t span_stride, int64_t D, float *out) {
    const int64_t heads = span_stride / D;
    float most = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; s < num_spans; s++) most = best[s * heads] > most ? best[s * heads] : most;
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    if (most == -INFINITY) return; /* no visible key: zeros, as a task gives */
    for (int64_t s = 0; s < num_spans; s++)
        if (best[s * heads] != -INFINITY) sum += expf(best[s * heads] - most) * total[s * heads];
    for (int64_t s = 0; s < num_spans; s++) {
        if (best[s * heads] == -INFINITY) continue;
        const float share = expf(best[s * heads] - most) * total[s * heads] / sum;
        const float *o = partial + s * span_stride;
        for (int64_t i = 0; i < D; i++) out[i] += share * o[i];
    }
}

/* Attention of rows [b] for all heads; query row b starts at query + b * query_row_stride. Keys past one span
 * (span_keys) are split into spans whose outputs merge_spans adds up. A task is one sequence's span of every head
 * where there are at least 2 such spans a thread (each block read in order); else one KV head's query heads of a
 * span, or with fewer of those than 2 a thread, one query head, so every thread has work. A head's numbers are the
 * same in every split: spans start at fixed keys, and keys past a sequence's end are masked in a span or fill spans
 * of their own with no visible key. */
static int decode_attention_capped(const float *query, int64_t query_row_stride, const void *key_cache,
                                   const void *value_cache, const int64_t *blocks, const uint8_t *mask, float *out,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks_per_seq, float scale, float softcap,
                                   int kv_format, int num_threads) {
    const int64_t num_keys = num_blocks_per_seq * block_size, group = num_heads / num_kv_heads;
    const int64_t span = span_keys(block_size) < num_keys ? span_keys(block_size) : num_keys;
    const int64_t num_spans = (num_keys + span - 1) / span, units = num_seqs * num_spans; /* a unit: one span */
    const int64_t row_bytes = kv_row_bytes(kv_format, head_dim), row_floats = num_heads * head_dim;
    const int64_t stride = round_up8(span), padded = round_up8(head_dim); /* as attend_tiled takes them */
    const int64_t enough = 2 * (int64_t)num_threads;
    /* per task: KV heads and query heads of each of their groups */
    const int64_t kv_per_task = units >= enough ? num_kv_heads : 1;
    const int64_t q_per_group = units >= enough || units * num_kv_heads >= enough ? group : 1;
    const int64_t tasks_per_unit = (num_kv_heads / kv_per_task) * (group / q_per_group);
    const int64_t task_heads = kv_per_task * q_per_group;
    /* with spans: each unit's outputs [units, Hq, D], then its heads' largest scores and totals [units, Hq] */
    float *partial = NULL;
    if (num_spans > 1 && !(partial = malloc((size_t)(units * num_heads * (head_dim + 2)) * sizeof(float)))) return 1;
    float *span_best = partial ? partial + units * row_floats : NULL;
    float *span_total = partial ? span_best + units * num_heads : NULL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [task_heads, stride] | best [task_heads] | total [task_heads] | tile [heads_per_tile, TILE,
         * padded D] | its row scales [heads_per_tile, TILE] */
        float *scratch =
            malloc((size_t)(task_heads * (stride + 2) + heads_per_tile(padded) * TILE * (padded + 1)) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        float *best = scratch ? scratch + task_heads * stride : NULL, *total = scratch ? best + task_heads : NULL;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < units * tasks_per_unit; task++) {
            if (!scratch) continue;
            const int64_t unit = task / tasks_per_unit, part = task % tasks_per_unit;
            const int64_t b = unit / num_spans, first_key = unit % num_spans * span;
            const int64_t h0 = part / (group / q_per_group) * kv_per_task, g0 = part % (group / q_per_group) * q_per_group;
            AttentionTask t = {query + b * query_row_stride,
                               partial ? partial + unit * row_floats : out + b * row_floats,
                               key_cache,
                               value_cache,
                               blocks + b * num_blocks_per_seq + first_key / block_size,
                               mask ? mask + b * num_keys + first_key : NULL,
                               h0,
                               h0 + kv_per_task,
                               g0,
                               g0 + q_per_group,
                               group,
                               num_keys - first_key < span ? num_keys - first_key : span,
                               block_size,
                               num_kv_heads * row_bytes,
                               row_bytes,
                               head_dim,
                               scale,
                               softcap};
            attend_in_format(&t, scratch, best, total, best + 2 * task_heads, kv_format);
            if (partial)
                for (int64_t kvh = h0; kvh < h0 + kv_per_task; kvh++)
                    for (int64_t g = 0; g < q_per_group; g++) {
                        const int64_t local = (kvh - h0) * q_per_group + g, head = kvh * group + g0 + g;
                        span_best[unit * num_heads + head] = best[local];
                        span_total[unit * num_heads + head] = total[local];
                    }
        }
        if (partial) {
#pragma omp for schedule(static)
            for (int64_t row = 0; row < num_seqs * num_heads; row++) {
                const int64_t b = row / num_heads, head = row % num_heads, first = b * num_spans * num_heads + head;
                merge_spans(partial + first * head_dim, span_best + first, span_total + first, num_spans, row_floats,
                            head_dim, out + row * head_dim);
            }
        }
        free(scratch);
    }
    free(partial);
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
