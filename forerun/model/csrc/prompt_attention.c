/* Causal attention of prompt chunks over dense bfloat16 K/V, as tiled matrix products
 * (AVX512-BF16): the prefill counterpart of paged_attention.c's per-token walk.
 *
 * A prompt's queries all read the same keys, so the work is two matrix products per
 * (kv head, block of query rows): S = Q K^T and O += P V, with an online softmax between
 * them (flash attention's order: a block of keys at a time, the running max and sum per
 * row, O rescaled when the max grows). torch's SDPA does the same on CPU but with generic
 * float vectors; here both products are vdpbf16ps (two bf16 products per float lane), K and
 * V packed per block of keys into pairs that instruction takes, and the rows of one work
 * item are the G query heads of the kv head times a few tokens, so each packed key feeds
 * all G heads. Scores, the softmax and O are float32; P is rounded to bf16 for the second
 * product (as SDPA's bf16 path does).
 *
 * Layout: q [tokens, H, D] (heads contiguous within a token, any token stride), k and v
 * [tokens, KVH, D] with any token and head strides (a token's D values contiguous); prompt c's n_q queries are tokens c n_q .. c n_q + n_q - 1 of q and its
 * n_k keys tokens c n_k .. of k and v; query i sits at position q_pos0 + i and sees keys
 * 0 .. q_pos0 + i (q_pos0 = n_k - n_q: the keys before the chunk are its context), or with a
 * sliding window (window > 0) only the last `window` of those: key blocks wholly before every
 * row's window are skipped, not masked. out is
 * [tokens, H, D] contiguous. Without AVX512-BF16 the entry returns -2 and the caller keeps
 * SDPA. Built by forerun/model/cpu_kernels.py; loaded through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

#define ROWS 64   /* query rows (token, head) per work item */
#define BK 64     /* keys per block */
#define SROWS 8   /* rows per pass of the score product */
#define NEG_BIG -1e30f /* the running max before any key: finite (-ffast-math) */

int prompt_attention_available(void) { return 1; }

/* e^x for x <= 0 (scores minus their max): 2^(x log2 e) as 2^n 2^f, f in [-1/2, 1/2], 2^f by
 * its Taylor polynomial of degree 6 (relative error ~1e-7); below -87 the result is ~0. */
static inline __m512 exp_le0(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                   _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* One thread's scratch: scores, probabilities, output accumulators, packed K and V. */
typedef struct {
    float s[ROWS + SROWS][BK]; /* rows past the item's are a pass's padding */
    uint16_t p[ROWS][BK];
    float m[ROWS], l[ROWS], alpha[ROWS];
    uint32_t *kp; /* [D / 2][BK]: key j's dimensions 2e, 2e + 1 as word e of column j */
    uint32_t *vp; /* [BK / 2][D]: keys 2i, 2i + 1 of dimension d as one word */
    float *o;     /* [ROWS][D] */
} scratch_t;

/* S[r][half 32 keys] = scale * q_r . k_j for SROWS rows (pointers; padding repeats row 0). */
static inline void scores(const uint32_t *const qr[SROWS], const uint32_t *kp, int64_t d,
                          float scale, float (*s)[BK]) {
    for (int half = 0; half < BK / 32; ++half) {
        __m512 acc[SROWS][2];
        for (int i = 0; i < SROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t e = 0; e < d / 2; ++e) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + e * BK + 32 * half);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + e * BK + 32 * half + 16);
            for (int i = 0; i < SROWS; ++i) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)qr[i][e]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], k0, a);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], k1, a);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int i = 0; i < SROWS; ++i) {
            _mm512_storeu_ps(s[i] + 32 * half, _mm512_mul_ps(acc[i][0], sc));
            _mm512_storeu_ps(s[i] + 32 * half + 16, _mm512_mul_ps(acc[i][1], sc));
        }
    }
}

/* O[rows] = alpha O[rows] + P[rows] V for RP rows of DV 16-lane vectors (RP DV <= 16). */
static inline __attribute__((always_inline)) void pv_rows(
    scratch_t *w, int64_t r0, const int rp, const int dv, int64_t pairs) {
    __m512 acc[4][16];
    for (int i = 0; i < rp; ++i) {
        const __m512 al = _mm512_set1_ps(w->alpha[r0 + i]);
        for (int v = 0; v < dv; ++v)
            acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(w->o + (r0 + i) * 16 * dv + 16 * v), al);
    }
    for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512bh vv[16];
        for (int v = 0; v < dv; ++v)
            vv[v] = (__m512bh)_mm512_loadu_si512(w->vp + jp * 16 * dv + 16 * v);
        for (int i = 0; i < rp; ++i) {
            uint32_t pair;
            memcpy(&pair, w->p[r0 + i] + 2 * jp, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)pair);
            for (int v = 0; v < dv; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], vv[v], a);
        }
    }
    for (int i = 0; i < rp; ++i)
        for (int v = 0; v < dv; ++v)
            _mm512_storeu_ps(w->o + (r0 + i) * 16 * dv + 16 * v, acc[i][v]);
}

static void pv(scratch_t *w, int64_t rows, int64_t d, int64_t pairs) {
    for (int64_t r0 = 0; r0 < rows;) {
        switch (d) { /* rows per pass: as many as 16 accumulators hold */
        case 64:
            if (rows - r0 >= 4) { pv_rows(w, r0, 4, 4, pairs); r0 += 4; }
            else { pv_rows(w, r0, 1, 4, pairs); r0 += 1; }
            break;
        case 128:
            if (rows - r0 >= 2) { pv_rows(w, r0, 2, 8, pairs); r0 += 2; }
            else { pv_rows(w, r0, 1, 8, pairs); r0 += 1; }
            break;
        case 256: pv_rows(w, r0, 1, 16, pairs); r0 += 1; break;
        default: /* d = 32, 96, 160, ...: one row at a time */
            pv_rows(w, r0, 1, (int)(d / 16), pairs); r0 += 1; break;
        }
    }
}

/* One work item: tokens t0 .. t1 - 1 of prompt c, the G query heads of kv head h. */
static void item(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                 int64_t k_hstride, const uint16_t *v, int64_t v_stride, int64_t v_hstride,
                 uint16_t *out, int64_t c, int64_t h,
                 int64_t t0, int64_t t1, int64_t n_q, int64_t n_k, int64_t q_pos0, int64_t H,
                 int64_t KVH, int64_t d, float scale, int64_t window, scratch_t *w) {
    const int64_t g = H / KVH, rows = (t1 - t0) * g, nk = q_pos0 + t1;
    const uint32_t *qrow[ROWS];
    int64_t pos[ROWS];
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / g, head = h * g + r % g;
        qrow[r] = (const uint32_t *)(q + (c * n_q + t) * q_stride + head * d);
        pos[r] = q_pos0 + t;
        w->m[r] = NEG_BIG;
        w->l[r] = 0.f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)(rows * d));
    int64_t kb0 = 0; /* the block holding the first row's first visible key */
    if (window > 0 && q_pos0 + t0 - window + 1 > 0) kb0 = (q_pos0 + t0 - window + 1) / BK * BK;
    for (int64_t kb = kb0; kb < nk; kb += BK) {
        const int64_t nkb = nk - kb < BK ? nk - kb : BK;
        /* Pack this block's keys and values (missing keys as zeros). */
        for (int64_t j = 0; j < BK; ++j) {
            const uint32_t *src =
                j < nkb ? (const uint32_t *)(k + (c * n_k + kb + j) * k_stride + h * k_hstride) : NULL;
            for (int64_t e = 0; e < d / 2; ++e) w->kp[e * BK + j] = src ? src[e] : 0u;
        }
        for (int64_t jp = 0; jp < BK / 2; ++jp) {
            const int64_t j0 = kb + 2 * jp, j1 = j0 + 1;
            const uint16_t *v0 = 2 * jp < nkb ? v + (c * n_k + j0) * v_stride + h * v_hstride : NULL;
            const uint16_t *v1 = 2 * jp + 1 < nkb ? v + (c * n_k + j1) * v_stride + h * v_hstride : NULL;
            uint32_t *dst = w->vp + jp * d;
            for (int64_t e = 0; e < d; ++e)
                dst[e] = (v0 ? v0[e] : 0u) | (uint32_t)(v1 ? v1[e] : 0u) << 16;
        }
        /* Scores, SROWS rows at a time (the last pass padded with row 0, stored past the
         * item's rows). */
        for (int64_t r0 = 0; r0 < rows; r0 += SROWS) {
            const uint32_t *qr[SROWS];
            for (int i = 0; i < SROWS; ++i) qr[i] = r0 + i < rows ? qrow[r0 + i] : qrow[0];
            scores(qr, w->kp, d, scale, w->s + r0);
        }
        /* Online softmax: each row's visible keys of the block, its new max and sum. */
        for (int64_t r = 0; r < rows; ++r) {
            int64_t vis = pos[r] - kb + 1, first = 0; /* visible: keys first .. vis - 1 */
            vis = vis < 0 ? 0 : vis > nkb ? nkb : vis;
            if (window > 0 && pos[r] - window + 1 > kb) first = pos[r] - window + 1 - kb;
            if (first >= vis) {
                w->alpha[r] = 1.f;
                memset(w->p[r], 0, sizeof w->p[r]);
                continue;
            }
            __mmask16 mk[BK / 16];
            __m512 sv[BK / 16];
            __m512 mx = _mm512_set1_ps(NEG_BIG);
            for (int u = 0; u < BK / 16; ++u) {
                const int64_t n = vis - 16 * u, f = first - 16 * u;
                mk[u] = n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                if (f > 0) mk[u] &= f >= 16 ? 0 : (__mmask16)(0xffffu << f);
                sv[u] = _mm512_loadu_ps(w->s[r] + 16 * u);
                mx = _mm512_mask_max_ps(mx, mk[u], mx, sv[u]);
            }
            const float m_old = w->m[r];
            float m_new = _mm512_reduce_max_ps(mx);
            m_new = m_new > m_old ? m_new : m_old;
            const float alpha = exp_le0(_mm512_set1_ps(m_old - m_new))[0];
            __m512 sum = _mm512_setzero_ps();
            const __m512 mv = _mm512_set1_ps(m_new);
            for (int u = 0; u < BK / 16; u += 2) {
                const __m512 p0 = _mm512_maskz_mov_ps(mk[u], exp_le0(_mm512_sub_ps(sv[u], mv)));
                const __m512 p1 =
                    _mm512_maskz_mov_ps(mk[u + 1], exp_le0(_mm512_sub_ps(sv[u + 1], mv)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                _mm512_storeu_si512(w->p[r] + 16 * u, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            w->m[r] = m_new;
            w->l[r] = w->l[r] * alpha + _mm512_reduce_add_ps(sum);
            w->alpha[r] = alpha;
        }
        pv(w, rows, d, (nkb + 1) / 2);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / g, head = h * g + r % g;
        uint16_t *dst = out + ((c * n_q + t) * H + head) * d;
        const __m512 inv = _mm512_set1_ps(1.f / w->l[r]);
        for (int64_t e = 0; e < d; e += 16)
            _mm256_storeu_si256((__m256i *)(dst + e), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_loadu_ps(w->o + r * d + e), inv)));
    }
}

int prompt_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                          int64_t k_stride, int64_t k_hstride, const uint16_t *v,
                          int64_t v_stride, int64_t v_hstride, uint16_t *out,
                          int64_t n_prompts, int64_t n_q, int64_t n_k, int64_t H, int64_t KVH,
                          int64_t d, float scale, int64_t window) {
    if (d % 32 || d > 256 || KVH < 1 || H % KVH || H / KVH > ROWS || n_k < n_q || n_q < 1)
        return -2;
    const int64_t g = H / KVH, bq = ROWS / g, nqb = (n_q + bq - 1) / bq;
    const int64_t items = n_prompts * KVH * nqb, q_pos0 = n_k - n_q;
    int failed = 0;
#pragma omp parallel
    {
        scratch_t *w = aligned_alloc(64, sizeof(scratch_t));
        uint32_t *buf = w ? aligned_alloc(64, sizeof(uint32_t) * (size_t)(BK * d) +
                                                  sizeof(float) * (size_t)(ROWS * d))
                          : NULL;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            w->kp = buf;
            w->vp = buf + (BK / 2) * d;
            w->o = (float *)(buf + BK * d);
        }
        /* Latest query blocks first: they see the most keys, so the threads end together. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (!buf) continue;
            const int64_t qb = nqb - 1 - it / (n_prompts * KVH), rest = it % (n_prompts * KVH);
            const int64_t t0 = qb * bq, t1 = t0 + bq < n_q ? t0 + bq : n_q;
            item(q, q_stride, k, k_stride, k_hstride, v, v_stride, v_hstride, out, rest / KVH, rest % KVH, t0, t1,
                 n_q, n_k, q_pos0, H, KVH, d, scale, window, w);
        }
        free(buf);
        free(w);
    }
    return failed ? -1 : 0;
}
#else
int prompt_attention_available(void) { return 0; }

int prompt_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                          int64_t k_stride, int64_t k_hstride, const uint16_t *v,
                          int64_t v_stride, int64_t v_hstride, uint16_t *out,
                          int64_t n_prompts, int64_t n_q, int64_t n_k, int64_t H, int64_t KVH,
                          int64_t d, float scale, int64_t window) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)k_hstride, (void)v, (void)v_stride;
    (void)v_hstride, (void)out;
    (void)n_prompts, (void)n_q, (void)n_k, (void)H, (void)KVH, (void)d, (void)scale, (void)window;
    return -2;
}
#endif
