/* The register-tiled products over interleaved GGUF blocks, written once for two register widths: gguf_interleaved.c
 * includes this file twice, with the V_* macros naming 512-bit (AVX-512 VNNI: a vector is a whole group of 16
 * weight rows) or 256-bit operations (AVX2, with VNNI where the build has it: a vector is half a group, 8 rows,
 * and a group is two passes; the 32-weight types only). The layout is the same for both: a half's bytes are the second 32 of each 64-byte
 * vector and the second 8 of each 16-entry array of the group's block.
 *
 * Every function here is named through V_NAME (suffix _512 or _256). Shapes: a vector holds V_LANES weight rows'
 * int32 sums or float outputs; "quad v" of a 32-weight run is its weights 4v .. 4v+3.
 */

/* Where half h of a group's block starts: in its 64-byte vectors, and in its 16-entry fp16 / uint16 arrays. */
#define V_VECTOR_HALF(h) (32 * (h) * (V_HALVES - 1))
#define V_ARRAY_HALF(h) (16 * (h) * (V_HALVES - 1))

/* A 32-weight block of V_LANES rows: the 8 quads' unsigned weight bytes, the rows' scales and offsets. */
typedef struct {
    V_I w[8];
    V_F d, m;
} V_NAME(Block);

static inline __attribute__((always_inline)) void V_NAME(unpack)(int base, const uint8_t *p, int h, V_NAME(Block) *t) {
    t->d = V_HALFS(p + V_ARRAY_HALF(h));
    p += 2 * GROUP_ROWS;
    if (interleaved_has_offset(base)) {
        t->m = V_HALFS(p + V_ARRAY_HALF(h));
        p += 2 * GROUP_ROWS;
    }
    if (base == KV_Q8_0) {
        for (int v = 0; v < 8; v++) t->w[v] = V_LOADU(p + 64 * v + V_VECTOR_HALF(h));
        return;
    }
    V_I high = V_ZEROI;
    if (interleaved_is_5bit(base)) {
        high = V_LOADU(p + V_VECTOR_HALF(h));
        p += 64;
    }
    const V_I low4 = V_SET8(0x0F);
    for (int c = 0; c < 4; c++) {
        V_I raw = V_LOADU(p + 64 * c + V_VECTOR_HALF(h));
        t->w[c] = V_AND(raw, low4);
        t->w[c + 4] = V_AND(V_SRLI16(raw, 4), low4);
    }
    if (base == KV_IQ4_NL) { /* indices -> grid values + 128, one byte shuffle per quad */
        const V_I grid = V_GRID(_mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
        for (int v = 0; v < 8; v++) t->w[v] = V_SHUF8(grid, t->w[v]);
    } else if (interleaved_is_5bit(base)) { /* quad v's fifth bits: bit v of each qh byte, moved to bit 4 */
        const V_I bit4 = V_SET8(0x10);
        for (int v = 0; v < 8; v++) {
            V_I moved = v <= 4 ? V_SLLI16(high, 4 - v) : V_SRLI16(high, v - 4);
            t->w[v] = V_OR(t->w[v], V_AND(moved, bit4));
        }
    }
}

/* Q8_0 and IQ4_NL in the 256-bit kernel without VNNI: their unsigned bytes (weight + 128) reach 255, where
 * vpmaddubsw's pair sums (2 * 255 * 127) would saturate. Their products take the signed weights' magnitudes times
 * the activations with the weights' signs (vpsignb) instead, pair sums of at most 2 * 128 * 127, so the integer
 * sums start at 0 rather than at -128 times the activations' sum: the same sums, exactly. */
#if V_LANES == 8 && !KV_VNNI
#define V_SIGNED_PAIRS(base) ((base) == KV_Q8_0 || (base) == KV_IQ4_NL)
#else
#define V_SIGNED_PAIRS(base) 0
#endif

/* y[m0 .. m0+R, n0 .. n0+V_LANES] (columns past N left alone) for half h of one group (nb blocks from w) and R
 * activation rows. */
static inline __attribute__((always_inline)) void V_NAME(dot)(int base, const uint8_t *w, int h, int64_t nb,
                                                               const InterleavedActivations *act, int64_t m0,
                                                               const int R, const float *bias, float *y, int64_t N,
                                                               int64_t n0, int once) {
    V_F acc[V_MAX_R];
    for (int r = 0; r < R; r++) acc[r] = V_ZEROF;
    const int64_t stride = interleaved_block_bytes(base);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * stride;
        /* every 64-byte line of the block PREFETCH_BYTES ahead: with a hint for only some of them, a 2-core EPYC
         * streamed the weights of 8-row products at 12-18 GB/s instead of 25-55 */
        for (int64_t ahead = 0; ahead < stride; ahead += 64) prefetch_weight_line(p + PREFETCH_BYTES + ahead, once);
        V_NAME(Block) t;
        V_NAME(unpack)(base, p, h, &t);
#if V_LANES == 8 && !KV_VNNI
        V_I sign[8]; /* the signed weights, whose signs the activations take; t.w becomes their magnitudes */
        if (V_SIGNED_PAIRS(base))
            for (int v = 0; v < 8; v++) {
                sign[v] = _mm256_xor_si256(t.w[v], V_SET8(0x80));
                t.w[v] = _mm256_abs_epi8(sign[v]);
            }
#endif
        for (int r = 0; r < R; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int32_t *quads = (const int32_t *)(act->q + i * QK);
            V_I sums = V_SET32(V_SIGNED_PAIRS(base) ? 0 : act->start[i]);
#if V_LANES == 8 && !KV_VNNI
            if (V_SIGNED_PAIRS(base)) {
                for (int v = 0; v < 8; v++) sums = V_DOT(sums, t.w[v], _mm256_sign_epi8(V_SET32(quads[v]), sign[v]));
            } else {
                /* vpmaddubsw's 16-bit pair sums added in 16 bits before one vpmaddwd widens them: a 4-bit weight's
                 * pair sums (at most 2 * 15 * 127) fit 8 at a time, a 5-bit one's (2 * 31 * 127) 4 at a time */
                const int run = interleaved_is_5bit(base) ? 4 : 8;
                for (int v0 = 0; v0 < 8; v0 += run) {
                    __m256i pairs = _mm256_maddubs_epi16(t.w[v0], V_SET32(quads[v0]));
                    for (int v = v0 + 1; v < v0 + run; v++)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(t.w[v], V_SET32(quads[v])));
                    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
                }
            }
#else
            for (int v = 0; v < 8; v++) sums = V_DOT(sums, t.w[v], V_SET32(quads[v]));
#endif
            acc[r] = V_FMA(V_CVT(sums), V_MULF(t.d, V_SETF(act->d[i])), acc[r]);
            if (interleaved_has_offset(base)) acc[r] = V_FMA(t.m, V_SETF(act->s[i]), acc[r]);
        }
    }
    const int64_t columns = N - n0 < V_LANES ? N - n0 : V_LANES;
    const V_F b = bias ? V_LOAD_COLUMNS(bias + n0, columns) : V_ZEROF;
    for (int r = 0; r < R; r++) V_STORE_COLUMNS(y + (m0 + r) * N + n0, columns, V_ADDF(acc[r], b));
}

/* Every half and activation tile of group g, for one 32-weight type (a constant at each call: each type's loops
 * compile on their own). */
static inline __attribute__((always_inline)) void V_NAME(group)(int base, const uint8_t *w, int64_t g, int64_t M,
                                                                 int64_t nb, const InterleavedActivations *act,
                                                                 const float *bias, float *y, int64_t N) {
    const uint8_t *group = w + g * nb * interleaved_block_bytes(base);
    for (int h = 0; h < V_HALVES && g * GROUP_ROWS + h * V_LANES < N; h++) {
        const int64_t n0 = g * GROUP_ROWS + h * V_LANES;
        /* one tile of activation rows and one half: each weight line read once (two halves read the two halves of
         * each line, the second pass after the whole group) */
        const int once = V_HALVES == 1 && M <= V_MAX_R;
        for (int64_t m0 = 0; m0 < M; m0 += V_MAX_R) {
            const int R = (int)(M - m0 < V_MAX_R ? M - m0 : V_MAX_R);
            switch (R) {
#if V_MAX_R > 4
            case 8: V_NAME(dot)(base, group, h, nb, act, m0, 8, bias, y, N, n0, once); break;
            case 7: V_NAME(dot)(base, group, h, nb, act, m0, 7, bias, y, N, n0, once); break;
            case 6: V_NAME(dot)(base, group, h, nb, act, m0, 6, bias, y, N, n0, once); break;
            case 5: V_NAME(dot)(base, group, h, nb, act, m0, 5, bias, y, N, n0, once); break;
#endif
            case 4: V_NAME(dot)(base, group, h, nb, act, m0, 4, bias, y, N, n0, once); break;
            case 3: V_NAME(dot)(base, group, h, nb, act, m0, 3, bias, y, N, n0, once); break;
            case 2: V_NAME(dot)(base, group, h, nb, act, m0, 2, bias, y, N, n0, once); break;
            default: V_NAME(dot)(base, group, h, nb, act, m0, 1, bias, y, N, n0, once); break;
            }
        }
    }
}

/* The groups shared out among the threads of the enclosing parallel region (called by each of them), in guided
 * chunks: contiguous runs that the software prefetch streams through, halving towards the end so that a thread that
 * fell behind (its core slower, or its memory) is caught up. The type is switched on inside the loop, so that each
 * case's calls have it as a constant (a parallel region is outlined before inlining: its own variables are not
 * constants). */
static void V_NAME(gemm)(int base, const uint8_t *w, int64_t M, int64_t nb, const InterleavedActivations *act,
                         const float *bias, float *y, int64_t N) {
    const int64_t groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;
#pragma omp for schedule(guided, 2)
    for (int64_t g = 0; g < groups; g++) {
        switch (base) {
        case KV_Q4_0: V_NAME(group)(KV_Q4_0, w, g, M, nb, act, bias, y, N); break;
        case KV_Q4_1: V_NAME(group)(KV_Q4_1, w, g, M, nb, act, bias, y, N); break;
        case KV_Q5_0: V_NAME(group)(KV_Q5_0, w, g, M, nb, act, bias, y, N); break;
        case KV_Q5_1: V_NAME(group)(KV_Q5_1, w, g, M, nb, act, bias, y, N); break;
        case KV_Q8_0: V_NAME(group)(KV_Q8_0, w, g, M, nb, act, bias, y, N); break;
        default: V_NAME(group)(KV_IQ4_NL, w, g, M, nb, act, bias, y, N); break;
        }
    }
}

#if V_LANES == 16 /* The 256-weight types on 512-bit registers only: in 256-bit ones they measured no faster than the
                    row kernel (dot_row_k), whose 16-bit products already carry their sub-block scales. */
/* Quad v (4 weights of each of the group's rows) of sub-block j of half h of the block at p, unsigned: Q4_K, Q5_K,
 * IQ4_XS. */
static inline __attribute__((always_inline)) V_I V_NAME(quad_k)(int type, const uint8_t *p, int h, int j, int v) {
    const V_I low4 = V_SET8(0x0F);
    const int half = V_VECTOR_HALF(h);
    if (type == KV_IQ4_XS) { /* quads v and v + 4: the low and high nibbles of one load */
        const V_I grid = V_GRID(_mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
        V_I raw = V_LOADU(p + 128 + 64 * (4 * j + v % 4) + half);
        return V_SHUF8(grid, v < 4 ? V_AND(raw, low4) : V_AND(V_SRLI16(raw, 4), low4));
    }
    const int five_bit = type == KV_Q5_K;
    const uint8_t *qs = p + (five_bit ? 768 : 256) + 64 * 8 * (j / 2);
    V_I raw = V_LOADU(qs + 64 * v + half);
    V_I w = j % 2 ? V_AND(V_SRLI16(raw, 4), low4) : V_AND(raw, low4);
    if (five_bit) { /* bit j of the quad's qh bytes, moved to bit 4 */
        V_I qh = V_LOADU(p + 256 + 64 * v + half);
        qh = j <= 4 ? V_SLLI16(qh, 4 - j) : V_SRLI16(qh, j - 4);
        w = V_OR(w, V_AND(qh, V_SET8(0x10)));
    }
    return w;
}

/* Each row's integer scale of sub-block j of half h of the block at p: Q4_K, Q5_K, IQ4_XS. */
static inline __attribute__((always_inline)) V_I V_NAME(scale_k)(int type, const uint8_t *p, int h, int j) {
    const int half = V_VECTOR_HALF(h);
    if (type == KV_IQ4_XS) { /* the low 4 bits from nibble j of the scales_l word, the top 2 from bits 2j, 2j + 1 of
                                scales_h */
        V_I low = V_AND(V_SRLI32(V_LOADU(p + 64 + half), 4 * j), V_SET32(0x0F));
        V_I high = V_U16(p + 32 + V_ARRAY_HALF(h));
        high = V_SLLI32(V_AND(V_SRLI32(high, 2 * j), V_SET32(3)), 4);
        return V_SUB32(V_OR(low, high), V_SET32(32));
    }
    /* Q4_K, Q5_K: the packed scales' three words per row, decoded as k_scales_and_mins_vector does */
    const V_I a = V_LOADU(p + 64 + half);
    const V_I scales = j < 4 ? V_AND(a, V_SET8(0x3F))
                             : V_OR(V_AND(V_LOADU(p + 192 + half), V_SET8(0x0F)),
                                    V_SLLI32(V_AND(V_SRLI32(a, 6), V_SET8(0x03)), 4));
    return V_AND(V_SRLI32(scales, 8 * (j % 4)), V_SET32(0xFF));
}

/* Sub-block j's 32 weights (8 quads) of half h of the group's 256-weight block at p, unsigned; *scale: each row's
 * integer scale of the sub-block, *second the second 16's (Q6_K). */
static inline __attribute__((always_inline)) void V_NAME(unpack_k)(int type, const uint8_t *p, int h, int j,
                                                                    V_I w[8], V_I *scale, V_I *second) {
    if (type != KV_Q6_K) {
        *scale = V_NAME(scale_k)(type, p, h, j);
        for (int v = 0; v < 8; v++) w[v] = V_NAME(quad_k)(type, p, h, j, v);
        return;
    }
    const V_I low4 = V_SET8(0x0F);
    const int half = V_VECTOR_HALF(h);
    const int part = j / 4, g = j % 4;
    const uint8_t *ql = p + 288 + 64 * (16 * part + 8 * (g % 2)), *qh = p + 288 + 2048 + 64 * 8 * part;
    const V_I top2 = V_SET8(0x30);
    for (int v = 0; v < 8; v++) {
        V_I lo = V_LOADU(ql + 64 * v + half), hi = V_LOADU(qh + 64 * v + half);
        lo = g < 2 ? V_AND(lo, low4) : V_AND(V_SRLI16(lo, 4), low4);
        hi = g < 3 ? V_SLLI16(hi, 4 - 2 * g) : V_SRLI16(hi, 2);
        w[v] = V_OR(lo, V_AND(hi, top2));
    }
    /* sub-blocks 2j and 2j + 1: bytes (2j) % 4 and (2j + 1) % 4 of scale word (2j) / 4, sign-extended */
    V_I words = V_LOADU(p + 32 + 64 * (j / 2) + half);
    const int first = (2 * j) % 4;
    *scale = V_SRAI32(V_SLLI32(words, 24 - 8 * first), 24);
    *second = V_SRAI32(V_SLLI32(words, 16 - 8 * first), 24);
}

/* Q4_K, Q5_K: each row's 8 six-bit sub-block minimums of the block at p as int16 pairs, vpdpwssd's operand:
 * pairs[k] holds sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) for k = 0..3, the order of KActivations' min_pairs. */
static inline __attribute__((always_inline)) void V_NAME(minimum_pairs)(const uint8_t *p, int h, V_I pairs[4]) {
    const int half = V_VECTOR_HALF(h);
    const V_I b = V_LOADU(p + 128 + half), c = V_LOADU(p + 192 + half), even = V_SET32(0x00FF00FF);
    const V_I first = V_AND(b, V_SET8(0x3F)); /* minimums 0..3, one byte each */
    const V_I last = V_OR(V_AND(V_SRLI32(c, 4), V_SET8(0x0F)), V_SLLI32(V_AND(V_SRLI32(b, 6), V_SET8(0x03)), 4));
    pairs[0] = V_AND(first, even);
    pairs[1] = V_AND(V_SRLI32(first, 8), even);
    pairs[2] = V_AND(last, even);
    pairs[3] = V_AND(V_SRLI32(last, 8), even);
}

/* Tiles of at least this many rows (Q4_K, Q5_K, IQ4_XS) take a sub-block quad by quad, each quad's multiply-adds for
 * every row in turn, where fewer take it row by row (each row's 8 in turn after all 8 quads are unpacked). A 1.1B
 * LLaMA's 88 Q4_K products on 2 Zen 4 cores, the two orders alternating on every call: 1.07-1.11x at 3-6 rows,
 * 1.02-1.06x at 8-32, 1.00-1.04x at 110, but 0.92x at 2 rows and 0.98x at 1 (which stream the weights at the
 * memory's speed either way). Whole decode steps of its Q4_K_M file, old and new builds alternating every 2 steps:
 * 4 sequences 1.042x, 8 sequences 1.017x. */
#define BY_QUAD_ROWS 3

/* y[m0 .. m0+R, n0 .. n0+V_LANES] for half h of one group of 256-weight blocks (nb blocks from w). */
static inline __attribute__((always_inline)) void V_NAME(dot_k)(int type, const uint8_t *w, int h, int64_t nb,
                                                                 const KActivations *act, int64_t m0, const int R,
                                                                 const float *bias, float *y, int64_t N, int64_t n0,
                                                                 int once, const int by_quad) {
    V_F acc[V_MAX_R_K];
    for (int r = 0; r < R; r++) acc[r] = V_ZEROF;
    const int64_t stride = GROUP_ROWS * bytes_per_k_block(type);
    const int64_t lines = (stride + 63) / 64;
    const int has_min = type == KV_Q4_K || type == KV_Q5_K;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * stride;
        V_I sums[V_MAX_R_K];
        for (int r = 0; r < R; r++) sums[r] = V_ZEROI;
        for (int j = 0; j < 8; j++) {
            /* the block's lines PREFETCH_BYTES ahead, an eighth with each sub-block: with all 36-53 asked for at
             * the top of the block, 1-row products on a Zen 4 core streamed 19-27 GB/s instead of 31-32 */
            for (int64_t line = j * lines / 8; line < (j + 1) * lines / 8; line++)
                prefetch_weight_line(p + PREFETCH_BYTES + 64 * line, once);
            if (by_quad) {
                /* quad by quad, the rows' sums side by side: R independent multiply-adds follow each other */
                V_I s[V_MAX_R_K];
                for (int r = 0; r < R; r++)
                    s[r] = V_SET32(type == KV_IQ4_XS ? -128 * act->sum32[((m0 + r) * nb + b) * 8 + j] : 0);
                for (int v = 0; v < 8; v++) {
                    const V_I quad = V_NAME(quad_k)(type, p, h, j, v);
                    for (int r = 0; r < R; r++) {
                        const int32_t *quads = (const int32_t *)(act->q + ((m0 + r) * nb + b) * QK_K + 32 * j);
                        s[r] = V_DOT(s[r], quad, V_SET32(quads[v]));
                    }
                }
                const V_I scale = V_NAME(scale_k)(type, p, h, j);
                for (int r = 0; r < R; r++) sums[r] = V_ADD32(sums[r], V_MULLO(s[r], scale));
                continue;
            }
            V_I q[8], scale, second = V_ZEROI;
            V_NAME(unpack_k)(type, p, h, j, q, &scale, &second);
            for (int r = 0; r < R; r++) {
                const int64_t i = (m0 + r) * nb + b;
                const int32_t *quads = (const int32_t *)(act->q + i * QK_K + 32 * j);
                if (type == KV_Q6_K) { /* two sub-blocks of 16, each centred at 32 */
                    V_I s0 = V_SET32(-32 * act->sum16[i * 16 + 2 * j]);
                    V_I s1 = V_SET32(-32 * act->sum16[i * 16 + 2 * j + 1]);
                    for (int v = 0; v < 4; v++) {
                        s0 = V_DOT(s0, q[v], V_SET32(quads[v]));
                        s1 = V_DOT(s1, q[v + 4], V_SET32(quads[v + 4]));
                    }
                    sums[r] = V_ADD32(sums[r], V_ADD32(V_MULLO(s0, scale), V_MULLO(s1, second)));
                    continue;
                }
                V_I s = V_SET32(type == KV_IQ4_XS ? -128 * act->sum32[i * 8 + j] : 0);
                for (int v = 0; v < 8; v++) s = V_DOT(s, q[v], V_SET32(quads[v]));
                sums[r] = V_ADD32(sums[r], V_MULLO(s, scale));
            }
        }
        const V_F d = V_HALFS(p + V_ARRAY_HALF(h));
        V_I pairs[4];
        if (has_min) V_NAME(minimum_pairs)(p, h, pairs);
        const V_F dmin = has_min ? V_HALFS(p + 32 + V_ARRAY_HALF(h)) : d;
        for (int r = 0; r < R; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const V_F dx = V_SETF(act->d[i]);
            acc[r] = V_FMA(V_CVT(sums[r]), V_MULF(d, dx), acc[r]);
            if (has_min) { /* the minimums' term, sum over j of minimum_j * sum32_j: four int16 pair products */
                V_I mins = V_ZEROI;
                for (int k = 0; k < 4; k++) mins = V_DOT16(mins, pairs[k], V_SET32(act->min_pairs[i * 4 + k]));
                acc[r] = V_FNMA(V_CVT(mins), V_MULF(dmin, dx), acc[r]);
            }
        }
    }
    const int64_t columns = N - n0 < V_LANES ? N - n0 : V_LANES;
    const V_F b = bias ? V_LOAD_COLUMNS(bias + n0, columns) : V_ZEROF;
    for (int r = 0; r < R; r++) V_STORE_COLUMNS(y + (m0 + r) * N + n0, columns, V_ADDF(acc[r], b));
}

/* Every activation tile of group g, for one 256-weight type (a constant at each call); by_quad (Q4_K, Q5_K,
 * IQ4_XS): tiles of BY_QUAD_ROWS rows or more quad by quad. */
static inline __attribute__((always_inline)) void V_NAME(group_k)(int type, const uint8_t *w, int64_t g, int64_t M,
                                                                   int64_t nb, const KActivations *act,
                                                                   const float *bias, float *y, int64_t N,
                                                                   const int by_quad) {
    const uint8_t *group = w + g * nb * GROUP_ROWS * bytes_per_k_block(type);
    const int64_t n0 = g * GROUP_ROWS;
    const int once = M <= V_MAX_R_K; /* one tile of activation rows: each weight read once */
    for (int64_t m0 = 0; m0 < M; m0 += V_MAX_R_K) {
        const int R = (int)(M - m0 < V_MAX_R_K ? M - m0 : V_MAX_R_K);
        if (by_quad && R >= BY_QUAD_ROWS) {
            switch (R) {
            case 8: V_NAME(dot_k)(type, group, 0, nb, act, m0, 8, bias, y, N, n0, once, 1); break;
            case 7: V_NAME(dot_k)(type, group, 0, nb, act, m0, 7, bias, y, N, n0, once, 1); break;
            case 6: V_NAME(dot_k)(type, group, 0, nb, act, m0, 6, bias, y, N, n0, once, 1); break;
            case 5: V_NAME(dot_k)(type, group, 0, nb, act, m0, 5, bias, y, N, n0, once, 1); break;
            case 4: V_NAME(dot_k)(type, group, 0, nb, act, m0, 4, bias, y, N, n0, once, 1); break;
            default: V_NAME(dot_k)(type, group, 0, nb, act, m0, 3, bias, y, N, n0, once, 1); break;
            }
            continue;
        }
        switch (R) {
        case 8: V_NAME(dot_k)(type, group, 0, nb, act, m0, 8, bias, y, N, n0, once, 0); break;
        case 7: V_NAME(dot_k)(type, group, 0, nb, act, m0, 7, bias, y, N, n0, once, 0); break;
        case 6: V_NAME(dot_k)(type, group, 0, nb, act, m0, 6, bias, y, N, n0, once, 0); break;
        case 5: V_NAME(dot_k)(type, group, 0, nb, act, m0, 5, bias, y, N, n0, once, 0); break;
        case 4: V_NAME(dot_k)(type, group, 0, nb, act, m0, 4, bias, y, N, n0, once, 0); break;
        case 3: V_NAME(dot_k)(type, group, 0, nb, act, m0, 3, bias, y, N, n0, once, 0); break;
        case 2: V_NAME(dot_k)(type, group, 0, nb, act, m0, 2, bias, y, N, n0, once, 0); break;
        default: V_NAME(dot_k)(type, group, 0, nb, act, m0, 1, bias, y, N, n0, once, 0); break;
        }
    }
}

/* gemm_k for Q4_K, Q5_K and IQ4_XS products of BY_QUAD_ROWS rows or more. Its own function: compiled into gemm_k
 * beside the row-by-row tiles, the quad-by-quad ones made whole 2-sequence decode steps of a 1.1B LLaMA 3-5%
 * slower, with the row-by-row code unchanged; so did one switch over both kinds of tile in group_k (0.969x against
 * the two switches below), which the compiler lays out differently. */
static __attribute__((noinline)) void V_NAME(gemm_k_by_quad)(int type, const uint8_t *w, int64_t M, int64_t nb,
                                                              const KActivations *act, const float *bias, float *y,
                                                              int64_t N) {
    const int64_t groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;
#pragma omp for schedule(guided, 2)
    for (int64_t g = 0; g < groups; g++) {
        switch (type) {
        case KV_Q4_K: V_NAME(group_k)(KV_Q4_K, w, g, M, nb, act, bias, y, N, 1); break;
        case KV_Q5_K: V_NAME(group_k)(KV_Q5_K, w, g, M, nb, act, bias, y, N, 1); break;
        default: V_NAME(group_k)(KV_IQ4_XS, w, g, M, nb, act, bias, y, N, 1); break;
        }
    }
}

/* As V_NAME(gemm), for the 256-weight types. */
static void V_NAME(gemm_k)(int type, const uint8_t *w, int64_t M, int64_t nb, const KActivations *act,
                           const float *bias, float *y, int64_t N) {
    if (type != KV_Q6_K && M >= BY_QUAD_ROWS) {
        V_NAME(gemm_k_by_quad)(type, w, M, nb, act, bias, y, N);
        return;
    }
    const int64_t groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;
#pragma omp for schedule(guided, 2)
    for (int64_t g = 0; g < groups; g++) {
        switch (type) {
        case KV_Q4_K: V_NAME(group_k)(KV_Q4_K, w, g, M, nb, act, bias, y, N, 0); break;
        case KV_Q5_K: V_NAME(group_k)(KV_Q5_K, w, g, M, nb, act, bias, y, N, 0); break;
        case KV_Q6_K: V_NAME(group_k)(KV_Q6_K, w, g, M, nb, act, bias, y, N, 0); break;
        default: V_NAME(group_k)(KV_IQ4_XS, w, g, M, nb, act, bias, y, N, 0); break;
        }
    }
}

#endif

#undef V_SIGNED_PAIRS
#undef V_VECTOR_HALF
#undef V_ARRAY_HALF
