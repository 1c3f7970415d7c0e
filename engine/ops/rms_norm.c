/* RMSNorm over the last dimension of a float32 [rows, dim] tensor:
 *
 *   out[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * weight[i]
 *
 * Why a kernel: torch's CPU rms_norm runs as several ops and took ~50 us per
 * call on a 576-wide decode row, 61 calls per SmolLM2 step; this takes a few
 * microseconds. Sums of squares accumulate in double so the result matches
 * the reference (torch.rms_norm, float32) to float32 rounding. Single-threaded:
 * even a 512-row prefill is ~0.3 M multiply-adds.
 */
#include <math.h>
#include <stdint.h>

void kv_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; i++) sum += (double)row[i] * row[i];
        float inv = (float)(1.0 / sqrt(sum / (double)dim + (double)eps));
        float *dst = out + r * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = row[i] * inv * weight[i];
    }
}
