/* The largest magnitude of n floats, for the kernels that scale a row or block of values to integers
 * (gguf_blocks.c's activation blocks, int8_gemm.c's activation rows, decode_attention.c's int8 cache rows),
 * which include this file.
 *
 * Why: the scalar loop fmaxf(amax, fabsf(v[i])) compiles to a call of libm's fmaxf for every value (fmaxf must
 * skip a NaN, which vmaxss alone does not promise), 2-3% of a batched decode step. This takes 8 at a time with
 * the same result: a maximum is exact in any order, and vmaxps returns its second operand, the running maximum,
 * where v[i] is NaN, as fmaxf skips a NaN.
 */
#ifndef KV_ABSOLUTE_MAX_C
#define KV_ABSOLUTE_MAX_C

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline float absolute_max(const float *v, int64_t n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 best8 = _mm256_setzero_ps();
    const int64_t whole = n - n % 8; /* the values the vector loop takes (a bound gcc sees cannot overflow) */
    int64_t i = 0;
    for (; i < whole; i += 8) best8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude), best8);
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, best8);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    for (; i < n; i++) amax = fmaxf(amax, fabsf(v[i]));
    return amax;
}

#endif
