/* Causal softmax of a prefill block's attention scores, in place: one pass that masks, takes
 * the float32 softmax and writes the probabilities back in the scores' dtype.
 *
 * torch's way (masked_fill_, softmax to a float32 tensor, cast back) makes three passes over a
 * score matrix of tens of MiB and allocates two more of them per query block: half the
 * attention time of a 4k-token prompt on a 2-core host (attention.py says more).
 *
 * Layout (that of attention._blocked): scores [kv_heads, m, group, cols] contiguous, the
 * rows of query i (its group query heads) see keys 0 .. first_len + i - 1, where first_len
 * is the number of keys the block's first query sees. Masked keys get probability 0.
 * Precision is transformers' eager attention's: float32 max, exp and sum over the
 * model-dtype scores, each probability rounded once to the model's dtype.
 * Built by cpu_kernels.py with the host's own instruction set (-march=native). */
#include <stdlib.h>

#include "common.h"

/* Returns 0, or 2 when scratch memory ran out. */
#define DEFINE_SOFTMAX(NAME, T, LOAD, STORE)                                                    \
    int NAME(T* s, int64_t kv_heads, int64_t m, int64_t group, int64_t cols,                   \
             int64_t first_len, int threads) {                                                  \
        const int64_t rows = kv_heads * m * group;                                              \
        int failed = 0;                                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                          \
            float* e = malloc(sizeof(float) * (cols > 0 ? cols : 1));                           \
            if (!e) {                                                                           \
                _Pragma("omp atomic write") failed = 1;                                         \
            }                                                                                   \
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) {           \
                if (!e) continue;                                                               \
                T* row = s + r * cols;                                                          \
                int64_t len = first_len + (r / group) % m;                                      \
                if (len > cols) len = cols;                                                     \
                float mx = LOAD(row[0]);                                                        \
                for (int64_t j = 0; j < len; j++) {                                             \
                    float x = LOAD(row[j]);                                                     \
                    mx = x > mx ? x : mx;                                                       \
                }                                                                               \
                float sum = 0.f;                                                                \
                for (int64_t j = 0; j < len; j++) {                                             \
                    e[j] = expf(LOAD(row[j]) - mx);                                             \
                    sum += e[j];                                                                \
                }                                                                               \
                const float inv = 1.f / sum;                                                    \
                for (int64_t j = 0; j < len; j++) row[j] = STORE(e[j] * inv);                   \
                memset(row + len, 0, sizeof(T) * (size_t)(cols - len));                        \
            }                                                                                   \
            free(e);                                                                            \
        }                                                                                       \
        return failed ? 2 : 0;                                                                  \
    }

DEFINE_SOFTMAX(causal_softmax_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SOFTMAX(causal_softmax_f32, float, f32_id, f32_id)
