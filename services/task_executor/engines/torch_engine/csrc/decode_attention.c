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
 * Built by cpu_kernels.py with the host's own instruction set (-march=native). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HD 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

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
#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                     \
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
            float* scores = malloc(sizeof(float) * group * max_len);                            \
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

DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(decode_attention_f32, float, f32_id, f32_id)
