/* The engine's C kernels on the CPU: paged decode attention reading K/V
 * where they lie in the cache, prefill attention, and the linear layers of
 * small batches.
 *
 * Built at run time by inference/kernels/cpu.py with the machine's C
 * compiler (-O3 -march=native -fopenmp) and called through ctypes; OpenMP
 * here is the libgomp torch already loaded, so the kernels share torch's
 * threads and their count.
 *
 * --- Decode attention ---
 *
 * One query token per sequence attends over its own blocks; a batch's
 * shared prefix is attended to before, for all its queries at once, by the
 * prefill kernel's tasks (kvd_prefix_decode_f32, below), and this kernel
 * carries on from the running state that leaves. Each sequence is one task.
 * A block is folded into the sequence's running softmax (per query head: the running maximum, the sum of the
 * exponentials, the weighted sum of the values, kept in the output itself)
 * for all its heads at once, so the block's rows are read as one run while
 * the next block is prefetched. Nothing is gathered or copied.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 32

/* Eight floats, loaded from any float's address. NOTE: GCC's vector
 * extension, not intrinsics: it builds for whatever -march=native offers
 * (two SSE halves without AVX); the compiler left a plain loop's reduction
 * scalar (float sums may not be reordered), which took 10x as long. */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

/* The machine's widest vector of floats (PANEL of them): 16 with AVX-512, else 8. */
#ifdef __AVX512F__
#define PANEL 16
#else
#define PANEL 8
#endif
typedef float fp __attribute__((vector_size(PANEL * 4), aligned(4)));
typedef int32_t ip __attribute__((vector_size(PANEL * 4)));

/* e^x for x <= 0 (a score minus its running maximum), PANEL at once, within
 * ~2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
 * series to r^7, times 2^n set in the exponent bits. Below -87 (where expf
 * would give denormals) it gives ~2^-126: nothing, next to the maximum's 1.
 * NOTE: one expf call per score was the decode kernel's largest cost. */
static inline fp expv(fp x) {
    const fp lowest = (fp){0} - 87.0f;
    const ip below = x < lowest; /* all ones where true */
    x = (fp)(((ip)x & ~below) | ((ip)lowest & below));
    const ip n = -__builtin_convertvector(0.5f - x * 1.44269504088896341f, ip); /* round(x / ln2) */
    const fp nf = __builtin_convertvector(n, fp);
    const fp r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f; /* ln2 in two parts */
    fp p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (fp)((n + 127) << 23);
}

static inline float total(f8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* The sum of a PANEL-wide vector's lanes. */
static inline float lane_sum(fp x) {
    float sum = 0.0f;
    for (int i = 0; i < PANEL; i++) sum += x[i];
    return sum;
}

/* The eight sums of a[0..7]'s lanes, as one vector: pairwise sums three
 * times over (8 -> 4 -> 2 -> 1 vectors) rather than eight separate sums. */
static inline f8 sums8(const f8 *a) {
    const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const i8 low = {0, 1, 8, 9, 4, 5, 12, 13}, high = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 front = {0, 1, 2, 3, 8, 9, 10, 11}, back = {4, 5, 6, 7, 12, 13, 14, 15};
    f8 b[4], c[2];
    for (int i = 0; i < 4; i++) /* b[i]: rows 2i, 2i+1 interleaved, 4 partial sums each */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++) /* c[i]: rows 4i..4i+3, 2 partial sums each, per 128-bit half */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], low) + __builtin_shuffle(b[2 * i], b[2 * i + 1], high);
    /* lanes of c[i]: rows 4i..4i+3 in the low half, and again in the high half */
    return __builtin_shuffle(c[0], c[1], front) + __builtin_shuffle(c[0], c[1], back);
}

/* The dot products of `query` with `n` key rows `stride` floats apart, into
 * `scores`; head_dim is a multiple of 8 (cpu.py checks). Eight rows at a
 * time: eight independent chains of multiply-adds, summed by sums8. */
static void score_rows(const float *query, const float *keys, int64_t stride, int64_t n, int64_t d, float *scores) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        f8 a[8] = {{0}};
        for (int64_t i = 0; i < d; i += 8) {
            const f8 x = *(const f8 *)(query + i);
            for (int r = 0; r < 8; r++) a[r] += x * *(const f8 *)(keys + (t + r) * stride + i);
        }
        *(f8 *)(scores + t) = sums8(a);
    }
    for (; t < n; t++) {
        f8 a = {0};
        for (int64_t i = 0; i < d; i += 8) a += *(const f8 *)(query + i) * *(const f8 *)(keys + t * stride + i);
        scores[t] = total(a);
    }
}

/* acc[:d] += sum over t < n of w[t] * rows[t * stride :][:d], d a multiple of 8. NOTE: 64 floats of
 * the sum at a time stay in registers over all the rows; adding each row into
 * memory made every row wait on the previous one's stores. */
static void add_rows(float *acc, const float *rows, int64_t stride, const float *w, int64_t n, int64_t d) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
        f8 *sum = (f8 *)(acc + c);
        f8 r0 = sum[0], r1 = sum[1], r2 = sum[2], r3 = sum[3], r4 = sum[4], r5 = sum[5], r6 = sum[6], r7 = sum[7];
        for (int64_t t = 0; t < n; t++) {
            const f8 *v = (const f8 *)(rows + t * stride + c);
            const float x = w[t];
            r0 += x * v[0], r1 += x * v[1], r2 += x * v[2], r3 += x * v[3];
            r4 += x * v[4], r5 += x * v[5], r6 += x * v[6], r7 += x * v[7];
        }
        sum[0] = r0, sum[1] = r1, sum[2] = r2, sum[3] = r3, sum[4] = r4, sum[5] = r5, sum[6] = r6, sum[7] = r7;
    }
    for (; c < d; c += 8) {
        f8 r = *(f8 *)(acc + c);
        for (int64_t t = 0; t < n; t++) r += w[t] * *(const f8 *)(rows + t * stride + c);
        *(f8 *)(acc + c) = r;
    }
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

/* Prefetches bytes [from, to) of block `id`'s keys and of its values. NOTE:
 * inlined into the loop over heads; called there, the kernel ran ~20% slower. */
static inline __attribute__((always_inline)) void prefetch_part(const Layer *p, int64_t id, int64_t from,
                                                                int64_t to) {
    const char *k = (const char *)(p->k + id * p->block_stride), *v = (const char *)(p->v + id * p->block_stride);
    for (int64_t at = from; at < to; at += 64) {
        __builtin_prefetch(k + at, 0, 3);
        __builtin_prefetch(v + at, 0, 3);
    }
}

/* Folds the first `rows` positions of block `id` into sequence `seq`'s running
 * softmax, every head, while prefetching block `next` (-1: none) a share per
 * head. NOTE: the whole next block's prefetches issued at once (24 KB for
 * SmolLM2: 384 lines) ran the kernel at 12 GB/s; spread over the heads, 16. */
static void fold_block(const Layer *p, int64_t seq, int64_t id, int64_t rows, int64_t next) {
    const int64_t group = p->heads / p->kv_heads, d = p->head_dim;
    float scores[TILE] __attribute__((aligned(64))); /* TILE: a multiple of PANEL */
    const int64_t bytes = p->block_size * p->token_stride * (int64_t)sizeof(float);
    const int64_t share = (bytes / 64 + p->heads - 1) / p->heads * 64; /* whole lines */
    for (int64_t h = 0; h < p->heads; h++) {
        if (next >= 0) prefetch_part(p, next, h * share, (h + 1) * share < bytes ? (h + 1) * share : bytes);
        const float *query = p->q + (seq * p->heads + h) * d;
        float *acc = p->out + (seq * p->heads + h) * d, *top = p->top + seq * p->heads + h;
        float *mass = p->mass + seq * p->heads + h;
        const int64_t head_at = (h / group) * d;
        const float *keys = p->k + id * p->block_stride + head_at, *values = p->v + id * p->block_stride + head_at;
        for (int64_t start = 0; start < rows; start += TILE) {
            const int64_t n = rows - start < TILE ? rows - start : TILE, padded = (n + PANEL - 1) / PANEL * PANEL;
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
            fp sum = {0};
            for (int64_t t = 0; t < padded; t += PANEL) {
                fp w = expv(*(fp *)(scores + t) - *top);
                for (int64_t i = n - t; i < PANEL; i++) w[i] = 0; /* past the last row */
                *(fp *)(scores + t) = w;
                sum += w;
            }
            *mass += lane_sum(sum);
            add_rows(acc, values + start * p->token_stride, p->token_stride, scores, n, d);
        }
    }
}

/* Returns 0, or -1 when the shapes are not the kernel's. On return `top`
 * holds each head's log-sum-exp of its scores (for merging with another
 * part of the context). With `resume`, out, top and mass come in holding the
 * running state of the positions before each sequence's blocks (a shared
 * prefix: kvd_prefix_decode_f32), and the softmax carries on from it. */
int kvd_paged_decode_f32(const float *q, float *out, float *top, float *mass, const float *k, const float *v,
                         int64_t block_stride, int64_t token_stride, const int64_t *blocks, int64_t width,
                         const int64_t *lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int resume) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim % 8) return -1;
    const Layer p = {q, out, top, mass, k, v, block_stride, token_stride, heads, kv_heads, head_dim, block_size, scale};
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < batch; seq++) {
        const int64_t *table = blocks + seq * width, len = lens[seq];
        if (!resume) { /* else out, top and mass hold a prefix's running state (kvd_prefix_decode_f32) */
            for (int64_t i = seq * heads; i < (seq + 1) * heads; i++) {
                top[i] = -INFINITY;
                mass[i] = 0.0f;
            }
            for (int64_t i = seq * heads * head_dim; i < (seq + 1) * heads * head_dim; i++) out[i] = 0.0f;
        }
        for (int64_t b = 0; b * block_size < len; b++) {
            const int64_t rows = len - b * block_size < block_size ? len - b * block_size : block_size;
            fold_block(&p, seq, table[b], rows, (b + 1) * block_size < len ? table[b + 1] : -1);
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
 * once as panels of PANEL output features: [N / PANEL][K][PANEL], so that
 * one vector load brings a weight of each of PANEL outputs, multiplied by
 * one scalar of x per row. PANEL is the width of the machine's vectors: 16
 * floats with AVX-512, else 8 (cpu.py asks kvd_panel_width to pack). Each
 * thread takes runs of a few panels side by side, reading each run from
 * memory once (the next one prefetched while the current one is used)
 * however many rows there are, eight rows at a time against the run's
 * panels in registers. At 16 rows this read SmolLM2's weights in 52 ms
 * against oneDNN's 80 on a 2-core AVX2 box; on an AVX-512 one 16-wide panels
 * took 20-22 ms against 25-28 with 8-wide ones. Past ~32 rows the products
 * are bound by arithmetic and oneDNN's blocking wins (docs/benchmarks.md).
 */

int kvd_panel_width(void) { return PANEL; }

/* The register block: up to LIN_ROWS rows of x against LIN_PANELS panels side
 * by side, LIN_ROWS x LIN_PANELS accumulators (24 of AVX-512's 32 registers,
 * 8 of AVX2's 16). Each row's scalar of x, broadcast once, meets a weight
 * vector of each panel: per step one load per panel and per row against
 * rows x panels multiply-adds. With one panel at a time (the first form of
 * this kernel) the loads outnumbered the multiply-adds, and 16 rows ran at
 * 14.6 GB/s of weights where one row ran at 24.5, the memory's speed. */
#define LIN_ROWS 8
#define LIN_PANELS (PANEL == 16 ? 3 : 2)

/* R rows of x (k floats apart) against C consecutive panels from w into y
 * (n floats apart) + bias (or NULL), while prefetching `next` (the next run
 * of panels, or this one again), each panel's step by step: one instance per
 * shape, so that the compiler keeps the accumulators in registers. */
#define LINEAR_BLOCK(R, C)                                                                                         \
    static void linear_block_##R##_##C(const float *x, int64_t k, const float *w, const float *bias, float *y,    \
                                       int64_t n, const float *next) {                                             \
        fp acc[R][C] = {{{0}}};                                                                                    \
        const int64_t panel_floats = k * PANEL;                                                                    \
        for (int64_t i = 0; i < k; i++) {                                                                          \
            fp wv[C];                                                                                              \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                                 \
                wv[c] = *(const fp *)(w + c * panel_floats + i * PANEL);                                           \
                __builtin_prefetch(next + c * panel_floats + i * PANEL, 0, 3);                                     \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                const float xr = x[r * k + i];                                                                     \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] += xr * wv[c];                      \
            }                                                                                                      \
        }                                                                                                          \
        for (int c = 0; c < C; c++) {                                                                              \
            const fp b = bias ? *(const fp *)(bias + c * PANEL) : (fp){0};                                         \
            for (int r = 0; r < R; r++) *(fp *)(y + r * n + c * PANEL) = acc[r][c] + b;                           \
        }                                                                                                          \
    }
/* every row count, for runs of LIN_PANELS panels and for single panels (a weight's last ones) */
#define LINEAR_BLOCKS(C)                                                                                           \
    LINEAR_BLOCK(1, C) LINEAR_BLOCK(2, C) LINEAR_BLOCK(3, C) LINEAR_BLOCK(4, C) LINEAR_BLOCK(5, C)                \
    LINEAR_BLOCK(6, C) LINEAR_BLOCK(7, C) LINEAR_BLOCK(8, C)                                                       \
    static const linear_block_fn linear_blocks_##C[LIN_ROWS + 1] = {                                               \
        0, linear_block_1_##C, linear_block_2_##C, linear_block_3_##C, linear_block_4_##C,                         \
        linear_block_5_##C, linear_block_6_##C, linear_block_7_##C, linear_block_8_##C};
typedef void (*linear_block_fn)(const float *, int64_t, const float *, const float *, float *, int64_t,
                                const float *);
#if PANEL == 16
LINEAR_BLOCKS(3)
#define RUN_BLOCKS linear_blocks_3
#else
LINEAR_BLOCKS(2)
#define RUN_BLOCKS linear_blocks_2
#endif
LINEAR_BLOCKS(1)

/* y [m, n] = x [m, k] W^T (+ bias [n], or NULL); W as panels [n / PANEL][k][PANEL]; n a multiple of PANEL.
 * Each thread takes runs of LIN_PANELS panels, reading each run from memory once (the first block of rows
 * prefetches the next run) however many rows there are. */
void kvd_small_linear_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m, int64_t n,
                          int64_t k) {
    const int64_t count = n / PANEL, runs = (count + LIN_PANELS - 1) / LIN_PANELS;
#pragma omp parallel for schedule(static)
    for (int64_t run = 0; run < runs; run++) {
        const int64_t p0 = run * LIN_PANELS, width = count - p0 < LIN_PANELS ? count - p0 : LIN_PANELS;
        const float *w = panels + p0 * k * PANEL, *next = run + 1 < runs ? w + LIN_PANELS * k * PANEL : w;
        for (int64_t m0 = 0; m0 < m; m0 += LIN_ROWS) {
            const int64_t rows = m - m0 < LIN_ROWS ? m - m0 : LIN_ROWS;
            const float *ahead = m0 == 0 ? next : w; /* the first block of rows prefetches the next run */
            if (width == LIN_PANELS)
                RUN_BLOCKS[rows](x + m0 * k, k, w, bias ? bias + p0 * PANEL : 0, y + m0 * n + p0 * PANEL, n, ahead);
            else /* a weight's last panels, one at a time */
                for (int64_t c = 0; c < width; c++)
                    linear_blocks_1[rows](x + m0 * k, k, w + c * k * PANEL, bias ? bias + (p0 + c) * PANEL : 0,
                                          y + m0 * n + (p0 + c) * PANEL, n, w);
        }
    }
}

/* --- Prefill attention ---
 *
 * A prefill chunk's queries, the last q_len of k_len positions, each
 * attending causally to the positions up to its own (bottom-right aligned),
 * over K/V read where they lie in the cache through the chunk's blocks (all
 * of a step's chunks in one call, their tasks shared among the threads:
 * kvd_prefill_chunks_f32; and the shared prefix of a decode batch,
 * kvd_prefix_decode_f32). One task per (KV head, tile of
 * QT query tokens): the tile's rows are its tokens' query heads of that KV
 * head, all reading the same keys. Keys go by in tiles of KT; each tile is
 * two small matrix products kept in registers, between them a running
 * softmax per row, as in flash attention.
 *
 * The rows lie across a vector's lanes: the queries are transposed once per
 * task ([d][rows]), so the scores come out transposed too ([key][rows]), one
 * key's element broadcast against PANEL rows at a time, and the keys are
 * read where they lie. The running softmax is then lane-wise (each lane a
 * row): its maxima, masks, rescaling and sums take no horizontal step and
 * no scalar exponential. Transposing each tile of keys instead (rows as
 * scalars, keys across the lanes) cost a horizontal maximum and a masked
 * fix-up per row and tile, and the transposes themselves; together more
 * than the products (docs/benchmarks.md). torch's fused CPU kernel reached
 * ~90 GFLOP/s on these shapes (SmolLM2, 512-token chunks) where its linear
 * layers ran at ~450.
 */
#define KT 64 /* keys per tile */
#define QT 16 /* query tokens per task */
/* keys per register block of scores: KB x VB accumulators (8 x 3 of AVX-512's 32 registers: 30
 * layers of a 512-token chunk 48 ms against 53 with 4 x 3, whose loads were more of the work) */
#define KB (PANEL == 16 ? 8 : 4)
#define VB (PANEL == 16 ? 3 : 2) /* vectors of rows per register block: KB x VB accumulators */
#define RB (PANEL == 16 ? 4 : 2) /* rows per register block of the weighted values (4 x d / PANEL accumulators) */

static inline fp larger(fp a, fp b) {
    const ip more = a > b;
    return (fp)(((ip)a & more) | ((ip)b & ~more));
}

typedef struct {
    const float *q;                   /* q[h * q_head_stride + t * q_token_stride + i] */
    int64_t q_head_stride, q_token_stride;
    /* key j of KV head g at k[offset(j) + g * d]:
     * offset(j) = blocks[j / block_size] * block_stride + (j % block_size) * kv_token_stride */
    const float *k, *v;
    int64_t kv_token_stride;
    const int64_t *blocks;
    int64_t block_size, block_stride;
    float *out;                       /* out[t * out_token_stride + h * d + i] */
    int64_t out_token_stride;
    int64_t q_len, k_len, heads, kv_heads, d;
    float scale;
    int causal;         /* 0: every query sees every key */
    int64_t task_rows;  /* rows (query heads of one KV head) per task, a multiple of PANEL or all of them */
    float *top, *mass;  /* non-NULL: out gets the unnormalized running state ([t * heads + h]) */
} Chunk;

/* The offsets of keys [j0, j0 + n) from a KV head's first element. */
static void key_offsets(const Chunk *p, int64_t j0, int64_t n, int64_t *offsets) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t at = j0 + j;
        offsets[j] = p->blocks[at / p->block_size] * p->block_stride + (at % p->block_size) * p->kv_token_stride;
    }
}

/* scores[j][v * PANEL ..] = key j . rows of vectors [v0, v0 + nv), for keys j < nk (nk <= KB, nv <= VB);
 * queries_t: [d][width] (rows across), key j at keys + offsets[j]. */
static inline void score_block(const float *queries_t, int64_t width, int64_t d, const float *keys,
                               const int64_t *offsets, int nk, int nv, float *scores) {
    fp a[KB][VB];
    const float *key[KB];
    for (int j = 0; j < KB; j++) {
        key[j] = keys + offsets[j < nk ? j : 0];
        for (int v = 0; v < VB; v++) a[j][v] = (fp){0};
    }
    if (nk == KB && nv == VB) { /* the common case, unrolled in full */
        for (int64_t i = 0; i < d; i++) {
            const fp *qv = (const fp *)(queries_t + i * width);
            for (int v = 0; v < VB; v++)
                for (int j = 0; j < KB; j++) a[j][v] += key[j][i] * qv[v];
        }
    } else {
        for (int64_t i = 0; i < d; i++) {
            const fp *qv = (const fp *)(queries_t + i * width);
            for (int v = 0; v < nv; v++)
                for (int j = 0; j < nk; j++) a[j][v] += key[j][i] * qv[v];
        }
    }
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < nv; v++) *(fp *)(scores + j * width + v * PANEL) = a[j][v];
}

/* acc[r][0..d) += sum over j < n of weights[j * width + r] * value j, for RB rows; value j at values + offsets[j]. */
static inline void add_block(float *acc, int64_t d, const float *weights, int64_t width, const float *values,
                             const int64_t *offsets, int64_t n) {
    for (int64_t at = 0; at < d; at += 4 * PANEL) {
        fp o[RB][4];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < 4; c++) o[r][c] = *(const fp *)(acc + r * d + at + c * PANEL);
        for (int64_t j = 0; j < n; j++) {
            const fp *vv = (const fp *)(values + offsets[j] + at);
            const fp v0 = vv[0], v1 = vv[1], v2 = vv[2], v3 = vv[3];
            for (int r = 0; r < RB; r++) {
                const float w = weights[j * width + r];
                o[r][0] += w * v0, o[r][1] += w * v1, o[r][2] += w * v2, o[r][3] += w * v3;
            }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < 4; c++) *(fp *)(acc + r * d + at + c * PANEL) = o[r][c];
    }
}

/* The scores of n keys ([key][width]) folded into the running softmax of the
 * rows, lane-wise: vector v's lanes are rows v * PANEL.., at positions `pos`
 * (-1: a padding row, which sees nothing); key j (position j0 + j) is seen
 * by the rows at or past it. The scores become their weights under each
 * row's (possibly raised) maximum `top`; `mass` gains their sums; what a row
 * summed under an older maximum (mass, and its d values in acc) shrinks. */
static void softmax_tile(float *scores, int64_t width, int64_t n, int64_t j0, const ip *pos, fp *top, fp *mass,
                         float *acc, int64_t d) {
    const fp none = (fp){0} - INFINITY;
    for (int64_t v = 0; v < width / PANEL; v++) {
        fp most = none;
        for (int64_t j = 0; j < n; j++) {
            const ip seen = pos[v] >= (ip){0} + (int32_t)(j0 + j); /* all ones where seen */
            fp *s = (fp *)(scores + j * width + v * PANEL);
            *s = (fp)(((ip)*s & seen) | ((ip)none & ~seen));
            most = larger(most, *s);
        }
        const fp raised = larger(top[v], most);
        const ip any = raised > none; /* rows that have seen a key by now */
        /* where a row has seen nothing yet, nothing is subtracted: its scores are all -inf, weights 0 */
        const fp base = (fp)((ip)raised & any);
        const fp shrink = (fp)(((ip)expv(top[v] - base) & any) | ((ip)((fp){0} + 1.0f) & ~any));
        top[v] = raised;
        fp sum = {0};
        for (int64_t j = 0; j < n; j++) {
            fp *s = (fp *)(scores + j * width + v * PANEL);
            const ip seen = *s > none;
            *s = (fp)((ip)expv(*s - base) & seen); /* expv leaves ~2^-126 below -87, not 0 */
            sum += *s;
        }
        mass[v] = mass[v] * shrink + sum;
        for (int l = 0; l < PANEL; l++)
            if (shrink[l] != 1.0f) {
                float *row = acc + (v * PANEL + l) * d;
                for (int64_t i = 0; i < d; i++) row[i] *= shrink[l];
            }
    }
}

/* One task: KV head `g`, its rows [r0, r1) (row r: query token r / group, that token's
 * query head g * group + r % group); `work`: room for its buffers (prefill_work floats). */
static void prefill_task(const Chunk *p, int64_t g, int64_t r0, int64_t r1, float *work) {
    const int64_t group = p->heads / p->kv_heads, d = p->d, rows = r1 - r0;
    const int64_t width = (rows + PANEL - 1) / PANEL * PANEL, vectors = width / PANEL;
    const int64_t first_pos = p->k_len - p->q_len;
    float *queries_t = work, *scores = queries_t + d * width, *acc = scores + KT * width;
    fp *top = (fp *)(acc + width * d), *mass = top + vectors;
    ip *pos = (ip *)(mass + vectors);
    int64_t *offsets = (int64_t *)(pos + vectors);
    for (int64_t r = 0; r < width; r++) {
        const int64_t t = (r0 + r) / group, h = g * group + (r0 + r) % group;
        const float *q = p->q + h * p->q_head_stride + t * p->q_token_stride;
        for (int64_t i = 0; i < d; i++) {
            queries_t[i * width + r] = r < rows ? q[i] * p->scale : 0.0f;
            acc[r * d + i] = 0.0f;
        }
        pos[r / PANEL][r % PANEL] = r >= rows ? -1 : p->causal ? (int32_t)(first_pos + t) : INT32_MAX;
    }
    for (int64_t v = 0; v < vectors; v++) top[v] = (fp){0} - INFINITY, mass[v] = (fp){0};
    const int64_t last_pos = p->causal ? first_pos + (r1 - 1) / group : p->k_len - 1;
    for (int64_t j0 = 0; j0 <= last_pos; j0 += KT) {
        const int64_t n = last_pos + 1 - j0 < KT ? last_pos + 1 - j0 : KT;
        key_offsets(p, j0, n, offsets);
        const float *keys = p->k + g * d, *values = p->v + g * d;
        for (int64_t j = 0; j < n; j += KB)
            for (int64_t v = 0; v < vectors; v += VB)
                score_block(queries_t + v * PANEL, width, d, keys, offsets + j, n - j < KB ? n - j : KB,
                            vectors - v < VB ? vectors - v : VB, scores + j * width + v * PANEL);
        softmax_tile(scores, width, n, j0, pos, top, mass, acc, d);
        for (int64_t r = 0; r < width; r += RB) add_block(acc + r * d, d, scores + r, width, values, offsets, n);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = (r0 + r) / group, h = g * group + (r0 + r) % group;
        float *o = p->out + t * p->out_token_stride + h * d;
        const float total = mass[r / PANEL][r % PANEL], inv = p->top ? 1.0f : 1.0f / total;
        for (int64_t i = 0; i < d; i++) o[i] = acc[r * d + i] * inv;
        if (p->top) p->top[t * p->heads + h] = top[r / PANEL][r % PANEL], p->mass[t * p->heads + h] = total;
    }
}

/* The floats prefill_task needs for `task_rows` rows (the offsets' int64s counted as two). */
static int64_t prefill_work(int64_t task_rows, int64_t d) {
    const int64_t width = (task_rows + PANEL - 1) / PANEL * PANEL;
    return d * width + KT * width + width * d + 3 * width + 2 * KT;
}

/* Runs every task of the n chunks on the OpenMP threads, shared among them all: 0, or
 * -2 when out of memory. The chunks have the same heads, head dim and task_rows. */
static int prefill_tasks(const Chunk *chunks, int64_t n) {
    int64_t *first_task = malloc((n + 1) * sizeof(int64_t)); /* chunk c's tasks: [first_task[c], first_task[c + 1]) */
    if (!first_task) return -2;
    const int64_t group = chunks[0].heads / chunks[0].kv_heads, task_rows = chunks[0].task_rows;
    first_task[0] = 0;
    for (int64_t c = 0; c < n; c++)
        first_task[c + 1] = first_task[c] + (chunks[c].q_len * group + task_rows - 1) / task_rows * chunks[c].kv_heads;
    const int64_t floats = (prefill_work(task_rows, chunks[0].d) + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel
    {
        float *work = aligned_alloc(64, floats * sizeof(float));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t c = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < first_task[n]; task++) {
            while (task >= first_task[c + 1]) c++; /* the tasks come in order within a thread */
            const Chunk *p = chunks + c;
            const int64_t rows = p->q_len * group, tiles = (rows + task_rows - 1) / task_rows, i = task - first_task[c];
            const int64_t tile = tiles - 1 - i / p->kv_heads; /* the longest rows of a chunk first */
            const int64_t r0 = tile * task_rows, r1 = r0 + task_rows < rows ? r0 + task_rows : rows;
            if (work) prefill_task(p, i % p->kv_heads, r0, r1, work);
        }
        free(work);
    }
    free(first_task);
    return failed ? -2 : 0;
}

/* A step's prefill chunks in one call, their K/V read where they lie in one layer's
 * cache (k, v: block id * block_stride + offset * token_stride + kv head * head_dim),
 * their tasks shared among the threads. chunks[c] = {first query token in q and out,
 * query tokens, positions (the queries the last of them), first block id in tables}.
 * Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int kvd_prefill_chunks_f32(const float *q, int64_t q_head_stride, int64_t q_token_stride, const float *k,
                           const float *v, int64_t block_stride, int64_t token_stride, const int64_t *chunks,
                           int64_t num_chunks, const int64_t *tables, float *out, int64_t out_token_stride,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim % (4 * PANEL) || block_size <= 0) return -1;
    if (num_chunks <= 0) return 0;
    Chunk *each = malloc(num_chunks * sizeof(Chunk));
    if (!each) return -2;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t *info = chunks + 4 * c;
        if (info[1] > info[2]) {
            free(each);
            return -1;
        }
        each[c] = (Chunk){q + info[0] * q_token_stride, q_head_stride, q_token_stride, k, v, token_stride,
                          tables + info[3], block_size, block_stride, out + info[0] * out_token_stride,
                          out_token_stride, info[1], info[2], heads, kv_heads, head_dim, scale, 1,
                          QT * (heads / kv_heads), NULL, NULL};
    }
    const int failed = prefill_tasks(each, num_chunks);
    free(each);
    return failed;
}

/* A batch of decodes' queries q [batch, heads, head_dim] over the same prefix of
 * `num_blocks` whole blocks, read where they lie: the running state each head's
 * softmax has after it (out: the unnormalized weighted sums; top, mass: [batch,
 * heads]), which kvd_paged_decode_f32 then carries on over each one's own blocks.
 * Its rows are a KV head's queries of all the batch, in tasks of a few vectors.
 * Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int kvd_prefix_decode_f32(const float *q, float *out, float *top, float *mass, const float *k, const float *v,
                          int64_t block_stride, int64_t token_stride, const int64_t *blocks, int64_t num_blocks,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t threads, float scale) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim % (4 * PANEL) || block_size <= 0) return -1;
    /* enough tasks to share among the threads (a few each), each of whole vectors of rows */
    const int64_t rows = batch * (heads / kv_heads), per_head = (4 * threads + kv_heads - 1) / kv_heads;
    int64_t task_rows = (rows + per_head - 1) / per_head;
    task_rows = (task_rows + PANEL - 1) / PANEL * PANEL;
    if (task_rows > VB * PANEL * 2) task_rows = VB * PANEL * 2;
    const Chunk p = {q, head_dim, heads * head_dim, k, v, token_stride, blocks, block_size, block_stride,
                     out, heads * head_dim, batch, num_blocks * block_size, heads, kv_heads, head_dim, scale,
                     0, task_rows, top, mass};
    return prefill_tasks(&p, 1);
}

/* Head dims the prefill kernel's entries (kvd_prefill_chunks_f32, kvd_prefix_decode_f32) take are multiples of this. */
int kvd_prefill_multiple(void) { return 4 * PANEL; }

/* --- A decoder layer's element-wise steps (inference/fused_layers.py) ---
 *
 * RMS normalization, the rotary embedding and a gated MLP's activation, each
 * one pass over its rows. torch runs each as several operators, every one a
 * pass over the whole tensor into a new one: on a 512-token chunk of SmolLM2
 * they took about a sixth of the forward, and on a decode step of a few rows
 * the operators' own overhead was as long as their work. Rows are shared
 * among the threads only when there are enough of them to pay for waking
 * the threads.
 */
#define PARALLEL_FLOATS (1 << 15)

/* x[:n] * scale * weight into y, a vector at a time. */
static inline void scale_row(const float *x, const float *weight, float scale, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + PANEL <= n; i += PANEL) *(fp *)(y + i) = *(const fp *)(x + i) * scale * *(const fp *)(weight + i);
    for (; i < n; i++) y[i] = x[i] * scale * weight[i];
}

/* y[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps) over contiguous rows of d floats. */
void kvd_rms_norm_f32(const float *x, const float *weight, float *y, int64_t rows, int64_t d, float eps) {
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        fp squares = {0};
        int64_t i = 0;
        for (; i + PANEL <= d; i += PANEL) squares += *(const fp *)(row + i) * *(const fp *)(row + i);
        float sum = lane_sum(squares);
        for (; i < d; i++) sum += row[i] * row[i];
        scale_row(row, weight, 1.0f / sqrtf(sum / (float)d + eps), y + r * d, d);
    }
}

/* silu(x) = x / (1 + e^-x), from e = e^-|x| (expv takes x <= 0): x / (1 + e)
 * for x >= 0, x e / (1 + e) below; neither overflows. */
static inline fp siluv(fp x) {
    const ip negative = x < 0;                               /* all ones where true */
    const fp e = expv((fp)((ip)x | (int32_t)0x80000000));    /* the sign bit set: -|x| */
    const fp numerator = (fp)(((ip)(x * e) & negative) | ((ip)x & ~negative));
    return numerator / (1.0f + e);
}

/* out[r][j] = silu(gate_up[r][j]) * gate_up[r][n + j]: a gated MLP's
 * activation, its gate and up projections side by side in rows of 2n (one
 * product made both). */
void kvd_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        float *y = out + r * n;
        int64_t j = 0;
        for (; j + PANEL <= n; j += PANEL) *(fp *)(y + j) = siluv(*(const fp *)(gate + j)) * *(const fp *)(up + j);
        for (; j < n; j++) y[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* The rotary embedding, in place, of the first `heads` heads (d floats each,
 * side by side) of rows `stride` floats apart, by each row's cos and sin
 * ([rows][d]): the halves rotated as Hugging Face's rotate_half has them,
 * x' = x cos + (-x2, x1) sin. A projection's queries and keys lie side by
 * side in its rows: one call rotates both. */
void kvd_rotary_f32(float *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, const float *cos,
                    const float *sin) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * stride + h * d, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + PANEL <= half; i += PANEL) {
                const fp a = *(fp *)(x1 + i), b = *(fp *)(x2 + i);
                *(fp *)(x1 + i) = a * *(const fp *)(c + i) - b * *(const fp *)(s + i);
                *(fp *)(x2 + i) = b * *(const fp *)(c + half + i) + a * *(const fp *)(s + half + i);
            }
            for (; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
