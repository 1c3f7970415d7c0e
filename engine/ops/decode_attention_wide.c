/* The key-by-key way through a task (decode_attention.c, which includes this file) in 512-bit registers, for
 * heads of 96, 128 or 256 values, where the CPU has AVX-512 F/BW/VL and kv_decode_attention_use_wide turned it on.
 *
 * Scores go 8 keys at a time, slot by slot (a slot's KV heads sit together in the cache): each key row is
 * converted once into up to 16 registers, each query head's 512-bit sum with it is halved into 8 lanes, and the 8
 * keys' lanes are summed by one horizontal-add tree (no horizontal sum per key and head). Values go block by
 * block: each chunk of query heads whose outputs fit in 16 registers adds the block's weighted value rows there,
 * where the 8-wide way loads and stores a head's output at every key; given the same weights it adds the same
 * products in the same order, so only the scores' summation order differs from the 8-wide way's (float32
 * rounding). A head's numbers depend on the head size and the machine only, never on the batch.
 *
 * Why: for a Qwen3-0.6B shape (16 query / 8 KV heads of 128) the 8-wide way spent ~100 cycles a key and KV head,
 * most of them loads, stores and conversions. On 2 cores of a Zen 5, the two ways alternating in one process, this
 * way took 0.43-0.58x the 8-wide way's time where the cache sits in the processor's caches (1 to 4 sequences of
 * 208-512 keys), 0.58-0.88x over 32 x 1,024 keys read from memory (1.03x for heads of 96 in a float32 cache),
 * and a whole 1-sequence step of a random Qwen3-0.6B-shaped Q4_K file at 1,024 keys 0.54x. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

#define WIDE_REGISTERS 16 /* 512-bit registers a key row, or a chunk of query heads' outputs, takes at most */

static int wide_attention = 0; /* set by kv_decode_attention_use_wide */

/* Values i..i+15 of a cache row as float32 (an int8 row's before its scale). */
static inline __m512 kv_load16(const void *row, const int format, int64_t i) {
    switch (format) {
    case KV_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    case KV_BF16: {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    case KV_INT8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + i))));
    default: return _mm512_loadu_ps((const float *)row + i);
    }
}

#define WIDE_HEADS 32 /* query heads whose partial sums of 8 keys are kept at once (8 KiB) */

/* scores of every query head of the task for keys k0 .. k0 + count - 1 (count up to TILE, one block's keys from its
 * slot j0 on): scale * row scale * q . key, capped, -inf for a masked key. Each key row is converted once into
 * registers, slot by slot (a slot's KV heads sit together in the cache); each head's 512-bit sum of a key is halved
 * into 8 lanes, and the 8 keys' lanes are summed by one horizontal-add tree, so a key costs no horizontal sum of
 * its own. */
static inline __attribute__((always_inline)) void score_keys_wide(const AttentionTask *t, const char *block_keys,
                                                                  int64_t k0, int64_t j0, int64_t count,
                                                                  float *scores, float *best, const int format,
                                                                  const int64_t D) {
    const int64_t C = D / 16, per_kv = t->g1 - t->g0, num_keys = t->num_keys;
    const int64_t kv_chunk = per_kv < WIDE_HEADS ? WIDE_HEADS / per_kv : 1; /* KV heads taken at once */
    int lanes = 0; /* bit r: key k0 + r is visible */
    for (int64_t r = 0; r < count; r++) lanes |= (!t->visible || t->visible[k0 + r]) << r;
    __m256 part[WIDE_HEADS][TILE]; /* [head][key]: 8 lanes whose sum is the head's product with the key */
    float row_scales[WIDE_HEADS][TILE];
    for (int64_t c0 = t->h0; c0 < t->h1; c0 += kv_chunk) {
        const int64_t c1 = c0 + kv_chunk < t->h1 ? c0 + kv_chunk : t->h1;
        for (int64_t g0 = 0; g0 < per_kv; g0 += WIDE_HEADS) { /* more than one round only past 32 heads a group */
            const int64_t heads = per_kv - g0 < WIDE_HEADS ? per_kv - g0 : WIDE_HEADS;
            for (int64_t r = 0; r < TILE; r++) {
                const int real = lanes >> r & 1;
                for (int64_t kvh = c0; kvh < c1; kvh++) {
                    __m256 *sums = part[(kvh - c0) * heads];
                    row_scales[kvh - c0][r] = 0.0f;
                    if (!real) {
                        for (int64_t g = 0; g < heads; g++) sums[g * TILE + r] = _mm256_setzero_ps();
                        continue;
                    }
                    const char *row = block_keys + (j0 + r) * t->slot_stride + kvh * t->row_bytes;
                    row_scales[kvh - c0][r] = kv_row_scale(row, format, D);
                    __m512 key[WIDE_REGISTERS];
                    for (int64_t c = 0; c < C; c++) key[c] = kv_load16(row, format, 16 * c);
                    const float *q = t->q + (kvh * t->group + t->g0 + g0) * D;
                    for (int64_t g = 0; g < heads; g++) {
                        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two multiply-add chains */
                        for (int64_t c = 0; c + 1 < C; c += 2) {
                            even = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), key[c], even);
                            odd = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c + 16), key[c + 1], odd);
                        }
                        if (C % 2) even = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * (C - 1)), key[C - 1], even);
                        const __m512 sum = _mm512_add_ps(even, odd);
                        sums[g * TILE + r] = _mm256_add_ps(_mm512_castps512_ps256(sum),
                                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
                    }
                }
            }
            for (int64_t kvh = c0; kvh < c1; kvh++) {
                const __m256 scales = _mm256_mul_ps(_mm256_loadu_ps(row_scales[kvh - c0]), _mm256_set1_ps(t->scale));
                for (int64_t g = 0; g < heads; g++) {
                    float eight[TILE];
                    _mm256_storeu_ps(eight, _mm256_mul_ps(sum_lanes8(part[(kvh - c0) * heads + g]), scales));
                    const int64_t local = (kvh - t->h0) * per_kv + g0 + g;
                    for (int64_t r = 0; r < count; r++) {
                        float score = eight[r];
                        if (!(lanes >> r & 1))
                            score = -INFINITY;
                        else if (t->softcap > 0.0f)
                            score = tanhf(score / t->softcap) * t->softcap;
                        scores[local * num_keys + k0 + r] = score;
                        if (score > best[local]) best[local] = score;
                    }
                }
            }
        }
    }
}

/* o[r * D ..] += weight of key k for head local0 + r times its value row, for the block's keys; n heads, whose
 * outputs stay in registers through the block. */
static inline __attribute__((always_inline)) void add_block_wide(const AttentionTask *t, const char *block_values,
                                                                 int64_t first_key, int64_t kvh, int64_t local0,
                                                                 const int n, const float *scores, float *o,
                                                                 const int format, const int64_t D) {
    const int64_t C = D / 16, num_keys = t->num_keys;
    __m512 acc[WIDE_REGISTERS];
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < C; c++) acc[r * C + c] = _mm512_loadu_ps(o + r * D + 16 * c);
    for (int64_t j = 0, k = first_key; j < t->block_size; j++, k++) {
        if (t->visible && !t->visible[k]) continue;
        const char *row = block_values + j * t->slot_stride + kvh * t->row_bytes;
        const float row_scale = kv_row_scale(row, format, D);
        __m512 weight[WIDE_REGISTERS];
        for (int r = 0; r < n; r++) weight[r] = _mm512_set1_ps(scores[(local0 + r) * num_keys + k] * row_scale);
        for (int64_t c = 0; c < C; c++) {
            __m512 value = kv_load16(row, format, 16 * c);
            for (int r = 0; r < n; r++) acc[r * C + c] = _mm512_fmadd_ps(weight[r], value, acc[r * C + c]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(o + r * D + 16 * c, acc[r * C + c]);
}

/* add_block_wide with n (1 or 2; 1 only for heads of 256) a constant, so its registers are named at compile time. */
static inline __attribute__((always_inline)) void add_block_chunk(const AttentionTask *t, const char *block_values,
                                                                  int64_t first_key, int64_t kvh, int64_t local0,
                                                                  int n, const float *scores, float *o,
                                                                  const int format, const int64_t D) {
    if (n == 2 && WIDE_REGISTERS / (D / 16) >= 2)
        add_block_wide(t, block_values, first_key, kvh, local0, 2, scores, o, format, D);
    else
        add_block_wide(t, block_values, first_key, kvh, local0, 1, scores, o, format, D);
}

/* A task key by key in 512-bit registers (D 96, 128 or 256); the scratch as attend_per_key's. */
static inline __attribute__((always_inline)) void attend_wide_sized(const AttentionTask *t, float *scores,
                                                                    float *best, float *total, const int format,
                                                                    const int64_t D) {
    const int64_t num_keys = t->num_keys, block_size = t->block_size, num_blocks = num_keys / block_size;
    const int64_t per_kv = t->g1 - t->g0, heads = (t->h1 - t->h0) * per_kv;
    const int64_t chunk = WIDE_REGISTERS / (D / 16); /* query heads whose outputs fit in the registers: 1 or 2 */
    for (int64_t i = 0; i < heads; i++) best[i] = -INFINITY;
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const char *block_keys = t->keys + t->table[blk] * block_size * t->slot_stride;
        for (int64_t j = 0; j < block_size; j += TILE)
            score_keys_wide(t, block_keys, blk * block_size + j, j, block_size - j < TILE ? block_size - j : TILE,
                            scores, best, format, D);
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t i = 0; i < per_kv * D; i++) t->o[(kvh * t->group + t->g0) * D + i] = 0.0f;
    if (best[0] == -INFINITY) return; /* no visible key: zeros (never happens for real rows) */
    for (int64_t i = 0; i < heads; i++) total[i] = softmax_weights(scores + i * num_keys, num_keys, best[i]);
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const char *block_values = t->values + t->table[blk] * block_size * t->slot_stride;
        for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
            for (int64_t g = 0; g < per_kv; g += chunk) {
                int n = (int)(per_kv - g < chunk ? per_kv - g : chunk);
                add_block_chunk(t, block_values, blk * block_size, kvh, (kvh - t->h0) * per_kv + g, n, scores,
                                t->o + (kvh * t->group + t->g0 + g) * D, format, D);
            }
    }
    for (int64_t kvh = t->h0; kvh < t->h1; kvh++)
        for (int64_t g = 0; g < per_kv; g++) {
            float inv = 1.0f / total[(kvh - t->h0) * per_kv + g], *o = t->o + (kvh * t->group + t->g0 + g) * D;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
}

/* attend_wide_sized with the head size a constant, so its loops unroll and its registers are named. */
static inline __attribute__((always_inline)) void attend_wide_in_format(const AttentionTask *t, float *scores,
                                                                        float *best, float *total, const int format) {
    switch (t->head_dim) {
    case 128: attend_wide_sized(t, scores, best, total, format, 128); return;
    case 256: attend_wide_sized(t, scores, best, total, format, 256); return;
    default: attend_wide_sized(t, scores, best, total, format, 96); return;
    }
}

static __attribute__((noinline)) void attend_wide(const AttentionTask *t, float *scores, float *best, float *total,
                                                  int format) {
    switch (format) {
    case KV_F16: attend_wide_in_format(t, scores, best, total, KV_F16); return;
    case KV_BF16: attend_wide_in_format(t, scores, best, total, KV_BF16); return;
    case KV_INT8: attend_wide_in_format(t, scores, best, total, KV_INT8); return;
    default: attend_wide_in_format(t, scores, best, total, KV_F32); return;
    }
}

#pragma GCC pop_options

/* Whether a task of head size D goes the 512-bit way (the sizes of most models past 64: in other sizes it measured
 * 0.93-1.26x the 8-wide way). */
static inline int takes_wide(int64_t D) { return wide_attention && (D == 96 || D == 128 || D == 256); }

/* Turns the 512-bit way on (on > 0, where the CPU has AVX-512 F, BW and VL) or off (on == 0), or leaves it
 * (on < 0); returns whether it is on. */
int kv_decode_attention_use_wide(int on) {
    if (on < 0) return wide_attention;
    __builtin_cpu_init();
    wide_attention = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl");
    return wide_attention;
}
