/* Paged decode attention on CPU: one query token per request, over that request's K/V blocks
 * read in place from the paged cache (no gather into a padded copy, no mask).
 *
 * Layouts (those of kv_cache.PagedKVCache and model.Transformer):
 *   q      [batch, q_stride]: request b's query heads at q + b * q_stride, head h at h * hd
 *   k, v   [num_blocks, block_size, kv_heads, hd]
 *   tables [batch, width] block ids, lens [batch] tokens to attend to (>= 1)
 *   out    [batch, heads, hd]
 * Query head h reads K/V head h / (heads / kv_heads) (GQA without repeating K/V). One
 * (request, K/V head) pair is one work item: its query heads are held in float32, the scores of
 * all its tokens are computed in one pass over K, softmaxed in float32, and V is read once.
 * Three ways to compute an item, the first that applies: on a CPU with AMX (bf16, blocks of a
 * multiple of 16 keys), QK on tiles and a chunked online softmax (amx_bf16); with AVX-512
 * BF16, vdpbf16ps (fast_bf16_body); else portable loops the compiler vectorizes.
 * Built by cpu_kernels.py with the host's own instruction set (-march=native). */
#include <stdlib.h>

#include "common.h"

#define MAX_GROUP 16
#define MAX_HD 256
#define AMX_CHUNK 128 /* AMX path: keys per pass, their scores and V rows staying in L1 */

/* The whole work item for bf16 on a CPU with AVX-512 BF16 and a head size of 64 or 128, in
 * vdpbf16ps (products of bf16 pairs summed in float32), with no float32 copy of K or V and no
 * horizontal sum per score:
 * - QK, 16 keys at a time: K is gathered as (d, d+1) pairs across the 16 keys, so each
 *   query head's 16 scores build up in one register, a pair of dims per instruction;
 * - softmax in float32; each probability split into two bf16 (its rounding and what that
 *   left), so that the product with V keeps float32's precision (16 bits of it);
 * - PV, 2 keys at a time: their V rows interleaved into (key t, key t+1) pairs per dim, times
 *   the pair of probabilities (both parts), 16 dims per instruction.
 * 1.3x faster than the portable loops at 2k-8k keys (2-core AVX-512 host); the QK part most.
 * Returns 0 (nothing written) where it does not apply: the portable loops run instead. */
#if defined(__AVX512BF16__)
/* Walks the keys in order: the offset of each key's row, without a division per key. */
typedef struct {
    const int64_t* table;
    int64_t block, pos, block_size, row;
} cursor;

static inline __attribute__((always_inline)) int64_t cursor_next(cursor* c) {
    const int64_t off = (c->table[c->block] * c->block_size + c->pos) * c->row;
    if (++c->pos == c->block_size) {
        c->pos = 0;
        c->block++;
    }
    return off;
}

static inline __attribute__((always_inline)) int fast_bf16_body(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
    int64_t len, const int group, int hd, int64_t row, int block_size, float scale,
    uint16_t* out, float* scores, uint16_t* probs) {
    const int pairs = hd / 2;
    const int32_t* q32 = (const int32_t*)q;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    cursor keys = {table, 0, 0, block_size, row};
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? (int)(len - t0) : 16;
        int32_t idx[16];
        for (int j = 0; j < 16; j++) {
            int64_t e = j < n ? cursor_next(&keys) / 2 : idx[0];
            if (e > INT32_MAX - pairs) return 0; /* a cache too large for 32-bit indices */
            idx[j] = (int32_t)e;
        }
        const __m512i base = _mm512_loadu_si512((const void*)idx);
        __m512 acc[MAX_GROUP];
        for (int g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++) {
            __m512i kp = _mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(p)),
                                                (const void*)kc, 4);
            for (int g = 0; g < group; g++)
                acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(q32[g * pairs + p]),
                                          (__m512bh)kp);
        }
        const __mmask16 m = (__mmask16)_mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(n));
        for (int g = 0; g < group; g++)
            _mm512_mask_storeu_ps(scores + g * len + t0, m,
                                  _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
    }
    const int64_t lenp = len + (len & 1); /* the probabilities of a pair of keys: even */
    for (int g = 0; g < group; g++) {
        float* sg = scores + g * len;
        uint16_t* pg = probs + g * 2 * lenp; /* hi parts, then lo parts */
        float mx = sg[0];
        for (int64_t t = 1; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - mx);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) {
            const float x = sg[t] * inv;
            pg[t] = f32_to_bf16(x);
            pg[lenp + t] = f32_to_bf16(x - bf16_to_f32(pg[t]));
        }
        if (len & 1) pg[len] = pg[lenp + len] = 0;
    }
    for (int c = 0; c < hd / 32; c++) {
        __m512 lo[MAX_GROUP], hi[MAX_GROUP];
        for (int g = 0; g < group; g++) lo[g] = hi[g] = _mm512_setzero_ps();
        cursor values = {table, 0, 0, block_size, row};
        for (int64_t t = 0; t < len; t += 2) {
            __m512i a = _mm512_loadu_si512((const void*)(vc + cursor_next(&values) + 32 * c));
            __m512i b = t + 1 < len
                            ? _mm512_loadu_si512((const void*)(vc + cursor_next(&values) + 32 * c))
                            : _mm512_setzero_si512();
            __m512bh il = (__m512bh)_mm512_unpacklo_epi16(a, b);
            __m512bh ih = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < group; g++) {
                const uint16_t* pg = probs + g * 2 * lenp + t;
                __m512bh ph = (__m512bh)_mm512_set1_epi32(*(const int32_t*)pg);
                __m512bh pl = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(pg + lenp));
                lo[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(lo[g], il, ph), il, pl);
                hi[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(hi[g], ih, ph), ih, pl);
            }
        }
        /* Within each 128-bit lane k, unpacklo holds dims 8k..8k+3 and unpackhi 8k+4..8k+7. */
        for (int g = 0; g < group; g++) {
            float l[16], h[16];
            _mm512_storeu_ps(l, lo[g]);
            _mm512_storeu_ps(h, hi[g]);
            uint16_t* o = out + g * hd + 32 * c;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) {
                    o[8 * k + i] = f32_to_bf16(l[4 * k + i]);
                    o[8 * k + 4 + i] = f32_to_bf16(h[4 * k + i]);
                }
        }
    }
    return 1;
}
#endif

#if defined(__AMX_BF16__) && defined(__AVX512F__)
/* o[g][0..31] = alpha[g] * o[g][0..31] + sum over the chunk's n keys of p[key][g0 + g] *
 * V[key][d0 .. d0 + 31], for g < ng: 2 registers a head, so up to 8 heads' accumulators stay
 * in registers (ng is a constant where this is inlined). */
static inline __attribute__((always_inline)) void amx_pv(
    const uint16_t* const* vrows, int n, const float* p, const float* alpha, int g0, int d0,
    float* o, int o_stride, const int ng) {
    __m512 acc[8][2];
    for (int g = 0; g < ng; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g0 + g]);
        acc[g][0] = _mm512_mul_ps(a, _mm512_loadu_ps(o + g * o_stride));
        acc[g][1] = _mm512_mul_ps(a, _mm512_loadu_ps(o + g * o_stride + 16));
    }
    for (int j = 0; j < n; j++) {
        const __m512i v = _mm512_loadu_si512((const void*)(vrows[j] + d0));
        const __m512 lo = bf16x16_to_ps(_mm512_castsi512_si256(v));
        const __m512 hi = bf16x16_to_ps(_mm512_extracti64x4_epi64(v, 1));
        for (int g = 0; g < ng; g++) {
            const __m512 pg = _mm512_set1_ps(p[j * 16 + g0 + g]);
            acc[g][0] = _mm512_fmadd_ps(pg, lo, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(pg, hi, acc[g][1]);
        }
    }
    for (int g = 0; g < ng; g++) {
        _mm512_storeu_ps(o + g * o_stride, acc[g][0]);
        _mm512_storeu_ps(o + g * o_stride + 16, acc[g][1]);
    }
}

/* One work item on AMX, flash-decoding style over chunks of AMX_CHUNK keys:
 * - S^T = K Q^T, 16 keys at a time: each K tile is 16 keys' rows of 32 dims loaded straight
 *   from the paged cache (the block's keys are its rows), times the query heads laid out
 *   once as VNNI tiles kept in tile registers;
 * - an online softmax down the columns (a key's 16 lanes are the heads): the running max and
 *   sum, and the output rescaled when the max grows;
 * - P V in float32 FMAs, V rows widened from bf16.
 * Needs block_size % 16 == 0, hd % 32 == 0, hd <= 128 and group <= 16; the output rows are
 * kept in s (64-byte aligned, 16 * AMX_CHUNK + group * hd floats). */
static int amx_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                    const int64_t* table, int64_t len, int group, int hd, int64_t row,
                    int block_size, float scale, uint16_t* out, float* s) {
    if (block_size % 16 || hd % 32 || hd > 128 || group > 16 || !amx_usable()) return 0;
    const int halves = hd / 32;
    /* Q^T as VNNI B tiles, one per 32 dims: row r holds (q[g][2r], q[g][2r+1]) for g < 16. */
    int32_t qt[4][16][16] __attribute__((aligned(64)));
    memset(qt, 0, sizeof(qt));
    const int32_t* q32 = (const int32_t*)q;
    for (int g = 0; g < group; g++)
        for (int c = 0; c < halves; c++)
            for (int r = 0; r < 16; r++) qt[c][r][g] = q32[g * (hd / 2) + c * 16 + r];
    load_full_tiles(); /* C: tmm0, tmm1; K: tmm2, tmm3; Q: tmm4..tmm7 */
    _tile_loadd(4, qt[0], 64);
    if (halves > 1) _tile_loadd(5, qt[1], 64);
    if (halves > 2) _tile_loadd(6, qt[2], 64);
    if (halves > 3) _tile_loadd(7, qt[3], 64);
    float* o = s + 16 * AMX_CHUNK; /* [group][hd] running output, float32 */
    memset(o, 0, sizeof(float) * group * hd);
    const int64_t stride = row * 2;
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    float alpha[16] __attribute__((aligned(64)));
    const uint16_t* vrows[AMX_CHUNK];
    for (int64_t t0 = 0; t0 < len; t0 += AMX_CHUNK) {
        const int n = len - t0 < AMX_CHUNK ? (int)(len - t0) : AMX_CHUNK;
        /* The next chunk's K and V rows, asked for while this one computes: a long context
         * comes from DRAM, a block (a 4 KiB page) at a time, which the hardware prefetcher
         * does not cross. 8k keys x 24 layers (2-core Sapphire Rapids): 330-395 -> 257-315
         * us a layer. */
        for (int64_t t = t0 + AMX_CHUNK; t < t0 + 2 * AMX_CHUNK && t < len; t++) {
            const int64_t at = (table[t / block_size] * block_size + t % block_size) * row;
            for (int c = 0; c < hd; c += 32) {
                _mm_prefetch((const char*)(kc + at + c), _MM_HINT_T1);
                _mm_prefetch((const char*)(vc + at + c), _MM_HINT_T1);
            }
        }
        for (int j = 0; j < n; j += 16) {
            const int64_t t = t0 + j;
            const int64_t base = (table[t / block_size] * block_size + t % block_size) * row;
            const uint16_t* kb = kc + base;
#define QK_HALF(C, TK, TQ) \
    _tile_loadd(TK, kb + 32 * (C), stride); \
    _tile_dpbf16ps(0, TK, TQ);
            _tile_zero(0);
            QK_HALF(0, 2, 4)
            if (halves > 1) { QK_HALF(1, 3, 5) }
            if (halves > 2) { QK_HALF(2, 2, 6) }
            if (halves > 3) { QK_HALF(3, 3, 7) }
#undef QK_HALF
            _tile_stored(0, s + j * 16, 64);
            for (int i = 0; i < 16; i++) vrows[j + i] = vc + base + i * row;
        }
        /* Rows past n hold keys of a block's tail: never read. */
        __m512 mc = m;
        for (int j = 0; j < n; j++) mc = _mm512_max_ps(mc, _mm512_mul_ps(_mm512_load_ps(s + j * 16), sc));
        const __m512 a = exp16(_mm512_sub_ps(m, mc)); /* 0 on the first chunk */
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            __m512 p = exp16(_mm512_fmsub_ps(_mm512_load_ps(s + j * 16), sc, mc));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(s + j * 16, p);
        }
        l = _mm512_fmadd_ps(l, a, sum);
        m = mc;
        _mm512_store_ps(alpha, a);
        for (int g0 = 0; g0 < group; g0 += 8) {
            const int ng = group - g0 < 8 ? group - g0 : 8;
            for (int d0 = 0; d0 < hd; d0 += 32) {
                float* og = o + g0 * hd + d0;
                switch (ng) {
#define PV_CASE(N) \
    case N: amx_pv(vrows, n, s, alpha, g0, d0, og, hd, N); break;
                    PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7)
                    default: amx_pv(vrows, n, s, alpha, g0, d0, og, hd, 8); break;
#undef PV_CASE
                }
            }
        }
    }
    _tile_release();
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
    for (int g = 0; g < group; g++)
        for (int d = 0; d < hd; d++) out[g * hd + d] = f32_to_bf16(o[g * hd + d] * inv[g]);
    return 1;
}
#else
static int amx_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                    const int64_t* table, int64_t len, int group, int hd, int64_t row,
                    int block_size, float scale, uint16_t* out, float* s) {
    (void)q, (void)kc, (void)vc, (void)table, (void)len, (void)group, (void)hd, (void)row;
    (void)block_size, (void)scale, (void)out, (void)s;
    return 0;
}
#endif

static inline int fast_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                            const int64_t* table, int64_t len, int group, int hd, int64_t row,
                            int block_size, float scale, uint16_t* out, float* scores,
                            void* scratch) {
    if (amx_bf16(q, kc, vc, table, len, group, hd, row, block_size, scale, out, scores)) return 1;
#if defined(__AVX512BF16__)
    if (hd != 64 && hd != 128) return 0;
    uint16_t* probs = scratch;
    /* A constant group lets the compiler keep every accumulator in a register. */
#define FAST_CASE(G)                                                                             \
    case G:                                                                                     \
        return fast_bf16_body(q, kc, vc, table, len, G, hd, row, block_size, scale, out, scores, \
                              probs);
    switch (group) {
        FAST_CASE(1)
        FAST_CASE(2)
        FAST_CASE(4)
        FAST_CASE(7)
        FAST_CASE(8)
        default:
            return fast_bf16_body(q, kc, vc, table, len, group, hd, row, block_size, scale, out,
                                  scores, probs);
    }
#undef FAST_CASE
#else
    (void)q, (void)kc, (void)vc, (void)table, (void)len, (void)group, (void)hd, (void)row;
    (void)block_size, (void)scale, (void)out, (void)scores, (void)scratch;
    return 0;
#endif
}

static inline int fast_f32(const float* q, const float* kc, const float* vc,
                           const int64_t* table, int64_t len, int group, int hd, int64_t row,
                           int block_size, float scale, float* out, float* scores,
                           void* scratch) {
    (void)q, (void)kc, (void)vc, (void)table, (void)len, (void)group, (void)hd, (void)row;
    (void)block_size, (void)scale, (void)out, (void)scores, (void)scratch;
    return 0;
}

/* One work item. Inlined with a constant hd for the common head sizes, so that the loops over
 * hd vectorize without remainders. */
#define DEFINE_ONE(NAME, T, LOAD, STORE)                                                        \
    static inline __attribute__((always_inline)) void NAME(                                     \
        const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len, int group,     \
        int hd, int64_t row, int block_size, float scale, T* out, float* scores) {              \
        float qf[MAX_GROUP][MAX_HD];                                                            \
        float acc[MAX_GROUP][MAX_HD];                                                           \
        float x[MAX_HD];                                                                        \
        float inv[MAX_GROUP];                                                                   \
        for (int g = 0; g < group; g++)                                                         \
            for (int d = 0; d < hd; d++) {                                                      \
                qf[g][d] = LOAD(q[g * hd + d]) * scale;                                         \
                acc[g][d] = 0.f;                                                                \
            }                                                                                   \
        for (int64_t t = 0; t < len; t++) {                                                     \
            const T* kp = kc + (table[t / block_size] * block_size + t % block_size) * row;     \
            for (int d = 0; d < hd; d++) x[d] = LOAD(kp[d]);                                    \
            for (int g = 0; g < group; g++) {                                                   \
                float s = 0.f;                                                                  \
                for (int d = 0; d < hd; d++) s += qf[g][d] * x[d];                              \
                scores[g * len + t] = s;                                                        \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < group; g++) {                                                       \
            float* sg = scores + g * len;                                                       \
            float m = sg[0];                                                                    \
            for (int64_t t = 1; t < len; t++) m = sg[t] > m ? sg[t] : m;                        \
            float sum = 0.f;                                                                    \
            for (int64_t t = 0; t < len; t++) {                                                 \
                sg[t] = expf(sg[t] - m);                                                        \
                sum += sg[t];                                                                   \
            }                                                                                   \
            inv[g] = 1.f / sum;                                                                 \
        }                                                                                       \
        for (int64_t t = 0; t < len; t++) {                                                     \
            const T* vp = vc + (table[t / block_size] * block_size + t % block_size) * row;     \
            for (int d = 0; d < hd; d++) x[d] = LOAD(vp[d]);                                    \
            for (int g = 0; g < group; g++) {                                                   \
                float p = scores[g * len + t];                                                  \
                for (int d = 0; d < hd; d++) acc[g][d] += p * x[d];                             \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < group; g++)                                                         \
            for (int d = 0; d < hd; d++) out[g * hd + d] = STORE(acc[g][d] * inv[g]);           \
    }

/* Returns 0, 1 for shapes beyond MAX_GROUP / MAX_HD, 2 when scratch memory ran out. */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, FAST)                                               \
    DEFINE_ONE(NAME##_one, T, LOAD, STORE)                                                      \
    int NAME(const T* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables,     \
             int64_t width, const int64_t* lens, T* out, int64_t batch, int heads,              \
             int kv_heads, int hd, int block_size, float scale, int threads) {                  \
        if (kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP || hd > MAX_HD)    \
            return 1;                                                                           \
        const int group = heads / kv_heads;                                                     \
        const int64_t row = (int64_t)kv_heads * hd;                                             \
        int64_t max_len = 1;                                                                    \
        for (int64_t b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;   \
        int failed = 0;                                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                          \
            /* Scores in float32, then (the fast paths) the probabilities; 64-byte aligned. */  \
            size_t need = sizeof(float) * (size_t)group * (size_t)(max_len + 2) * 2;            \
            size_t amx = sizeof(float) * (16 * AMX_CHUNK + MAX_GROUP * MAX_HD);                 \
            need = ((need > amx ? need : amx) + 63) / 64 * 64;                                  \
            float* scores = aligned_alloc(64, need);                                            \
            if (!scores) {                                                                      \
                _Pragma("omp atomic write") failed = 1;                                         \
            }                                                                                   \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t i = 0; i < batch * kv_heads;   \
                                                         i++) {                                 \
                if (!scores) continue;                                                          \
                const int64_t b = i / kv_heads;                                                 \
                const int h = (int)(i % kv_heads);                                              \
                const T* qb = q + b * q_stride + (int64_t)h * group * hd;                       \
                const T* kh = kc + (int64_t)h * hd;                                             \
                const T* vh = vc + (int64_t)h * hd;                                             \
                const int64_t* tb = tables + b * width;                                         \
                T* ob = out + (b * heads + (int64_t)h * group) * hd;                            \
                if (FAST(qb, kh, vh, tb, lens[b], group, hd, row, block_size, scale, ob, scores, \
                         scores + group * max_len))                                             \
                    continue;                                                                   \
                if (hd == 64)                                                                   \
                    NAME##_one(qb, kh, vh, tb, lens[b], group, 64, row, block_size, scale, ob,  \
                               scores);                                                         \
                else if (hd == 128)                                                             \
                    NAME##_one(qb, kh, vh, tb, lens[b], group, 128, row, block_size, scale, ob, \
                               scores);                                                         \
                else                                                                            \
                    NAME##_one(qb, kh, vh, tb, lens[b], group, hd, row, block_size, scale, ob,  \
                               scores);                                                         \
            }                                                                                   \
            free(scores);                                                                       \
        }                                                                                       \
        return failed ? 2 : 0;                                                                  \
    }

DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, fast_bf16)
DEFINE_KERNEL(decode_attention_f32, float, f32_id, f32_id, fast_f32)
