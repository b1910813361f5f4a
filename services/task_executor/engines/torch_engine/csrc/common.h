/* What the CPU kernels share: bf16 <-> float32 with torch's rounding, scalar and 16 lanes at
 * a time; e^x in float32 over 16 lanes; and, where the CPU has AMX, asking Linux for the tile
 * registers and their configuration. Each kernel source includes it; cpu_kernels.py hashes it
 * with them. */
#ifndef MESHSERVE_KERNELS_COMMON_H
#define MESHSERVE_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : r);
}

static inline float f32_id(float x) { return x; }

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 bf16x16_to_ps(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

static inline __m512 ld16(const uint16_t* p) {
    return bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)p));
}

static inline __m256i rne16(__m512 x) { /* f32_to_bf16, 16 lanes */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline void st16(uint16_t* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, rne16(x)); }

static inline __m512 round16(__m512 x) { return bf16x16_to_ps(rne16(x)); } /* via bf16 */

/* e^x, 16 lanes, float32 (relative error ~2e-7): 2^n * 2^f, f in [-0.5, 0.5] by a degree-6
 * polynomial, 2^n by vscalefps. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 q = _mm512_set1_ps(1.535336188319500e-4f);
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.339887440266574e-3f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(9.618437357674640e-3f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(5.550332471162809e-2f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(2.402264791363012e-1f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(6.931472028550421e-1f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(q, n);
}
#endif

#if defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux lends AMX's tile registers to a process that asks (oneDNN asks too; asking twice is
 * harmless). 1 where granted; asked once per process and source. */
static inline int amx_usable(void) {
    static int state = 0; /* 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
        s = syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile register 16 rows of 64 bytes: the shape both kernels use. */
static inline void load_full_tiles(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif

#endif
