/* acc = xq @ Wq.T, exact int32 sums: the matmul of quantization="int8" (CPU), for int8 weights
 * per output channel and int8 activations per row (the rescale after it is quant_matmul.c's
 * int8_dequant).
 *
 * Layout: the weight rows regrouped by 16 into tiles (cpu_kernels.int8_tile_weights makes
 * them, once at load), the same interleaving as the GGUF tiles of quant_matmul.c without
 * their scales: tile g holds rows 16g..16g+15 as kp / 4 lines of 64 bytes, line j holding
 * bytes 4j..4j+3 of each of the 16 rows in row order (kp = k rounded up to 4; rows past n and
 * bytes past k are zeros). One 64-byte load then feeds 16 output rows, and 4 activation bytes
 * broadcast to every lane meet them in one dot-product instruction, so every sum stays in a
 * vector lane of its own: no horizontal sums, no shuffles.
 *
 * Why not torch._int_mm on row-major weights: oneDNN's int8 GEMM runs far below the weights'
 * streaming rate at decode's few rows, on a CPU without VNNI at every size, and row-major
 * weights leave a GEMV with a horizontal sum per output (the layout before this one: 4 x 4
 * blocks, 40% of the VNNI rate at 32 rows). On a 2-core Zen 4, the 1B shape's o, gate/up and
 * down linears at 32 rows: 850 / 755 / 783 GOP/s against 400 / 442 / 485 (row-major) and
 * 348 / 390 / 267 (torch._int_mm); at 512 rows 844 / 762 / 798 against _int_mm's
 * 785 / 657 / 730.
 *
 * Bodies (int8_matmul_isa): AVX512-VNNI takes 4 tiles (64 output rows) x up to 4 activation
 * rows per pass, 16 accumulators; vpdpbusd multiplies unsigned by signed bytes, so the
 * activations go in as xu = x + 128 (x ^ 0x80; |x| <= 127, so 1..255) and 128 * sum(w) of
 * each row (wsum, made at load) comes off again. AVX2 (also the AVX-512 build without VNNI):
 * one tile as two 8-row halves, the weight's sign moved onto the activation so that maddubs
 * multiplies |w| (unsigned) by +-x, exact since 127 * 127 * 2 < 2^15, then madd into int32
 * lanes. Plain C elsewhere. The sums are exact in every body: |lane| <= 255 * 127 * kp
 * < 2^31 for k < 2^16, as torch._int_mm's are.
 * Built and loaded by forerun/model/cpu_kernels.py. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GR 16 /* weight rows per tile */
#define MR 4  /* activation rows per pass */

/* Every body's pass (DEFINE_PASS): out[r][c * 16 + i] for R activation rows (xu, stride kp)
 * against T tiles (t, tile stride ts), valid[c] of each tile's 16 rows written (the last
 * tile of a matrix may be short). */
#define PASS_HEAD(R, T)                                                                         \
    static void pass_##R##_##T(const uint8_t *xu, int64_t kp, const int8_t *t, int64_t ts,      \
                               const int32_t *wsum, int32_t *out, int64_t ldo, const int *valid)

static inline int32_t act4(const uint8_t *p) { /* 4 activation bytes as one lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define ISA 2
#define NT 4 /* tiles per pass */
#define FLIP 0x80u
/* Bytes ahead of the line being read that each tile's stream is prefetched into L2 (the
 * row-major body measured 21 -> 27 GB/s at one row with it on a 2-core Zen 4; into L1 the
 * streams' lines evicted each other). */
#define I8_AHEAD 16384
/* An empty asm that takes v in a register and may change it: without it GCC folded each
 * weight line into every product as a memory operand (four loads of it, not one) and moved
 * the 16 sums between registers and the stack every line (0.7x the rate). */
#define KEEP_IN_ZMM(v) __asm__("" : "+v"(v))
#define DEFINE_PASS(R, T)                                                                       \
    PASS_HEAD(R, T) {                                                                           \
        __m512i s[R][T];                                                                        \
        for (int r = 0; r < R; ++r)                                                             \
            for (int c = 0; c < T; ++c) s[r][c] = _mm512_setzero_si512();                       \
        for (int64_t j = 0; j < kp / 4; ++j) {                                                  \
            __m512i w[T];                                                                       \
            for (int c = 0; c < T; ++c) {                                                       \
                _mm_prefetch((const char *)(t + c * ts + 64 * j + I8_AHEAD), _MM_HINT_T1);      \
                w[c] = _mm512_loadu_si512((const void *)(t + c * ts + 64 * j));                 \
                KEEP_IN_ZMM(w[c]);                                                              \
            }                                                                                   \
            for (int r = 0; r < R; ++r) {                                                       \
                const __m512i a = _mm512_set1_epi32(act4(xu + r * kp + 4 * j));                 \
                for (int c = 0; c < T; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], a, w[c]);    \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < T; ++c) {                                                           \
            const __mmask16 keep = (__mmask16)((1u << valid[c]) - 1);                           \
            const __m512i off =                                                                 \
                _mm512_slli_epi32(_mm512_loadu_si512((const void *)(wsum + c * GR)), 7);        \
            for (int r = 0; r < R; ++r)                                                         \
                _mm512_mask_storeu_epi32(out + r * ldo + c * GR, keep,                          \
                                         _mm512_sub_epi32(s[r][c], off));                       \
        }                                                                                       \
    }

#else /* one tile per pass, signed activations */
#define NT 1
#define FLIP 0u
#if defined(__AVX2__)
#define ISA 1
/* The AVX2 pass: one tile as two halves of 8 rows (a ymm of 8 rows x 4 bytes each). */
#define DEFINE_PASS(R, T)                                                                       \
    PASS_HEAD(R, T) {                                                                           \
        (void)ts, (void)wsum;                                                                   \
        const __m256i ones = _mm256_set1_epi16(1);                                              \
        __m256i s[R][2];                                                                        \
        for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();                 \
        for (int64_t j = 0; j < kp / 4; ++j) {                                                  \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(t + 64 * j));               \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(t + 64 * j + 32));          \
            const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);         \
            for (int r = 0; r < R; ++r) {                                                       \
                const __m256i a = _mm256_set1_epi32(act4(xu + r * kp + 4 * j));                 \
                s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(     \
                                                        u0, _mm256_sign_epi8(a, w0)), ones));   \
                s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(     \
                                                        u1, _mm256_sign_epi8(a, w1)), ones));   \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; ++r) {                                                           \
            int32_t v[GR];                                                                      \
            _mm256_storeu_si256((__m256i *)v, s[r][0]);                                         \
            _mm256_storeu_si256((__m256i *)(v + 8), s[r][1]);                                   \
            memcpy(out + r * ldo, v, sizeof(int32_t) * (size_t)valid[0]);                       \
        }                                                                                       \
    }

#else
#define ISA 0
#define DEFINE_PASS(R, T)                                                                       \
    PASS_HEAD(R, T) {                                                                           \
        (void)ts, (void)wsum;                                                                   \
        for (int r = 0; r < R; ++r)                                                             \
            for (int i = 0; i < valid[0]; ++i) {                                                \
                int32_t sum = 0;                                                                \
                for (int64_t j = 0; j < kp; ++j)                                                \
                    sum += (int32_t)(int8_t)xu[r * kp + j] * (int32_t)t[64 * (j / 4) + 4 * i + j % 4]; \
                out[r * ldo + i] = sum;                                                         \
            }                                                                                   \
    }
#endif
#endif

/* The instruction set the body below was built for: 2 AVX512-VNNI, 1 AVX2, 0 plain C. */
int int8_matmul_isa(void) { return ISA; }

DEFINE_PASS(1, 1)
DEFINE_PASS(2, 1)
DEFINE_PASS(3, 1)
DEFINE_PASS(4, 1)
#if NT > 1
#define DEFINE_PASS_NT(R, T) DEFINE_PASS(R, T) /* T expanded before it is pasted */
DEFINE_PASS_NT(1, NT)
DEFINE_PASS_NT(2, NT)
DEFINE_PASS_NT(3, NT)
DEFINE_PASS_NT(4, NT)
#endif

/* Integer sums out [m, n] of xq [m, k] against the tiled weights (ceil(n / 16) tiles of
 * 16 x kp bytes) and wsum [ceil(n / 16) * 16] (each weight row's sum, zeros past n; read by
 * the VNNI body only); -1 if scratch cannot be had. */
int int8_matmul_acc(const int8_t *xq, const int8_t *tiles, const int32_t *wsum, int32_t *out,
                    int64_t m, int64_t n, int64_t k) {
    const int64_t kp = (k + 3) / 4 * 4, groups = (n + GR - 1) / GR, ts = GR * kp;
    /* the activations with the row stride kp, padded with zeros (x + 128 for VNNI) */
    uint8_t *xu = malloc((size_t)(m * kp));
    if (!xu) return -1;
    const int64_t nblocks = (groups + NT - 1) / NT;
#pragma omp parallel if (n * k > 65536)
    {
    /* a prompt's rows on both cores too (512 x 8192 bytes: the down projection 3% faster) */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < k; ++j) xu[r * kp + j] = (uint8_t)xq[r * k + j] ^ FLIP;
        for (int64_t j = k; j < kp; ++j) xu[r * kp + j] = FLIP;
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t g0 = b * NT, nt = groups - g0 < NT ? groups - g0 : NT;
        int valid[NT];
        for (int c = 0; c < nt; ++c) {
            const int64_t left = n - (g0 + c) * GR;
            valid[c] = (int)(left < GR ? left : GR);
        }
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            const int64_t mr = m - r0 < MR ? m - r0 : MR;
            const uint8_t *x = xu + r0 * kp;
            int32_t *o = out + r0 * n + g0 * GR;
#define PASS(R, T) pass_##R##_##T(x, kp, tiles + (g0 + c) * ts, ts, wsum + (g0 + c) * GR, \
                                  o + c * GR, n, valid + c)
#define FOR_ROWS(T)                                                                          \
    switch (mr) {                                                                            \
    case 1: PASS(1, T); break;                                                               \
    case 2: PASS(2, T); break;                                                               \
    case 3: PASS(3, T); break;                                                               \
    default: PASS(4, T); break;                                                              \
    }
#if NT > 1
            if (nt == NT) {
                const int64_t c = 0;
                FOR_ROWS(NT)
                continue;
            }
#endif
            for (int64_t c = 0; c < nt; ++c) FOR_ROWS(1)
#undef FOR_ROWS
#undef PASS
        }
    }
    }
    free(xu);
    return 0;
}
