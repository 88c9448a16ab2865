/* The engine's C kernels on the CPU: paged decode attention reading K/V
 * where they lie in the cache, and the linear layers of small batches.
 *
 * Built at run time by inference/kernels/cpu.py with the machine's C
 * compiler (-O3 -march=native -fopenmp) and called through ctypes; OpenMP
 * here is the libgomp torch already loaded, so the kernels share torch's
 * threads and their count.
 *
 * --- Decode attention ---
 *
 * One query token per sequence attends over its own blocks (a batch's
 * shared prefix is attended to apart, in one matrix product for all of its
 * queries: inference/attention.py merges the two by their log-sum-exps).
 * Each sequence is one task. A block is folded into the sequence's running
 * softmax (per query head: the running maximum, the sum of the
 * exponentials, the weighted sum of the values, kept in the output itself)
 * for all its heads at once, so the block's rows are read as one run while
 * the next block is prefetched. Nothing is gathered or copied.
 */
#include <math.h>
#include <stdint.h>

#define TILE 32

/* Eight floats, loaded from any float's address. NOTE: GCC's vector
 * extension, not intrinsics: it builds for whatever -march=native offers
 * (two SSE halves without AVX); the compiler left a plain loop's reduction
 * scalar (float sums may not be reordered), which took 10x as long. */
typedef float f8 __attribute__((vector_size(32), aligned(4)));

static inline float total(f8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* The dot products of `query` with `n` key rows `stride` floats apart, into
 * `scores`; head_dim is a multiple of 8 (cpu.py checks). Four rows at
 * a time: four independent chains of multiply-adds instead of one. */
static void score_rows(const float *query, const float *keys, int64_t stride, int64_t n, int64_t d, float *scores) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
        f8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < d; i += 8) {
            const f8 x = *(const f8 *)(query + i);
            a0 += x * *(const f8 *)(k0 + i);
            a1 += x * *(const f8 *)(k1 + i);
            a2 += x * *(const f8 *)(k2 + i);
            a3 += x * *(const f8 *)(k3 + i);
        }
        scores[t] = total(a0), scores[t + 1] = total(a1), scores[t + 2] = total(a2), scores[t + 3] = total(a3);
    }
    for (; t < n; t++) {
        f8 a = {0};
        for (int64_t i = 0; i < d; i += 8) a += *(const f8 *)(query + i) * *(const f8 *)(keys + t * stride + i);
        scores[t] = total(a);
    }
}

/* acc += w * row, n a multiple of 8 */
static inline void add_scaled(float *acc, const float *row, float w, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) *(f8 *)(acc + i) += w * *(const f8 *)(row + i);
}

typedef struct {
    const float *q;               /* [batch, heads, head_dim] */
    float *out;                   /* [batch, heads, head_dim]: the running weighted sums, then the result */
    float *top, *mass;            /* [batch, heads]: the running maximum and sum of exponentials */
    const float *k, *v;           /* one layer's cache: block id * block_stride + offset * token_stride + kv head * head_dim */
    int64_t block_stride, token_stride;
    int64_t heads, kv_heads, head_dim, block_size;
    float scale;
} Layer;

static void prefetch_block(const Layer *p, int64_t id) {
    const char *k = (const char *)(p->k + id * p->block_stride), *v = (const char *)(p->v + id * p->block_stride);
    const int64_t bytes = p->block_size * p->token_stride * (int64_t)sizeof(float);
    for (int64_t at = 0; at < bytes; at += 64) {
        __builtin_prefetch(k + at, 0, 3);
        __builtin_prefetch(v + at, 0, 3);
    }
}

/* Folds the first `rows` positions of block `id` into sequence `seq`'s running softmax, every head. */
static void fold_block(const Layer *p, int64_t seq, int64_t id, int64_t rows) {
    const int64_t group = p->heads / p->kv_heads, d = p->head_dim;
    float scores[TILE];
    for (int64_t h = 0; h < p->heads; h++) {
        const float *query = p->q + (seq * p->heads + h) * d;
        float *acc = p->out + (seq * p->heads + h) * d, *top = p->top + seq * p->heads + h;
        float *mass = p->mass + seq * p->heads + h;
        const int64_t head_at = (h / group) * d;
        const float *keys = p->k + id * p->block_stride + head_at, *values = p->v + id * p->block_stride + head_at;
        for (int64_t start = 0; start < rows; start += TILE) {
            const int64_t n = rows - start < TILE ? rows - start : TILE;
            float tile_top = -INFINITY;
            score_rows(query, keys + start * p->token_stride, p->token_stride, n, d, scores);
            for (int64_t t = 0; t < n; t++) {
                scores[t] *= p->scale;
                if (scores[t] > tile_top) tile_top = scores[t];
            }
            if (tile_top > *top) { /* rescale what was summed under the old maximum */
                const float shrink = expf(*top - tile_top);
                *mass *= shrink;
                for (int64_t i = 0; i < d; i++) acc[i] *= shrink;
                *top = tile_top;
            }
            for (int64_t t = 0; t < n; t++) {
                const float w = expf(scores[t] - *top);
                *mass += w;
                add_scaled(acc, values + (start + t) * p->token_stride, w, d);
            }
        }
    }
}

/* Returns 0, or -1 when the shapes are not the kernel's. On return `top`
 * holds each head's log-sum-exp of its scores (for merging with another
 * part of the context). */
int kvd_paged_decode_f32(const float *q, float *out, float *top, float *mass, const float *k, const float *v,
                         int64_t block_stride, int64_t token_stride, const int64_t *blocks, int64_t width,
                         const int64_t *lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim % 8) return -1;
    const Layer p = {q, out, top, mass, k, v, block_stride, token_stride, heads, kv_heads, head_dim, block_size, scale};
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < batch; seq++) {
        const int64_t *table = blocks + seq * width, len = lens[seq];
        for (int64_t i = seq * heads; i < (seq + 1) * heads; i++) {
            top[i] = -INFINITY;
            mass[i] = 0.0f;
        }
        for (int64_t i = seq * heads * head_dim; i < (seq + 1) * heads * head_dim; i++) out[i] = 0.0f;
        for (int64_t b = 0; b * block_size < len; b++) {
            if ((b + 1) * block_size < len) prefetch_block(&p, table[b + 1]);
            const int64_t rows = len - b * block_size < block_size ? len - b * block_size : block_size;
            fold_block(&p, seq, table[b], rows);
        }
        for (int64_t h = seq * heads; h < (seq + 1) * heads; h++) {
            float *acc = out + h * head_dim;
            const float inv = 1.0f / mass[h];
            for (int64_t i = 0; i < head_dim; i++) acc[i] *= inv;
            top[h] += logf(mass[h]);
        }
    }
    return 0;
}

/* --- Linear layers of small batches ---
 *
 * y = x W^T + bias for a few rows of x (a decode step's tokens), W packed
 * once as panels of 8 output features: [N / 8][K][8], so that one vector
 * load brings a weight of each of 8 outputs, multiplied by one scalar of x
 * per row. Eight rows at a time keep 8 accumulators in registers; each
 * thread takes a run of panels, reading each from memory once (the next one
 * prefetched while the current one is used) however many rows there are.
 * At 16 rows this read SmolLM2's weights in 52 ms against oneDNN's 80 on a
 * 2-core AVX2 box; past ~32 rows the products are bound by arithmetic and
 * oneDNN's blocking wins (docs/benchmarks.md).
 */

/* Eight rows of x against one panel; `next` (or NULL): the panel to prefetch meanwhile. */
static inline void eight_rows(const float *x, int64_t k, const float *w, const float *next, f8 *out) {
    f8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const float *x0 = x, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k, *x4 = x3 + k, *x5 = x4 + k, *x6 = x5 + k,
                *x7 = x6 + k;
    for (int64_t i = 0; i < k; i++) {
        const f8 wv = *(const f8 *)(w + i * 8);
        if (next && !(i & 1)) __builtin_prefetch(next + i * 8, 0, 3); /* a 64-byte line holds two steps */
        a0 += x0[i] * wv, a1 += x1[i] * wv, a2 += x2[i] * wv, a3 += x3[i] * wv;
        a4 += x4[i] * wv, a5 += x5[i] * wv, a6 += x6[i] * wv, a7 += x7[i] * wv;
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

/* Fewer than eight rows: one row at a time, two accumulators each. */
static inline void some_rows(const float *x, int64_t k, int64_t rows, const float *w, f8 *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        f8 a = {0}, b = {0};
        int64_t i = 0;
        for (; i + 2 <= k; i += 2) {
            a += xr[i] * *(const f8 *)(w + i * 8);
            b += xr[i + 1] * *(const f8 *)(w + (i + 1) * 8);
        }
        if (i < k) a += xr[i] * *(const f8 *)(w + i * 8);
        out[r] = a + b;
    }
}

/* y [m, n] = x [m, k] W^T (+ bias [n], or NULL); W as panels [n / 8][k][8]; n a multiple of 8. */
void kvd_small_linear_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m, int64_t n,
                          int64_t k) {
    const int64_t count = n / 8;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++) {
        const float *w = panels + p * k * 8, *next = p + 1 < count ? w + k * 8 : 0;
        const f8 b = bias ? *(const f8 *)(bias + p * 8) : (f8){0};
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            f8 acc[8];
            const int64_t rows = m - m0 < 8 ? m - m0 : 8;
            if (rows == 8)
                eight_rows(x + m0 * k, k, w, m0 == 0 ? next : 0, acc);
            else
                some_rows(x + m0 * k, k, rows, w, acc);
            for (int64_t r = 0; r < rows; r++) *(f8 *)(y + (m0 + r) * n + p * 8) = acc[r] + b;
        }
    }
}
