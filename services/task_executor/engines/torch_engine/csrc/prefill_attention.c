/* Causal prefill attention on AMX tiles (bf16): flash attention over 32-row x 32-key blocks.
 *
 * Layouts (those of model.Transformer):
 *   q    [n, heads, hd]: query i's head h at q + i * q_stride + h * hd
 *   k, v [ctx, kv_heads, hd], ctx = start + n: key t's head h at k + t * k_stride + h * hd
 *        (v: v_stride)
 *   out  [n, heads, hd] contiguous
 * Query i sits at position start + i and sees keys 0 .. start + i; query head h reads K/V head
 * h / (heads / kv_heads) (GQA without repeating K/V).
 *
 * K and V of each K/V head are first laid out once as AMX B tiles (VNNI pairs): K as 16 keys x
 * 32 dims per tile (its dims paired), V as 16 dims x 32 keys (its keys paired). A work item is
 * one K/V head and 32 query rows, a row being one (query, query head) pair, query-major; it
 * walks the keys its rows may see in blocks of 32:
 * - S = Q K^T on 4 accumulator tiles (2 row halves x 2 key halves);
 * - an online softmax per row in float32 (running max and sum; the row's output is rescaled
 *   when its max grows), the probabilities rounded to bf16 as transformers' eager attention
 *   and torch's CPU flash kernel round them;
 * - O += P V on tiles, O kept in float32.
 * The softmax and the rescaling are most of the time (a 32x32 block is 16 tile products and
 * about 2,000 vector instructions).
 * Built by cpu_kernels.py with the host's own instruction set (-march=native); without AMX it
 * compiles to a stub that declines (prefill_attention_amx returns 0). */
#include <stdlib.h>

#include "common.h"

int prefill_attention_amx(void);

#if defined(__AMX_BF16__) && defined(__AVX512F__)
#define ROWS 32
#define KEYS 32
#define MAX_HD 256
#define RESCALE 8.0f /* log2 of how far a row's max may grow before its output is rescaled */

int prefill_attention_amx(void) { return amx_usable(); }

/* 2^x in float32, 16 lanes, for finite x <= RESCALE (infinities give NaN: callers mask those
 * lanes): 2^n * 2^f with f in [-0.5, 0.5] by a degree-4 polynomial (relative error 3e-6: the
 * probabilities are rounded to bf16, 4e-3, before they multiply V), 2^n by vscalefps (0 below
 * 2^-149). */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.5605105e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917040e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312197e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999917e-1f));
    return _mm512_scalef_ps(p, n);
}

/* V^T of one head: vt[d * vt_stride + t] = V[t][d] for t < ctx, 0 up to whole blocks of 32
 * keys. */
static void pack_vt(const uint16_t* v, int64_t v_stride, int64_t ctx, int64_t vt_stride, int hd,
                    uint16_t* vt) {
    for (int64_t t0 = 0; t0 < ctx; t0 += 32)
        for (int d = 0; d < hd; d++)
            for (int64_t t = t0; t < t0 + 32; t++)
                vt[d * vt_stride + t] = t < ctx ? v[t * v_stride + d] : 0;
}

typedef struct {
    float ot[2][MAX_HD][16];          /* O^T of each 16-row group, unnormalized */
    float st[2][KEYS][16];            /* a block's S^T per row group: [key][row] */
    uint16_t qt[2][MAX_HD / 32][512]; /* Q^T per row group and 32 dims: VNNI B tiles */
    uint16_t pt[2][512];              /* a block's P^T per row group: VNNI B tiles */
    uint16_t tail[KEYS][MAX_HD];      /* the keys of a block past the context's end: 0 */
} item_scratch;

/* Interleaves two rows of 16 float32 as bf16 pairs (a[i], b[i]): one row of a VNNI tile. */
static inline __m512i vnni_pair(__m512 a, __m512 b) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a in the low half */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, both);
}

/* 32 rows from row0 (row = query * group + head in the group) of K/V head h, the rows' scores
 * and probabilities transposed (a key's 16 lanes are 16 rows), so the softmax is vertical. */
static void item(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                 const uint16_t* vt, int64_t ctx, int64_t vt_stride, int64_t n, int64_t start,
                 int group, int h, int hd, float scale, int64_t row0, uint16_t* out, int heads,
                 item_scratch* w) {
    const int64_t rows_total = n * group;
    const int nrows = rows_total - row0 < ROWS ? (int)(rows_total - row0) : ROWS;
    int32_t lim[ROWS] __attribute__((aligned(64))); /* keys row r sees: 0 .. lim - 1 */
    const int halves = hd / 32;
    memset(w->qt, 0, sizeof(w->qt));
    for (int r = 0; r < ROWS; r++) {
        if (r >= nrows) {
            lim[r] = 0;
            continue;
        }
        const int64_t i = (row0 + r) / group;
        lim[r] = (int32_t)(start + i + 1);
        const uint16_t* src = q + i * q_stride + (int64_t)(h * group + (row0 + r) % group) * hd;
        for (int c = 0; c < halves; c++)
            for (int p = 0; p < 16; p++) {
                w->qt[r / 16][c][p * 32 + 2 * (r % 16)] = src[32 * c + 2 * p];
                w->qt[r / 16][c][p * 32 + 2 * (r % 16) + 1] = src[32 * c + 2 * p + 1];
            }
    }
    memset(w->ot, 0, sizeof(float) * 2 * MAX_HD * 16);
    const int64_t keys = lim[nrows - 1];
    /* Scores in base 2: exp(s * scale) = 2^(s * scale * log2(e)). */
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 m[2] = {ninf, ninf}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i lims[2] = {_mm512_load_si512(lim), _mm512_load_si512(lim + 16)};
    const int32_t lo_lim = lim[0];
    for (int64_t k0 = 0; k0 < keys; k0 += KEYS) {
        /* S^T = K Q^T: tmm0..3 = (keys 0-15 | 16-31) x (rows 0-15 | 16-31). The keys' rows
         * are read in place, or from the zeroed tail past the context's end. */
        const uint16_t* kb = k + k0 * k_stride;
        int64_t kstride = k_stride;
        if (k0 + KEYS > ctx) {
            for (int t = 0; t < KEYS; t++)
                if (k0 + t < ctx) memcpy(w->tail[t], kb + t * k_stride, sizeof(uint16_t) * hd);
            kb = &w->tail[0][0];
            kstride = MAX_HD;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < halves; c++) {
            _tile_loadd(4, kb + 32 * c, kstride * 2);
            _tile_loadd(5, kb + 16 * kstride + 32 * c, kstride * 2);
            _tile_loadd(6, w->qt[0][c], 64);
            _tile_loadd(7, w->qt[1][c], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &w->st[0][0][0], 64);
        _tile_stored(1, &w->st[1][0][0], 64);
        _tile_stored(2, &w->st[0][16][0], 64);
        _tile_stored(3, &w->st[1][16][0], 64);
        /* The online softmax, in base 2. A row's running max m moves only when the block's
         * max exceeds it by RESCALE (probabilities up to 2^RESCALE are fine in float32 and
         * bf16), so its output is rarely rescaled. Every row sees the whole block when its
         * first row does; else a row's keys past its position get probability 0. */
        const int masked = k0 + KEYS > lo_lim;
        for (int g = 0; g < 2; g++) {
            if (g * 16 >= nrows) {
                memset(w->pt[g], 0, sizeof(w->pt[g]));
                continue;
            }
            __mmask16 seen[KEYS];
            __m512 bm = ninf; /* of the raw scores: scale > 0 */
            for (int t = 0; t < KEYS; t++) {
                seen[t] = masked ? _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int32_t)(k0 + t)),
                                                           lims[g])
                                 : (__mmask16)0xffff;
                bm = _mm512_mask_max_ps(bm, seen[t], bm, _mm512_load_ps(w->st[g][t]));
            }
            const __m512 cand = _mm512_mul_ps(bm, sc);
            const __mmask16 move = _mm512_cmp_ps_mask(
                cand, _mm512_add_ps(m[g], _mm512_set1_ps(RESCALE)), _CMP_GT_OQ);
            if (move) {
                const __m512 mnew = _mm512_mask_blend_ps(move, m[g], cand);
                /* exp2(-inf) is 0: a row's first keys scale its (empty) output by 0. */
                const __m512 a = _mm512_mask_blend_ps(
                    move, _mm512_set1_ps(1.f),
                    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m[g], ninf, _CMP_NEQ_OQ),
                                        exp2_ps(_mm512_sub_ps(m[g], mnew))));
                l[g] = _mm512_mul_ps(l[g], a);
                for (int d = 0; d < hd; d++)
                    _mm512_store_ps(w->ot[g][d], _mm512_mul_ps(a, _mm512_load_ps(w->ot[g][d])));
                m[g] = mnew;
            }
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < KEYS; t += 2) {
                const __m512 p0 = _mm512_maskz_mov_ps(
                    seen[t], exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w->st[g][t]), sc, m[g])));
                const __m512 p1 = _mm512_maskz_mov_ps(
                    seen[t + 1],
                    exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w->st[g][t + 1]), sc, m[g])));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                _mm512_store_si512(w->pt[g] + 16 * t, vnni_pair(p0, p1));
            }
            l[g] = _mm512_add_ps(l[g], sum);
        }
        /* O^T += V^T P^T, 32 dims at a time: tmm0..3 = (dims +0 | +16) x (rows 0-15 | 16-31). */
        _tile_loadd(6, w->pt[0], 64);
        _tile_loadd(7, w->pt[1], 64);
        for (int d = 0; d < hd; d += 32) {
            _tile_loadd(0, &w->ot[0][d][0], 64);
            _tile_loadd(1, &w->ot[1][d][0], 64);
            _tile_loadd(2, &w->ot[0][d + 16][0], 64);
            _tile_loadd(3, &w->ot[1][d + 16][0], 64);
            _tile_loadd(4, vt + d * vt_stride + k0, vt_stride * 2);
            _tile_loadd(5, vt + (d + 16) * vt_stride + k0, vt_stride * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(0, &w->ot[0][d][0], 64);
            _tile_stored(1, &w->ot[1][d][0], 64);
            _tile_stored(2, &w->ot[0][d + 16][0], 64);
            _tile_stored(3, &w->ot[1][d + 16][0], 64);
        }
    }
    float inv[ROWS] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[0]));
    _mm512_store_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.f), l[1]));
    for (int r = 0; r < nrows; r++) {
        const int64_t i = (row0 + r) / group;
        uint16_t* dst = out + (i * heads + (int64_t)h * group + (row0 + r) % group) * hd;
        for (int d = 0; d < hd; d++) dst[d] = f32_to_bf16(w->ot[r / 16][d][r % 16] * inv[r]);
    }
}

/* Returns 0, 1 for shapes it does not take (the caller's other path runs), 2 when memory ran
 * out. */
int prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                           int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t n,
                           int64_t start,
                           int heads, int kv_heads, int hd, float scale, uint16_t* out,
                           int threads) {
    if (n < 1 || kv_heads < 1 || heads % kv_heads || hd % 32 || hd > MAX_HD ||
        !prefill_attention_amx())
        return 1;
    const int group = heads / kv_heads;
    const int64_t ctx = start + n;
    /* V^T's rows: whole blocks of keys, and 64 bytes more, so that a tile's 16 rows do not
     * fall in one cache set (as 8k keys x 2 bytes apart would). */
    const int64_t vt_stride = (ctx + KEYS - 1) / KEYS * KEYS + 32;
    uint16_t* vt = aligned_alloc(64, sizeof(uint16_t) * hd * vt_stride * kv_heads);
    if (!vt) return 2;
    const int64_t row_blocks = (n * group + ROWS - 1) / ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++)
            pack_vt(v + (int64_t)h * hd, v_stride, ctx, vt_stride, hd, vt + (size_t)hd * vt_stride * h);
        item_scratch* w = aligned_alloc(64, sizeof(item_scratch));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        } else {
            memset(w->tail, 0, sizeof(w->tail));
            load_full_tiles();
        }
        /* Later row blocks see more keys: handed out one at a time, last first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < row_blocks * kv_heads; it++) {
            if (!w) continue;
            const int64_t b = row_blocks - 1 - it / kv_heads;
            const int h = (int)(it % kv_heads);
            item(q, q_stride, k + (int64_t)h * hd, k_stride, vt + (size_t)hd * vt_stride * h, ctx,
                 vt_stride, n, start, group, h, hd, scale, b * ROWS, out, heads, w);
        }
        if (w) _tile_release();
        free(w);
    }
    free(vt);
    return failed ? 2 : 0;
}

#else
int prefill_attention_amx(void) { return 0; }

int prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                           int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t n,
                           int64_t start,
                           int heads, int kv_heads, int hd, float scale, uint16_t* out,
                           int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)n;
    (void)start;
    (void)heads, (void)kv_heads, (void)hd, (void)scale, (void)out, (void)threads;
    return 1;
}
#endif
