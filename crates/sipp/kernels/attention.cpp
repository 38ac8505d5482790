// sipp's CPU attention for small batches.
//
// Below 64 query rows ggml's CPU flash attention walks the KV cache one
// cell at a time for every row and head: an f16 dot product, a scalar expf
// and an f16 multiply-add per cell. A decode step of a few rows (several
// slots, a speculative draft) then pays that walk once per row. This kernel
// takes 32 cells at a time instead: their keys converted to f32 and
// transposed once for every query of the tile, their scores 32 to a
// register, the softmax with a vectorized exp, tiles whose mask is -inf for
// every row skipped.
//
// The cells are cut into chunks at fixed places (64 cells, longer only for
// a long cache), the threads take the chunks in turn, and each chunk's
// partial result (running maximum, sum and weighted values) is merged with
// the others in chunk order, as flash-decoding does. Where the chunks fall
// depends on the cache alone, and every row is computed on its own, so a
// row's result is the same bit for bit whatever the batch around it: its
// rows, the threads, the cells the step spans. A token verified inside a
// speculative draft therefore gets exactly the logits it gets decoded
// alone, and two runs of a request agree however their steps were batched.
// One row goes through here as well for that reason.
//
// The arithmetic is attention's: softmax(scale * q.k + mask) v, with the
// online-softmax rescaling; ggml's path rounds queries to f16 first, this
// one keeps them in f32.

#include "attention.h"

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__F16C__)
#    define SIPP_CPU_ATTENTION 1
#    include <immintrin.h>
#endif

namespace sipp {
namespace {

constexpr int     TILE     = 32;   // cells per tile
constexpr int64_t MAX_ROWS = 63;   // the most rows for which the threads split the cells
constexpr int64_t MAX_DIM  = 256;
// Partial results of one op stay within this many bytes (at MAX_ROWS rows):
// a longer cache gets longer chunks.
constexpr size_t  PARTIALS_BUDGET = (size_t) 32 << 20;

std::atomic<unsigned long long> g_calls{ 0 };

// Cells of the whole cache behind the op's keys (a view of one layer's
// cache): the chunk length depends on it and on the heads, never on the
// batch, so a row's result is the same in every batch.
int64_t cache_cells(const ggml_tensor * k) {
    int64_t cells = k->ne[1];
    if (k->view_src && k->nb[1] > 0) {
        cells = std::max<int64_t>(cells, (int64_t) (ggml_nbytes(k->view_src) / k->nb[1]));
    }
    return cells;
}

struct Shape {
    int64_t D, N, heads, kv_heads, cells;
    int64_t chunk;         // cells per chunk, a multiple of TILE
    int64_t chunks;        // chunks over `cells`
    size_t  per_chunk;     // bytes of one chunk's partial results, every row
    size_t  per_thread;    // bytes of one thread's tile scratch

    // Bytes of one chunk's partial results for `rows` rows.
    size_t partial_bytes(int64_t rows) const {
        return ((size_t) heads * rows * (D + 2) * sizeof(float) + 63) / 64 * 64;
    }

    // Many rows: the threads split the rows, each walking every chunk;
    // few: they split the chunks. The results are the same, bit for bit.
    bool by_rows(int n_threads) const { return N > MAX_ROWS || N >= 16 * (int64_t) n_threads; }

    int64_t rows_per_thread(int n_threads) const { return (N + n_threads - 1) / n_threads; }

    explicit Shape(const ggml_tensor * op) {
        const ggml_tensor * q = op->src[0];
        const ggml_tensor * k = op->src[1];
        D                     = q->ne[0];
        N                     = q->ne[1];
        heads                 = q->ne[2];
        kv_heads              = k->ne[2];
        cells                 = k->ne[1];
        const size_t largest  = (size_t) MAX_ROWS * heads * (D + 2) * sizeof(float);
        const int64_t all     = cache_cells(k);
        chunk                 = 2 * TILE;
        while ((size_t) ((all + chunk - 1) / chunk) * largest > PARTIALS_BUDGET) {
            chunk *= 2;
        }
        chunks     = (cells + chunk - 1) / chunk;
        per_chunk  = partial_bytes(N);
        per_thread = ((size_t) D * TILE * 2 + (size_t) N * TILE) * sizeof(float) + N + 64;
        per_thread = (per_thread + 63) / 64 * 64;
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
           max_bias == 0.0f && softcap == 0.0f && q->ne[1] >= 1 && q->ne[0] == v->ne[0] &&
           k->ne[0] == q->ne[0] && q->ne[0] % 16 == 0 && q->ne[0] <= MAX_DIM && q->ne[3] == 1 && k->ne[3] == 1 &&
           v->ne[3] == 1 && k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 && v->ne[2] == k->ne[2] &&
           v->ne[1] == k->ne[1] && q->nb[0] == sizeof(float) && k->nb[0] == sizeof(ggml_fp16_t) &&
           v->nb[0] == sizeof(ggml_fp16_t) && op->nb[0] == sizeof(float) && op->ne[0] == q->ne[0] &&
           op->ne[1] == q->ne[2] && op->ne[2] == q->ne[1];
#else
    (void) op;
    return false;
#endif
}

size_t attention_work_size(const ggml_tensor * op, int n_threads) {
    const Shape s(op);
    if (s.by_rows(n_threads)) {
        // per thread: one chunk's partial and the running maxima and sums
        const int64_t rows = s.rows_per_thread(n_threads);
        return (s.partial_bytes(rows) + s.partial_bytes(rows) + s.per_thread) * n_threads + 64;
    }
    return s.per_chunk * s.chunks + s.per_thread * n_threads + 64;
}

unsigned long long attention_calls() {
    return g_calls.load(std::memory_order_relaxed);
}

#ifdef SIPP_CPU_ATTENTION

namespace {

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

// One chunk's partial results for the rows [r0, r0 + R) and every head:
// query (h, r) at h * R + r - r0.
struct Partial {
    int64_t r0, R;
    float * acc;  // [heads * R][D]
    float * m;    // [heads * R] running maximum
    float * l;    // [heads * R] running sum

    Partial(char * at, const Shape & s, int64_t r0, int64_t R) : r0(r0), R(R) {
        const size_t queries = (size_t) s.heads * R;
        acc                  = (float *) at;
        m                    = acc + queries * s.D;
        l                    = m + queries;
    }

    int64_t at(int64_t h, int64_t r) const { return h * R + r - r0; }
};

// One thread's scratch for a tile.
struct Scratch {
    float *   kt;    // [D][TILE] keys of a tile, transposed
    float *   vf;    // [TILE][D] values of a tile
    float *   mask;  // [N][TILE]
    uint8_t * live;  // [N] whether a row has an unmasked cell in the tile

    Scratch(char * at, const Shape & s) {
        kt   = (float *) at;
        vf   = kt + s.D * TILE;
        mask = vf + s.D * TILE;
        live = (uint8_t *) (mask + s.N * TILE);
    }
};

// One tile for J queries of head h (rows `rows`), each exactly as alone:
// the queries only share the loads of the tile's keys and values.
template <int J>
inline void queries(const ggml_tensor * op, const Shape & s, const Partial & p, const Scratch & t, int64_t h,
                    const int64_t * rows, int n, float scale) {
    const ggml_tensor * q    = op->src[0];
    const __m512        ninf = _mm512_set1_ps(-INFINITY);
    const float *       qp[J];
    __m512              s0[J], s1[J];
    for (int j = 0; j < J; j++) {
        qp[j] = (const float *) ((const char *) q->data + rows[j] * q->nb[1] + h * q->nb[2]);
        s0[j] = _mm512_setzero_ps();
        s1[j] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < s.D; d++) {
        const __m512 k0 = _mm512_loadu_ps(t.kt + d * TILE), k1 = _mm512_loadu_ps(t.kt + d * TILE + 16);
        for (int j = 0; j < J; j++) {
            const __m512 qd = _mm512_set1_ps(qp[j][d]);
            s0[j]           = _mm512_fmadd_ps(qd, k0, s0[j]);
            s1[j]           = _mm512_fmadd_ps(qd, k1, s1[j]);
        }
    }
    alignas(64) float w[J][TILE];
    __m512            cv[J];
    float *           acc[J];
    bool              any = false;
    const __m512      sc  = _mm512_set1_ps(scale);
    for (int j = 0; j < J; j++) {
        const int64_t r = rows[j];
        s0[j]           = _mm512_fmadd_ps(s0[j], sc, _mm512_loadu_ps(t.mask + r * TILE));
        s1[j]           = _mm512_fmadd_ps(s1[j], sc, _mm512_loadu_ps(t.mask + r * TILE + 16));
        const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0[j], s1[j]));
        acc[j]               = nullptr;
        if (tile_max == -INFINITY) {
            continue;
        }
        const int64_t qi   = p.at(h, r);
        const float   mnew = std::max(p.m[qi], tile_max);
        const float   corr = p.m[qi] == -INFINITY ? 0.0f : expf(p.m[qi] - mnew);
        const __m512  mv   = _mm512_set1_ps(mnew);
        // exp(-inf) is 0: masked cells weigh nothing
        const __mmask16 m0 = _mm512_cmp_ps_mask(s0[j], ninf, _CMP_NEQ_OQ);
        const __mmask16 m1 = _mm512_cmp_ps_mask(s1[j], ninf, _CMP_NEQ_OQ);
        const __m512    e0 = _mm512_maskz_mov_ps(m0, ggml_v_expf(_mm512_sub_ps(_mm512_maskz_mov_ps(m0, s0[j]), mv)));
        const __m512    e1 = _mm512_maskz_mov_ps(m1, ggml_v_expf(_mm512_sub_ps(_mm512_maskz_mov_ps(m1, s1[j]), mv)));
        p.l[qi]            = p.l[qi] * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        p.m[qi]            = mnew;
        _mm512_store_ps(w[j], e0);
        _mm512_store_ps(w[j] + 16, e1);
        cv[j]  = _mm512_set1_ps(corr);
        acc[j] = p.acc + qi * s.D;
        any    = true;
    }
    if (!any) {
        return;
    }
    for (int j = 0; j < J; j++) {
        if (!acc[j]) {  // nothing seen in the tile: weights 0, nothing to add
            std::memset(w[j], 0, sizeof(w[j]));
            cv[j] = _mm512_set1_ps(1.0f);
        }
    }
    for (int64_t d = 0; d < s.D; d += 16) {
        __m512 a[J];
        for (int j = 0; j < J; j++) {
            a[j] = acc[j] ? _mm512_mul_ps(_mm512_loadu_ps(acc[j] + d), cv[j]) : _mm512_setzero_ps();
        }
        for (int c = 0; c < n; c++) {
            const __m512 vv = _mm512_loadu_ps(t.vf + c * s.D + d);
            for (int j = 0; j < J; j++) {
                a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j][c]), vv, a[j]);
            }
        }
        for (int j = 0; j < J; j++) {
            if (acc[j]) {
                _mm512_storeu_ps(acc[j] + d, a[j]);
            }
        }
    }
}

// The cells [c_begin, c_end) of one chunk for the partial's rows and every
// head, from scratch.
void walk(const ggml_tensor * op, const Shape & s, const Partial & p, const Scratch & t, int64_t c_begin, int64_t c_end,
          float scale) {
    const int64_t r0 = p.r0, r1 = p.r0 + p.R;
    const ggml_tensor * q     = op->src[0];
    const ggml_tensor * k     = op->src[1];
    const ggml_tensor * v     = op->src[2];
    const ggml_tensor * maskt = op->src[3];
    const int64_t       group = s.heads / s.kv_heads;
    const __m512        ninf  = _mm512_set1_ps(-INFINITY);

    for (int64_t qi = 0; qi < s.heads * p.R; qi++) {
        p.m[qi] = -INFINITY;
        p.l[qi] = 0.0f;
    }
    std::memset(p.acc, 0, sizeof(float) * s.heads * p.R * s.D);

    for (int64_t c0 = c_begin; c0 < c_end; c0 += TILE) {
        const int n = (int) std::min<int64_t>(TILE, c_end - c0);
        // the mask of every row over the tile; -inf past its end
        bool any = false;
        for (int64_t r = r0; r < r1; r++) {
            const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) maskt->data + r * maskt->nb[1]) + c0;
            float *             mr = t.mask + r * TILE;
            // past the cells (in the last tile) -inf, and nothing read
            const __mmask16 in0 = n >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n) - 1);
            const __mmask16 in1 = n >= 32 ? (__mmask16) 0xFFFF : n <= 16 ? (__mmask16) 0 : (__mmask16) ((1u << (n - 16)) - 1);
            const __m512    m0  = _mm512_mask_cvtph_ps(ninf, in0, _mm256_maskz_loadu_epi16(in0, mp));
            const __m512    m1  = _mm512_mask_cvtph_ps(ninf, in1, _mm256_maskz_loadu_epi16(in1, mp + 16));
            _mm512_storeu_ps(mr, m0);
            _mm512_storeu_ps(mr + 16, m1);
            const __mmask16 a = _mm512_cmp_ps_mask(m0, ninf, _CMP_NEQ_OQ);
            const __mmask16 b = _mm512_cmp_ps_mask(m1, ninf, _CMP_NEQ_OQ);
            t.live[r]         = (a | b) != 0;
            any |= t.live[r] != 0;
        }
        if (!any) {
            continue;
        }
        for (int64_t hk = 0; hk < s.kv_heads; hk++) {
            // keys transposed and values, as f32
            for (int cb = 0; cb < TILE; cb += 16) {
                for (int64_t d = 0; d < s.D; d += 16) {
                    __m512 rows[16];
                    for (int i = 0; i < 16; i++) {
                        const int c = cb + i;
                        __m512    kv = _mm512_setzero_ps(), vv = _mm512_setzero_ps();
                        if (c < n) {
                            const char * kp = (const char *) k->data + (c0 + c) * k->nb[1] + hk * k->nb[2];
                            const char * vp = (const char *) v->data + (c0 + c) * v->nb[1] + hk * v->nb[2];
                            kv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) kp + d)));
                            vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) vp + d)));
                        }
                        _mm512_storeu_ps(t.vf + c * s.D + d, vv);
                        rows[i] = kv;
                    }
                    transpose16(rows);
                    for (int j = 0; j < 16; j++) {
                        _mm512_storeu_ps(t.kt + (d + j) * TILE + cb, rows[j]);
                    }
                }
            }
            // the tile's live rows, up to 4 queries of a head at a time
            int64_t live[64];
            int64_t n_live = 0;
            for (int64_t r = r0; r < r1; r++) {
                if (t.live[r]) {
                    live[n_live++] = r;
                }
                if (n_live == 64 || (r == r1 - 1 && n_live > 0)) {
                    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                        int64_t i = 0;
                        for (; i + 4 <= n_live; i += 4) {
                            queries<4>(op, s, p, t, h, live + i, n, scale);
                        }
                        switch (n_live - i) {
                            case 3: queries<3>(op, s, p, t, h, live + i, n, scale); break;
                            case 2: queries<2>(op, s, p, t, h, live + i, n, scale); break;
                            case 1: queries<1>(op, s, p, t, h, live + i, n, scale); break;
                            default: break;
                        }
                    }
                    n_live = 0;
                }
            }
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
    const float  wa = expf(m - mn), wb = expf(mc - mn);
    const __m512 av = _mm512_set1_ps(wa), bv = _mm512_set1_ps(wb);
    l               = l * wa + part.l[qi] * wb;
    m               = mn;
    for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(out + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), bv,
                                                  _mm512_mul_ps(_mm512_loadu_ps(out + d), av)));
    }
}

// The query's output from its folded state: zeros where every cell was
// masked, as ggml writes.
inline void finish(float m, float l, float * out, int64_t D) {
    if (m == -INFINITY) {
        std::memset(out, 0, sizeof(float) * D);
        return;
    }
    const __m512 inv = _mm512_set1_ps(l == 0.0f ? 0.0f : 1.0f / l);
    for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
    }
}

}  // namespace

void attention_compute(ggml_compute_params * params, ggml_tensor * op) {
    const Shape s(op);
    float       scale;
    std::memcpy(&scale, (const float *) op->op_params + 0, sizeof(float));
    char * base = (char *) (((uintptr_t) params->wdata + 63) & ~(uintptr_t) 63);
    GGML_ASSERT(params->wsize >= attention_work_size(op, params->nth));
    const int ith = params->ith, nth = params->nth;
    auto      output = [&](int64_t h, int64_t r) {
        return (float *) ((char *) op->data + (h + r * op->ne[1]) * op->nb[1]);
    };

    if (s.by_rows(nth)) {
        // Every thread takes a share of the rows through all the chunks.
        const int64_t per = s.rows_per_thread(nth);
        const int64_t r0 = std::min(s.N, per * ith), r1 = std::min(s.N, r0 + per);
        char *        own = base + (s.partial_bytes(per) * 2 + s.per_thread) * ith;
        const Partial part(own, s, r0, r1 - r0);
        const Partial state(own + s.partial_bytes(per), s, r0, r1 - r0);  // its m and l: the running state
        const Scratch t(own + s.partial_bytes(per) * 2, s);
        if (r0 < r1) {
            for (int64_t qi = 0; qi < s.heads * (r1 - r0); qi++) {
                state.m[qi] = -INFINITY;
                state.l[qi] = 0.0f;
            }
            for (int64_t c = 0; c < s.chunks; c++) {
                const int64_t c0 = c * s.chunk;
                walk(op, s, part, t, c0, std::min(s.cells, c0 + s.chunk), scale);
                for (int64_t h = 0; h < s.heads; h++) {
                    for (int64_t r = r0; r < r1; r++) {
                        const int64_t qi = part.at(h, r);
                        fold(state.m[qi], state.l[qi], output(h, r), part, qi, s.D);
                    }
                }
            }
            for (int64_t h = 0; h < s.heads; h++) {
                for (int64_t r = r0; r < r1; r++) {
                    const int64_t qi = part.at(h, r);
                    finish(state.m[qi], state.l[qi], output(h, r), s.D);
                }
            }
        }
    } else {
        // 1. the threads take the chunks in turn, each chunk from scratch
        const Scratch t(base + s.per_chunk * s.chunks + ith * s.per_thread, s);
        for (int64_t c = ith; c < s.chunks; c += nth) {
            const int64_t c0 = c * s.chunk;
            walk(op, s, Partial(base + c * s.per_chunk, s, 0, s.N), t, c0, std::min(s.cells, c0 + s.chunk), scale);
        }
        ggml_barrier(params->threadpool);

        // 2. every thread folds a share of the queries over the chunks, in order
        for (int64_t qi = ith; qi < s.heads * s.N; qi += nth) {
            const int64_t h = qi / s.N, r = qi % s.N;
            float *       out = output(h, r);
            float         m = -INFINITY, l = 0.0f;
            for (int64_t c = 0; c < s.chunks; c++) {
                fold(m, l, out, Partial(base + c * s.per_chunk, s, 0, s.N), qi, s.D);
            }
            finish(m, l, out, s.D);
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
