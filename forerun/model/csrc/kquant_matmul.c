/* y = x @ W.T (+ bias) with W in GGUF's Q2_K super-blocks (256 values) as the file's rows:
 * the matmul of quantization="gguf" for that type (CPU). Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS
 * run in row-interleaved tiles (quant_matmul.c).
 *
 * The formats, per super-block of 256 values of a weight row (ggml's layouts; byte offsets):
 *   Q2_K  84 B: scales[16] (lo nibble scale, hi nibble min, per 16 values), qs[64], d, dmin
 *               value 128h + 32g + i = bits 2g..2g+1 of qs[32h + i];   w = d sc q - dmin m
 * forerun/model/quant/kquant_blocks.py reads the same bits in torch (and names the oracle).
 * A row's super-blocks are used as the file stores them: the GEMV walks a row's bytes once,
 * in order.
 *
 * Activations: each row of x is quantized per 32 to int8 with its own scale s = max|x| / 127
 * (round to nearest even), exactly as quant_matmul.c does for the 32-value types, and
 * s * (the sum of every 16 int8 values) is kept. (Per 256 with one scale, llama.cpp's Q8_K,
 * would save 7 of 8 int -> float conversions per super-block, but one outlier channel then
 * coarsens 255 other values: SmolLM2 in Q6_K lost 1.7% of its NLL to it, 0.5% per 32; see
 * forerun/model/quant/kquant_blocks.py.) With a weight w = d * sc * q - dmin * m per
 * sub-block, the 32 values of activation block j contribute
 *   s_j * d * sum_sub sc * dot(q, a)  -  sum_sub (dmin * m) * (s_j * sum(a)):
 * dot products of small unsigned integers with int8 (maddubs: 32 products per instruction,
 * pairs summed in int16), weighted by the sub-block scales in int32 (madd), one float FMA
 * per 32 values; the mins come from the kept sums, 16 per super-block, once per block and
 * row.
 *
 * Bodies by the build's -march: AVX2 (with FMA and F16C; its byte dot products with VNNI
 * where the CPU has AVX512-VNNI or AVX-VNNI), or plain C; kquant_matmul_isa() says which.
 * A weight row is read once for up to MAXM activation rows (its unpacked quants feed all of
 * them); rows are shared among threads.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#include "qweight.h"

#define QK_K 256
#define MAXM 4      /* activation rows per pass over a weight row */
#define MCHUNK 256  /* activation rows whose quantized values stay cache-resident together */
#define PREFETCH_BLOCKS 8 /* super-blocks ahead of the one being read (AVX2 body) */

enum { QT_Q2_K = 10 };


/* One quantized activation row: q[k]; per 16 values (in lane order, below) the scale s of
 * their block of 32 and s times the sum of their 16 q. */
typedef struct {
    const int8_t *q;
    const float *s16;
    const float *ss16;
} act_t;

/* "Lane order" of a super-block's 16 sub-blocks of 16 values: the order in which the AVX2
 * body's horizontal adds leave their dot products (two vectors of 8: sub-blocks
 * 0 2 4 6 1 3 5 7, then 8 10 12 14 9 11 13 15). Per-sub-block factors (activation scales and
 * sums here, weight scales in the body) are laid out so, and multiply lane by lane. */
#define SUBPOS(t) (((t) / 8) * 8 + ((t) % 2) * 4 + ((t) % 8) / 2)

static int64_t kblock_bytes(int64_t type) {
    switch (type) {
    case QT_Q2_K: return 84;
    default: return 0;
    }
}

/* ---- activations ------------------------------------------------------------------------ */
static void quantize_row_k(const float *x, int64_t k, int8_t *q, float *s16, float *ss16) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int h = 0; h < 2; ++h) {
            int32_t sum = 0;
            for (int j = 16 * h; j < 16 * h + 16; ++j) {
                const int32_t v = (int32_t)nearbyintf(xb[j] * inv);
                q[b * 32 + j] = (int8_t)v;
                sum += v;
            }
            const int64_t t = 2 * b + h, at = (t / 16) * 16 + SUBPOS(t % 16);
            s16[at] = d;
            ss16[at] = d * (float)sum;
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* 32 products of u (unsigned, <= 63) and a (int8, |a| <= 127) summed by fours into 8 int32:
 * lanes 0-3 hold the first 16 values' dot product, lanes 4-7 the last 16's. One VNNI
 * instruction where the CPU has it (AVX512-VNNI on 256-bit vectors, or AVX-VNNI); else
 * maddubs (pairs in int16, no saturation: 2 * 63 * 127 < 32767) and madd by ones. */
static inline __m256i dot32v(__m256i u, __m256i av) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ISA 3
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, av);
#elif defined(__AVXVNNI__)
#define ISA 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, av);
#else
#define ISA 1
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), _mm256_set1_epi16(1));
#endif
}

/* The 16 sub-block dot products of 8 dot32 results, as two vectors in lane order. */
static inline void sub_dots(const __m256i p[8], __m256i g[2]) {
    for (int h = 0; h < 2; ++h)
        g[h] = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4 * h], p[4 * h + 1]),
                                 _mm256_hadd_epi32(p[4 * h + 2], p[4 * h + 3]));
}

/* 8 bytes (as uint64) -> 8 floats, unsigned or signed. */
static inline __m256 u8_to_ps(uint64_t v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
}
static inline __m256 i8_to_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

/* The sub-block scales and mins of one super-block as floats in lane order (two vectors
 * each; mins 0 for the types without), and d, dmin. */
static inline void block_factors(int64_t type, const uint8_t *blk, __m256 sc[2], __m256 mn[2],
                                 float *d, float *dmin) {
    /* 16 sub-block bytes in natural order -> lane order. */
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    (void)type; /* Q2_K: the only type here */
    *d = fp16_to_f32(blk + 80);
    *dmin = fp16_to_f32(blk + 82);
    const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk), order);
    const __m128i s4 = _mm_and_si128(v, _mm_set1_epi8(0x0f));
    const __m128i m4 = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
    sc[0] = i8_to_ps(s4); /* 0..15: as signed bytes too */
    sc[1] = i8_to_ps(_mm_srli_si128(s4, 8));
    mn[0] = i8_to_ps(m4);
    mn[1] = i8_to_ps(_mm_srli_si128(m4, 8));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The quants of one Q2_K super-block as 8 vectors of 32 values (value 32j + i in vector j,
 * lane i), and the offset to subtract from them (0). */
static inline int unpack_u(int64_t type, const uint8_t *blk, __m256i u[8]) {
    (void)type;
    const __m256i m2 = _mm256_set1_epi8(3);
    const uint8_t *qs = blk + 16;
    for (int h = 0; h < 2; ++h) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        u[4 * h] = _mm256_and_si256(l, m2);
        u[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(l, 2), m2);
        u[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(l, 4), m2);
        u[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(l, 6), m2);
    }
    return 0;
}
#else
#define ISA 0
/* The quants of one Q2_K super-block, value v in u[v], and the offset to subtract (0). */
static inline int unpack_u(int64_t type, const uint8_t *blk, int16_t u[QK_K]) {
    (void)type;
    const uint8_t *qs = blk + 16;
    for (int v = 0; v < QK_K; ++v) u[v] = (qs[32 * (v / 128) + v % 32] >> (2 * ((v / 32) % 4))) & 3;
    return 0;
}
#endif

#if ISA == 0
/* Sub-block scales and mins of one super-block, per 16 values, and d, dmin. */
static inline void block_scales(int64_t type, const uint8_t *blk, int32_t sc[16],
                                int32_t mn[16], float *d, float *dmin) {
    (void)type; /* Q2_K: the only type here */
    *d = fp16_to_f32(blk + 80);
    *dmin = fp16_to_f32(blk + 82);
    for (int s = 0; s < 16; ++s) {
        sc[s] = blk[s] & 0x0f;
        mn[s] = blk[s] >> 4;
    }
}

#endif

/* out[i] = weight row w (nb super-blocks of type) . activation row a[i], i < m; m is a
 * compile-time constant in each instance (row_dot below), so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void row_dot_m(
    int64_t type, const uint8_t *w, int64_t nb, const act_t *a, const int m, float *out) {
    const int64_t bb = kblock_bytes(type);
#if ISA >= 1
    __m256 acc[MAXM], fix[MAXM];
    for (int64_t i = 0; i < m; ++i) acc[i] = fix[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = w + b * bb;
        /* Software prefetch on top of the hardware's (rows are read one after another):
         * a 2048 x 8192 GEMV (Q6_K rows, measured before they moved to tiles) 17 -> 19 GB/s
         * on 2 cores with the weights in DRAM. */
        for (int64_t o = 0; o < bb; o += 64)
            _mm_prefetch((const char *)(blk + PREFETCH_BLOCKS * bb + o), _MM_HINT_T0);
        __m256 sc[2], mn[2];
        float d, dmin;
        block_factors(type, blk, sc, mn, &d, &dmin);
        __m256i u[8];
        const int off = unpack_u(type, blk, u);
        /* Per sub-block: d * sc multiplies the integer dot products, d * off * sc + dmin * m
         * the activations' scaled sums (taken back). */
        __m256 dsc[2], cw[2];
        for (int h = 0; h < 2; ++h) {
            dsc[h] = _mm256_mul_ps(_mm256_set1_ps(d), sc[h]);
            cw[h] = _mm256_fmadd_ps(_mm256_set1_ps((float)off), dsc[h],
                                    _mm256_mul_ps(_mm256_set1_ps(dmin), mn[h]));
        }
        for (int64_t i = 0; i < m; ++i) {
            const int8_t *q = a[i].q + b * QK_K;
            const float *s16 = a[i].s16 + b * 16, *ss16 = a[i].ss16 + b * 16;
            __m256i p[8], g[2];
            for (int j = 0; j < 8; ++j)
                p[j] = dot32v(u[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j)));
            sub_dots(p, g);
            for (int h = 0; h < 2; ++h) {
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g[h]),
                                         _mm256_mul_ps(dsc[h], _mm256_loadu_ps(s16 + 8 * h)),
                                         acc[i]);
                fix[i] = _mm256_fmadd_ps(_mm256_loadu_ps(ss16 + 8 * h), cw[h], fix[i]);
            }
        }
    }
    for (int64_t i = 0; i < m; ++i) out[i] = hsum8(_mm256_sub_ps(acc[i], fix[i]));
#else
    for (int64_t i = 0; i < m; ++i) out[i] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = w + b * bb;
        int32_t sc[16], mn[16];
        float d, dmin;
        block_scales(type, blk, sc, mn, &d, &dmin);
        int16_t u[QK_K];
        const int off = unpack_u(type, blk, u);
        for (int64_t i = 0; i < m; ++i) {
            const int8_t *q = a[i].q + b * QK_K;
            const float *s16 = a[i].s16 + b * 16, *ss16 = a[i].ss16 + b * 16;
            for (int t = 0; t < 16; ++t) {
                int32_t dot = 0;
                for (int v = 16 * t; v < 16 * t + 16; ++v) dot += u[v] * q[v];
                out[i] += d * (float)sc[t] * s16[SUBPOS(t)] * (float)dot -
                          (d * (float)(off * sc[t]) + dmin * (float)mn[t]) * ss16[SUBPOS(t)];
            }
        }
    }
#endif
}

static void row_dot(int64_t type, const uint8_t *w, int64_t nb, const act_t *a, int64_t m,
                    float *out) {
    switch (m) {
    case 1: row_dot_m(type, w, nb, a, 1, out); return;
    case 2: row_dot_m(type, w, nb, a, 2, out); return;
    case 3: row_dot_m(type, w, nb, a, 3, out); return;
    default: row_dot_m(type, w, nb, a, 4, out); return;
    }
}

/* 3: AVX512-VNNI (256-bit), 2: AVX-VNNI, 1: AVX2 (maddubs), 0: plain C (tests, logs). */
int kquant_matmul_isa(void) { return ISA; }

/* See qweight.h; gguf_matmul.c is the entry point that calls this. */
int kquant_matmul_rows(const float *xf, const qweight_t *w, float *y, int64_t ldy, int64_t m,
                       int64_t k) {
    if (k % QK_K || w->nparts < 1 || w->nparts > QW_MAXPARTS) return -2;
    int64_t total = 0, first_row[QW_MAXPARTS + 1];
    for (int64_t p = 0; p < w->nparts; ++p) {
        if (!kblock_bytes(w->type[p]) || w->rows[p] < 1) return -2;
        first_row[p] = total;
        total += w->rows[p];
    }
    first_row[w->nparts] = total;
    const int64_t n = total, nb = k / QK_K;
    /* One allocation: quantized rows, then scales and scaled sums (per 16, lane order). */
    const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    char *scratch = malloc(qbytes + sizeof(float) * (size_t)(2 * m * (k / 16)));
    if (!scratch) return -1;
    int8_t *qa = (int8_t *)scratch;
    float *sa = (float *)(scratch + qbytes), *ssa = sa + m * (k / 16);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i)
            quantize_row_k(xf + i * k, k, qa + i * k, sa + i * (k / 16), ssa + i * (k / 16));
        for (int64_t i0 = 0; i0 < m; i0 += MCHUNK) {
            const int64_t mc = i0 + MCHUNK <= m ? MCHUNK : m - i0;
            /* Guided, not static: the engine's other threads (the scheduler planning the next
             * step) share these cores, and equal static shares left one thread waiting at
             * the barrier (1B Q4_K_M decode ~49 -> ~42 ms/token on 2 cores). */
#pragma omp for schedule(guided, 16)
            for (int64_t r = 0; r < n; ++r) {
                int64_t p = 0;
                while (r >= first_row[p + 1]) ++p;
                const int64_t type = w->type[p];
                const uint8_t *row = w->data[p] + (r - first_row[p]) * nb * kblock_bytes(type);
                for (int64_t i = i0; i < i0 + mc; i += MAXM) {
                    const int64_t mi = i + MAXM <= i0 + mc ? MAXM : i0 + mc - i;
                    act_t acts[MAXM];
                    for (int64_t t = 0; t < mi; ++t)
                        acts[t] = (act_t){qa + (i + t) * k, sa + (i + t) * (k / 16),
                                          ssa + (i + t) * (k / 16)};
                    float out[MAXM];
                    row_dot(type, row, nb, acts, mi, out);
                    for (int64_t t = 0; t < mi; ++t) y[(i + t) * ldy + r] = out[t];
                }
            }
        }
    }
    free(scratch);
    return 0;
}
