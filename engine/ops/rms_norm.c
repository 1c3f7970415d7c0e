/* RMSNorm over the last dimension of a float32 [rows, dim] tensor:
 *
 *   out[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * weight[i]
 *
 * Why a kernel: torch's CPU rms_norm runs as several ops and took ~50 us per
 * call on a 576-wide decode row, 61 calls per SmolLM2 step; this takes a few
 * microseconds. Sums of squares accumulate in double so the result matches
 * the reference (torch.rms_norm, float32) to float32 rounding, in 8 running
 * sums (each value's square into sum i % 8, then the 8 added pairwise), which
 * the compiler keeps in vector registers: one running sum is a chain of
 * dependent additions, ~2 us a 2,048-wide row where these take ~0.2 us.
 * Single-threaded: even a 512-row prefill is ~0.3 M multiply-adds.
 */
#include <math.h>
#include <stdint.h>

#define RMS_LANES 8

/* The sum of row[i]^2 over i < dim, in double. */
static inline double sum_of_squares(const float *row, int64_t dim) {
    double part[RMS_LANES] = {0.0};
    int64_t i = 0;
    for (; i + RMS_LANES <= dim; i += RMS_LANES)
        for (int k = 0; k < RMS_LANES; k++) part[k] += (double)row[i + k] * row[i + k];
    for (int k = 0; i < dim; i++, k++) part[k] += (double)row[i] * row[i];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

void kv_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        const double sum = sum_of_squares(row, dim);
        float inv = (float)(1.0 / sqrt(sum / (double)dim + (double)eps));
        float *dst = out + r * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = row[i] * inv * weight[i];
    }
}
