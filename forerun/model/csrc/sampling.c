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
 * almost every element skips, and for top-p a weighted quickselect over the few tokens
 * that could be in the nucleus (a token whose probability is below (1 - top_p) / V cannot
 * be: all tokens at or below it hold less than 1 - top_p of the mass).
 *
 * Tie rules: top-k keeps every token equal to the k-th largest logit (like a sort-based
 * threshold); top-p orders by probability, then by lower token id.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256 /* elements per partial sum of the inverse-CDF walk */
#define CHUNK 16  /* elements tested at once before the scalar path */

typedef struct {
    float e;   /* unnormalised probability exp((x - max) / T) */
    int32_t i; /* token id */
} cand_t;

typedef struct {
    float *e;
    double *blocks;
    cand_t *cand;
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
    free(s->heap);
    s->e = malloc(sizeof(float) * (size_t)v);
    s->blocks = malloc(sizeof(double) * (size_t)(v / BLOCK + 1));
    s->cand = malloc(sizeof(cand_t) * (size_t)v);
    s->heap = malloc(sizeof(float) * (size_t)v);
    if (!s->e || !s->blocks || !s->cand || !s->heap) {
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

static int64_t row_argmax(const float *x, int64_t v, float *max_out) {
    float m = x[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < v; ++i) m = x[i] > m ? x[i] : m;
    int64_t idx = 0;
    while (idx < v && !(x[idx] == m)) ++idx;
    *max_out = m;
    return idx < v ? idx : 0;
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
    for (; i + CHUNK <= v; i += CHUNK) {
        const float lo = h[0];
        int any = 0;
        for (int j = 0; j < CHUNK; ++j) any |= x[i + j] > lo;
        if (!any) continue;
        for (int j = 0; j < CHUNK; ++j) {
            if (x[i + j] > h[0]) {
                h[0] = x[i + j];
                sift_down(h, k, 0);
            }
        }
    }
    for (; i < v; ++i) {
        if (x[i] > h[0]) {
            h[0] = x[i];
            sift_down(h, k, 0);
        }
    }
    return h[0];
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
        const float floor_e = (float)((1.0 - (double)top_p) * total / (double)v);
        cand_t *c = s->cand;
        int64_t n = 0, i = 0;
        for (; i + CHUNK <= v; i += CHUNK) {
            int any = 0;
            for (int j = 0; j < CHUNK; ++j) any |= e[i + j] >= floor_e && e[i + j] > 0.f;
            if (!any) continue;
            for (int j = 0; j < CHUNK; ++j) {
                const float ej = e[i + j];
                if (ej >= floor_e && ej > 0.f) c[n++] = (cand_t){ej, (int32_t)(i + j)};
            }
        }
        for (; i < v; ++i)
            if (e[i] >= floor_e && e[i] > 0.f) c[n++] = (cand_t){e[i], (int32_t)i};
        const int64_t kept = select_nucleus(c, n, (double)top_p * total);
        if (kept == 0) return best;
        cand_t last = c[0]; /* the nucleus's lowest-ranked token: the threshold */
        for (int64_t j = 1; j < kept; ++j)
            if (ranks_before(last, c[j])) last = c[j];
        /* Drop everything ranked below it, then draw as without top-p: walking the tokens in
         * id order gives the same token as the torch path for the same uniform. */
        total = 0.0;
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < v ? i0 + BLOCK : v;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = i0; i < i1; ++i) {
                const float kept_e =
                    (e[i] > last.e || (e[i] == last.e && i <= last.i)) ? e[i] : 0.f;
                e[i] = kept_e;
                acc += kept_e;
            }
            blocks[b] = acc;
            total += acc;
        }
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
