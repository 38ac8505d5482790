// sipp's CPU flash attention.
//
// Below 64 query rows ggml's CPU flash attention walks the KV cache one
// cell at a time for every row and head: an f16 dot product, a scalar expf
// and an f16 multiply-add per cell. A decode step of a few rows (several
// slots, a speculative draft) then pays that walk once per row; from 64
// rows it tiles, with other arithmetic. This kernel takes every batch: 32
// cells at a time, their keys converted to f32 and transposed once for
// every query of the tile (every head that shares the kv head, for every
// row), scores 16 to a register for up to 8 queries at once, the softmax
// with a vectorized exp, the values weighed 64 dimensions at a time. The
// next tile's keys and values are fetched while a tile computes.
//
// A row's result does not depend on anything but the cells it sees, bit
// for bit. The tiles are made of the cells a row sees, in cell order,
// counted from the first (rows of one sequence, each seeing a prefix of
// what the last sees, share them); 64 such cells make a chunk, and the
// chunks' partial softmaxes (running maximum, sum and weighted values) are
// folded in chunk order. With few rows the threads split the chunks
// (flash-decoding), with many the rows; both fold the same way. So neither
// the batch around a row, nor the threads, nor where its cells lie in the
// cache (after other requests, behind a cached prefix) moves its logits,
// only their order: a token verified in a speculative draft gets exactly
// the logits it gets decoded alone, and a request whose cells are in the
// order of its positions computes the same wherever they are.
//
// The arithmetic is attention's: softmax(scale * q.k + mask) v, with the
// online-softmax rescaling; ggml's path rounds queries to f16 first, this
// one keeps them in f32.
//
// Written once over a vector of 16 floats (`V`): one AVX-512 register, or
// two AVX2 ones on CPUs without AVX-512 (where fewer queries share a tile
// pass, 3 instead of 8, and values are weighed 32 dimensions at a time, to
// fit AVX2's 16 registers). Either way each lane computes alone.

#include "attention.h"
#include "prefetch.h"

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// Two builds: AVX-512, and AVX2 with FMA (a vector of 16 floats as two
// registers, fewer queries at a time for AVX2's 16 registers).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__F16C__)
#    define SIPP_CPU_ATTENTION        1
#    define SIPP_CPU_ATTENTION_AVX512 1
#    include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#    define SIPP_CPU_ATTENTION      1
#    define SIPP_CPU_ATTENTION_AVX2 1
#    include <immintrin.h>
#endif

namespace sipp {
namespace {

constexpr int     TILE     = 32;   // cells per tile
constexpr int64_t MAX_ROWS = 63;   // the most rows for which the threads split the chunks
constexpr int64_t MAX_DIM  = 256;
// Partial results of one op stay within this many bytes (at MAX_ROWS rows):
// a longer cache gets longer chunks.
constexpr size_t  PARTIALS_BUDGET = (size_t) 32 << 20;

std::atomic<unsigned long long> g_calls{ 0 };

// Cells of the whole cache behind the op's keys (a view of one layer's
// cache): the chunk length depends on it and on the heads, never on the
// batch.
int64_t cache_cells(const ggml_tensor * k) {
    int64_t cells = k->ne[1];
    if (k->view_src && k->nb[1] > 0) {
        cells = std::max<int64_t>(cells, (int64_t) (ggml_nbytes(k->view_src) / k->nb[1]));
    }
    return cells;
}

size_t round64(size_t n) {
    return (n + 63) / 64 * 64;
}

// A row: how many cells it sees, the last of them, its group and its
// place among the group's rows.
struct RowInfo {
    int32_t count, last, group, local;
};

// Rows each of which sees a prefix (in cell order) of what the group's
// representative row sees: a sequence's rows of a step.
struct Group {
    int32_t rep, members, first, chunks;  // first: where its rows start in the order
    int64_t partials;                     // its partial results' offset (chunks split)
};

struct Shape {
    int64_t D, N, heads, kv_heads, cells;
    int64_t chunk;       // seen cells per chunk, a multiple of TILE
    int64_t max_chunks;  // chunks of a row that sees every cell

    // Bytes of one chunk's partial results for `rows` rows.
    size_t partial_bytes(int64_t rows) const { return round64((size_t) heads * rows * (D + 2) * sizeof(float)); }

    // Many rows: the threads split the rows, each walking every chunk;
    // few: they split the chunks. The results are the same, bit for bit.
    bool by_rows(int n_threads) const { return N > MAX_ROWS || N >= 16 * (int64_t) n_threads; }

    int64_t rows_per_thread(int n_threads) const { return (N + n_threads - 1) / n_threads; }

    size_t scratch_bytes() const {
        return round64(((size_t) D * TILE * 3 + (size_t) N * TILE) * sizeof(float) + N + 64 + 2 * TILE * sizeof(int32_t));
    }

    explicit Shape(const ggml_tensor * op) {
        const ggml_tensor * q = op->src[0];
        const ggml_tensor * k = op->src[1];
        D                     = q->ne[0];
        N                     = q->ne[1];
        heads                 = q->ne[2];
        kv_heads              = k->ne[2];
        cells                 = k->ne[1];
        const size_t  largest = (size_t) MAX_ROWS * heads * (D + 2) * sizeof(float);
        const int64_t all     = cache_cells(k);
        chunk                 = 2 * TILE;
        while ((size_t) ((all + chunk - 1) / chunk) * largest > PARTIALS_BUDGET) {
            chunk *= 2;
        }
        max_chunks = (cells + chunk - 1) / chunk;
    }
};

// Where everything lives in the work buffer: what the rows see and their
// groups (the meta; with few rows every thread works it out for itself,
// which saves two barriers), then the chunks' partial results, then every
// thread's own space.
struct Layout {
    size_t rows, groups, order, starts, meta;  // offsets within a meta, its size
    size_t partials, threads, per_thread, total;

    Layout(const Shape & s, int n_threads) {
        rows   = 0;
        groups = round64(rows + sizeof(RowInfo) * s.N);
        order  = round64(groups + sizeof(Group) * s.N + sizeof(int32_t));
        starts = round64(order + sizeof(int32_t) * s.N);
        meta   = round64(starts + sizeof(int32_t) * s.N * (s.max_chunks + 1));
        if (s.by_rows(n_threads)) {
            // one meta; a thread's rows: one chunk's partial and the running state
            partials   = meta;
            threads    = partials;
            per_thread = 2 * s.partial_bytes(s.rows_per_thread(n_threads)) + s.scratch_bytes();
        } else {
            // a meta per thread; every group's chunks (at most max_chunks of every row)
            // and per thread, the running maximum and sum of its queries as it folds
            partials   = meta * n_threads;
            threads    = partials + s.max_chunks * (s.partial_bytes(s.N) + 64 * s.N);
            per_thread = s.scratch_bytes() + round64((size_t) 2 * s.heads * s.N * sizeof(float));
        }
        total = threads + per_thread * n_threads;
    }
};

}  // namespace

bool attention_usable(const ggml_tensor * op) {
#ifdef SIPP_CPU_ATTENTION
    if (op->op != GGML_OP_FLASH_ATTN_EXT) {
        return false;
    }
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];
    float               max_bias, softcap;
    std::memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
    std::memcpy(&softcap, (const float *) op->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 &&
           op->type == GGML_TYPE_F32 && mask && mask->type == GGML_TYPE_F16 && mask->ne[2] == 1 &&
           mask->ne[3] == 1 && mask->ne[0] >= k->ne[1] && mask->ne[1] >= q->ne[1] && op->src[4] == nullptr &&
           max_bias == 0.0f && softcap == 0.0f && q->ne[1] >= 1 && q->ne[1] < INT32_MAX && k->ne[1] < INT32_MAX &&
           q->ne[0] == v->ne[0] && k->ne[0] == q->ne[0] && q->ne[0] % 16 == 0 && q->ne[0] <= MAX_DIM &&
           q->ne[3] == 1 && k->ne[3] == 1 && v->ne[3] == 1 && k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 &&
           v->ne[2] == k->ne[2] && v->ne[1] == k->ne[1] && q->nb[0] == sizeof(float) &&
           k->nb[0] == sizeof(ggml_fp16_t) && v->nb[0] == sizeof(ggml_fp16_t) && mask->nb[0] == sizeof(ggml_fp16_t) &&
           op->nb[0] == sizeof(float) && op->ne[0] == q->ne[0] && op->ne[1] == q->ne[2] && op->ne[2] == q->ne[1];
#else
    (void) op;
    return false;
#endif
}

size_t attention_work_size(const ggml_tensor * op, int n_threads) {
    return Layout(Shape(op), n_threads).total + 64;
}

unsigned long long attention_calls() {
    return g_calls.load(std::memory_order_relaxed);
}

#ifdef SIPP_CPU_ATTENTION

namespace {

// 16 floats, and the operations the kernel needs on them. With AVX-512 one
// register, with AVX2 two; either way each lane computes alone, so a row's
// result depends only on its own arithmetic.
#ifdef SIPP_CPU_ATTENTION_AVX512

struct V {
    __m512 x;
};

// queries scored at once, and weighed at once 16 * VB dimensions at a time
constexpr int QMAX = 8, WMAX = 4, VB = 4;

inline V vload(const float * p) { return { _mm512_loadu_ps(p) }; }
inline void vstore(float * p, V a) { _mm512_storeu_ps(p, a.x); }
inline V vset1(float f) { return { _mm512_set1_ps(f) }; }
inline V vzero() { return { _mm512_setzero_ps() }; }
inline V vadd(V a, V b) { return { _mm512_add_ps(a.x, b.x) }; }
inline V vmul(V a, V b) { return { _mm512_mul_ps(a.x, b.x) }; }
inline V vmax(V a, V b) { return { _mm512_max_ps(a.x, b.x) }; }
inline V vfmadd(V a, V b, V c) { return { _mm512_fmadd_ps(a.x, b.x, c.x) }; }
inline float vreduce_max(V a) { return _mm512_reduce_max_ps(a.x); }
inline float vreduce_add(V a) { return _mm512_reduce_add_ps(a.x); }

// 16 halves as floats
inline V vhalf(const ggml_fp16_t * p) { return { _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)) }; }

// exp(s - m) where s is not -inf, 0 where it is (exp(-inf) is 0: masked
// cells weigh nothing)
inline V vexp_seen(V s, V m) {
    const __mmask16 k = _mm512_cmp_ps_mask(s.x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return { _mm512_maskz_mov_ps(k, ggml_v_expf(_mm512_sub_ps(_mm512_maskz_mov_ps(k, s.x), m.x))) };
}

// the vector exp, lane 0: a call to expf would spill every query's scores
// around it
inline float vexp1(float x) { return _mm512_cvtss_f32(ggml_v_expf(_mm512_set1_ps(x))); }

// rows[i][j] becomes rows[j][i].
inline void transpose16(__m512 rows[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i]     = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    // u[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i]        = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1]    = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2]    = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3]    = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 lo01 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 hi01 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        rows[j]           = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
        rows[4 + j]       = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
        rows[8 + j]       = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
        rows[12 + j]      = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
    }
}

// The keys of a tile ([TILE][D]) transposed ([D][TILE]).
inline void transpose_keys(const float * kf, float * kt, int64_t D) {
    for (int cb = 0; cb < TILE; cb += 16) {
        for (int64_t d = 0; d < D; d += 16) {
            __m512 kr[16];
            for (int i = 0; i < 16; i++) {
                kr[i] = _mm512_loadu_ps(kf + (cb + i) * D + d);
            }
            transpose16(kr);
            for (int i = 0; i < 16; i++) {
                _mm512_storeu_ps(kt + (d + i) * TILE + cb, kr[i]);
            }
        }
    }
}

#else  // AVX2

struct V {
    __m256 lo, hi;
};

constexpr int QMAX = 3, WMAX = 2, VB = 2;

inline V vload(const float * p) { return { _mm256_loadu_ps(p), _mm256_loadu_ps(p + 8) }; }
inline void vstore(float * p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline V vset1(float f) { return { _mm256_set1_ps(f), _mm256_set1_ps(f) }; }
inline V vzero() { return { _mm256_setzero_ps(), _mm256_setzero_ps() }; }
inline V vadd(V a, V b) { return { _mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi) }; }
inline V vmul(V a, V b) { return { _mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi) }; }
inline V vmax(V a, V b) { return { _mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi) }; }
inline V vfmadd(V a, V b, V c) { return { _mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi) }; }

inline float vreduce_max(V a) {
    const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
    __m128       m  = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m               = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m               = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline float vreduce_add(V a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
    __m128       s  = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s               = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s               = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline V vhalf(const ggml_fp16_t * p) {
    return { _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)),
             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 8))) };
}

inline __m256 exp_seen(__m256 s, __m256 m) {
    const __m256 k = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm256_and_ps(k, ggml_v_expf(_mm256_sub_ps(_mm256_and_ps(k, s), m)));
}

inline V vexp_seen(V s, V m) { return { exp_seen(s.lo, m.lo), exp_seen(s.hi, m.hi) }; }

inline float vexp1(float x) { return _mm256_cvtss_f32(ggml_v_expf(_mm256_set1_ps(x))); }

// rows[i][j] becomes rows[j][i], 8 x 8.
inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i]     = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i]     = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i]     = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

inline void transpose_keys(const float * kf, float * kt, int64_t D) {
    for (int cb = 0; cb < TILE; cb += 8) {
        for (int64_t d = 0; d < D; d += 8) {
            __m256 kr[8];
            for (int i = 0; i < 8; i++) {
                kr[i] = _mm256_loadu_ps(kf + (cb + i) * D + d);
            }
            transpose8(kr);
            for (int i = 0; i < 8; i++) {
                _mm256_storeu_ps(kt + (d + i) * TILE + cb, kr[i]);
            }
        }
    }
}

#endif

constexpr uint16_t F16_NEG_INF = 0xFC00;

// Bits of the cells [c, c + 32) of a mask row that are not -inf (seen);
// none past `end`.
inline uint32_t seen_bits(const ggml_fp16_t * row, int64_t c, int64_t end) {
    const int64_t n = std::min<int64_t>(32, end - c);
#ifdef SIPP_CPU_ATTENTION_AVX512
    const __mmask32 in   = n >= 32 ? (__mmask32) 0xFFFFFFFFu : (__mmask32) ((1u << n) - 1);
    const __m512i   vals = _mm512_maskz_loadu_epi16(in, row + c);
    return (uint32_t) (_mm512_cmpneq_epi16_mask(vals, _mm512_set1_epi16((short) F16_NEG_INF)) & in);
#else
    const uint32_t in = n >= 32 ? 0xFFFFFFFFu : (1u << n) - 1;
    // no reads past the row's end: a short stretch is copied out first
    uint16_t       tail[32];
    const void *   from = row + c;
    if (n < 32) {
        std::memcpy(tail, row + c, sizeof(uint16_t) * n);
        from = tail;
    }
    const __m256i ninf = _mm256_set1_epi16((short) F16_NEG_INF);
    const __m256i a    = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *) from), ninf);
    const __m256i b    = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *) from + 1), ninf);
    // one byte a cell, in cell order (packs interleaves the 128-bit lanes)
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xD8);
    return ~(uint32_t) _mm256_movemask_epi8(bytes) & in;
#endif
}

// Whether the cells row `a` sees are the first of those row `b` sees, in
// cell order (a seeing no more than b).
bool seen_prefix(const ggml_tensor * maskt, const RowInfo * info, int64_t a, int64_t b) {
    if (info[a].count > info[b].count) {
        return false;
    }
    const ggml_fp16_t * ra = (const ggml_fp16_t *) ((const char *) maskt->data + a * maskt->nb[1]);
    const ggml_fp16_t * rb = (const ggml_fp16_t *) ((const char *) maskt->data + b * maskt->nb[1]);
    const int64_t       end = info[a].last + 1;
    for (int64_t c = 0; c < end; c += 32) {
        if (seen_bits(ra, c, end) != seen_bits(rb, c, end)) {
            return false;
        }
    }
    return true;
}

// One chunk's partial results for R rows of a group, every head: query
// (h, i) of the group's rows at h * R + i.
struct Partial {
    int64_t R;
    float * acc;  // [heads * R][D]
    float * m;    // [heads * R] running maximum
    float * l;    // [heads * R] running sum

    Partial(char * at, const Shape & s, int64_t R) : R(R) {
        const size_t queries = (size_t) s.heads * R;
        acc                  = (float *) at;
        m                    = acc + queries * s.D;
        l                    = m + queries;
    }

    int64_t at(int64_t h, int64_t i) const { return h * R + i; }
};

// One thread's scratch for a tile.
struct Scratch {
    float *   kt;    // [D][TILE] keys of a tile, transposed
    float *   kf;    // [TILE][D] keys of a tile, before
    float *   vf;    // [TILE][D] values of a tile
    float *   mask;  // [R][TILE]
    uint8_t * live;  // [R] whether a row sees a cell of the tile
    int32_t * idx;   // [2][TILE] the tile's cells and the next tile's

    Scratch(char * at, const Shape & s) {
        kt   = (float *) at;
        kf   = kt + s.D * TILE;
        vf   = kf + s.D * TILE;
        mask = vf + s.D * TILE;
        live = (uint8_t *) (mask + s.N * TILE);
        idx  = (int32_t *) round64((size_t) (live + s.N));
    }
};

// The tile's values weighed into J queries' accumulators `acc` (a null one
// takes nothing), which start from `from` scaled by `cv` (from zero where
// `from` is null: a query's first seen cells), 64 dimensions at a time:
// every query keeps four running sums at once, so the multiply-adds do not
// wait on one another. Each lane adds the cells in order, as one sum at a
// time would.
template <int J>
inline void weigh_values(const Scratch & t, int64_t D, int n, const float * const * from, float * const * acc,
                         const V * cv, const float (*w)[TILE]) {
    for (int64_t d0 = 0; d0 < D; d0 += 16 * VB) {
        V a[J][VB];
        for (int j = 0; j < J; j++) {
            for (int b = 0; b < VB; b++) {
                a[j][b] = from[j] ? vmul(vload(from[j] + d0 + 16 * b), cv[j]) : vzero();
            }
        }
        for (int c = 0; c < n; c++) {
            const float * vr = t.vf + c * D + d0;
            V             v[VB];
            for (int b = 0; b < VB; b++) {
                v[b] = vload(vr + 16 * b);
            }
            for (int j = 0; j < J; j++) {
                const V wj = vset1(w[j][c]);
                for (int b = 0; b < VB; b++) {
                    a[j][b] = vfmadd(wj, v[b], a[j][b]);
                }
            }
        }
        for (int j = 0; j < J; j++) {
            if (acc[j]) {
                for (int b = 0; b < VB; b++) {
                    vstore(acc[j] + d0 + 16 * b, a[j][b]);
                }
            }
        }
    }
}

// weigh_values for J queries, WMAX at a time.
template <int J>
inline void weigh_all(const Scratch & t, int64_t D, int n, const float * const * from, float * const * acc,
                      const V * cv, const float (*w)[TILE]) {
    if constexpr (J <= WMAX) {
        weigh_values<J>(t, D, n, from, acc, cv, w);
    } else {
        weigh_values<WMAX>(t, D, n, from, acc, cv, w);
        weigh_all<J - WMAX>(t, D, n, from + WMAX, acc + WMAX, cv + WMAX, w + WMAX);
    }
}

// A query of a tile: a head and one of the group's rows (its place).
struct Query {
    int64_t h, i;
};

// One tile for J queries (heads of the tile's kv head, rows of the group's
// `rows`), each exactly as alone: the queries only share the loads of the
// tile's keys and values.
template <int J>
inline void queries(const ggml_tensor * op, const Shape & s, const Partial & p, const Scratch & t,
                    const int32_t * rows, const Query * qs, int n, float scale) {
    const ggml_tensor * q = op->src[0];
    const float *       qp[J];
    V                   s0[J], s1[J];
    for (int j = 0; j < J; j++) {
        qp[j] = (const float *) ((const char *) q->data + rows[qs[j].i] * q->nb[1] + qs[j].h * q->nb[2]);
        s0[j] = vzero();
        s1[j] = vzero();
    }
    for (int64_t d = 0; d < s.D; d++) {
        const V k0 = vload(t.kt + d * TILE), k1 = vload(t.kt + d * TILE + 16);
        for (int j = 0; j < J; j++) {
            const V qd = vset1(qp[j][d]);
            s0[j]      = vfmadd(qd, k0, s0[j]);
            s1[j]      = vfmadd(qd, k1, s1[j]);
        }
    }
    alignas(64) float w[J][TILE];
    V                 cv[J];
    float *           acc[J];
    const float *     from[J];
    bool              any = false;
    const V           sc  = vset1(scale);
    for (int j = 0; j < J; j++) {
        const int64_t i = qs[j].i;
        s0[j]           = vfmadd(s0[j], sc, vload(t.mask + i * TILE));
        s1[j]           = vfmadd(s1[j], sc, vload(t.mask + i * TILE + 16));
        const float tile_max = vreduce_max(vmax(s0[j], s1[j]));
        acc[j]               = nullptr;
        from[j]              = nullptr;
        if (tile_max == -INFINITY) {
            continue;
        }
        const int64_t qi    = p.at(qs[j].h, i);
        const bool    fresh = p.m[qi] == -INFINITY;  // the query's first seen cells
        const float   mnew  = std::max(p.m[qi], tile_max);
        const float   corr = fresh ? 0.0f : vexp1(p.m[qi] - mnew);
        const V       mv   = vset1(mnew);
        const V       e0   = vexp_seen(s0[j], mv);
        const V       e1   = vexp_seen(s1[j], mv);
        p.l[qi]            = p.l[qi] * corr + vreduce_add(vadd(e0, e1));
        p.m[qi]            = mnew;
        vstore(w[j], e0);
        vstore(w[j] + 16, e1);
        cv[j]   = vset1(corr);
        acc[j]  = p.acc + qi * s.D;
        from[j] = fresh ? nullptr : acc[j];
        any     = true;
    }
    if (!any) {
        return;
    }
    for (int j = 0; j < J; j++) {
        if (!acc[j]) {  // nothing seen in the tile: weights 0, nothing to add
            std::memset(w[j], 0, sizeof(w[j]));
            cv[j] = vset1(1.0f);
        }
    }
    if (s.D % (16 * VB) == 0) {
        weigh_all<J>(t, s.D, n, from, acc, cv, w);
        return;
    }
    for (int64_t d = 0; d < s.D; d += 16) {
        V a[J];
        for (int j = 0; j < J; j++) {
            a[j] = from[j] ? vmul(vload(from[j] + d), cv[j]) : vzero();
        }
        for (int c = 0; c < n; c++) {
            const V vv = vload(t.vf + c * s.D + d);
            for (int j = 0; j < J; j++) {
                a[j] = vfmadd(vset1(w[j][c]), vv, a[j]);
            }
        }
        for (int j = 0; j < J; j++) {
            if (acc[j]) {
                vstore(acc[j] + d, a[j]);
            }
        }
    }
}

// queries<J> for J of 1 to QMAX chosen at run time.
inline void dispatch(int64_t J, const ggml_tensor * op, const Shape & s, const Partial & p, const Scratch & t,
                     const int32_t * rows, const Query * qs, int n, float scale) {
    switch (J) {
#ifdef SIPP_CPU_ATTENTION_AVX512
        case 8: queries<8>(op, s, p, t, rows, qs, n, scale); break;
        case 7: queries<7>(op, s, p, t, rows, qs, n, scale); break;
        case 6: queries<6>(op, s, p, t, rows, qs, n, scale); break;
        case 5: queries<5>(op, s, p, t, rows, qs, n, scale); break;
        case 4: queries<4>(op, s, p, t, rows, qs, n, scale); break;
#endif
        case 3: queries<3>(op, s, p, t, rows, qs, n, scale); break;
        case 2: queries<2>(op, s, p, t, rows, qs, n, scale); break;
        case 1: queries<1>(op, s, p, t, rows, qs, n, scale); break;
        default: break;
    }
}

// Chunk j of group g for R of its rows (`rows`), every head, from scratch.
// The tiles are the group's seen cells in cell order, 32 at a time,
// counted from the group's first seen cell: a row's tiles hold the same
// cells in the same places whatever else the cache or the batch holds.
void walk(const ggml_tensor * op, const Shape & s, const RowInfo * info, const Group & g, const int32_t * starts,
          int64_t j, const int32_t * rows, int64_t R, const Partial & p, const Scratch & t, float scale) {
    const ggml_tensor * k     = op->src[1];
    const ggml_tensor * v     = op->src[2];
    const ggml_tensor * maskt = op->src[3];
    const int64_t       group = s.heads / s.kv_heads;
    const ggml_fp16_t * rep   = (const ggml_fp16_t *) ((const char *) maskt->data + g.rep * maskt->nb[1]);
    const int64_t       seen  = info[g.rep].count;

    for (int64_t qi = 0; qi < s.heads * R; qi++) {
        p.m[qi] = -INFINITY;
        p.l[qi] = 0.0f;
    }
    // p.acc needs no clearing: a query's first seen cells start its sums

    int64_t       cell = starts[j];  // where the chunk's first seen cell is
    const int64_t end  = std::min(seen, (j + 1) * s.chunk);
    // the next n cells the representative row sees, from `cell` on
    auto gather = [&](int32_t * idx, int n) {
        int got = 0;
        while (got < n) {
            uint32_t bits = seen_bits(rep, cell & ~(int64_t) 31, s.cells) & (~0u << (cell & 31));
            while (bits && got < n) {
                const int b = __builtin_ctz(bits);
                idx[got++]  = (int32_t) ((cell & ~(int64_t) 31) + b);
                bits &= bits - 1;
            }
            cell = got < n ? (cell & ~(int64_t) 31) + 32 : idx[got - 1] + 1;
        }
    };
    const char *  kdata = (const char *) k->data;
    const char *  vdata = (const char *) v->data;
    const size_t  knb1 = k->nb[1], knb2 = k->nb[2], vnb1 = v->nb[1], vnb2 = v->nb[2];
    const size_t  row_bytes = (size_t) s.D * sizeof(ggml_fp16_t);
    int32_t *     idx       = t.idx;
    int32_t *     next      = t.idx + TILE;
    int           n         = (int) std::min<int64_t>(TILE, end - j * s.chunk);
    if (n > 0) {
        gather(idx, n);
    }
    for (int64_t first = j * s.chunk; first < end; first += TILE) {
        // the next tile's cells, so that their keys and values are on
        // their way while this tile computes
        const int nn = first + TILE < end ? (int) std::min<int64_t>(TILE, end - first - TILE) : 0;
        if (nn > 0) {
            gather(next, nn);
        }
        // every row's mask over the tile's cells; -inf where the row sees
        // no further
        bool any = false;
        for (int64_t i = 0; i < R; i++) {
            const int64_t       r     = rows[i];
            const ggml_fp16_t * mp    = (const ggml_fp16_t *) ((const char *) maskt->data + r * maskt->nb[1]);
            const int64_t       upto  = std::min<int64_t>(n, std::max<int64_t>(0, info[r].count - first));
            float *             mr    = t.mask + i * TILE;
            for (int c = 0; c < TILE; c++) {
                mr[c] = c < upto ? _cvtsh_ss(mp[idx[c]]) : -INFINITY;
            }
            t.live[i] = upto > 0;
            any |= upto > 0;
        }
        if (!any) {
            break;  // the rows see no further
        }
        for (int64_t hk = 0; hk < s.kv_heads; hk++) {
            for (int c = 0; c < nn; c++) {
                const char * kp = kdata + (size_t) next[c] * knb1 + hk * knb2;
                const char * vp = vdata + (size_t) next[c] * vnb1 + hk * vnb2;
                prefetch_l2(kp, kp + row_bytes);
                prefetch_l2(vp, vp + row_bytes);
            }
            // keys and values as f32, a cell at a time; then the keys
            // transposed
            const int64_t D = s.D;
            for (int c = 0; c < TILE; c++) {
                float * kr = t.kf + c * D;
                float * vr = t.vf + c * D;
                if (c < n) {
                    const ggml_fp16_t * kp = (const ggml_fp16_t *) (kdata + (size_t) idx[c] * knb1 + hk * knb2);
                    const ggml_fp16_t * vp = (const ggml_fp16_t *) (vdata + (size_t) idx[c] * vnb1 + hk * vnb2);
                    for (int64_t d = 0; d < D; d += 16) {
                        vstore(kr + d, vhalf(kp + d));
                        vstore(vr + d, vhalf(vp + d));
                    }
                } else {
                    for (int64_t d = 0; d < D; d += 16) {
                        vstore(kr + d, vzero());
                        vstore(vr + d, vzero());
                    }
                }
            }
            transpose_keys(t.kf, t.kt, s.D);
            // every head of the kv head for every live row, QMAX queries at
            // a time (a row alone still fills them with its heads)
            Query   qs[64];
            int64_t n_qs = 0;
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                for (int64_t i = 0; i < R; i++) {
                    if (t.live[i]) {
                        qs[n_qs++] = { h, i };
                    }
                    const bool last = h == (hk + 1) * group - 1 && i == R - 1;
                    if (n_qs == 64 || (last && n_qs > 0)) {
                        // as few passes as QMAX at a time take, as even
                        // as can be (9 queries as 4 and 5, not 8 and 1: a
                        // lone query's sums wait on one another)
                        const int64_t passes = (n_qs + QMAX - 1) / QMAX;
                        int64_t       x      = 0;
                        for (int64_t pass = 0; pass + 1 < passes; pass++) {
                            const int64_t size = (n_qs - x) / (passes - pass);
                            dispatch(size, op, s, p, t, rows, qs + x, n, scale);
                            x += size;
                        }
                        dispatch(n_qs - x, op, s, p, t, rows, qs + x, n, scale);
                        n_qs = 0;
                    }
                }
            }
        }
        std::swap(idx, next);
        n = nn;
    }
}

// Asks for the keys and values (every kv head's) of the first tile of
// chunk j of group g. A walk fetches each next tile while a tile computes,
// but a chunk is only a few tiles: without this its first one would wait on
// memory. Called a chunk ahead of its walk.
void prefetch_chunk(const ggml_tensor * op, const Shape & s, const RowInfo * info, const Group & g,
                    const int32_t * starts, int64_t j) {
    const ggml_tensor * k     = op->src[1];
    const ggml_tensor * v     = op->src[2];
    const ggml_tensor * maskt = op->src[3];
    const int64_t       first = j * s.chunk;
    const int64_t       seen  = info[g.rep].count;
    if (j >= g.chunks || first >= seen) {
        return;
    }
    const ggml_fp16_t * rep   = (const ggml_fp16_t *) ((const char *) maskt->data + g.rep * maskt->nb[1]);
    const size_t        k_len = (size_t) (s.kv_heads - 1) * k->nb[2] + (size_t) s.D * sizeof(ggml_fp16_t);
    const size_t        v_len = (size_t) (s.kv_heads - 1) * v->nb[2] + (size_t) s.D * sizeof(ggml_fp16_t);
    int64_t             n     = std::min<int64_t>(TILE, seen - first);
    for (int64_t cell = starts[j]; n > 0 && cell < s.cells; cell = (cell & ~(int64_t) 31) + 32) {
        uint32_t bits = seen_bits(rep, cell & ~(int64_t) 31, s.cells) & (~0u << (cell & 31));
        for (; bits && n > 0; bits &= bits - 1, n--) {
            const int64_t c  = (cell & ~(int64_t) 31) + __builtin_ctz(bits);
            const char *  kp = (const char *) k->data + (size_t) c * k->nb[1];
            const char *  vp = (const char *) v->data + (size_t) c * v->nb[1];
            prefetch_l2(kp, kp + k_len);
            prefetch_l2(vp, vp + v_len);
        }
    }
}

// Running softmax state of one query over the chunks so far: the maximum,
// the sum and (in `out`) the weighted values. Both ways of splitting the
// work fold a row's chunks with this, in chunk order.
inline void fold(float & m, float & l, float * out, const Partial & part, int64_t qi, int64_t D) {
    const float mc = part.m[qi];
    if (mc == -INFINITY) {
        return;  // no cell of the chunk seen
    }
    const float * acc = part.acc + qi * D;
    if (m == -INFINITY) {
        m = mc;
        l = part.l[qi];
        std::memcpy(out, acc, sizeof(float) * D);
        return;
    }
    const float  mn = std::max(m, mc);
    const float wa = expf(m - mn), wb = expf(mc - mn);
    const V     av = vset1(wa), bv = vset1(wb);
    l              = l * wa + part.l[qi] * wb;
    m              = mn;
    for (int64_t d = 0; d < D; d += 16) {
        vstore(out + d, vfmadd(vload(acc + d), bv, vmul(vload(out + d), av)));
    }
}

// The query's output from its folded state: zeros where every cell was
// masked, as ggml writes.
inline void finish(float m, float l, float * out, int64_t D) {
    if (m == -INFINITY) {
        std::memset(out, 0, sizeof(float) * D);
        return;
    }
    const V inv = vset1(l == 0.0f ? 0.0f : 1.0f / l);
    for (int64_t d = 0; d < D; d += 16) {
        vstore(out + d, vmul(vload(out + d), inv));
    }
}

// The meta: what each row sees, its group, the groups' rows in order and
// where each group's chunks start.
struct Meta {
    RowInfo * info;
    Group *   groups;
    int32_t * n_groups;
    int32_t * order;
    int32_t * starts0;
    int64_t   stride;

    Meta(char * at, const Layout & lay, const Shape & s) {
        info     = (RowInfo *) (at + lay.rows);
        groups   = (Group *) (at + lay.groups);
        n_groups = (int32_t *) (groups + s.N);
        order    = (int32_t *) (at + lay.order);
        starts0  = (int32_t *) (at + lay.starts);
        stride   = s.max_chunks + 1;
    }

    int32_t * starts(int64_t g) const { return starts0 + g * stride; }
};

// What the rows r0, r0 + step, ... see.
void see(const ggml_tensor * op, const Shape & s, const Meta & mt, int64_t r0, int64_t step) {
    const ggml_tensor * maskt = op->src[3];
    for (int64_t r = r0; r < s.N; r += step) {
        const ggml_fp16_t * row   = (const ggml_fp16_t *) ((const char *) maskt->data + r * maskt->nb[1]);
        int32_t             count = 0, last = -1;
        for (int64_t c = 0; c < s.cells; c += 32) {
            const uint32_t bits = seen_bits(row, c, s.cells);
            if (bits) {
                count += __builtin_popcount(bits);
                last = (int32_t) (c + 31 - __builtin_clz(bits));
            }
        }
        mt.info[r] = { count, last, -1, -1 };
    }
}

// The groups: a row joins a group whose representative sees what it sees
// and more after, or becomes its representative; then the rows in group
// order, where every chunk starts, and where its partial results go.
void group(const ggml_tensor * op, const Shape & s, const Meta & mt) {
    const ggml_tensor * maskt  = op->src[3];
    RowInfo *           info   = mt.info;
    Group *             groups = mt.groups;
    int32_t             ng     = 0;
    for (int64_t r = 0; r < s.N; r++) {
        if (info[r].count == 0) {
            continue;
        }
        int32_t found = -1;
        for (int32_t g = ng - 1; g >= 0 && found < 0; g--) {
            if (seen_prefix(maskt, info, r, groups[g].rep)) {
                found = g;
            } else if (seen_prefix(maskt, info, groups[g].rep, r)) {
                groups[g].rep = (int32_t) r;
                found         = g;
            }
        }
        if (found < 0) {
            found         = ng++;
            groups[found] = { (int32_t) r, 0, 0, 0, 0 };
        }
        info[r].group = found;
        info[r].local = groups[found].members++;
    }
    int32_t first    = 0;
    int64_t partials = 0;
    for (int32_t g = 0; g < ng; g++) {
        Group & gr  = groups[g];
        gr.first    = first;
        gr.partials = partials;
        first += gr.members;
        const int64_t seen = info[gr.rep].count;
        gr.chunks          = (int32_t) ((seen + s.chunk - 1) / s.chunk);
        partials += (int64_t) gr.chunks * s.partial_bytes(gr.members);
        gr.members = 0;
        // where each chunk's first seen cell is
        const ggml_fp16_t * rep = (const ggml_fp16_t *) ((const char *) maskt->data + gr.rep * maskt->nb[1]);
        int32_t *           st  = mt.starts(g);
        int64_t             n   = 0;
        for (int64_t c = 0; c < s.cells && n < seen; c += 32) {
            uint32_t bits = seen_bits(rep, c, s.cells);
            while (bits) {
                if (n % s.chunk == 0) {
                    st[n / s.chunk] = (int32_t) (c + __builtin_ctz(bits));
                }
                n++;
                bits &= bits - 1;
            }
        }
        st[gr.chunks] = (int32_t) s.cells;
    }
    for (int64_t r = 0; r < s.N; r++) {
        if (info[r].group >= 0) {
            Group & gr                        = groups[info[r].group];
            mt.order[gr.first + gr.members++] = (int32_t) r;
        }
    }
    *mt.n_groups = ng;
}

}  // namespace

void attention_compute(ggml_compute_params * params, ggml_tensor * op) {
    const Shape s(op);
    float       scale;
    std::memcpy(&scale, (const float *) op->op_params + 0, sizeof(float));
    char * base = (char *) (((uintptr_t) params->wdata + 63) & ~(uintptr_t) 63);
    GGML_ASSERT(params->wsize >= attention_work_size(op, params->nth));
    const int    ith = params->ith, nth = params->nth;
    const Layout lay(s, nth);
    const bool   by_rows = s.by_rows(nth);
    const Meta   mt(base + (by_rows ? 0 : lay.meta * ith), lay, s);
    auto         output = [&](int64_t h, int64_t r) {
        return (float *) ((char *) op->data + (h + r * op->ne[1]) * op->nb[1]);
    };
    if (by_rows) {
        see(op, s, mt, ith, nth);
        ggml_barrier(params->threadpool);
        if (ith == 0) {
            group(op, s, mt);
        }
        ggml_barrier(params->threadpool);
    } else {
        see(op, s, mt, 0, 1);
        group(op, s, mt);
    }
    const RowInfo * info   = mt.info;
    const Group *   groups = mt.groups;
    const int32_t * order  = mt.order;
    const int32_t   ng     = *mt.n_groups;

    // rows that see nothing: zeros, as ggml writes
    for (int64_t r = ith; r < s.N; r += nth) {
        if (info[r].group < 0) {
            for (int64_t h = 0; h < s.heads; h++) {
                std::memset(output(h, r), 0, sizeof(float) * s.D);
            }
        }
    }

    if (by_rows) {
        // Every thread takes a share of the rows (in group order) through
        // all of their group's chunks.
        char *        own = base + lay.threads + lay.per_thread * ith;
        const int64_t per = s.rows_per_thread(nth);
        const Scratch t(own + 2 * s.partial_bytes(per), s);
        const int64_t grouped = ng > 0 ? groups[ng - 1].first + groups[ng - 1].members : 0;
        const int64_t o0 = std::min(grouped, per * ith), o1 = std::min(grouped, o0 + per);
        for (int64_t o = o0; o < o1;) {
            const Group & g = groups[info[order[o]].group];
            const int64_t R = std::min<int64_t>(o1, g.first + g.members) - o;
            const Partial part(own, s, R);
            const Partial state(own + s.partial_bytes(per), s, R);  // its m and l: the running state
            for (int64_t qi = 0; qi < s.heads * R; qi++) {
                state.m[qi] = -INFINITY;
                state.l[qi] = 0.0f;
            }
            for (int64_t j = 0; j < g.chunks; j++) {
                prefetch_chunk(op, s, info, g, mt.starts(info[order[o]].group), j + 1);
                walk(op, s, info, g, mt.starts(info[order[o]].group), j, order + o, R, part, t, scale);
                for (int64_t h = 0; h < s.heads; h++) {
                    for (int64_t i = 0; i < R; i++) {
                        const int64_t qi = part.at(h, i);
                        fold(state.m[qi], state.l[qi], output(h, order[o + i]), part, qi, s.D);
                    }
                }
            }
            for (int64_t h = 0; h < s.heads; h++) {
                for (int64_t i = 0; i < R; i++) {
                    const int64_t qi = part.at(h, i);
                    finish(state.m[qi], state.l[qi], output(h, order[o + i]), s.D);
                }
            }
            o += R;
        }
    } else {
        // 1. every thread takes a run of the chunks (of every group in
        // turn) holding its share of the work, and asks for the next one's
        // first tile before it walks one. A chunk's work is its cells times
        // two plus its group's rows: each cell is made ready once (keys and
        // values to f32, about two rows' weighing) and then weighed by every
        // row. With drafts one sequence's chunks may cost several times
        // another's, and an even count of chunks would leave one thread
        // waiting on the other.
        char *        partials = base + lay.partials;
        const Scratch t(base + lay.threads + lay.per_thread * ith, s);
        auto          work = [&](const Group & g, int64_t j) {
            const int64_t cells = std::min<int64_t>(s.chunk, info[g.rep].count - j * s.chunk);
            return cells * (2 + g.members);
        };
        int64_t total = 0;  // every group's chunks together hold its seen cells
        for (int32_t gi = 0; gi < ng; gi++) {
            total += (int64_t) info[groups[gi].rep].count * (2 + groups[gi].members);
        }
        // a chunk is this thread's when the work before it lies in [w0, w1)
        const int64_t w0 = total * ith / nth, w1 = total * (ith + 1) / nth;
        int64_t       before = 0;
        for (int32_t gi = 0; gi < ng && before < w1; gi++) {
            const Group & g = groups[gi];
            for (int64_t j = 0; j < g.chunks && before < w1; j++) {
                const bool mine = before >= w0;
                before += work(g, j);
                if (!mine) {
                    continue;
                }
                if (before < w1 && j + 1 < g.chunks) {
                    prefetch_chunk(op, s, info, g, mt.starts(gi), j + 1);
                } else if (before < w1 && gi + 1 < ng) {
                    prefetch_chunk(op, s, info, groups[gi + 1], mt.starts(gi + 1), 0);
                }
                const Partial part(partials + g.partials + j * s.partial_bytes(g.members), s, g.members);
                walk(op, s, info, g, mt.starts(gi), j, order + g.first, g.members, part, t, scale);
            }
        }
        ggml_barrier(params->threadpool);

        // 2. every thread folds a share of every group's queries (heads of
        // rows) over the group's chunks, in chunk order: a chunk's partial
        // results for the share lie together, so they are read in the
        // order they lie in memory.
        float * run_m = (float *) (base + lay.threads + lay.per_thread * ith + s.scratch_bytes());
        float * run_l = run_m + s.heads * s.N;
        for (int32_t gi = 0; gi < ng; gi++) {
            const Group & g  = groups[gi];
            const int64_t Q  = s.heads * g.members;  // query h * members + i
            const int64_t q0 = Q * ith / nth, q1 = Q * (ith + 1) / nth;
            for (int64_t qi = q0; qi < q1; qi++) {
                run_m[qi - q0] = -INFINITY;
                run_l[qi - q0] = 0.0f;
            }
            for (int64_t j = 0; j < g.chunks; j++) {
                const Partial part(partials + g.partials + j * s.partial_bytes(g.members), s, g.members);
                for (int64_t qi = q0; qi < q1; qi++) {
                    float * out = output(qi / g.members, order[g.first + qi % g.members]);
                    fold(run_m[qi - q0], run_l[qi - q0], out, part, qi, s.D);
                }
            }
            for (int64_t qi = q0; qi < q1; qi++) {
                finish(run_m[qi - q0], run_l[qi - q0], output(qi / g.members, order[g.first + qi % g.members]), s.D);
            }
        }
    }
    if (ith == 0) {
        g_calls.fetch_add(1, std::memory_order_relaxed);
    }
}

#else

void attention_compute(ggml_compute_params *, ggml_tensor *) {
    GGML_ABORT("sipp's CPU attention is not compiled in");
}

#endif  // SIPP_CPU_ATTENTION

}  // namespace sipp
