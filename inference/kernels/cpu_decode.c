/* Paged decode attention on the CPU, reading K/V where they lie in the cache.
 *
 * One query token per sequence attends over its own blocks (a batch's
 * shared prefix is attended to apart, in one matrix product for all of its
 * queries: inference/attention.py merges the two by their log-sum-exps).
 * Each sequence is one task. A block is folded into the sequence's running
 * softmax (per query head: the running maximum, the sum of the
 * exponentials, the weighted sum of the values, kept in the output itself)
 * for all its heads at once, so the block's rows are read as one run while
 * the next block is prefetched. Nothing is gathered or copied.
 *
 * Built at run time by inference/kernels/cpu_decode.py with the machine's C
 * compiler (-O3 -march=native -fopenmp) and called through ctypes; OpenMP
 * here is the libgomp torch already loaded, so the kernel shares torch's
 * threads and their count.
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
 * `scores`; head_dim is a multiple of 8 (cpu_decode.py checks). Four rows at
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
