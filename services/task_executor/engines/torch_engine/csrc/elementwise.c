/* The position-wise steps of a decoder layer between its matrix multiplies, each one pass
 * over its rows instead of torch's several (and their temporaries):
 *
 *   add_rms_norm  h += delta (optional; rounded to the dtype), then
 *                 out = weight * dtype(h * rsqrt(mean(h^2) + eps)), statistics in float32:
 *                 the reference's rounding order (model._rms_norm says why);
 *   silu_mul      out = silu(gate) * up over a [rows, 2 * inter] gate/up output, in float32,
 *                 rounded once;
 *   rope          q and k heads rotated in place (rotate-half layout, transformers' formula
 *                 q * cos + rotate_half(q) * sin) from the [max_len, hd] cos/sin tables, in
 *                 float32, rounded once.
 *
 * A long prompt's rows are split between threads; a decode step's few rows run on the calling
 * thread (a parallel region costs more than they do).
 * Built by cpu_kernels.py with the host's own instruction set (-march=native). */
#include "common.h"

#if defined(__AVX512F__)
/* One bf16 row of each kernel 16 elements at a time, where its width is a multiple of 16 (the
 * compiler does not vectorize the scalar loops below: their conversions and expf defeat it),
 * with the scalar loops' exact rounding; 0: the scalar loop runs. */
static inline int silu_mul_row16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
    if (n % 16) return 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 x = ld16(g + j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        st16(o + j, _mm512_mul_ps(silu, ld16(u + j)));
    }
    return 1;
}

static inline int add_rms_norm_row16(uint16_t* h, const uint16_t* d, const uint16_t* w,
                                     uint16_t* o, int64_t n, float eps) {
    if (n % 16) return 0;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __m512 x = ld16(h + j);
        if (d) {
            x = round16(_mm512_add_ps(x, ld16(d + j)));
            st16(h + j, x);
        }
        ss = _mm512_fmadd_ps(x, x, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (int64_t j = 0; j < n; j += 16)
        st16(o + j, _mm512_mul_ps(ld16(w + j), round16(_mm512_mul_ps(ld16(h + j), inv))));
    return 1;
}

static inline int rope_row16(uint16_t* v, const uint16_t* c, const uint16_t* s, int64_t half) {
    if (half % 16) return 0;
    for (int64_t j = 0; j < half; j += 16) {
        const __m512 a = ld16(v + j), b = ld16(v + j + half);
        st16(v + j, _mm512_fmsub_ps(a, ld16(c + j), _mm512_mul_ps(b, ld16(s + j))));
        st16(v + j + half,
             _mm512_fmadd_ps(b, ld16(c + j + half), _mm512_mul_ps(a, ld16(s + j + half))));
    }
    return 1;
}
#define SILU_MUL_ROW_bf16 silu_mul_row16
#define ADD_RMS_NORM_ROW_bf16 add_rms_norm_row16
#define ROPE_ROW_bf16 rope_row16
#else
#define SILU_MUL_ROW_bf16(g, u, o, n) 0
#define ADD_RMS_NORM_ROW_bf16(h, d, w, o, n, eps) 0
#define ROPE_ROW_bf16(v, c, s, half) 0
#endif
/* float32 rows: the scalar loops, which the compiler vectorizes itself. */
#define SILU_MUL_ROW_f32(g, u, o, n) 0
#define ADD_RMS_NORM_ROW_f32(h, d, w, o, n, eps) 0
#define ROPE_ROW_f32(v, c, s, half) 0

/* Rows per thread below which one thread does all: about 64k elements of work. */
static inline int threads_for(int64_t rows, int64_t width, int threads) {
    int64_t want = rows * width / 65536;
    if (want < 1) return 1;
    return want < threads ? (int)want : threads;
}

#define DEFINE_ELEMENTWISE(SUFFIX, T, LOAD, STORE)                                               \
    int add_rms_norm_##SUFFIX(T* h, int64_t h_stride, const T* delta, int64_t delta_stride,     \
                              const T* weight, T* out, int64_t rows, int64_t dim, float eps,     \
                              int threads) {                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads_for(rows, dim, threads))") \
        for (int64_t r = 0; r < rows; r++) {                                                     \
            T* hr = h + r * h_stride;                                                            \
            T* o = out + r * dim;                                                                \
            if (ADD_RMS_NORM_ROW_##SUFFIX(hr, delta ? delta + r * delta_stride : NULL, weight,  \
                                          o, dim, eps))                                          \
                continue;                                                                        \
            float ss = 0.f;                                                                      \
            if (delta) {                                                                         \
                const T* dr = delta + r * delta_stride;                                          \
                for (int64_t j = 0; j < dim; j++) {                                              \
                    T s = STORE(LOAD(hr[j]) + LOAD(dr[j]));                                      \
                    hr[j] = s;                                                                   \
                    float x = LOAD(s);                                                           \
                    ss += x * x;                                                                 \
                }                                                                                \
            } else {                                                                             \
                for (int64_t j = 0; j < dim; j++) {                                              \
                    float x = LOAD(hr[j]);                                                       \
                    ss += x * x;                                                                 \
                }                                                                                \
            }                                                                                    \
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);                                \
            for (int64_t j = 0; j < dim; j++)                                                    \
                o[j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(hr[j]) * inv)));                  \
        }                                                                                        \
        return 0;                                                                                \
    }                                                                                            \
                                                                                                 \
    int silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t inter, int threads) {  \
        _Pragma("omp parallel for schedule(static) num_threads(threads_for(rows, inter, threads))") \
        for (int64_t r = 0; r < rows; r++) {                                                     \
            const T* g = gate_up + r * 2 * inter;                                                \
            const T* u = g + inter;                                                              \
            T* o = out + r * inter;                                                              \
            if (SILU_MUL_ROW_##SUFFIX(g, u, o, inter)) continue;                                 \
            for (int64_t j = 0; j < inter; j++) {                                                \
                float x = LOAD(g[j]);                                                            \
                o[j] = STORE(x / (1.f + expf(-x)) * LOAD(u[j]));                                 \
            }                                                                                    \
        }                                                                                        \
        return 0;                                                                                \
    }                                                                                            \
                                                                                                 \
    int rope_##SUFFIX(T* x, int64_t row_stride, const int64_t* positions, const T* cos,          \
                      const T* sin, int64_t rows, int64_t heads, int64_t hd, int threads) {      \
        const int64_t half = hd / 2;                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads_for(rows, heads * hd, threads))") \
        for (int64_t r = 0; r < rows; r++) {                                                     \
            const T* c = cos + positions[r] * hd;                                                \
            const T* s = sin + positions[r] * hd;                                                \
            for (int64_t h = 0; h < heads; h++) {                                                \
                T* v = x + r * row_stride + h * hd;                                              \
                if (ROPE_ROW_##SUFFIX(v, c, s, half)) continue;                                  \
                for (int64_t j = 0; j < half; j++) {                                             \
                    float a = LOAD(v[j]), b = LOAD(v[j + half]);                                 \
                    v[j] = STORE(a * LOAD(c[j]) - b * LOAD(s[j]));                               \
                    v[j + half] = STORE(b * LOAD(c[j + half]) + a * LOAD(s[j + half]));         \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        return 0;                                                                                \
    }

DEFINE_ELEMENTWISE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ELEMENTWISE(f32, float, f32_id, f32_id)
