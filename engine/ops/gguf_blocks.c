/* Matrix products on weights kept in a GGUF file's own quantized blocks, on AVX2 CPUs (with VNNI where built for it).
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * x: float32 [M, K]; w: [N, K] stored row by row as K / 32 GGUF blocks (types below,
 * byte-for-byte as in the file, so the weights take the file's bytes and no more);
 * y: float32 [M, N].
 *
 * Each activation row is first rounded to blocks of 32 int8 values with one float
 * scale per block (d = max|x| / 127 over the block), the way the weights are stored,
 * so a block's dot product is an integer sum of int8 x int8 (or uint4 x int8)
 * products, computed 32 at a time (`dot4`: vpdpbusd where the build has VNNI, else
 * vpmaddubsw and vpmaddwd; the same integers either way), and scaled by
 * d_w * d_x in float. Q4_1's and Q5_1's offset m adds m * d_x * sum(q_x), kept per
 * activation block; 5-bit weights are unpacked to bytes 0..31 (the fifth bits spread
 * from one 32-bit word). Every (row, column) pair is summed block by block in the same order
 * whatever M is and however rows are grouped, so a row's result does not depend
 * on the batch it came in (sampling stays batch-invariant).
 *
 * 4-bit weights run from a repacked copy of the file's blocks (kv_gguf_repack, done
 * once at load; same bytes, same numbers): two consecutive blocks share 32 bytes,
 * the first block's weight i in the low nibble of byte i and the second's in the
 * high nibble, with their two scales (and offsets) in front. One 256-bit load and
 * two masks then give 64 weights in order; the file's layout needs twice the
 * shuffling per weight, and the kernel is bound by instructions, not memory
 * bandwidth, at one row (on 2 AVX2 cores an [11264, 2048] Q4_0 row product went from 23 to 42 GMAC/s).
 *
 * IQ4_NL holds Q4_0's nibbles as indices into a fixed grid of 16 int8 values (IQ4_VALUES); the kernel looks the
 * 32 values up with one byte shuffle and multiplies them as Q8_0's.
 *
 * Also here: dequantizing rows of blocks to float32 (prefill multiplies those in
 * BLAS, an embedding table looks its rows up), and rounding activation rows to the
 * same blocks in float (what the BLAS path multiplies, so both paths agree).
 *
 * The types of 256-weight blocks with sub-block scales (the K-quants, IQ4_XS) are in gguf_kquants.c, included
 * below.
 *
 * Built at first use by engine/ops/loader.py; engine/ops/gguf_linear.py holds the
 * torch reference these are tested against.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "absolute_max.c"

/* GGML's type ids, as written in GGUF files; PAIRED marks the repacked 4-bit layout. */
enum { KV_Q4_0 = 2, KV_Q4_1 = 3, KV_Q5_0 = 6, KV_Q5_1 = 7, KV_Q8_0 = 8, KV_IQ4_NL = 20, KV_PAIRED = 0x100 };

#define QK 32 /* weights per block */
#define ROWS_PER_SLAB 16
/* How far ahead of the block being read the weight loops ask for memory. A decode step reads every
 * weight once, from DRAM: on 2 AMD EPYC cores, the matrix products of a Gemma-3-1B-shaped Q8_0 step
 * (802 MB) streamed 12.4 GB/s on the hardware prefetchers alone, 15-17 GB/s with this 16 KB lead
 * (4 KB: 12-16 GB/s). Past the end of a thread's rows it only warms the next thread's; a hint never faults. */
#define PREFETCH_BYTES 16384

/* Asks for the weight line at p. `once`: the product reads each weight once (its activation rows are one register
 * tile), so the line comes without a place in the outer caches (prefetchnta), where a decode step's few hundred MB of
 * weights otherwise pushed out what the step reads again: its code, KV cache rows and activations. On 2 Zen 4 cores,
 * whole decode steps with the two hints alternating in one process: a 1.1B Q4_0 model 1.008-1.022x (two runs of 6
 * and 10 rounds each), the default model 1.02x, Q4_K_M 1.008x. A product whose tiles re-read the weights (prefill,
 * or the 256-bit kernel's two passes over each line) keeps them in the caches. */
static inline __attribute__((always_inline)) void prefetch_weight_line(const uint8_t *p, int once) {
    if (once)
        __builtin_prefetch(p, 0, 0);
    else
        __builtin_prefetch(p);
}

typedef struct {
    uint16_t d; /* fp16 scale */
    uint8_t qs[16]; /* weight j in the low nibble of qs[j], weight j + 16 in its high nibble; value (q - 8) * d */
} BlockQ4_0;

typedef struct {
    uint16_t d, m; /* fp16 scale and offset: value q * d + m */
    uint8_t qs[16];
} BlockQ4_1;

/* 5-bit blocks: the low 4 bits as in Q4_0 / Q4_1, bit j of qh the fifth bit of weight j. */
typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[16]; /* value (q - 16) * d, q in 0..31 */
} BlockQ5_0;

typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[16]; /* value q * d + m */
} BlockQ5_1;

typedef struct {
    uint16_t d;
    int8_t qs[32]; /* value q * d */
} BlockQ8_0;

/* IQ4_NL (and IQ4_XS, gguf_kquants.c): each weight a 4-bit index into IQ4_VALUES, a grid denser near zero than
 * Q4_0's, laid out as Q4_0's nibbles; value IQ4_VALUES[q] * d. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

typedef struct {
    uint16_t d;
    uint8_t qs[16]; /* indices: weight j in the low nibble of qs[j], weight j + 16 in its high nibble */
} BlockIQ4_NL;

/* Two 4-bit blocks repacked: weight i of the first block in the low nibble of qs[i], of the second in the
 * high nibble. Q4_0: value (q - 8) * d; Q4_1: q * d + m. */
typedef struct {
    uint16_t d[2];
    uint8_t qs[32];
} PairQ4_0;

typedef struct {
    uint16_t d[2], m[2];
    uint8_t qs[32];
} PairQ4_1;

/* Activation rows rounded to blocks, as arrays over the M * K / 32 blocks (row-major):
 * q: int8 values; d: scales; s: d * sum(q) (Q4_1's offset); centre: per 4 values, -8 * (q[4i] + ... + q[4i+3])
 * as int32 (Q4_0's -8 offset, where the integer sums of 4 products start, so it is subtracted exactly). The
 * K-quant types (gguf_kquants.c) round per block of 256 instead: q and d as above, s and centre unused, and
 * bsums the sum of each 16 values as int16. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *centre;
    int16_t *bsums;
} Activations;

/* Sums of 4 unsigned x signed byte products as eight int32 lanes (lane j: bytes 4j..4j+3), added to `start`.
 * With VNNI one instruction; otherwise pairs in int16 (no pair here can saturate: |u| <= 127 or u <= 31, so
 * two products stay under 32767) then pairs of pairs. Either way the same integers. */
#if defined(__AVXVNNI__)
#define KV_VNNI 1
static inline __m256i dot4(__m256i start, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(start, u, s); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_VNNI 1
static inline __m256i dot4(__m256i start, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(start, u, s); }
#else
#define KV_VNNI 0
static inline __m256i dot4(__m256i start, __m256i u, __m256i s) {
    return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

static inline float fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* IQ4_VALUES in both 128-bit lanes, for iq4_lookup. */
static inline __m256i iq4_grid(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES)); }

/* 16 bytes of IQ4 indices (weight j in the low nibble of byte j, j + 16 in its high one) -> the 32 int8 values. */
static inline __m256i iq4_lookup(__m256i grid, const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i index = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(grid, index);
}

/* One block of n floats -> int8 values, returning its scale (d = max|x| / 127; an all-zero block gets d = 0)
 * and setting *sum to the values' sum. */
static inline float round_block(const float *v, int64_t n, int8_t *q, int *sum) {
    float amax = absolute_max(v, n);
    float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int total = 0;
    for (int64_t i = 0; i < n; i++) {
        int value = (int)nearbyintf(v[i] * inv);
        value = value > 127 ? 127 : (value < -127 ? -127 : value);
        q[i] = (int8_t)value;
        total += value;
    }
    *sum = total;
    return d;
}

#include "gguf_kquants.c"

/* Weights per block: 256 for the K-quant types, 32 otherwise. */
static int64_t weights_per_block(int type) { return is_k_type(type) ? QK_K : QK; }

static int64_t bytes_per_block(int type) {
    switch (type) {
    case KV_Q4_K:
    case KV_Q5_K:
    case KV_Q6_K:
    case KV_IQ4_XS: return bytes_per_k_block(type);
    case KV_Q4_0: return sizeof(BlockQ4_0);
    case KV_Q4_1: return sizeof(BlockQ4_1);
    case KV_Q5_0: return sizeof(BlockQ5_0);
    case KV_Q5_1: return sizeof(BlockQ5_1);
    case KV_Q8_0: return sizeof(BlockQ8_0);
    case KV_IQ4_NL: return sizeof(BlockIQ4_NL);
    case KV_Q4_0 | KV_PAIRED: return sizeof(PairQ4_0) / 2;
    case KV_Q4_1 | KV_PAIRED: return sizeof(PairQ4_1) / 2;
    default: return 0;
    }
}

/* 0 when blocks of `type` can hold rows of K weights; paired types need an even number of blocks. */
static int check_shape(int type, int64_t K) {
    if (bytes_per_block(type) == 0 || K % weights_per_block(type) != 0) return 2;
    if ((type & KV_PAIRED) && K % (2 * QK) != 0) return 2;
    return 0;
}

#include "gguf_interleaved.c"

/* One activation row -> its blocks in `act` (from block first_block on), as `type`'s products read them. */
static void quantize_act_row(int type, const float *x, int64_t K, const Activations *act, int64_t first_block) {
    const int64_t block = weights_per_block(type);
    for (int64_t b = 0; b < K / block; b++) {
        int64_t index = first_block + b;
        int8_t *q = act->q + index * block;
        int sum;
        float d = round_block(x + b * block, block, q, &sum);
        act->d[index] = d;
        if (is_k_type(type)) { /* the sum of each 16 values */
            for (int g = 0; g < QK_K / 16; g++) {
                int group = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++) group += q[i];
                act->bsums[index * 16 + g] = (int16_t)group;
            }
            continue;
        }
        act->s[index] = d * (float)sum;
        for (int i = 0; i < QK / 4; i++)
            act->centre[index * 8 + i] = -8 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
    }
}

/* Eight int32 lanes scaled by d and added to acc. */
static inline __m256 scale_add(__m256i lanes, __m256 d, __m256 acc) {
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), acc);
}

/* Two consecutive fp16 values as floats in lanes 0 and 1. */
static inline __m128 load_fp16_pair(const uint16_t *h) {
    int32_t both;
    __builtin_memcpy(&both, h, sizeof both);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(both));
}

static inline __m128 load_float_pair(const float *f) { return _mm_castpd_ps(_mm_load_sd((const double *)f)); }

/* 32 bits -> 32 bytes, byte i 0xFF where bit i is set: each byte lane takes the byte of `bits` holding its
 * bit, every other bit of it is forced to one, and the lane is all ones exactly when its own bit was one. */
static inline __m256i bits_to_byte_mask(uint32_t bits) {
    const __m256i byte_of_lane = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                                    0x0303030303030303);
    const __m256i other_bits = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* lane i: every bit but i % 8 */
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of_lane);
    return _mm256_cmpeq_epi8(_mm256_or_si256(v, other_bits), _mm256_set1_epi64x(-1));
}

/* The 32 weights of a Q5_0 / Q5_1 block as bytes 0..31, in order. */
static inline __m256i unpack_5bit(const uint8_t *qh, const uint8_t *qs) {
    uint32_t high;
    __builtin_memcpy(&high, qh, sizeof high);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(low, _mm256_and_si256(bits_to_byte_mask(high), _mm256_set1_epi8(0x10)));
}

/* Dot products of one weight row (nb blocks) with R activation rows (block offsets act_first[r]);
 * R is a constant at each call. Each row accumulates block by block, in the same order for every R. */
static inline __attribute__((always_inline)) void dot_row(int type, const uint8_t *w, const Activations *act,
                                                          const int64_t *act_first, int64_t nb, const int R,
                                                          float *out) {
    __m256 acc[4];
    __m128 offset[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        offset[r] = _mm_setzero_ps();
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == KV_Q8_0 || type == KV_IQ4_NL) {
        /* signed 8-bit weights: Q8_0's as stored, IQ4_NL's looked up from their indices; the fp16 scale first */
        const int64_t stride = bytes_per_block(type);
        const __m256i grid = iq4_grid();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = w + b * stride;
            __builtin_prefetch(block + PREFETCH_BYTES);
            float dw = fp16_to_float(*(const uint16_t *)block);
            __m256i wv = type == KV_Q8_0 ? _mm256_loadu_si256((const __m256i *)(block + 2)) : iq4_lookup(grid, block + 2);
            __m256i wabs = _mm256_sign_epi8(wv, wv); /* dot4 takes one unsigned operand: |w| . x*sign(w) */
            for (int r = 0; r < R; r++) {
                int64_t i = act_first[r] + b;
                __m256i xv = _mm256_loadu_si256((const __m256i *)(act->q + i * QK));
                __m256i lanes = dot4(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(xv, wv));
                acc[r] = scale_add(lanes, _mm256_set1_ps(dw * act->d[i]), acc[r]);
            }
        }
    } else if (type == KV_Q4_0 || type == KV_Q4_1 || type == KV_Q5_0 || type == KV_Q5_1) {
        /* 4-bit blocks in the file's layout (rows of an odd number of blocks) and 5-bit blocks: unsigned weights,
         * Q4_0 / Q5_0 centred at 8 / 16 (subtracted exactly in the integer sums), Q4_1 / Q5_1 with an offset. */
        const int64_t stride = bytes_per_block(type);
        const int five_bit = type == KV_Q5_0 || type == KV_Q5_1, has_offset = type == KV_Q4_1 || type == KV_Q5_1;
        const int centre_shift = type == KV_Q5_0 ? 1 : 0; /* the centre is 8 << centre_shift */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = w + b * stride;
            __builtin_prefetch(block + PREFETCH_BYTES);
            float dw = fp16_to_float(*(const uint16_t *)block);
            /* the offset (Q4_1 / Q5_1) follows the scale; a 5-bit block's fifth bits come next, then qs */
            float mw = has_offset ? fp16_to_float(*(const uint16_t *)(block + 2)) : 0.0f;
            const uint8_t *qs = block + stride - 16;
            __m256i wv;
            if (five_bit) {
                wv = unpack_5bit(qs - 4, qs);
            } else {
                __m128i raw = _mm_loadu_si128((const __m128i *)qs);
                wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4); /* 0..15 */
            }
            for (int r = 0; r < R; r++) {
                int64_t i = act_first[r] + b;
                /* sum (q - c) x = sum q x - c sum x: the sums start at -c sum x, from -8 times the sums of 4 */
                __m256i start = has_offset ? _mm256_setzero_si256()
                                           : _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(act->centre + i * 8)),
                                                               centre_shift);
                __m256i lanes = dot4(start, wv, _mm256_loadu_si256((const __m256i *)(act->q + i * QK)));
                acc[r] = scale_add(lanes, _mm256_set1_ps(dw * act->d[i]), acc[r]);
                if (has_offset) offset[r] = _mm_add_ss(offset[r], _mm_set_ss(mw * act->s[i]));
            }
        }
    } else {
        const int is_q4_0 = type == (KV_Q4_0 | KV_PAIRED);
        const int64_t pair_bytes = is_q4_0 ? sizeof(PairQ4_0) : sizeof(PairQ4_1);
        for (int64_t p = 0; p < nb / 2; p++) {
            const uint8_t *pair = w + p * pair_bytes;
            __builtin_prefetch(pair + PREFETCH_BYTES);
            const uint16_t *scales = (const uint16_t *)pair;
            const uint8_t *qs = pair + (is_q4_0 ? offsetof(PairQ4_0, qs) : offsetof(PairQ4_1, qs));
            __m128 dw = load_fp16_pair(scales);
            __m128 mw = is_q4_0 ? _mm_setzero_ps() : load_fp16_pair(scales + 2);
            __m256i raw = _mm256_loadu_si256((const __m256i *)qs);
            __m256i first = _mm256_and_si256(raw, low4);                         /* block 2p: 0..15 */
            __m256i second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4); /* block 2p + 1 */
            for (int r = 0; r < R; r++) {
                int64_t i = act_first[r] + 2 * p;
                const int8_t *xq = act->q + i * QK;
                /* Q4_0: sum (q - 8) x = sum q x - 8 sum x, the sums starting at -8 sum x */
                __m256i start0 = is_q4_0 ? _mm256_loadu_si256((const __m256i *)(act->centre + i * 8)) : _mm256_setzero_si256();
                __m256i start1 = is_q4_0 ? _mm256_loadu_si256((const __m256i *)(act->centre + i * 8 + 8)) : _mm256_setzero_si256();
                __m256i p0 = dot4(start0, first, _mm256_loadu_si256((const __m256i *)xq));
                __m256i p1 = dot4(start1, second, _mm256_loadu_si256((const __m256i *)(xq + QK)));
                __m128 d = _mm_mul_ps(dw, load_float_pair(act->d + i));
                acc[r] = scale_add(p0, _mm256_broadcastss_ps(d), acc[r]);
                acc[r] = scale_add(p1, _mm256_broadcastss_ps(_mm_movehdup_ps(d)), acc[r]);
                if (!is_q4_0) offset[r] = _mm_fmadd_ps(mw, load_float_pair(act->s + i), offset[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 o = offset[r];
        out[r] = hsum_ps(acc[r]) + (_mm_cvtss_f32(o) + _mm_cvtss_f32(_mm_movehdup_ps(o)));
    }
}

/* dot_row or dot_row_k, by the weights' type; R is a constant at each call. */
static inline __attribute__((always_inline)) void dot_rows(int type, const uint8_t *w, const Activations *act,
                                                           const int64_t *act_first, int64_t nb, const int R,
                                                           float *out) {
    if (is_k_type(type))
        dot_row_k(type, w, act, act_first, nb, R, out);
    else
        dot_row(type, w, act, act_first, nb, R, out);
}

/* The activation buffer for M rows of K values rounded to `type`'s activation blocks, its parts 32-byte
 * aligned: q [M*K] int8, then (32-weight types) centre [M*K/4] int32, d and s [M*K/32] float, or (K-quants)
 * bsums [M*K/16] int16 and d [M*K/256] float. NULL if it cannot be allocated. */
static uint8_t *alloc_activations(int type, int64_t M, int64_t K, Activations *act) {
    size_t q_bytes = ((size_t)(M * K) + 31) & ~(size_t)31, nb = (size_t)(M * K / weights_per_block(type));
    size_t sums_bytes = ((size_t)(M * K) + 31) & ~(size_t)31; /* M*K/4 int32 (centre) or M*K/16 int16 (bsums) */
    size_t float_bytes = ((nb * sizeof(float)) + 31) & ~(size_t)31;
    uint8_t *buffer = aligned_alloc(32, q_bytes + sums_bytes + 2 * float_bytes);
    if (!buffer) return NULL;
    uint8_t *sums = buffer + q_bytes;
    float *floats = (float *)(buffer + q_bytes + sums_bytes);
    *act = (Activations){(int8_t *)buffer, floats, floats + float_bytes / sizeof(float), NULL, NULL};
    if (is_k_type(type))
        act->bsums = (int16_t *)sums;
    else
        act->centre = (int32_t *)sums;
    return buffer;
}

/* 1 when this build's dot4 is VNNI's vpdpbusd, 0 for the AVX2 pair sums. */
int kv_gguf_uses_vnni(void) { return KV_VNNI; }

/* Returns 0 on success, 1 if the activation buffer could not be allocated, 2 for an unknown type
 * or a K the type cannot hold. */
int kv_gguf_gemm(const float *x, int64_t M, int64_t K, int type, const uint8_t *w, const float *bias, float *y,
                 int64_t N, int num_threads) {
    if (type & KV_INTERLEAVED) return interleaved_gemm(x, M, K, type & ~KV_INTERLEAVED, w, bias, y, N, num_threads);
    if (check_shape(type, K)) return 2;
    int64_t nb = K / weights_per_block(type), row_bytes = nb * bytes_per_block(type);
    Activations act;
    uint8_t *buffer = alloc_activations(type, M, K, &act);
    if (!buffer) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) quantize_act_row(type, x + m * K, K, &act, m * nb);
    /* Activation rows in slabs of ROWS_PER_SLAB (~2.25 K bytes a row: a slab stays in L2 while every
     * weight row passes over it; all M rows at once spilled to memory once M * K passed ~1 MB). */
    for (int64_t slab = 0; slab < M; slab += ROWS_PER_SLAB) {
        int64_t slab_end = slab + ROWS_PER_SLAB < M ? slab + ROWS_PER_SLAB : M;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m0 = slab; m0 < slab_end; m0 += 4) {
            int R = (int)(slab_end - m0 < 4 ? slab_end - m0 : 4);
            int64_t first[4];
            for (int r = 0; r < 4; r++) first[r] = (m0 + (r < R ? r : 0)) * nb;
            float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            switch (R) {
            case 4: dot_rows(type, row, &act, first, nb, 4, out); break;
            case 3: dot_rows(type, row, &act, first, nb, 3, out); break;
            case 2: dot_rows(type, row, &act, first, nb, 2, out); break;
            default: dot_rows(type, row, &act, first, nb, 1, out); break;
            }
            for (int r = 0; r < R; r++) y[(m0 + r) * N + n] = bias ? out[r] + bias[n] : out[r];
        }
    }
    }
    free(buffer);
    return 0;
}

/* The 4-bit value i (0..31) of a file-layout block. */
static inline int file_nibble(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4; }

/* Rows of file-layout Q4_0 / Q4_1 blocks -> the paired layout (type without the flag). Returns 2 when
 * the type is not 4-bit or K is not a multiple of 64. */
int kv_gguf_repack(int type, const uint8_t *src, uint8_t *dst, int64_t rows, int64_t K, int num_threads) {
    if ((type != KV_Q4_0 && type != KV_Q4_1) || check_shape(type | KV_PAIRED, K)) return 2;
    int64_t pairs = K / (2 * QK);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t p = 0; p < pairs; p++) {
            int64_t b = r * pairs * 2 + 2 * p; /* index of the pair's first block among all blocks */
            if (type == KV_Q4_0) {
                const BlockQ4_0 *in = (const BlockQ4_0 *)src + b;
                PairQ4_0 *out = (PairQ4_0 *)dst + r * pairs + p;
                out->d[0] = in[0].d, out->d[1] = in[1].d;
                for (int i = 0; i < QK; i++)
                    out->qs[i] = (uint8_t)(file_nibble(in[0].qs, i) | file_nibble(in[1].qs, i) << 4);
            } else {
                const BlockQ4_1 *in = (const BlockQ4_1 *)src + b;
                PairQ4_1 *out = (PairQ4_1 *)dst + r * pairs + p;
                out->d[0] = in[0].d, out->d[1] = in[1].d, out->m[0] = in[0].m, out->m[1] = in[1].m;
                for (int i = 0; i < QK; i++)
                    out->qs[i] = (uint8_t)(file_nibble(in[0].qs, i) | file_nibble(in[1].qs, i) << 4);
            }
        }
    }
    return 0;
}

/* One row of K weights in blocks of `type` -> float32. */
static void dequantize_row(int type, const uint8_t *row, int64_t K, float *dst) {
    int64_t nb = K / QK;
    if (is_k_type(type)) {
        dequantize_row_k(type, row, K, dst);
    } else if (type == KV_Q8_0) {
        for (int64_t b = 0; b < nb; b++) {
            const BlockQ8_0 *block = (const BlockQ8_0 *)row + b;
            float d = fp16_to_float(block->d);
            for (int j = 0; j < QK; j++) dst[b * QK + j] = (float)block->qs[j] * d;
        }
    } else if (type == KV_IQ4_NL) {
        for (int64_t b = 0; b < nb; b++) {
            const BlockIQ4_NL *block = (const BlockIQ4_NL *)row + b;
            float d = fp16_to_float(block->d);
            __m256i values = iq4_lookup(iq4_grid(), block->qs);
            for (int e = 0; e < 4; e++) { /* 8 values at a time, each d * value as the reference rounds it */
                __m128i eight = _mm_srli_si128(e < 2 ? _mm256_castsi256_si128(values) : _mm256_extracti128_si256(values, 1), 8 * (e % 2));
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), _mm256_set1_ps(d));
                _mm256_storeu_ps(dst + b * QK + 8 * e, v);
            }
        }
    } else if (type == KV_Q5_0 || type == KV_Q5_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = row + b * bytes_per_block(type);
            const uint8_t *qh = type == KV_Q5_0 ? ((const BlockQ5_0 *)block)->qh : ((const BlockQ5_1 *)block)->qh;
            const uint8_t *qs = type == KV_Q5_0 ? ((const BlockQ5_0 *)block)->qs : ((const BlockQ5_1 *)block)->qs;
            float d = fp16_to_float(*(const uint16_t *)block);
            float m = type == KV_Q5_0 ? -16.0f * d : fp16_to_float(((const BlockQ5_1 *)block)->m);
            uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int j = 0; j < QK; j++)
                dst[b * QK + j] = (float)(file_nibble(qs, j) | ((high >> j) & 1) << 4) * d + m;
        }
    } else if (type == KV_Q4_0 || type == KV_Q4_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *qs = type == KV_Q4_0 ? ((const BlockQ4_0 *)row)[b].qs : ((const BlockQ4_1 *)row)[b].qs;
            float d = fp16_to_float(type == KV_Q4_0 ? ((const BlockQ4_0 *)row)[b].d : ((const BlockQ4_1 *)row)[b].d);
            float m = type == KV_Q4_0 ? -8.0f * d : fp16_to_float(((const BlockQ4_1 *)row)[b].m);
            for (int j = 0; j < QK; j++) dst[b * QK + j] = (float)file_nibble(qs, j) * d + m;
        }
    } else {
        for (int64_t p = 0; p < nb / 2; p++) {
            int is_q4_0 = type == (KV_Q4_0 | KV_PAIRED);
            const uint16_t *scales = is_q4_0 ? ((const PairQ4_0 *)row)[p].d : ((const PairQ4_1 *)row)[p].d;
            const uint8_t *qs = is_q4_0 ? ((const PairQ4_0 *)row)[p].qs : ((const PairQ4_1 *)row)[p].qs;
            for (int half = 0; half < 2; half++) {
                float d = fp16_to_float(scales[half]);
                float m = is_q4_0 ? -8.0f * d : fp16_to_float(((const PairQ4_1 *)row)[p].m[half]);
                for (int j = 0; j < QK; j++)
                    dst[(2 * p + half) * QK + j] = (float)((qs[j] >> (4 * half)) & 0x0F) * d + m;
            }
        }
    }
}

/* out[i, :] rows as float32 (out_bf16 NULL) or as bfloat16 (out NULL; each value rounded to nearest even, as
 * torch rounds float32 to bfloat16), each row dequantized in float32 first in a buffer of its thread. */
static int dequantize_rows_to(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t num_rows, float *out,
                              uint16_t *out_bf16, int num_threads) {
    const int interleaved = (type & KV_INTERLEAVED) != 0;
    type &= ~KV_NARROW;
    if (interleaved ? !is_interleavable(type & ~KV_INTERLEAVED) || K % weights_per_block(type & ~KV_INTERLEAVED) != 0
                    : check_shape(type, K))
        return 2;
    int64_t row_bytes = K / weights_per_block(type) * bytes_per_block(type);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = out ? NULL : malloc((size_t)K * sizeof(float));
        if (!out && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_rows; i++) {
            if (!out && !scratch) continue;
            const int64_t n = rows ? rows[i] : i;
            float *dst = out ? out + i * K : scratch;
            if (interleaved)
                dequantize_interleaved_row(type & ~KV_INTERLEAVED, w, K, n, dst);
            else
                dequantize_row(type, w + n * row_bytes, K, dst);
            if (out_bf16)
                for (int64_t k = 0; k < K; k++) {
                    uint32_t bits;
                    __builtin_memcpy(&bits, dst + k, sizeof bits);
                    out_bf16[i * K + k] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
                }
        }
        free(scratch);
    }
    return failed;
}

/* out[i, :] = the K weights of row rows[i] (or row i when rows is NULL), as float32.
 * Returns 2 for an unknown type or a K the type cannot hold. */
int kv_gguf_dequantize(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t num_rows, float *out,
                       int num_threads) {
    return dequantize_rows_to(type, w, K, rows, num_rows, out, NULL, num_threads);
}

/* kv_gguf_dequantize into bfloat16 (the prefill tiles of --prefill-dtype bfloat16); also 1 if out of memory. */
int kv_gguf_dequantize_bf16(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t num_rows,
                            uint16_t *out, int num_threads) {
    return dequantize_rows_to(type, w, K, rows, num_rows, NULL, out, num_threads);
}

/* out = each row of x rounded to activation blocks of `block` values (32, or 256 for the K-quant types) and
 * back to float (q * d): what the BLAS path multiplies, so a row gets the kernel's numbers whichever path
 * its batch takes. */
void kv_gguf_round_activations(const float *x, float *out, int64_t M, int64_t K, int64_t block, int num_threads) {
    if (block != QK && block != QK_K) return;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        int8_t q[QK_K];
        int sum;
        for (int64_t b = 0; b < K / block; b++) {
            float d = round_block(x + m * K + b * block, block, q, &sum);
            for (int64_t i = 0; i < block; i++) out[m * K + b * block + i] = (float)q[i] * d;
        }
    }
}
