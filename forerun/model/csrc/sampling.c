/* Random sampling of one token per row from processed float32 logits (CPU).
 *
 * Per row: temperature, then min_p and top-k (thresholds on the same order), then top-p
 * over what is left, then one draw by inverse CDF with a uniform the caller supplies: a
 * seeded row's token depends only on its logits and its own uniform, never on the batch.
 * Rows with temperature 0 take the argmax.
 *
 * What it avoids: the exponential race draws one random number per vocabulary entry, and
 * top-k/top-p by sorting the vocabulary costs a full sort per row. Here a row costs a few
 * vectorised passes (max, exp with block sums, the draw) plus, for top-k, a heap that
 * almost every element skips, and for top-p one pass that brackets the nucleus's edge
 * between two power-of-two cutoffs and a weighted quickselect over the tokens between
 * them (a few percent of the nucleus, typically).
 *
 * Tie rules: top-k keeps every token equal to the k-th largest logit (like a sort-based
 * threshold); top-p orders by probability, then by lower token id.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_argmax.h"

#define BLOCK 256 /* elements per partial sum of the inverse-CDF walk */

typedef struct {
    float e;   /* unnormalised probability exp((x - max) / T) */
    int32_t i; /* token id */
} cand_t;

typedef struct {
    float *e;
    double *blocks;
    cand_t *cand;
    cand_t *all;
    float *heap;
    int64_t cap;
} scratch_t;

/* One per OpenMP thread, kept across calls: the row buffers are as large as the vocabulary,
 * and allocating them per call would fault in fresh pages every step. */
static __thread scratch_t t_scratch;

static int reserve(scratch_t *s, int64_t v) {
    if (s->cap >= v) return 0;
    free(s->e);
    free(s->blocks);
    free(s->cand);
    free(s->all);
    free(s->heap);
    s->e = malloc(sizeof(float) * (size_t)v);
    s->blocks = malloc(sizeof(double) * (size_t)(v / BLOCK + 1));
    s->cand = malloc(sizeof(cand_t) * (size_t)v);
    s->all = malloc(sizeof(cand_t) * (size_t)v);
    s->heap = malloc(sizeof(float) * (size_t)v);
    if (!s->e || !s->blocks || !s->cand || !s->all || !s->heap) {
        s->cap = 0;
        return -1;
    }
    s->cap = v;
    return 0;
}

/* -ffast-math lets the compiler assume no infinities, so test the bits. */
static inline int is_neg_inf_or_nan(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u == 0xff800000u || (u & 0x7fffffffu) > 0x7f800000u;
}

static void sift_down(float *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, s = i;
        if (l < n && h[l] < h[s]) s = l;
        if (r < n && h[r] < h[s]) s = r;
        if (s == i) return;
        float t = h[i];
        h[i] = h[s];
        h[s] = t;
        i = s;
    }
}

/* The k-th largest value of x (0 < k < v), by a min-heap of the k largest seen so far;
 * chunks with nothing above the heap's minimum, nearly all of them, cost one vector test. */
static float kth_largest(const float *x, int64_t v, int64_t k, float *h) {
    memcpy(h, x, sizeof(float) * (size_t)k);
    for (int64_t i = k / 2 - 1; i >= 0; --i) sift_down(h, k, i);
    int64_t i = k;
#if defined(__AVX512F__)
    for (; i + 16 <= v; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(h[0]),
                                           _CMP_GT_OQ);
        while (hit) {
            const int64_t t = i + __builtin_ctz(hit);
            hit &= hit - 1;
            if (x[t] > h[0]) {
                h[0] = x[t];
                sift_down(h, k, 0);
            }
        }
    }
#endif
    for (; i < v; ++i) {
        if (x[i] > h[0]) {
            h[0] = x[i];
            sift_down(h, k, 0);
        }
    }
    return h[0];
}

#define NUM_CUTS 16 /* cutoffs 2^-1 .. 2^-16 of the largest probability */
#define CUT_MARGIN 1e-3 /* covers the rounding of mass_below_cuts' float sums */
#define NO_HI 2.f      /* above any probability (the largest is 1); finite for -ffast-math */

/* below[j] = the mass of the tokens with e < 2^-(j+1) (the largest e is 1), for j < NUM_CUTS,
 * in one vectorised pass with a float accumulator per cutoff and lane. */
static void mass_below_cuts(const float *e, int64_t v, double below[NUM_CUTS]) {
#if defined(__AVX512F__)
    __m512 acc[NUM_CUTS], cut[NUM_CUTS];
    for (int j = 0; j < NUM_CUTS; ++j) {
        acc[j] = _mm512_setzero_ps();
        cut[j] = _mm512_set1_ps(ldexpf(1.f, -(j + 1)));
    }
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) {
        const __m512 x = _mm512_loadu_ps(e + i);
        for (int j = 0; j < NUM_CUTS; ++j)
            acc[j] = _mm512_mask_add_ps(acc[j], _mm512_cmp_ps_mask(x, cut[j], _CMP_LT_OQ),
                                        acc[j], x);
    }
    for (int j = 0; j < NUM_CUTS; ++j) {
        below[j] = _mm512_reduce_add_ps(acc[j]);
        const float c = ldexpf(1.f, -(j + 1));
        for (int64_t r = i; r < v; ++r)
            if (e[r] < c) below[j] += e[r];
    }
#else
    for (int j = 0; j < NUM_CUTS; ++j) below[j] = 0.0;
    for (int64_t r = 0; r < v; ++r)
        for (int j = 0; j < NUM_CUTS; ++j)
            if (e[r] < ldexpf(1.f, -(j + 1))) below[j] += e[r];
#endif
}

static inline int ranks_before(cand_t a, cand_t b) {
    return a.e > b.e || (a.e == b.e && a.i < b.i);
}

static inline void swap_c(cand_t *a, cand_t *b) {
    cand_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorders c[0..n) so that its first K entries are the nucleus: the tokens, in rank order
 * (probability, then lower id), whose mass ranked strictly above them is below target.
 * Returns K. Expected linear time: a quickselect that recurses by mass, not by count. */
static int64_t select_nucleus(cand_t *c, int64_t n, double target) {
    int64_t lo = 0, hi = n;
    double above = 0.0; /* mass of c[0..lo), all ranked above c[lo..hi) */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        /* median of three, moved to hi - 1 */
        if (ranks_before(c[mid], c[lo])) swap_c(&c[mid], &c[lo]);
        if (ranks_before(c[hi - 1], c[lo])) swap_c(&c[hi - 1], &c[lo]);
        if (ranks_before(c[mid], c[hi - 1])) swap_c(&c[mid], &c[hi - 1]);
        const cand_t pivot = c[hi - 1];
        int64_t store = lo;
        double mass = 0.0;
        for (int64_t j = lo; j < hi - 1; ++j) {
            if (ranks_before(c[j], pivot)) {
                mass += c[j].e;
                swap_c(&c[j], &c[store++]);
            }
        }
        swap_c(&c[store], &c[hi - 1]);
        if (above + mass >= target) { /* the last kept token ranks above the pivot */
            hi = store;
            continue;
        }
        above += mass;
        if (above + pivot.e >= target) return store + 1;
        above += pivot.e;
        lo = store + 1;
    }
    return lo; /* rounding left the target unreached: keep every candidate */
}

static int64_t sample_row(const float *x, int64_t v, float temperature, int64_t top_k,
                          float top_p, float min_p, double u, scratch_t *s) {
    float m;
    const int64_t best = row_argmax(x, v, &m);
    if (!(temperature > 0.f) || is_neg_inf_or_nan(m)) return best;
    float thr_k = x[best];
    int use_k = top_k > 0 && top_k < v;
    if (use_k) thr_k = kth_largest(x, v, top_k, s->heap);
    const float inv_t = 1.f / temperature;
    float *e = s->e;
    double *blocks = s->blocks;
    const int64_t nblocks = (v + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < v ? i0 + BLOCK : v;
        float acc = 0.f;
        if (use_k) {
#pragma omp simd reduction(+ : acc)
            for (int64_t i = i0; i < i1; ++i) {
                const float p = expf((x[i] - m) * inv_t);
                const float kept = (x[i] >= thr_k && p >= min_p) ? p : 0.f;
                e[i] = kept;
                acc += kept;
            }
        } else {
#pragma omp simd reduction(+ : acc)
            for (int64_t i = i0; i < i1; ++i) {
                const float p = expf((x[i] - m) * inv_t);
                const float kept = p >= min_p ? p : 0.f;
                e[i] = kept;
                acc += kept;
            }
        }
        blocks[b] = acc;
        total += acc;
    }
    if (!(total > 0.0)) return best;
    if (top_p < 1.f) {
        /* Bracket the nucleus's last token by cutoffs of the largest probability: a token
         * below a cutoff under which at most 1 - top_p of the mass lies is never in it
         * (neither is any token below (1 - top_p) * total / V: all V of them together
         * hold less); a token at or above a cutoff under which more lies always is. Only
         * the tokens between the two go through the selection. */
        const double allowed = (1.0 - (double)top_p) * total;
        double below[NUM_CUTS];
        mass_below_cuts(e, v, below);
        float lo = (float)(allowed / (double)v), hi = NO_HI;
        for (int j = NUM_CUTS - 1; j >= 0; --j) {
            const float cut = ldexpf(1.f, -(j + 1));
            if (below[j] <= allowed * (1.0 - CUT_MARGIN)) {
                if (cut > lo) lo = cut;
            } else if (below[j] >= allowed * (1.0 + CUT_MARGIN) && cut < hi) {
                hi = cut;
            }
        }
        if (hi <= lo) hi = NO_HI;
        /* One pass keeps, in id order, every token that may be in the nucleus (all), and
         * apart the ones whose membership is open (band). */
        cand_t *all = s->all, *band = s->cand;
        double sure = 0.0; /* mass of the tokens at or above hi, all kept */
        int64_t n_all = 0, n_band = 0, i = 0;
#if defined(__AVX512F__)
        const __m512 lo_v = _mm512_set1_ps(lo);
        for (; i + 16 <= v; i += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), lo_v, _CMP_GE_OQ);
            while (hit) {
                const int64_t t = i + __builtin_ctz(hit);
                hit &= hit - 1;
                all[n_all++] = (cand_t){e[t], (int32_t)t};
                if (e[t] >= hi) sure += e[t];
                else band[n_band++] = (cand_t){e[t], (int32_t)t};
            }
        }
#endif
        for (; i < v; ++i) {
            if (!(e[i] >= lo)) continue;
            all[n_all++] = (cand_t){e[i], (int32_t)i};
            if (e[i] >= hi) sure += e[i];
            else band[n_band++] = (cand_t){e[i], (int32_t)i};
        }
        const int64_t kept = select_nucleus(band, n_band, (double)top_p * total - sure);
        /* The nucleus's lowest-ranked token, the threshold; without one in the band, every
         * token at or above hi. */
        cand_t last = {hi, INT32_MAX};
        double mass = sure;
        if (kept > 0) {
            last = band[0];
            for (int64_t j = 0; j < kept; ++j) {
                mass += band[j].e;
                if (ranks_before(last, band[j])) last = band[j];
            }
        } else if (hi == NO_HI) {
            return best;
        }
        /* The draw walks the kept tokens in id order, as the torch path walks its
         * cumulative sum, so both pick the same token for the same uniform. */
        const double target = u * mass;
        double acc = 0.0;
        int64_t pick = best;
        for (int64_t j = 0; j < n_all; ++j) {
            const cand_t t = all[j];
            if (t.e > last.e || (t.e == last.e && t.i <= last.i)) {
                acc += t.e;
                pick = t.i;
                if (acc > target) return t.i;
            }
        }
        return pick; /* rounding left the target unreached: the last kept token */
    }
    const double target = u * total;
    double acc = 0.0;
    int64_t b = 0;
    while (b < nblocks - 1 && acc + blocks[b] <= target) acc += blocks[b++];
    const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < v ? i0 + BLOCK : v;
    int64_t last = -1;
    for (int64_t i = i0; i < i1; ++i) {
        if (e[i] > 0.f) {
            acc += e[i];
            last = i;
            if (acc > target) return i;
        }
    }
    /* The block's vectorised sum and this walk round differently; land on its last token
     * (or, if the block is empty of mass after rounding, the nearest earlier one). */
    if (last >= 0) return last;
    for (int64_t i = i0 - 1; i >= 0; --i)
        if (e[i] > 0.f) return i;
    return best;
}

/* out[r] = one token of row r of logits [rows, v]; per row: temperature (0 = argmax),
 * top_k (0 or >= v = off), top_p (1 = off), min_p (0 = off), u in [0, 1).
 * Returns 0, or -1 if scratch space could not be allocated. */
int sample_rows_f32(const float *logits, int64_t rows, int64_t v, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p,
                    const double *u, int64_t *out) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t r = 0; r < rows; ++r) {
        scratch_t *s = &t_scratch;
        if (reserve(s, v) != 0) {
            failed = 1;
            out[r] = 0;
            continue;
        }
        out[r] = sample_row(logits + r * v, v, temperature[r], top_k[r], top_p[r], min_p[r],
                            u[r], s);
    }
    return failed ? -1 : 0;
}
