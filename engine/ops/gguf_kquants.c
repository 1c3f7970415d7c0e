/* The GGUF types of 256-weight blocks (the K-quants Q4_K, Q5_K, Q6_K, and IQ4_XS) for gguf_blocks.c, which
 * includes this file: their blocks,
 * the activation rounding they multiply with, their dot products and their dequantization.
 *
 * A K-quant block holds 256 weights ("super-block") in sub-blocks with their own integer scales:
 *   Q4_K (144 bytes, 4.5 bits a weight): 8 sub-blocks of 32, value d * sc[j] * q - dmin * m[j], q in 0..15,
 *        sc and m 6-bit, packed in 12 bytes;
 *   Q5_K (176 bytes, 5.5 bits): Q4_K plus a fifth bit per weight, q in 0..31;
 *   Q6_K (210 bytes, 6.5625 bits): 16 sub-blocks of 16, value d * sc[j] * (q - 32), q in 0..63, sc int8;
 *   IQ4_XS (136 bytes, 4.25 bits): 8 sub-blocks of 32, value d * (ls[j] - 32) * IQ4_VALUES[q], q in 0..15,
 *        ls 6-bit.
 * Activations are rounded per block of 256 (one float scale d = max|x| / 127) with the sum of each 16
 * values kept as int16, so a sub-block's offset (Q4_K's and Q5_K's minimum, Q6_K's centre 32) is
 * subtracted exactly from the integer sums: a block's whole dot product is one int32, scaled once.
 * IQ4_XS's weights are signed (its grid's values), multiplied as |w| times x * sign(w), as Q8_0's are.
 */

enum { KV_Q4_K = 12, KV_Q5_K = 13, KV_Q6_K = 14, KV_IQ4_XS = 23 };

#define QK_K 256 /* weights per block of these types */

typedef struct {
    uint16_t d, dmin;   /* fp16 super-scales of the sub-block scales and minimums */
    uint8_t scales[12]; /* 8 six-bit scales and 8 six-bit minimums (k_scales_and_mins_vector) */
    uint8_t qs[128];    /* 64 weights per 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high */
} BlockQ4_K;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];  /* bit j of qh[l]: the fifth bit of weight l of sub-block j */
    uint8_t qs[128]; /* the low 4 bits, as in Q4_K */
} BlockQ5_K;

typedef struct {
    uint8_t ql[128];  /* per half of 128 weights, 64 bytes: weights 0..63 in the low nibbles, 64..127 high */
    uint8_t qh[64];   /* per half, 32 bytes: bits 2g, 2g + 1 of qh[l] the top bits of weight 32 g + l */
    int8_t scales[16]; /* one per 16 weights */
    uint16_t d;
} BlockQ6_K;

typedef struct {
    uint16_t d;
    uint16_t scales_h;  /* bits 2j, 2j + 1: the top two bits of sub-block j's scale */
    uint8_t scales_l[4]; /* the low four bits of sub-block j's scale in the low (j even) or high (j odd) nibble of
                            scales_l[j / 2] */
    uint8_t qs[128];     /* 16 bytes per sub-block, indices laid out as IQ4_NL's */
} BlockIQ4_XS;

/* The types of 256-weight blocks, whose products take activations rounded per 256 (with sums of 16). */
static inline int is_k_type(int type) { return type == KV_Q4_K || type == KV_Q5_K || type == KV_Q6_K || type == KV_IQ4_XS; }

/* The 8 six-bit scales (low 64 bits) and minimums (high 64 bits) of a Q4_K / Q5_K block as bytes, decoded
 * four at a time in 32-bit words. Bytes 0-3 of `packed` hold scales 0-3 in their low 6 bits, bytes 4-7
 * minimums 0-3; scales and minimums 4-7 keep their low 4 bits in bytes 8-11 (scale low, minimum high) and
 * their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (minimums). */
static inline __m128i k_scales_and_mins_vector(const uint8_t *packed) {
    uint32_t a, b, c;
    __builtin_memcpy(&a, packed, 4), __builtin_memcpy(&b, packed + 4, 4), __builtin_memcpy(&c, packed + 8, 4);
    const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
    uint32_t scales_low = a & six, minimums_low = b & six;
    uint32_t scales_high = (c & four) | ((a >> 6) & two) << 4, minimums_high = ((c >> 4) & four) | ((b >> 6) & two) << 4;
    return _mm_set_epi32((int)minimums_high, (int)minimums_low, (int)scales_high, (int)scales_low);
}

/* A block's numbers, unpacked for the dot products and dequantization. */
typedef struct {
    __m256i q[8];          /* the 256 weights as bytes, in order: unsigned (Q6_K: before subtracting 32), IQ4_XS
                              signed */
    __m128i scale_bytes;   /* one int8 scale per 16 weights (Q4_K / Q5_K: sub-block j's for 16-groups 2j, 2j+1) */
    __m128i minimum_bytes; /* Q4_K / Q5_K: sub-block j's minimum at bytes 2j and 2j + 1; Q6_K: zero */
    float d, dmin;
} KBlock;

static inline int64_t bytes_per_k_block(int type) {
    switch (type) {
    case KV_Q6_K: return sizeof(BlockQ6_K);
    case KV_Q5_K: return sizeof(BlockQ5_K);
    case KV_IQ4_XS: return sizeof(BlockIQ4_XS);
    default: return sizeof(BlockQ4_K);
    }
}

static inline __attribute__((always_inline)) void unpack_k_block(int type, const uint8_t *bytes, KBlock *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t ahead = 0; ahead < bytes_per_k_block(type); ahead += 64) __builtin_prefetch(bytes + PREFETCH_BYTES + ahead);
    if (type == KV_IQ4_XS) {
        const BlockIQ4_XS *block = (const BlockIQ4_XS *)bytes;
        out->d = fp16_to_float(block->d), out->dmin = 0.0f;
        const __m256i grid = iq4_grid();
        for (int j = 0; j < 8; j++) out->q[j] = iq4_lookup(grid, block->qs + 16 * j);
        /* Sub-block j's scale: the low nibble (j even) or high nibble (j odd) of scales_l[j / 2], and bits 2j, 2j + 1
         * of scales_h on top; decoded four at a time in 32-bit words (h's nibble k moved to byte k first). */
        uint32_t low, h = block->scales_h;
        __builtin_memcpy(&low, block->scales_l, 4);
        h = (h & 0x00FF) | (h & 0xFF00) << 8;
        h = (h & 0x000F000F) | (h & 0x00F000F0) << 4;
        uint32_t even = (low & 0x0F0F0F0F) | (h & 0x03030303) << 4, odd = (low >> 4 & 0x0F0F0F0F) | (h >> 2 & 0x03030303) << 4;
        __m128i scales = _mm_sub_epi8(_mm_unpacklo_epi8(_mm_cvtsi32_si128((int)even), _mm_cvtsi32_si128((int)odd)),
                                      _mm_set1_epi8(32));
        out->scale_bytes = _mm_unpacklo_epi8(scales, scales);
        out->minimum_bytes = _mm_setzero_si128();
        return;
    }
    if (type == KV_Q6_K) {
        const BlockQ6_K *block = (const BlockQ6_K *)bytes;
        out->d = fp16_to_float(block->d), out->dmin = 0.0f;
        const __m256i top2 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) { /* 128 weights: ql's low nibbles, then its high ones; qh's bit pairs */
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(block->ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(block->ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(block->qh + 32 * h));
            __m256i *q = out->q + 4 * h;
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, top2));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), top2));
        }
        out->scale_bytes = _mm_loadu_si128((const __m128i *)block->scales);
        out->minimum_bytes = _mm_setzero_si128();
        return;
    }
    const int five_bit = type == KV_Q5_K;
    const BlockQ4_K *head = (const BlockQ4_K *)bytes; /* d, dmin and scales sit alike in both */
    out->d = fp16_to_float(head->d), out->dmin = fp16_to_float(head->dmin);
    __m128i scales_mins = k_scales_and_mins_vector(head->scales);
    out->scale_bytes = _mm_unpacklo_epi8(scales_mins, scales_mins);
    out->minimum_bytes = _mm_unpackhi_epi8(scales_mins, scales_mins);
    const uint8_t *qs = five_bit ? ((const BlockQ5_K *)bytes)->qs : head->qs;
    __m256i high = five_bit ? _mm256_loadu_si256((const __m256i *)((const BlockQ5_K *)bytes)->qh) : _mm256_setzero_si256();
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        out->q[2 * c] = _mm256_and_si256(raw, low4);
        out->q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if (five_bit) { /* bits 2c and 2c + 1 of each qh byte, moved to bit 4; then the next two */
            out->q[2 * c] = _mm256_or_si256(out->q[2 * c], _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));
            out->q[2 * c + 1] = _mm256_or_si256(out->q[2 * c + 1], _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4));
            high = _mm256_srli_epi16(high, 2);
        }
    }
}

/* Dot products of one weight row of 256-weight blocks (nb blocks) with R activation rows (block offsets act_first[r]),
 * as dot_row does for the 32-weight types: each row block by block, in the same order for every R. */
static inline __attribute__((always_inline)) void dot_row_k(int type, const uint8_t *w, const Activations *act,
                                                            const int64_t *act_first, int64_t nb, const int R,
                                                            float *out) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        KBlock block;
        unpack_k_block(type, w + b * bytes_per_k_block(type), &block);
        /* maddubs takes one unsigned operand: unsigned weights as they are, IQ4_XS's as |w| . x * sign(w) */
        const int signed_weights = type == KV_IQ4_XS;
        __m256i q[8];
        for (int g = 0; g < 8; g++) q[g] = signed_weights ? _mm256_sign_epi8(block.q[g], block.q[g]) : block.q[g];
        const __m128i scale_bytes = block.scale_bytes;
        const __m256i minimums16 = _mm256_cvtepu8_epi16(block.minimum_bytes);
        const float d = block.d, dmin = block.dmin;
        /* Per 32 weights g: scale 2g in the low 8 int16 lanes (weights 0..15), 2g + 1 in the high ones. */
        __m256i scales[8];
        for (int g = 0; g < 8; g++) {
            const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (2 * g + 1), 0x0101010101010101LL * (2 * g));
            scales[g] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scale_bytes, pick));
        }
        const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes); /* Q6_K: for the centre's bsum products */
        for (int r = 0; r < R; r++) {
            int64_t i = act_first[r] + b;
            const int8_t *xq = act->q + i * QK_K;
            __m256i sums = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * g));
                __m256i pairs = _mm256_maddubs_epi16(q[g], signed_weights ? _mm256_sign_epi8(xv, block.q[g]) : xv);
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, scales[g]));
            }
            __m256i bsums = _mm256_loadu_si256((const __m256i *)(act->bsums + i * 16));
            float dx = act->d[i];
            if (type == KV_Q6_K) /* sum sc (q - 32) x = sum sc q x - 32 sum_g sc_g bsum_g */
                sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums), acc[r]);
            if (type == KV_Q4_K || type == KV_Q5_K) /* minus dmin m_j dx sum x over sub-block j */
                acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx),
                                          _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, minimums16)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]);
}

/* One row of 256-weight blocks -> K float32 weights: d * sc * q - dmin * m (Q4_K, Q5_K), d * sc * (q - 32)
 * (Q6_K) or d * (ls - 32) * value (IQ4_XS), each product rounded as the torch reference rounds it (no fused multiply-add). */
static void dequantize_row_k(int type, const uint8_t *row, int64_t K, float *dst) {
    for (int64_t b = 0; b < K / QK_K; b++, dst += QK_K) {
        KBlock block;
        unpack_k_block(type, row + b * bytes_per_k_block(type), &block);
        int8_t scales[16];
        uint8_t minimums[16];
        _mm_storeu_si128((__m128i *)scales, block.scale_bytes);
        _mm_storeu_si128((__m128i *)minimums, block.minimum_bytes);
        const __m256i centre = _mm256_set1_epi32(type == KV_Q6_K ? 32 : 0);
        for (int g = 0; g < 16; g++) { /* 16 weights with one scale (and minimum) */
            __m128i bytes = g % 2 ? _mm256_extracti128_si256(block.q[g / 2], 1) : _mm256_castsi256_si128(block.q[g / 2]);
            __m256 scale = _mm256_set1_ps(block.d * (float)scales[g]);
            __m256 minimum = _mm256_set1_ps(block.dmin * (float)minimums[g]);
            for (int half = 0; half < 2; half++) {
                __m128i eight = half ? _mm_srli_si128(bytes, 8) : bytes;
                __m256i wide = type == KV_IQ4_XS ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
                __m256 v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, centre)));
                if (type == KV_Q4_K || type == KV_Q5_K) v = _mm256_sub_ps(v, minimum);
                _mm256_storeu_ps(dst + 16 * g + 8 * half, v);
            }
        }
    }
}
