/* y = x @ W.T (+ bias) with W kept in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1): the matmuls
 * of quantization="gguf" (CPU).
 *
 * A weight row of k values is k/32 blocks, stored exactly as in the GGUF file:
 *   Q8_0: fp16 d, int8 q[32]              w = d * q
 *   Q4_0: fp16 d, uint8 qs[16]            w = d * (nibble - 8)
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]    w = d * nibble + m
 * (value j of a 4-bit block is the low nibble of qs[j], value 16 + j its high nibble).
 *
 * Activations: each row of x is quantized per block of 32 to int8 with its own scale
 * s = max|x| / 127 (round to nearest even), as llama.cpp's q8 activations are. The dot
 * product of a block pair is then an integer sum, which the CPU's int8 dot-product
 * instructions (AVX512-VNNI / AVX-VNNI, else AVX2's maddubs) do 32 at a time, and the
 * weights are read once, in their packed 4.5-8.5 bits per value: decode is bound by those
 * bytes. With every weight written as w = d * u + c (u a small non-negative integer per
 * value, d and c per block), a block contributes
 *     d * s * sum_j(u_j a_j) + c * (s * sum_j a_j),
 * so one kernel serves the three types: only the unpacking of u and the (d, c) differ.
 * forerun/model/quant/gguf_blocks.py computes the same function in torch (the fallback).
 *
 * Which body is compiled follows the build's -march (cpu_kernels.py builds for the machine):
 * AVX512-VNNI (two blocks per 512-bit instruction), AVX-VNNI, AVX2, or plain C;
 * quant_matmul_isa() says which.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define QK 32
#define MAXM 4      /* rows of x per pass over a weight row */
#define MCHUNK 256  /* rows of x whose quantized activations stay cache-resident together */
#define MAXPARTS 4

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8 }; /* ggml's type ids */

/* A linear weight as up to MAXPARTS row ranges, each in its own block type (a fused q/k/v
 * whose GGUF tensors differ in type keeps each part as it is). Rows are concatenated. */
typedef struct {
    int64_t nparts;
    int64_t type[MAXPARTS];
    int64_t rows[MAXPARTS];
    const uint8_t *data[MAXPARTS];
} qweight_t;

static int64_t block_bytes(int64_t type) {
    switch (type) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    default: return 0;
    }
}

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 1;
            while (!(man & 0x400u)) { man <<= 1; --exp; }
            man &= 0x3ffu;
            u = sign | ((exp + 112u) << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* d and c of a block (w = d * u + c). The u of Q8_0 depends on the body: see unpack. */
static inline void block_dc(int64_t type, const uint8_t *blk, float *d, float *c) {
    *d = fp16_to_f32(blk);
    switch (type) {
    case QT_Q4_0: *c = -8.f * *d; break;
    case QT_Q4_1: *c = fp16_to_f32(blk + 2); break;
    default: *c = 0.f; break; /* Q8_0; the VNNI body shifts u and sets c itself */
    }
}

/* With AVX512-VNNI one 512-bit dot product covers two blocks. A 4-bit block pair unpacks
 * most cheaply as [low nibbles of b, of b+1, high nibbles of b, of b+1], so the activations
 * are stored in that order: for blocks b = 2p, 2p+1, the 64 bytes at 64p are
 * [a_b[0:16], a_b+1[0:16], a_b[16:32], a_b+1[16:32]] (an odd last block stays as it is), and
 * sv holds per pair the 16 lane scales (s_b in int32 lanes 0-3 and 8-11, s_b+1 in 4-7 and
 * 12-15: the lanes each block's products land in), then the same lanes holding an eighth of
 * s * sum(q), so that the c terms are one vector multiply-add too. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAIRS 1
#else
#define PAIRS 0
#endif

/* Row of k floats -> int8 per block of 32 (in the layout above), its scale s, s * sum(q) and,
 * with PAIRS, the pairs' lane scales and lane shares of s * sum(q), sv [k / 64][2][16]. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *s, float *ssum,
                         float *sv) {
    const int64_t nb = k / QK;
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        int8_t qb[QK];
        for (int j = 0; j < QK; ++j) {
            const int32_t v = (int32_t)nearbyintf(xb[j] * inv);
            qb[j] = (int8_t)v;
            sum += v;
        }
        s[b] = d;
        ssum[b] = d * (float)sum;
        if (PAIRS && b / 2 < nb / 2) {
            int8_t *dst = q + (b & ~(int64_t)1) * QK + (b & 1) * 16;
            memcpy(dst, qb, 16);
            memcpy(dst + 32, qb + 16, 16);
            for (int l = 0; l < 16; ++l) {
                if (((l >> 2) & 1) != (b & 1)) continue;
                sv[(b / 2) * 32 + l] = d;
                sv[(b / 2) * 32 + 16 + l] = ssum[b] / 8.f; /* 8 lanes sum to s * sum(q) */
            }
        } else {
            memcpy(q + b * QK, qb, QK);
        }
    }
}

/* ---- one weight row against up to MAXM activation rows ---------------------------------- */
#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define HAVE_VNNI 0
#endif

/* u8 x s8 -> 8 int32 partial sums. maddubs saturates int16 pairs: u <= 15 (4-bit) or
 * |u| <= 128 against |a| <= 127 (Q8_0 with the sign trick) stays below 32767. */
static inline __m256i dot_u8s8(__m256i u, __m256i a) {
#if HAVE_VNNI
    return DPBUSD(_mm256_setzero_si256(), u, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256i unpack4(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

#define DEFINE_ROW4(NAME, CONST_M)                                                             \
    static void NAME(int64_t type, const uint8_t *w, int64_t nb, const int8_t *qa,            \
                     const float *sa, const float *ssa, int64_t k, int64_t m, float *out) {   \
        const int M = CONST_M;                                                                 \
        const int64_t bs = block_bytes(type), qoff = type == QT_Q4_1 ? 4 : 2;                  \
        __m256 acc[MAXM];                                                                      \
        float cacc[MAXM];                                                                      \
        for (int i = 0; i < M; ++i) { acc[i] = _mm256_setzero_ps(); cacc[i] = 0.f; }           \
        (void)m;                                                                               \
        for (int64_t b = 0; b < nb; ++b) {                                                     \
            const uint8_t *blk = w + b * bs;                                                   \
            float d, c;                                                                        \
            block_dc(type, blk, &d, &c);                                                       \
            if (type == QT_Q8_0) {                                                             \
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + qoff));           \
                if (HAVE_VNNI) {                                                               \
                    /* u = q + 128 (unsigned), and c removes the 128 * sum(a) it adds */       \
                    const __m256i u = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));       \
                    c = -128.f * d;                                                            \
                    for (int i = 0; i < M; ++i) {                                              \
                        const __m256i a =                                                      \
                            _mm256_loadu_si256((const __m256i *)(qa + i * k + b * QK));        \
                        const __m256 ds = _mm256_set1_ps(d * sa[i * nb + b]);                  \
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, a)), ds,       \
                                                 acc[i]);                                      \
                        cacc[i] += c * ssa[i * nb + b];                                        \
                    }                                                                          \
                } else {                                                                       \
                    /* |q| against a with q's sign: the same products, u unsigned */           \
                    const __m256i u = _mm256_sign_epi8(q, q);                                  \
                    for (int i = 0; i < M; ++i) {                                              \
                        const __m256i a = _mm256_sign_epi8(                                    \
                            _mm256_loadu_si256((const __m256i *)(qa + i * k + b * QK)), q);    \
                        const __m256 ds = _mm256_set1_ps(d * sa[i * nb + b]);                  \
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, a)), ds,       \
                                                 acc[i]);                                      \
                    }                                                                          \
                }                                                                              \
            } else {                                                                           \
                const __m256i u = unpack4(blk + qoff);                                         \
                for (int i = 0; i < M; ++i) {                                                  \
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + i * k + b * QK)); \
                    const __m256 ds = _mm256_set1_ps(d * sa[i * nb + b]);                      \
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, a)), ds, acc[i]);  \
                    cacc[i] += c * ssa[i * nb + b];                                            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < M; ++i) out[i] = hsum256(acc[i]) + cacc[i];                        \
    }

#if !PAIRS
DEFINE_ROW4(row_m1, 1)
DEFINE_ROW4(row_m2, 2)
DEFINE_ROW4(row_m3, 3)
DEFINE_ROW4(row_m4, 4)
#endif

#if PAIRS
/* Two blocks per step (layout above); an odd last block goes through the 256-bit body. */
/* d (and Q4_1's m) of blocks b and b+1 as floats [d0, m0, d1, m1]: one conversion. */
static inline __m128 pair_dm(const uint8_t *b0, const uint8_t *b1) {
    int32_t h0, h1;
    memcpy(&h0, b0, 4); /* d, m (Q4_1) or d and a quant byte pair (ignored) */
    memcpy(&h1, b1, 4);
    return _mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0));
}

#define DEFINE_ROWZ(NAME, TAIL, CONST_M)                                                        \
    static void NAME(int64_t type, const uint8_t *w, int64_t nb, const int8_t *qa,             \
                     const float *sa, const float *ssa, const float *sv, int64_t k,            \
                     float *out) {                                                             \
        const int M = CONST_M;                                                                 \
        const int64_t bs = block_bytes(type), qoff = type == QT_Q4_1 ? 4 : 2, np = nb / 2;     \
        /* lanes of block b take element 0 (d0) / 1 (m0), those of b+1 element 2 / 3 */        \
        const __m512i di = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);   \
        const __m512i mi = _mm512_add_epi32(di, _mm512_set1_epi32(1));                         \
        const float cd = type == QT_Q4_0 ? -8.f : -128.f; /* c = cd * d unless Q4_1 */         \
        __m512 acc[MAXM], cacc[MAXM];                                                          \
        for (int i = 0; i < M; ++i) { acc[i] = _mm512_setzero_ps(); cacc[i] = acc[i]; }        \
        for (int64_t p = 0; p < np; ++p) {                                                     \
            const uint8_t *b0 = w + 2 * p * bs, *b1 = b0 + bs;                                 \
            const __m512 dm = _mm512_castps128_ps512(pair_dm(b0, b1));                   \
            const __m512 dv = _mm512_permutexvar_ps(di, dm);                                   \
            const __m512 cv = type == QT_Q4_1 ? _mm512_permutexvar_ps(mi, dm)                  \
                                              : _mm512_mul_ps(dv, _mm512_set1_ps(cd));         \
            __m512i u;                                                                         \
            if (type == QT_Q8_0) {                                                             \
                __m512i z = _mm512_inserti64x4(                                                \
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),     \
                    _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);                         \
                z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                       \
                u = _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80)); /* q + 128 */           \
            } else {                                                                           \
                const __m256i r = _mm256_inserti128_si256(                                     \
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + qoff))),     \
                    _mm_loadu_si128((const __m128i *)(b1 + qoff)), 1);                         \
                u = _mm512_and_si512(                                                          \
                    _mm512_inserti64x4(_mm512_castsi256_si512(r), _mm256_srli_epi16(r, 4), 1), \
                    _mm512_set1_epi8(0x0f));                                                   \
            }                                                                                  \
            for (int i = 0; i < M; ++i) {                                                      \
                const float *svp = sv + (i * np + p) * 32;                                     \
                const __m512i a = _mm512_loadu_si512((const void *)(qa + i * k + p * 64));     \
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, a);         \
                const __m512 sc = _mm512_mul_ps(dv, _mm512_loadu_ps(svp));                     \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[i]);                 \
                cacc[i] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(svp + 16), cacc[i]);             \
            }                                                                                  \
        }                                                                                      \
        float tail[MAXM] = {0.f};                                                              \
        if (nb & 1) {                                                                          \
            const int64_t b = nb - 1;                                                          \
            TAIL(type, w + b * bs, 1, qa + b * QK, sa + b, ssa + b, k, M, tail);               \
        }                                                                                      \
        for (int i = 0; i < M; ++i)                                                            \
            out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], cacc[i])) + tail[i];           \
    }

/* The 256-bit bodies run one block here, with the row strides of the full activations. */
#define DEFINE_TAIL(NAME, CONST_M)                                                              \
    static void NAME(int64_t type, const uint8_t *blk, int64_t nb1, const int8_t *qa,          \
                     const float *sa, const float *ssa, int64_t k, int64_t m, float *out) {    \
        (void)nb1;                                                                             \
        float d, c;                                                                            \
        block_dc(type, blk, &d, &c);                                                           \
        __m256i u;                                                                             \
        if (type == QT_Q8_0) {                                                                 \
            u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),               \
                                 _mm256_set1_epi8((char)0x80));                                \
            c = -128.f * d;                                                                    \
        } else {                                                                               \
            u = unpack4(blk + (type == QT_Q4_1 ? 4 : 2));                                      \
        }                                                                                      \
        const int64_t nb = k / QK;                                                             \
        for (int i = 0; i < CONST_M && i < m; ++i) {                                           \
            const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + i * k));               \
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);             \
            out[i] = (float)hsum256(_mm256_cvtepi32_ps(dot)) * d * sa[i * nb] +                \
                     c * ssa[i * nb];                                                          \
        }                                                                                      \
    }

DEFINE_TAIL(tail_block, MAXM)
DEFINE_ROWZ(rowz_m1, tail_block, 1)
DEFINE_ROWZ(rowz_m2, tail_block, 2)
DEFINE_ROWZ(rowz_m3, tail_block, 3)
DEFINE_ROWZ(rowz_m4, tail_block, 4)

static void weight_row(int64_t type, const uint8_t *w, int64_t nb, const int8_t *qa,
                       const float *sa, const float *ssa, const float *sv, int64_t k,
                       int64_t m, float *out) {
    switch (m) {
    case 1: rowz_m1(type, w, nb, qa, sa, ssa, sv, k, out); break;
    case 2: rowz_m2(type, w, nb, qa, sa, ssa, sv, k, out); break;
    case 3: rowz_m3(type, w, nb, qa, sa, ssa, sv, k, out); break;
    default: rowz_m4(type, w, nb, qa, sa, ssa, sv, k, out); break;
    }
}
#else
static void weight_row(int64_t type, const uint8_t *w, int64_t nb, const int8_t *qa,
                       const float *sa, const float *ssa, const float *sv, int64_t k,
                       int64_t m, float *out) {
    (void)sv;
    switch (m) {
    case 1: row_m1(type, w, nb, qa, sa, ssa, k, m, out); break;
    case 2: row_m2(type, w, nb, qa, sa, ssa, k, m, out); break;
    case 3: row_m3(type, w, nb, qa, sa, ssa, k, m, out); break;
    default: row_m4(type, w, nb, qa, sa, ssa, k, m, out); break;
    }
}
#endif
#else /* plain C */
static void weight_row(int64_t type, const uint8_t *w, int64_t nb, const int8_t *qa,
                       const float *sa, const float *ssa, const float *sv, int64_t k,
                       int64_t m, float *out) {
    (void)sv;
    const int64_t bs = block_bytes(type), qoff = type == QT_Q4_1 ? 4 : 2;
    for (int64_t i = 0; i < m; ++i) out[i] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = w + b * bs, *qs = blk + qoff;
        float d, c;
        block_dc(type, blk, &d, &c);
        int32_t u[QK];
        for (int j = 0; j < QK; ++j)
            u[j] = type == QT_Q8_0 ? (int32_t)(int8_t)qs[j]
                                   : (j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4);
        for (int64_t i = 0; i < m; ++i) {
            const int8_t *a = qa + i * k + b * QK;
            int32_t dot = 0;
            for (int j = 0; j < QK; ++j) dot += u[j] * a[j];
            out[i] += d * sa[i * nb + b] * (float)dot + c * ssa[i * nb + b];
        }
    }
}
#endif

/* 3: AVX512-VNNI (two blocks per instruction), 2: 256-bit VNNI (AVX512-VL or AVX-VNNI),
 * 1: AVX2, 0: plain C (for tests and logs). */
int quant_matmul_isa(void) {
#if defined(__AVX2__) && PAIRS
    return 3;
#elif defined(__AVX2__) && HAVE_VNNI
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] (float32) = xf [m, k] @ W.T: the body shared by both activation dtypes. */
static int quant_matmul_core(const float *xf, const qweight_t *w, float *y, int64_t m,
                             int64_t n, int64_t k) {
    if (k % QK || w->nparts < 1 || w->nparts > MAXPARTS) return -2;
    int64_t total = 0;
    for (int64_t p = 0; p < w->nparts; ++p) {
        if (!block_bytes(w->type[p])) return -2;
        total += w->rows[p];
    }
    if (total != n) return -2;
    const int64_t nb = k / QK, np = nb / 2;
    /* One allocation: quantized rows, then scales, scaled sums and pair lane scales. */
    const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    char *scratch = malloc(qbytes + sizeof(float) * (size_t)(m * (2 * nb + 32 * np)) + 64);
    if (!scratch) return -1;
    int8_t *qa = (int8_t *)scratch;
    float *sa = (float *)(scratch + qbytes), *ssa = sa + m * nb, *sv = ssa + m * nb;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i)
            quantize_row(xf + i * k, k, qa + i * k, sa + i * nb, ssa + i * nb, sv + i * np * 32);
        for (int64_t i0 = 0; i0 < m; i0 += MCHUNK) {
            const int64_t mc = i0 + MCHUNK <= m ? MCHUNK : m - i0;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; ++r) {
                int64_t p = 0, rr = r;
                while (rr >= w->rows[p]) rr -= w->rows[p++];
                const uint8_t *wr = w->data[p] + rr * block_bytes(w->type[p]) * nb;
                for (int64_t i = i0; i < i0 + mc; i += MAXM) {
                    const int64_t mi = i + MAXM <= i0 + mc ? MAXM : i0 + mc - i;
                    float out[MAXM];
                    weight_row(w->type[p], wr, nb, qa + i * k, sa + i * nb, ssa + i * nb,
                               sv + i * np * 32, k, mi, out);
                    for (int64_t t = 0; t < mi; ++t) y[(i + t) * n + r] = out[t];
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* y [m, n] = x [m, k] @ W.T (+ bias), W a qweight_t; same signature as small_matmul_*. */
int quant_matmul_f32(const float *x, const void *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k) {
    const int rc = quant_matmul_core(x, w, y, m, n, k);
    if (rc == 0 && bias)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
    return rc;
}

int quant_matmul_bf16(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * n));
    if (!xf) return -1;
    float *yf = xf + m * k;
    for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_f32(x[i]);
    const int rc = quant_matmul_core(xf, w, yf, m, n, k);
    if (rc == 0) {
#pragma omp parallel for schedule(static) if (m * n > 65536)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
                y[i * n + j] = f32_to_bf16(yf[i * n + j] + (bias ? bf16_to_f32(bias[j]) : 0.f));
    }
    free(xf);
    return rc;
}

/* ---- quantization="int8": the elementwise ends of an int8 x int8 -> int32 GEMM ------------
 * Per-token (row) dynamic quantization of activations, and the int32 -> float epilogue with
 * the row and per-output-channel scales, each one pass over memory (in torch each is several
 * passes over tensors as large as the GEMM's output, which would eat its speed-up). */
#define DEFINE_INT8_ENDS(T, SFX, LOAD, STORE)                                                   \
    int int8_quantize_rows_##SFX(const T *x, int8_t *q, float *s, int64_t m, int64_t k) {       \
        _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < m; ++i) {         \
            const T *xi = x + i * k;                                                            \
            float amax = 0.f;                                                                   \
            for (int64_t j = 0; j < k; ++j) amax = fmaxf(amax, fabsf(LOAD(xi[j])));             \
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;                        \
            for (int64_t j = 0; j < k; ++j) q[i * k + j] = (int8_t)nearbyintf(LOAD(xi[j]) * inv); \
            s[i] = d;                                                                           \
        }                                                                                       \
        return 0;                                                                               \
    }                                                                                           \
    int int8_dequant_##SFX(const int32_t *acc, const float *sx, const float *sw, const T *bias, \
                           T *y, int64_t m, int64_t n) {                                        \
        _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < m; ++i) {         \
            const float si = sx[i];                                                             \
            for (int64_t j = 0; j < n; ++j) {                                                   \
                const float v = (float)acc[i * n + j] * si * sw[j];                             \
                y[i * n + j] = STORE(bias ? v + LOAD(bias[j]) : v);                             \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

#define ID(v) (v)
DEFINE_INT8_ENDS(float, f32, ID, ID)
DEFINE_INT8_ENDS(uint16_t, bf16, bf16_to_f32, f32_to_bf16)
