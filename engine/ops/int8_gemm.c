/* Weight-only int8 matrix products on AVX2 CPUs (with VNNI where built for it).
 *
 *   y[m, n] = w_scale[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * x: float32 [M, K] row-major; w: int8 [N, K] row-major with one symmetric scale
 * per output channel (values in -127..127); y: float32 [M, N].
 *
 * For decode-sized M, where a step is bound by reading weights (the caller,
 * engine/ops/int8_linear.py, runs a float32 matmul for larger M). AVX2 has no
 * int8 x float instruction and widening int8 to float costs two instructions
 * per 8 weights, which kept an all-float version at ~9 GB/s. Each activation
 * row is instead rounded to int16 with its own scale (error <= max|x_m| / 65534,
 * far below the weights' own rounding) and products run as int16 pair dot
 * products (vpmaddwd) on 16 weights at a time. The per-row scale keeps rows
 * independent of each other. Accumulators are int32, flushed to float every
 * KCHUNK columns so no sum overflows: |one vpmaddwd lane| <= 2 * 32767 * 127 and
 * a lane adds KCHUNK / 16 of them (< 2^31); lanes are summed in int64.
 *
 * Batch 1 (M == 1) streams each thread's block of weight rows one row at a time
 * (row_dot); larger M uses tiles of 4 weight rows x 2 activation rows, so each
 * widened weight vector serves two rows.
 *
 * Built at first use by engine/ops/loader.py against the OpenMP runtime
 * torch already loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "absolute_max.c"

#define KCHUNK 4096

/* Sum of the 8 int32 lanes, widened first: the lanes together can exceed int32. */
static inline int64_t hsum_i64(__m256i v) {
    __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                    _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

/* acc + the int16 pair products of a and b, as eight int32 lanes: one vpdpwssd where the build has VNNI,
 * else vpmaddwd and an add (the same integers; both wrap alike, and the KCHUNK flush keeps them from it). */
#if defined(__AVXVNNI__)
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

static inline __m256i load_w16(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* Dot products of weight rows [n0, n0 + 4) (clamped to valid rows) with
 * activation rows [m0, m0 + MB) over all K columns, as float sums of int products.
 * MB is a compile-time constant at each call. */
static inline __attribute__((always_inline)) void tile(const int16_t *xq, int64_t K, const int8_t *w, int64_t N,
                                                       int64_t n0, int64_t m0, const int MB, float out[2][4]) {
    const int16_t *xr[2] = {xq + m0 * K, xq + (m0 + MB - 1) * K};
    const int8_t *wr[4];
    for (int j = 0; j < 4; j++) wr[j] = w + (n0 + j < N ? n0 + j : n0) * K;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) out[i][j] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += KCHUNK) {
        int64_t k1 = k0 + KCHUNK < K ? k0 + KCHUNK : K;
        __m256i acc[2][4];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
        int64_t k = k0;
        for (; k + 16 <= k1; k += 16) {
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(xr[0] + k));
            __m256i a1 = MB > 1 ? _mm256_loadu_si256((const __m256i *)(xr[1] + k)) : a0;
            for (int j = 0; j < 4; j++) {
                /* the rows 2 tiles ahead: the hardware prefetcher alone kept this at ~10 GB/s */
                _mm_prefetch((const char *)(wr[j] + k + 8 * K), _MM_HINT_T0);
                __m256i wv = load_w16(wr[j] + k);
                acc[0][j] = madd_add(acc[0][j], a0, wv);
                if (MB > 1) acc[1][j] = madd_add(acc[1][j], a1, wv);
            }
        }
        for (int i = 0; i < MB; i++)
            for (int j = 0; j < 4; j++) {
                int64_t tail = 0;
                for (int64_t kk = k; kk < k1; kk++) tail += (int64_t)xr[i][kk] * wr[j][kk];
                out[i][j] += (float)(hsum_i64(acc[i][j]) + tail);
            }
    }
}

/* One weight row against one activation row, 64 columns a step into four accumulators.
 * Used when M == 1 (batch-1 decode): each thread then streams its block of weight rows
 * front to back, which the tile path's four interleaved rows did not: measured 21 GB/s
 * against 12 GB/s on a 3072 x 576 matrix. */
static inline int64_t row_dot(const int16_t *xq, const int8_t *row, int64_t K) {
    int64_t total = 0;
    for (int64_t k0 = 0; k0 < K; k0 += 4 * KCHUNK) { /* each accumulator lane adds one vpmaddwd per 64 columns */
        int64_t k1 = k0 + 4 * KCHUNK < K ? k0 + 4 * KCHUNK : K;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
            _mm_prefetch((const char *)(row + k + 1024), _MM_HINT_T0);
            __m256i w01 = _mm256_loadu_si256((const __m256i *)(row + k));
            __m256i w23 = _mm256_loadu_si256((const __m256i *)(row + k + 32));
            const __m256i *xv = (const __m256i *)(xq + k);
            a0 = madd_add(a0, _mm256_loadu_si256(xv), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w01)));
            a1 = madd_add(a1, _mm256_loadu_si256(xv + 1), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w01, 1)));
            a2 = madd_add(a2, _mm256_loadu_si256(xv + 2), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w23)));
            a3 = madd_add(a3, _mm256_loadu_si256(xv + 3), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w23, 1)));
        }
        for (; k + 16 <= k1; k += 16)
            a0 = madd_add(a0, _mm256_loadu_si256((const __m256i *)(xq + k)), load_w16(row + k));
        total += hsum_i64(a0) + hsum_i64(a1) + hsum_i64(a2) + hsum_i64(a3);
        for (; k < k1; k++) total += (int64_t)xq[k] * row[k];
    }
    return total;
}

/* The int16 grid of one activation row: scale = max|row| / 32767 (1 for an all-zero row). */
static inline float row_scale(const float *row, int64_t K) {
    float amax = absolute_max(row, K);
    return amax > 0.0f ? amax / 32767.0f : 1.0f;
}

/* v on that grid, as an integer in -32767..32767 (inv = 1 / scale) */
static inline float grid_value(float v, float inv) {
    float q = nearbyintf(v * inv);
    return q > 32767.0f ? 32767.0f : (q < -32767.0f ? -32767.0f : q);
}

/* Round each row of x to int16 with its own scale; returns the scales in x_scale. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *x_scale) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float scale = row_scale(row, K), inv = 1.0f / scale;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = (int16_t)grid_value(row[k], inv);
        x_scale[m] = scale;
    }
}

/* Returns 0 on success, 1 if the scratch buffer could not be allocated. */
int kv_int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *w, const float *w_scale, const float *bias,
                 float *y, int64_t N, int num_threads) {
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t) + (size_t)M * sizeof(float));
    if (!xq) return 1;
    float *x_scale = (float *)(xq + M * K);
    quantize_rows(x, M, K, xq, x_scale);
    if (M == 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float v = (float)row_dot(xq, w + n * K, K) * x_scale[0] * w_scale[n];
            y[n] = bias ? v + bias[n] : v;
        }
        free(xq);
        return 0;
    }
    int64_t num_tiles = (N + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        int64_t n0 = t * 4;
        int nb = (int)(N - n0 < 4 ? N - n0 : 4);
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            int mb = (int)(M - m0 < 2 ? M - m0 : 2);
            float out[2][4];
            if (mb == 2)
                tile(xq, K, w, N, n0, m0, 2, out);
            else
                tile(xq, K, w, N, n0, m0, 1, out);
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    float v = out[i][j] * x_scale[m0 + i] * w_scale[n0 + j];
                    y[(m0 + i) * N + n0 + j] = bias ? v + bias[n0 + j] : v;
                }
        }
    }
    free(xq);
    return 0;
}


/* out = each row of x rounded to the kernel's int16 grid (q * scale, q as in quantize_rows):
 * what the float32 BLAS path for large M multiplies, so both paths see the same activations. */
void kv_round_rows_int16(const float *x, float *out, int64_t M, int64_t K, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float scale = row_scale(row, K), inv = 1.0f / scale;
        for (int64_t k = 0; k < K; k++) out[m * K + k] = grid_value(row[k], inv) * scale;
    }
}
