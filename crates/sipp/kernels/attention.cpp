// sipp's CPU attention for small batches.
//
// Below 64 query rows ggml's CPU flash attention walks the KV cache one
// cell at a time for every row and head: an f16 dot product, a scalar expf
// and an f16 multiply-add per cell. A decode step of a few rows (several
// slots, a speculative draft) then pays that walk once per row. This kernel
// splits the cells between the threads instead, and within a thread takes
// 32 cells at a time: their keys converted to f32 and transposed once for
// every query of the tile, their scores 32 to a register, the softmax with
// a vectorized exp, tiles whose mask is -inf for every row skipped. The
// threads' partial results (running maximum, sum and weighted values) are
// merged at the end, as flash-decoding does.
//
// The arithmetic is attention's: softmax(scale * q.k + mask) v, with the
// online-softmax rescaling; ggml's path rounds queries to f16 first, this
// one keeps them in f32. A row's result does not depend on the other rows.

#include "attention.h"

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__F16C__)
#    define SIPP_CPU_ATTENTION 1
#    include <immintrin.h>
#endif

namespace sipp {
namespace {

constexpr int     TILE     = 32;   // cells per tile
constexpr int64_t MAX_ROWS = 63;   // ggml's tiled path takes 64 rows and more
// One row stays ggml's too: it walks each cell once anyway, and the tile's
// key transposition would cost more than it saves.
constexpr int64_t MAX_DIM  = 256;

std::atomic<unsigned long long> g_calls{ 0 };

struct Shape {
    int64_t D, N, heads, kv_heads, cells;
    size_t  per_thread;  // bytes of one thread's partial results and tiles

    explicit Shape(const ggml_tensor * op) {
        const ggml_tensor * q = op->src[0];
        const ggml_tensor * k = op->src[1];
        D                     = q->ne[0];
        N                     = q->ne[1];
        heads                 = q->ne[2];
        kv_heads              = k->ne[2];
        cells                 = k->ne[1];
        const size_t queries  = (size_t) heads * N;
        per_thread = (queries * (D + 2) + (size_t) D * TILE * 2 + (size_t) N * TILE) * sizeof(float) + N + 64;
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
           max_bias == 0.0f && softcap == 0.0f && q->ne[1] >= 2 && q->ne[1] <= MAX_ROWS && q->ne[0] == v->ne[0] &&
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
    return Shape(op).per_thread * n_threads + 64;
}

unsigned long long attention_calls() {
    return g_calls.load(std::memory_order_relaxed);
}

#ifdef SIPP_CPU_ATTENTION

namespace {

inline float f16(ggml_fp16_t h) {
    return _cvtsh_ss(h);
}

// One thread's share: the cells [c_begin, c_end) for every query.
struct Partial {
    float * acc;    // [heads * N][D]
    float * m;      // [heads * N] running maximum
    float * l;      // [heads * N] running sum
    float * kt;     // [D][TILE] keys of a tile, transposed
    float * vf;     // [TILE][D] values of a tile
    float * mask;   // [N][TILE]
    uint8_t * live; // [N] whether a row has an unmasked cell in the tile

    Partial(char * at, const Shape & s) {
        const size_t queries = (size_t) s.heads * s.N;
        acc                  = (float *) at;
        m                    = acc + queries * s.D;
        l                    = m + queries;
        kt                   = l + queries;
        vf                   = kt + s.D * TILE;
        mask                 = vf + s.D * TILE;
        live                 = (uint8_t *) (mask + s.N * TILE);
    }
};

void walk(const ggml_tensor * op, const Shape & s, const Partial & p, int64_t c_begin, int64_t c_end, float scale) {
    const ggml_tensor * q     = op->src[0];
    const ggml_tensor * k     = op->src[1];
    const ggml_tensor * v     = op->src[2];
    const ggml_tensor * maskt = op->src[3];
    const int64_t       group = s.heads / s.kv_heads;
    const __m512        ninf  = _mm512_set1_ps(-INFINITY);

    for (int64_t qi = 0; qi < s.heads * s.N; qi++) {
        p.m[qi] = -INFINITY;
        p.l[qi] = 0.0f;
    }
    std::memset(p.acc, 0, sizeof(float) * s.heads * s.N * s.D);

    for (int64_t c0 = c_begin; c0 < c_end; c0 += TILE) {
        const int n = (int) std::min<int64_t>(TILE, c_end - c0);
        // the mask of every row over the tile; -inf past its end
        bool any = false;
        for (int64_t r = 0; r < s.N; r++) {
            const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) maskt->data + r * maskt->nb[1]) + c0;
            float *             mr = p.mask + r * TILE;
            for (int c = 0; c < TILE; c++) {
                mr[c] = c < n ? f16(mp[c]) : -INFINITY;
            }
            const __mmask16 a = _mm512_cmp_ps_mask(_mm512_loadu_ps(mr), ninf, _CMP_NEQ_OQ);
            const __mmask16 b = _mm512_cmp_ps_mask(_mm512_loadu_ps(mr + 16), ninf, _CMP_NEQ_OQ);
            p.live[r]         = (a | b) != 0;
            any |= p.live[r] != 0;
        }
        if (!any) {
            continue;
        }
        for (int64_t hk = 0; hk < s.kv_heads; hk++) {
            // keys transposed and values, as f32
            for (int c = 0; c < TILE; c++) {
                const ggml_fp16_t * kp = (const ggml_fp16_t *) ((const char *) k->data + (c0 + c) * k->nb[1] + hk * k->nb[2]);
                const ggml_fp16_t * vp = (const ggml_fp16_t *) ((const char *) v->data + (c0 + c) * v->nb[1] + hk * v->nb[2]);
                for (int64_t d = 0; d < s.D; d += 16) {
                    __m512 kv = _mm512_setzero_ps(), vv = _mm512_setzero_ps();
                    if (c < n) {
                        kv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (kp + d)));
                        vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (vp + d)));
                    }
                    _mm512_storeu_ps(p.vf + c * s.D + d, vv);
                    alignas(64) float tmp[16];
                    _mm512_store_ps(tmp, kv);
                    for (int j = 0; j < 16; j++) {
                        p.kt[(d + j) * TILE + c] = tmp[j];
                    }
                }
            }
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                for (int64_t r = 0; r < s.N; r++) {
                    if (!p.live[r]) {
                        continue;
                    }
                    const float * qp = (const float *) ((const char *) q->data + r * q->nb[1] + h * q->nb[2]);
                    __m512        s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
                    for (int64_t d = 0; d < s.D; d++) {
                        const __m512 qd = _mm512_set1_ps(qp[d]);
                        s0              = _mm512_fmadd_ps(qd, _mm512_loadu_ps(p.kt + d * TILE), s0);
                        s1              = _mm512_fmadd_ps(qd, _mm512_loadu_ps(p.kt + d * TILE + 16), s1);
                    }
                    const __m512 sc = _mm512_set1_ps(scale);
                    s0 = _mm512_fmadd_ps(s0, sc, _mm512_loadu_ps(p.mask + r * TILE));
                    s1 = _mm512_fmadd_ps(s1, sc, _mm512_loadu_ps(p.mask + r * TILE + 16));
                    const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
                    if (tile_max == -INFINITY) {
                        continue;
                    }
                    const int64_t qi   = h * s.N + r;
                    const float   mnew = std::max(p.m[qi], tile_max);
                    const float   corr = p.m[qi] == -INFINITY ? 0.0f : expf(p.m[qi] - mnew);
                    const __m512  mv   = _mm512_set1_ps(mnew);
                    // exp(-inf) is 0: masked cells weigh nothing
                    const __mmask16 k0 = _mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_OQ);
                    const __mmask16 k1 = _mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_OQ);
                    const __m512    e0 = _mm512_maskz_mov_ps(k0, ggml_v_expf(_mm512_sub_ps(_mm512_maskz_mov_ps(k0, s0), mv)));
                    const __m512    e1 = _mm512_maskz_mov_ps(k1, ggml_v_expf(_mm512_sub_ps(_mm512_maskz_mov_ps(k1, s1), mv)));
                    p.l[qi]            = p.l[qi] * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
                    p.m[qi]            = mnew;
                    alignas(64) float w[TILE];
                    _mm512_store_ps(w, e0);
                    _mm512_store_ps(w + 16, e1);
                    float *      acc = p.acc + qi * s.D;
                    const __m512 cv  = _mm512_set1_ps(corr);
                    for (int64_t d = 0; d < s.D; d += 16) {
                        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), cv);
                        for (int c = 0; c < n; c++) {
                            a = _mm512_fmadd_ps(_mm512_set1_ps(w[c]), _mm512_loadu_ps(p.vf + c * s.D + d), a);
                        }
                        _mm512_storeu_ps(acc + d, a);
                    }
                }
            }
        }
    }
}

}  // namespace

void attention_compute(ggml_compute_params * params, ggml_tensor * op) {
    const Shape s(op);
    float       scale;
    std::memcpy(&scale, (const float *) op->op_params + 0, sizeof(float));
    char *  base = (char *) (((uintptr_t) params->wdata + 63) & ~(uintptr_t) 63);
    GGML_ASSERT(params->wsize >= attention_work_size(op, params->nth));
    const int ith = params->ith, nth = params->nth;

    // 1. every thread walks its share of the cells, in whole tiles
    const int64_t tiles = (s.cells + TILE - 1) / TILE;
    const int64_t c0    = tiles * ith / nth * TILE;
    const int64_t c1    = std::min(s.cells, tiles * (ith + 1) / nth * TILE);
    walk(op, s, Partial(base + ith * s.per_thread, s), c0, c1, scale);
    ggml_barrier(params->threadpool);

    // 2. every thread merges a share of the queries over the threads' parts
    const int64_t queries = s.heads * s.N;
    for (int64_t qi = ith; qi < queries; qi += nth) {
        float m = -INFINITY;
        for (int t = 0; t < nth; t++) {
            m = std::max(m, Partial(base + t * s.per_thread, s).m[qi]);
        }
        const int64_t h = qi / s.N, r = qi % s.N;
        float *       out = (float *) ((char *) op->data + (h + r * op->ne[1]) * op->nb[1]);
        std::memset(out, 0, sizeof(float) * s.D);
        if (m == -INFINITY) {
            continue;  // every cell masked: zeros, as ggml writes
        }
        float l = 0.0f;
        for (int t = 0; t < nth; t++) {
            const Partial part(base + t * s.per_thread, s);
            if (part.m[qi] == -INFINITY) {
                continue;
            }
            const float  w  = expf(part.m[qi] - m);
            const __m512 wv = _mm512_set1_ps(w);
            l += part.l[qi] * w;
            for (int64_t d = 0; d < s.D; d += 16) {
                _mm512_storeu_ps(out + d, _mm512_fmadd_ps(_mm512_loadu_ps(part.acc + qi * s.D + d), wv,
                                                          _mm512_loadu_ps(out + d)));
            }
        }
        const __m512 inv = _mm512_set1_ps(l == 0.0f ? 0.0f : 1.0f / l);
        for (int64_t d = 0; d < s.D; d += 16) {
            _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), inv));
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
