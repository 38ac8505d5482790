// sipp's CPU matrix products for Q4_1 and Q8_0 weights.
//
// ggml's CPU backend multiplies a Q4_1 matrix one (weight row, activation
// row) pair at a time: each pair is one vec_dot call that expands the
// weights again, so a step that computes many rows at once (a prompt chunk,
// several slots, a speculative draft) costs almost a one-row step per row.
// Q8_0 has llamafile's tiled product for many rows but the same pairwise
// path for one.
//
// This file adds a CPU "extra buffer type", the hook ggml's own repacked
// kernels use. A 2-D Q4_1 or Q8_0 matrix placed in it is repacked at load,
// 16 rows interleaved: for each block of 32 columns, the 16 rows' fp16
// scales (and Q4_1 minimums), then their quant bytes transposed so that one
// AVX-512 register holds 4 bytes of each row. A VNNI dot instruction then
// multiplies 16 rows by 4 activation bytes at once, every lane a different
// row, so block scales apply lane-wise and no horizontal sums are needed.
// On CPUs with AVX2 but not AVX-512 VNNI the same layout serves as two AVX2
// registers of 8 rows each, multiplied by vpmaddubsw and vpmaddwd.
// Every product over such a matrix, one activation row or many, runs here,
// and so does GET_ROWS over a Q8_0 matrix (tied token embeddings are read by
// GET_ROWS and multiplied as the output layer).
//
// Arithmetic follows ggml's dot products: activations are quantized per
// block of 32 to int8 exactly as ggml's quantize_row_q8_1 / q8_0 do (fp16
// scale d, and for Q4_1 an fp16 sum s = d * sum(q)); a block contributes
// d_w * d_a * sum(q_w * q_a), plus m_w * s_a for Q4_1. Only the order of the
// float additions differs, and a row's result does not depend on how many
// rows share the product.

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"
#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "traits.h"

#include "attention.h"
#include "prefetch.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#if defined(__linux__)
#    include <sys/mman.h>
#    include <unistd.h>
#endif

// Two builds of the same products: AVX-512 VNNI (16 rows in one register,
// one dot instruction per 4 columns), and AVX2 with FMA (the 16 rows as two
// halves of 8, u8 x s8 products summed in pairs by vpmaddubsw).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#    define SIPP_CPU_GEMM        1
#    define SIPP_CPU_GEMM_AVX512 1
#    include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#    define SIPP_CPU_GEMM      1
#    define SIPP_CPU_GEMM_AVX2 1
#    include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 16;  // weight rows interleaved per group, one per lane

// 16 interleaved rows of one block of 32 Q4_1 columns: as many bytes as the
// 16 blocks it holds. x[k] holds, for each row r, bytes 4k..4k+3 of the
// row's quants at 4r..4r+3: low nibbles are columns 4k..4k+3, high nibbles
// columns 16+4k...
struct packed_q4_1 {
    ggml_half d[ROWS];
    ggml_half m[ROWS];
    uint8_t   x[4][4 * ROWS];
};

// The same for Q8_0: x[k] holds bytes 4k..4k+3 (columns 4k..4k+3) of each
// row, each byte offset by 128 so the dot instruction can take it unsigned.
struct packed_q8_0 {
    ggml_half d[ROWS];
    uint8_t   x[8][4 * ROWS];
};

static_assert(sizeof(packed_q4_1) == ROWS * sizeof(block_q4_1), "a packed block holds 16 Q4_1 blocks");
static_assert(sizeof(packed_q8_0) == ROWS * sizeof(block_q8_0), "a packed block holds 16 Q8_0 blocks");

void pack(const block_q4_1 & q, packed_q4_1 & p, int r) {
    p.d[r] = q.data.data.d;
    p.m[r] = q.data.data.m;
    for (int k = 0; k < 4; k++) {
        std::memcpy(&p.x[k][4 * r], &q.qs[4 * k], 4);
    }
}

void unpack(const packed_q4_1 & p, block_q4_1 & q, int r) {
    q.data.data.d = p.d[r];
    q.data.data.m = p.m[r];
    for (int k = 0; k < 4; k++) {
        std::memcpy(&q.qs[4 * k], &p.x[k][4 * r], 4);
    }
}

void pack(const block_q8_0 & q, packed_q8_0 & p, int r) {
    p.d[r] = q.d;
    for (int k = 0; k < 8; k++) {
        for (int i = 0; i < 4; i++) {
            p.x[k][4 * r + i] = (uint8_t) (q.qs[4 * k + i] ^ 0x80);
        }
    }
}

void unpack(const packed_q8_0 & p, block_q8_0 & q, int r) {
    q.d = p.d[r];
    for (int k = 0; k < 8; k++) {
        for (int i = 0; i < 4; i++) {
            q.qs[4 * k + i] = (int8_t) (p.x[k][4 * r + i] ^ 0x80);
        }
    }
}

template <class Block, class Packed> void pack_matrix(const Block * src, Packed * dst, int64_t rows, int64_t nb) {
    for (int64_t g = 0; g < rows / ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < ROWS; r++) {
                pack(src[(g * ROWS + r) * nb + b], dst[g * nb + b], r);
            }
        }
    }
}

template <class Block, class Packed> void unpack_matrix(const Packed * src, Block * dst, int64_t rows, int64_t nb) {
    for (int64_t g = 0; g < rows / ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < ROWS; r++) {
                unpack(src[g * nb + b], dst[(g * ROWS + r) * nb + b], r);
            }
        }
    }
}

std::atomic<unsigned long long> g_calls{ 0 };

ggml_backend_buffer_type_t buffer_type();

// The matrices this buffer takes: 2-D Q4_1 or Q8_0 in whole groups of 16 rows.
bool packable(const ggml_tensor * w) {
    return (w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q8_0) && ggml_n_dims(w) == 2 &&
           w->ne[1] % ROWS == 0 && ggml_is_contiguous(w);
}

// Products over such a matrix: F32 activations (any number of rows, in up
// to 3 dimensions) into an F32 result; and row lookups from a Q8_0 one.
bool computable(const ggml_tensor * op) {
    const ggml_tensor * w = op->src[0];
    const ggml_tensor * x = op->src[1];
    if (!packable(w) || op->type != GGML_TYPE_F32) {
        return false;
    }
    if (op->op == GGML_OP_GET_ROWS) {
        return w->type == GGML_TYPE_Q8_0 && x->type == GGML_TYPE_I32 && x->ne[3] == 1 && op->ne[0] == w->ne[0];
    }
    return op->op == GGML_OP_MUL_MAT && x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] &&
           x->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) && op->ne[0] == w->ne[1] &&
           op->ne[1] == x->ne[1] && op->ne[2] == x->ne[2] && op->ne[3] == x->ne[3];
}

// The work buffer of one product: the quantized activations, their block
// scales, and their block sums (ggml's fp16 s = d * sum for Q4_1, the exact
// integer sum for Q8_0).
struct Layout {
    int64_t K, M, N, nb;
    size_t  qa, da, sa, ia, total;

    Layout(int64_t k, int64_t m, int64_t n) : K(k), M(m), N(n), nb(k / 32) {
        size_t at  = 0;
        auto   put = [&](size_t bytes) {
            size_t here = at;
            at += (bytes + 63) / 64 * 64;
            return here;
        };
        qa    = put(N * K);
        da    = put(N * nb * sizeof(float));
        sa    = put(N * nb * sizeof(float));
        ia    = put(N * nb * sizeof(int32_t));
        total = at + 64;  // room to align the start
    }

    explicit Layout(const ggml_tensor * op) :
        Layout(op->src[0]->ne[0], op->src[0]->ne[1], op->src[1]->ne[1] * op->src[1]->ne[2] * op->src[1]->ne[3]) {}
};

char * aligned(void * p) {
    return (char *) (((uintptr_t) p + 63) & ~(uintptr_t) 63);
}

#ifdef SIPP_CPU_GEMM

inline float half(ggml_half h) {
    return _cvtsh_ss(h);
}

inline ggml_half to_half(float f) {
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

#ifdef SIPP_CPU_GEMM_AVX512

// Quantizes one activation row exactly as ggml's quantize_row_q8_1 (and
// q8_0, the same numbers without the sum) does.
void quantize_row(const float * x, int64_t nb, int8_t * q, float * d_out, float * s_out, int32_t * i_out) {
    for (int64_t b = 0; b < nb; b++) {
        const __m512  x0   = _mm512_loadu_ps(x + b * 32);
        const __m512  x1   = _mm512_loadu_ps(x + b * 32 + 16);
        const float   amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float   d    = amax / 127.0f;
        const __m512  id   = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0   = _mm512_cvtps_epi32(
            _mm512_roundscale_ps(_mm512_mul_ps(x0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512i q1 = _mm512_cvtps_epi32(
            _mm512_roundscale_ps(_mm512_mul_ps(x1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i *) (q + b * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *) (q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d_out[b]      = half(to_half(d));
        s_out[b]      = half(to_half(d * (float) sum));
        i_out[b]      = sum;
    }
}

inline __m512i bcast4(const int8_t * q) {
    int32_t v;
    std::memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
}

#else  // AVX2

inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m        = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m        = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline int sum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s         = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s         = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// Quantizes one activation row exactly as ggml's quantize_row_q8_1 (and
// q8_0, the same numbers without the sum) does.
void quantize_row(const float * x, int64_t nb, int8_t * q, float * d_out, float * s_out, int32_t * i_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
            m    = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        const float  amax = max8(m);
        const float  d    = amax / 127.0f;
        const __m256 id   = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i      i[4];
        for (int j = 0; j < 4; j++) {
            i[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const int sum = sum8(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
        // |q| <= 127: the saturating packs are exact; they interleave lanes,
        // which the permutation puts back in order
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *) (q + b * 32), packed);
        d_out[b] = half(to_half(d));
        s_out[b] = half(to_half(d * (float) sum));
        i_out[b] = sum;
    }
}

inline __m256i bcast4(const int8_t * q) {
    int32_t v;
    std::memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

#endif

// One activation row's block, quantized.
struct Act {
    const int8_t *  q;
    const float *   d;
    const float *   s;
    const int32_t * i;
};

#ifdef SIPP_CPU_GEMM_AVX512

// 16 weight rows (one group) against C activation rows: one block.
template <int C>
inline void block(const packed_q4_1 & p, int64_t b, const Act * a, __m512 * acc) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i       lo[4], hi[4];
    for (int k = 0; k < 4; k++) {
        const __m512i x = _mm512_loadu_si512(p.x[k]);
        lo[k]           = _mm512_and_si512(x, low);
        hi[k]           = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p.d));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p.m));
    for (int c = 0; c < C; c++) {
        const int8_t * q  = a[c].q + b * 32;
        __m512i        s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast4(q));
        __m512i        s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], bcast4(q + 16));
        s0                = _mm512_dpbusd_epi32(s0, lo[1], bcast4(q + 4));
        s1                = _mm512_dpbusd_epi32(s1, hi[1], bcast4(q + 20));
        s0                = _mm512_dpbusd_epi32(s0, lo[2], bcast4(q + 8));
        s1                = _mm512_dpbusd_epi32(s1, hi[2], bcast4(q + 24));
        s0                = _mm512_dpbusd_epi32(s0, lo[3], bcast4(q + 12));
        s1                = _mm512_dpbusd_epi32(s1, hi[3], bcast4(q + 28));
        const __m512 dot  = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[c]            = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a[c].d[b])), acc[c]);
        acc[c]            = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[c].s[b]), acc[c]);
    }
}

template <int C>
inline void block(const packed_q8_0 & p, int64_t b, const Act * a, __m512 * acc) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p.d));
    for (int c = 0; c < C; c++) {
        const int8_t * q = a[c].q + b * 32;
        // the weights are offset by 128: take 128 * sum(q_a) back off
        __m512i        s0 = _mm512_set1_epi32(-128 * a[c].i[b]);
        __m512i        s1 = _mm512_setzero_si512();
        for (int k = 0; k < 8; k += 2) {
            s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(p.x[k]), bcast4(q + 4 * k));
            s1 = _mm512_dpbusd_epi32(s1, _mm512_loadu_si512(p.x[k + 1]), bcast4(q + 4 * k + 4));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[c]           = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a[c].d[b])), acc[c]);
    }
}

#else  // AVX2

// A group (weight rows 0..7 and 8..15, one per lane of two registers)
// against C activation rows: one block, both halves in one pass so that
// each activation broadcast serves 16 rows. Q4_1 quants are 0..15 and
// activations -127..127, so the 16 products a lane sums per block stay
// within int16. The k loop stays rolled: unrolled, the compiler keeps every
// k's weights live at once and spills the sums.
template <int C>
inline void block(const packed_q4_1 & p, int64_t b, const Act * a, __m256 (*acc)[C]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i       s[2][C];
    for (int c = 0; c < C; c++) {
        s[0][c] = s[1][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 1
    for (int k = 0; k < 4; k++) {
        const __m256i x0  = _mm256_loadu_si256((const __m256i *) p.x[k]);
        const __m256i x1  = _mm256_loadu_si256((const __m256i *) (p.x[k] + 32));
        const __m256i lo0 = _mm256_and_si256(x0, low);
        const __m256i lo1 = _mm256_and_si256(x1, low);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), low);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), low);
        for (int c = 0; c < C; c++) {
            const int8_t * q  = a[c].q + b * 32;
            const __m256i  al = bcast4(q + 4 * k), ah = bcast4(q + 16 + 4 * k);
            s[0][c] = _mm256_add_epi16(
                s[0][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, al), _mm256_maddubs_epi16(hi0, ah)));
            s[1][c] = _mm256_add_epi16(
                s[1][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, al), _mm256_maddubs_epi16(hi1, ah)));
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p.d + 8 * h)));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p.m + 8 * h)));
        for (int c = 0; c < C; c++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[h][c], ones));
            acc[h][c]        = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(a[c].d[b])), acc[h][c]);
            acc[h][c]        = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[c].s[b]), acc[h][c]);
        }
    }
}

// Q8_0 quants are signed: vpmaddubsw takes |w| and the activation with w's
// sign (at most 2 * 128 * 127 a pair, within int16). Half `h` of the group
// only: its sums need 32 bits, and both halves' would not leave room.
template <int C>
inline void block(const packed_q8_0 & p, int h, int64_t b, const Act * a, __m256 * acc) {
    const __m256i offset = _mm256_set1_epi8((char) 0x80);
    const __m256i ones   = _mm256_set1_epi16(1);
    __m256i       s[C];
    for (int c = 0; c < C; c++) {
        s[c] = _mm256_setzero_si256();
    }
    for (int k = 0; k < 8; k++) {
        const __m256i w  = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (p.x[k] + 32 * h)), offset);
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int c = 0; c < C; c++) {
            const __m256i qa = _mm256_sign_epi8(bcast4(a[c].q + b * 32 + 4 * k), w);
            s[c]             = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, qa), ones));
        }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p.d + 8 * h)));
    for (int c = 0; c < C; c++) {
        const __m256 dot = _mm256_cvtepi32_ps(s[c]);
        acc[c]           = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(a[c].d[b])), acc[c]);
    }
}

#endif

// How far ahead of the block in use a thread asks for its weights. Without
// it a step of several rows costs about its memory time plus its compute
// time: the hardware prefetcher does not run far enough ahead while the
// rows' products keep the core busy, and each matrix is a fresh stream.
constexpr size_t AHEAD = 8192;

// Asks for the block AHEAD bytes past `at` where the matrix (ending at
// `w_end`) reaches that far.
template <class Packed> inline void ask_ahead(const Packed * at, const char * w_end) {
    const char * next = (const char *) at + AHEAD;
    sipp::prefetch_l2(next, std::min(next + sizeof(Packed), w_end));
}

#ifdef SIPP_CPU_GEMM_AVX512

// `w_end` (the end of the matrix) when this pass is the group's first,
// which then also asks for the weights AHEAD bytes on; null for later
// passes over the same group.
template <int C, class Packed>
void group(const Packed * w, int64_t nb, const Act * a, float * const out[C], const char * w_end) {
    __m512 acc[C];
    for (int c = 0; c < C; c++) {
        acc[c] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        if (w_end != nullptr) {
            ask_ahead(w + b, w_end);
        }
        block<C>(w[b], b, a, acc);
    }
    for (int c = 0; c < C; c++) {
        _mm512_storeu_ps(out[c], acc[c]);
    }
}

#else  // AVX2

// `w_end` (the end of the matrix) when this pass is the group's first,
// which then also asks for the weights AHEAD bytes on; null for later
// passes over the same group. Q4_1 takes both halves of the group
// in one pass; Q8_0 one half a pass (the second from cache).
template <int C>
void group(const packed_q4_1 * w, int64_t nb, const Act * a, float * const out[C], const char * w_end) {
    __m256 acc[2][C];
    for (int c = 0; c < C; c++) {
        acc[0][c] = acc[1][c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        if (w_end != nullptr) {
            ask_ahead(w + b, w_end);
        }
        block<C>(w[b], b, a, acc);
    }
    for (int c = 0; c < C; c++) {
        _mm256_storeu_ps(out[c], acc[0][c]);
        _mm256_storeu_ps(out[c] + 8, acc[1][c]);
    }
}

template <int C>
void group(const packed_q8_0 * w, int64_t nb, const Act * a, float * const out[C], const char * w_end) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[C];
        for (int c = 0; c < C; c++) {
            acc[c] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            if (h == 0 && w_end != nullptr) {
                ask_ahead(w + b, w_end);
            }
            block<C>(w[b], h, b, a, acc);
        }
        for (int c = 0; c < C; c++) {
            _mm256_storeu_ps(out[c] + 8 * h, acc[c]);
        }
    }
}

#endif

// Where one product reads and writes: activation row c (of all planes) is
// at row(c), its result at out(c).
struct Operands {
    const void * w;
    const char * x;
    char *       dst;
    int64_t      ne11, ne12;           // activation rows per plane, planes per volume
    size_t       x_nb1, x_nb2, x_nb3;  // activation strides
    size_t       d_nb1, d_nb2, d_nb3;  // result strides

    const float * row(int64_t c) const {
        const int64_t i1 = c % ne11, i2 = (c / ne11) % ne12, i3 = c / (ne11 * ne12);
        return (const float *) (x + i1 * x_nb1 + i2 * x_nb2 + i3 * x_nb3);
    }

    float * out(int64_t c) const {
        const int64_t i1 = c % ne11, i2 = (c / ne11) % ne12, i3 = c / (ne11 * ne12);
        return (float *) (dst + i1 * d_nb1 + i2 * d_nb2 + i3 * d_nb3);
    }
};

Act act(const Layout & l, const char * base, int64_t c) {
    return Act{ (const int8_t *) (base + l.qa) + c * l.K, (const float *) (base + l.da) + c * l.nb,
                (const float *) (base + l.sa) + c * l.nb, (const int32_t *) (base + l.ia) + c * l.nb };
}

// Thread `ith` of `nth` quantizes its share of the activation rows.
void quantize_share(const Operands & o, const Layout & l, char * base, int ith, int nth) {
    for (int64_t c = ith; c < l.N; c += nth) {
        quantize_row(o.row(c), l.nb, (int8_t *) (base + l.qa) + c * l.K, (float *) (base + l.da) + c * l.nb,
                     (float *) (base + l.sa) + c * l.nb, (int32_t *) (base + l.ia) + c * l.nb);
    }
}

template <int C, class Packed>
void columns(const Operands & o, const Layout & l, const char * base, int64_t g, int64_t c0, const char * w_end) {
    Act     a[C];
    float * out[C];
    for (int c = 0; c < C; c++) {
        a[c]   = act(l, base, c0 + c);
        out[c] = o.out(c0 + c) + g * ROWS;
    }
    group<C>((const Packed *) o.w + g * l.nb, l.nb, a, out, c0 == 0 ? w_end : nullptr);
}

// Activation rows a pass over a group's blocks takes: four, but two for
// AVX2's Q4_1 (whose pass takes both halves of the group: 8 sums and
// accumulators, and the weights).
template <class Packed> constexpr int COLS = 4;
#ifndef SIPP_CPU_GEMM_AVX512
template <> constexpr int COLS<packed_q4_1> = 2;
#endif

// A product of several activation rows is cut into this many runs of row
// groups per thread, which the threads take in turn as they finish the
// last: on a shared machine one thread of a step often runs slower than the
// other (another tenant busy beside it), and with a fixed half each the
// other would wait at the barrier after every product. A product of one to
// three rows (a step of one sequence) streams its weights more than it
// computes: it keeps one run per thread, each a contiguous half, whose
// weights are asked for ahead without a break.
constexpr int64_t RUNS_PER_THREAD = 8;
constexpr int64_t RUNS_FROM_ROWS  = 4;

int64_t runs(int64_t groups, int64_t rows, int nth) {
    return std::min<int64_t>(groups, rows >= RUNS_FROM_ROWS ? RUNS_PER_THREAD * nth : nth);
}

// Row groups [first, end) against every activation row, once every
// activation row is quantized. `w_end` is the end of the whole matrix: the
// weights are asked for ahead up to it, since the next run (this thread's
// or the other's) usually follows this one.
template <class Packed>
void product_run(const Operands & o, const Layout & l, const char * base, int64_t first, int64_t end,
                 const char * w_end) {
    const Packed * w   = (const Packed *) o.w;
    const char *   run = (const char *) (w + first * l.nb);
    sipp::prefetch_l2(run, std::min(run + AHEAD, w_end));
    for (int64_t g = first; g < end; g++) {
        int64_t c0 = 0;
        for (; c0 + COLS<Packed> <= l.N; c0 += COLS<Packed>) {
            columns<COLS<Packed>, Packed>(o, l, base, g, c0, w_end);
        }
        switch (l.N - c0) {
            case 3:
                columns<3, Packed>(o, l, base, g, c0, w_end);
                break;
            case 2:
                columns<2, Packed>(o, l, base, g, c0, w_end);
                break;
            case 1:
                columns<1, Packed>(o, l, base, g, c0, w_end);
                break;
            default:
                break;
        }
    }
}

// Thread `ith` of `nth` takes run `ith`, then the next run nobody has taken
// (the threadpool's counter starts at `nth`, set before the barrier that
// ends the quantization; without a threadpool, one thread takes them all).
// Which thread computes a group changes nothing in its results.
template <class Packed>
void product_runs(const Operands & o, const Layout & l, const char * base, ggml_threadpool * tp, int ith,
                  int nth) {
    const int64_t groups = l.M / ROWS;
    const int64_t n      = runs(groups, l.N, nth);
    const char *  w_end  = (const char *) ((const Packed *) o.w + groups * l.nb);
    for (int64_t r = ith; r < n; r = tp != nullptr ? ggml_threadpool_chunk_add(tp, 1) : r + nth) {
        product_run<Packed>(o, l, base, groups * r / n, groups * (r + 1) / n, w_end);
    }
}

void product_runs(ggml_type type, const Operands & o, const Layout & l, const char * base, ggml_threadpool * tp,
                  int ith, int nth) {
    if (type == GGML_TYPE_Q4_1) {
        product_runs<packed_q4_1>(o, l, base, tp, ith, nth);
    } else {
        product_runs<packed_q8_0>(o, l, base, tp, ith, nth);
    }
}

Operands operands(const ggml_tensor * op) {
    const ggml_tensor * x = op->src[1];
    return Operands{ op->src[0]->data, (const char *) x->data, (char *) op->data, x->ne[1], x->ne[2], x->nb[1],
                     x->nb[2],         x->nb[3],              op->nb[1],         op->nb[2], op->nb[3] };
}

// Row `row` of a packed Q8_0 matrix, dequantized as ggml's
// dequantize_row_q8_0 does (d * q), so the values are the same.
void dequantize_row(const packed_q8_0 * w, int64_t nb, int64_t row, float * out) {
    const packed_q8_0 * p = w + (row / ROWS) * nb;
    const int           r = (int) (row % ROWS);
    for (int64_t b = 0; b < nb; b++) {
        const float d = half(p[b].d[r]);
        for (int j = 0; j < 32; j++) {
            out[b * 32 + j] = d * (float) (int8_t) (p[b].x[j / 4][4 * r + j % 4] ^ 0x80);
        }
    }
}

// GET_ROWS from a packed Q8_0 matrix.
void get_rows(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * w   = op->src[0];
    const ggml_tensor * ids = op->src[1];
    const int64_t       nb  = w->ne[0] / 32;
    const int64_t       n   = ggml_nelements(ids);
    const int64_t       per = (n + params->nth - 1) / params->nth;
    for (int64_t i = per * params->ith; i < std::min(n, per * (params->ith + 1)); i++) {
        const int64_t i2 = i / (ids->ne[1] * ids->ne[0]);
        const int64_t i1 = (i - i2 * ids->ne[1] * ids->ne[0]) / ids->ne[0];
        const int64_t i0 = i - i2 * ids->ne[1] * ids->ne[0] - i1 * ids->ne[0];
        const int64_t row =
            *(const int32_t *) ((const char *) ids->data + i0 * ids->nb[0] + i1 * ids->nb[1] + i2 * ids->nb[2]);
        GGML_ASSERT(row >= 0 && row < w->ne[1]);
        dequantize_row((const packed_q8_0 *) w->data, nb, row,
                       (float *) ((char *) op->data + i0 * op->nb[1] + i1 * op->nb[2] + i2 * op->nb[3]));
    }
}

#endif  // SIPP_CPU_GEMM

class traits : public ggml::cpu::tensor_traits {
    bool work_size(int, const ggml_tensor * op, size_t & size) override {
        if (op->op != GGML_OP_MUL_MAT || !computable(op)) {
            return false;
        }
        size = Layout(op).total;
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT && op->op != GGML_OP_GET_ROWS) {
            return false;
        }
        // The weights are repacked: ggml's own path cannot read them.
        GGML_ASSERT(computable(op) && "an op over a repacked matrix that sipp's kernel does not take");
#ifdef SIPP_CPU_GEMM
        if (op->op == GGML_OP_GET_ROWS) {
            get_rows(params, op);
            return true;
        }
        const Layout l(op);
        GGML_ASSERT(params->wsize >= l.total);
        const Operands o    = operands(op);
        char *         base = aligned(params->wdata);
        quantize_share(o, l, base, params->ith, params->nth);
        if (params->ith == 0) {
            ggml_threadpool_chunk_set(params->threadpool, params->nth);
        }
        ggml_barrier(params->threadpool);
        product_runs(op->src[0]->type, o, l, base, params->threadpool, params->ith, params->nth);
        if (params->ith == 0) {
            g_calls.fetch_add(1, std::memory_order_relaxed);
        }
        return true;
#else
        (void) params;
        GGML_ABORT("sipp's CPU kernels are not compiled in");
#endif
    }
};

traits g_traits;

// Attention ops named so run through ggml's own path (the check compares).
constexpr const char * ATTENTION_BYPASS = "sipp-bypass";

// The checks below count the kernels' calls: one at a time.
std::mutex g_check;

class attention_traits : public ggml::cpu::tensor_traits {
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        if (!sipp::attention_usable(op)) {
            return false;
        }
        size = sipp::attention_work_size(op, n_threads);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (!sipp::attention_usable(op) || params->wsize < sipp::attention_work_size(op, params->nth)) {
            return false;
        }
        sipp::attention_compute(params, op);
        return true;
    }
};

attention_traits g_attention_traits;

class extra : public ggml::cpu::extra_buffer_type {
    bool supports_op(ggml_backend_dev_t, const ggml_tensor * op) override {
        const ggml_tensor * x = op->src[1];
        return (op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_GET_ROWS) && op->src[0]->buffer &&
               op->src[0]->buffer->buft == buffer_type() && computable(op) &&
               (!x->buffer || ggml_backend_buft_is_host(x->buffer->buft));
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        if ((op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_GET_ROWS) && op->src[0]->buffer &&
            op->src[0]->buffer->buft == buffer_type()) {
            return &g_traits;
        }
        // Attention reads the KV cache, not a buffer of ours: ggml asks every
        // extra buffer type about every op, so small batches come here too.
        if (op->op == GGML_OP_FLASH_ATTN_EXT && std::strcmp(op->name, ATTENTION_BYPASS) != 0) {
            return &g_attention_traits;
        }
        return nullptr;
    }
};

enum ggml_status init_tensor(ggml_backend_buffer_t, ggml_tensor * tensor) {
    tensor->extra = &g_traits;
    return GGML_STATUS_SUCCESS;
}

void set_tensor(ggml_backend_buffer_t, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(t) && packable(t));
    if (t->type == GGML_TYPE_Q4_1) {
        pack_matrix((const block_q4_1 *) data, (packed_q4_1 *) t->data, t->ne[1], t->ne[0] / 32);
    } else {
        pack_matrix((const block_q8_0 *) data, (packed_q8_0 *) t->data, t->ne[1], t->ne[0] / 32);
    }
}

void get_tensor(ggml_backend_buffer_t, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(t) && packable(t));
    if (t->type == GGML_TYPE_Q4_1) {
        unpack_matrix((const packed_q4_1 *) t->data, (block_q4_1 *) data, t->ne[1], t->ne[0] / 32);
    } else {
        unpack_matrix((const packed_q8_0 *) t->data, (block_q8_0 *) data, t->ne[1], t->ne[0] / 32);
    }
}

const char * buffer_name(ggml_backend_buffer_type_t) {
    return "CPU_SIPP";
}

// Asks Linux to back the repacked weights with 2 MiB pages, before they are
// written. Every step streams all of them (96 MB for the default model);
// with 4 KiB pages that is a TLB miss every 4 KiB, and where transparent
// huge pages are only given on request ("madvise", as on these machines)
// nothing else asks. A kernel that refuses changes nothing.
void huge_pages(void * base, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t from = ((uintptr_t) base + page - 1) & ~(page - 1);
    const uintptr_t to   = ((uintptr_t) base + size) & ~(page - 1);
    if (to > from) {
        madvise((void *) from, to - from, MADV_HUGEPAGE);
    }
#else
    (void) base;
    (void) size;
#endif
}

ggml_backend_buffer_t alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    huge_pages(ggml_backend_buffer_get_base(buffer), size);
    buffer->buft                = buft;
    buffer->iface.init_tensor   = init_tensor;
    buffer->iface.set_tensor    = set_tensor;
    buffer->iface.get_tensor    = get_tensor;
    buffer->iface.set_tensor_2d = nullptr;
    buffer->iface.get_tensor_2d = nullptr;
    buffer->iface.cpy_tensor    = nullptr;
    return buffer;
}

size_t alignment(ggml_backend_buffer_type_t) {
    return ggml_backend_buft_get_alignment(ggml_backend_cpu_buffer_type());
}

ggml_backend_buffer_type_t buffer_type() {
    static ggml_backend_buffer_type type = [] {
        ggml_backend_buffer_type t{};
        t.iface.get_name      = buffer_name;
        t.iface.alloc_buffer  = alloc_buffer;
        t.iface.get_alignment = alignment;
        t.device              = ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
        t.context             = new extra();
        return t;
    }();
    return &type;
}

#ifdef SIPP_CPU_GEMM

// Random weights of a type: random quants and scales (and Q4_1 minimums).
template <class Block> std::vector<Block> random_blocks(std::mt19937 & rng, int64_t n);

template <> std::vector<block_q4_1> random_blocks(std::mt19937 & rng, int64_t n) {
    std::uniform_real_distribution<float> scale(0.001f, 0.05f), min(-0.4f, 0.0f);
    std::vector<block_q4_1>               w(n);
    for (auto & b : w) {
        b.data.data.d = to_half(scale(rng));
        b.data.data.m = to_half(min(rng));
        for (auto & q : b.qs) {
            q = (uint8_t) (rng() & 0xFF);
        }
    }
    return w;
}

template <> std::vector<block_q8_0> random_blocks(std::mt19937 & rng, int64_t n) {
    std::uniform_real_distribution<float> scale(0.001f, 0.05f);
    std::vector<block_q8_0>               w(n);
    for (auto & b : w) {
        b.d = to_half(scale(rng));
        for (auto & q : b.qs) {
            q = (int8_t) (rng() & 0xFF);
        }
    }
    return w;
}

ggml_half scale_of(const block_q8_0 & b) {
    return b.d;
}

ggml_half scale_of(const block_q8_1 & b) {
    return b.data.data.d;
}

template <class Block, class Packed, class ActBlock>
double check(ggml_type type, ggml_type act_type, int K, int M, int N, unsigned seed) {
    std::mt19937                    rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t                   nb = K / 32;
    const std::vector<Block>        w  = random_blocks<Block>(rng, M * nb);
    std::vector<Packed>             packed(M / ROWS * nb);
    pack_matrix(w.data(), packed.data(), M, nb);
    std::vector<Block> back(w.size());
    unpack_matrix(packed.data(), back.data(), M, nb);
    if (std::memcmp(back.data(), w.data(), w.size() * sizeof(Block)) != 0) {
        return 1e9;  // packing does not round-trip
    }
    if (type == GGML_TYPE_Q8_0) {
        // row lookups give ggml's dequantized values, bit for bit
        std::vector<float> want(K), got(K);
        for (int r = 0; r < M; r++) {
            ggml_get_type_traits(type)->to_float(w.data() + r * nb, want.data(), K);
            dequantize_row((const packed_q8_0 *) (const void *) packed.data(), nb, r, got.data());
            if (std::memcmp(want.data(), got.data(), K * sizeof(float)) != 0) {
                return 1e9;
            }
        }
    }

    std::vector<float> x((size_t) N * K);
    for (auto & v : x) {
        v = normal(rng);
    }
    for (int c = 0; c < N; c++) {
        x[(size_t) c * K + (size_t) (c * 37) % K] = 50.0f;
    }
    std::vector<float> dst((size_t) N * M);
    const Layout       l(K, M, N);
    std::vector<char>  work(l.total);
    char *             base = aligned(work.data());
    const Operands     o{ packed.data(),     (const char *) x.data(), (char *) dst.data(),
                      N,                 1,
                      K * sizeof(float), K * sizeof(float) * N,   K * sizeof(float) * N,
                      M * sizeof(float), M * sizeof(float) * N,   M * sizeof(float) * N };
    quantize_share(o, l, base, 0, 1);
    product_runs(type, o, l, base, nullptr, 0, 1);

    const auto *          quantize = ggml_get_type_traits_cpu(act_type);
    const auto *          dot      = ggml_get_type_traits_cpu(type);
    std::vector<ActBlock> q(nb);
    double                worst = 0, largest = 0;
    for (int c = 0; c < N; c++) {
        quantize->from_float(x.data() + (size_t) c * K, q.data(), K);
        // the same quantized activations as ggml's, bit for bit
        const Act a = act(l, base, c);
        for (int64_t b = 0; b < nb; b++) {
            if (std::memcmp(q[b].qs, a.q + b * 32, 32) != 0 || half(scale_of(q[b])) != a.d[b]) {
                return 1e9;
            }
        }
        for (int r = 0; r < M; r++) {
            float want;
            dot->vec_dot(K, &want, 0, w.data() + r * nb, 0, q.data(), 0, 1);
            worst   = std::max(worst, (double) std::fabs(want - dst[(size_t) c * M + r]));
            largest = std::max(largest, (double) std::fabs(want));
        }
    }
    return largest > 0 ? worst / largest : worst;
}

#endif  // SIPP_CPU_GEMM

}  // namespace

extern "C" {

// Adds sipp's buffer type to ggml's CPU backend, once. Call before the first
// model load: llama.cpp reads the list of extra buffer types then. Returns
// whether the kernels are compiled in for this CPU (when they are not,
// nothing is registered and ggml's own path runs).
bool sipp_cpu_gemm_register(void) {
#ifdef SIPP_CPU_GEMM
    static const bool once = [] {
        ggml_backend_cpu_get_extra_buffer_types().push_back(buffer_type());
        return true;
    }();
    return once;
#else
    return false;
#endif
}

// Checks the kernel for one weight type (`q8_0` false: Q4_1) against ggml's
// own arithmetic on random data: K x M weights (random quants and scales)
// times N activation rows (normal values, one large outlier per row),
// repacked through this kernel, and through ggml's activation quantization
// and dot product on the original blocks. The repacked matrix must unpack to
// the original blocks and the quantized activations must equal ggml's.
// Returns the largest difference relative to the largest result (1e9 when a
// bit-for-bit check fails), or -1 when the kernels are not compiled in or
// the shape is not one they take.
double sipp_cpu_gemm_check(bool q8_0, int K, int M, int N, unsigned seed) {
    const std::lock_guard<std::mutex> one_at_a_time(g_check);
#ifdef SIPP_CPU_GEMM
    if (K <= 0 || K % 32 != 0 || M <= 0 || M % ROWS != 0 || N <= 0) {
        return -1;
    }
    ggml_cpu_init();
    if (q8_0) {
        return check<block_q8_0, packed_q8_0, block_q8_0>(GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, K, M, N, seed);
    }
    return check<block_q4_1, packed_q4_1, block_q8_1>(GGML_TYPE_Q4_1, GGML_TYPE_Q8_1, K, M, N, seed);
#else
    (void) q8_0;
    (void) K;
    (void) M;
    (void) N;
    (void) seed;
    return -1;
#endif
}

// Checks the attention kernel against attention in double precision, and
// against ggml's flash attention, on random data:
// `heads` query heads over `kv_heads` key/value heads of dimension D, N query
// rows over `cells` cells, each row seeing a different prefix of the cells
// (and row 0 none of a middle stretch). Runs the same graph through ggml's
// path and through the kernel. Returns the kernel's largest difference from
// the exact result relative to the largest output (1e9 when it is more than
// twice ggml's own, or the kernel did not run), or -1 when the kernel does
// not take the shape.
double sipp_cpu_attention_check(int D, int N, int heads, int kv_heads, int cells, int n_threads, unsigned seed) {
    const std::lock_guard<std::mutex> one_at_a_time(g_check);
    if (!sipp_cpu_gemm_register()) {
        return -1;
    }
    const size_t         mem = (size_t) 64 * 1024 * 1024;
    ggml_init_params     ip{ mem, nullptr, false };
    ggml_context *       ctx = ggml_init(ip);
    ggml_tensor *        q   = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, N, heads, 1);
    ggml_tensor *        k   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, cells, kv_heads, 1);
    ggml_tensor *        v   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, cells, kv_heads, 1);
    const int            padded = N;
    ggml_tensor *        mask   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, cells, padded, 1, 1);
    std::mt19937         rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < ggml_nelements(q); i++) {
        ((float *) q->data)[i] = normal(rng);
    }
    for (ggml_tensor * t : { k, v }) {
        for (int64_t i = 0; i < ggml_nelements(t); i++) {
            ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(normal(rng));
        }
    }
    for (int r = 0; r < padded; r++) {
        for (int c = 0; c < cells; c++) {
            const bool seen = r < N && c <= cells - N + r && !(r == 0 && c > cells / 4 && c < cells / 2);
            ((ggml_fp16_t *) mask->data)[(size_t) r * cells + c] = ggml_fp32_to_fp16(seen ? 0.0f : -INFINITY);
        }
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt((float) D), 0.0f, 0.0f);
    double result = -1;
    if (sipp::attention_usable(out)) {
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_set_name(out, ATTENTION_BYPASS);
        ggml_graph_compute_with_ctx(ctx, gf, n_threads);
        ggml_set_name(out, "");
        std::vector<float> want((const float *) out->data, (const float *) out->data + ggml_nelements(out));
        const unsigned long long before = sipp::attention_calls();
        ggml_graph_compute_with_ctx(ctx, gf, n_threads);
        if (sipp::attention_calls() == before) {
            result = 1e9;  // the kernel did not run
        } else {
            // Both against attention in double precision: ggml's path
            // accumulates the values in f16, so it is the less exact one.
            const float scale = 1.0f / std::sqrt((float) D);
            double      ours = 0, ggml = 0, largest = 0;
            std::vector<double> w(cells), acc(D);
            for (int h = 0; h < heads; h++) {
                const int hk = h / (heads / kv_heads);
                for (int r = 0; r < N; r++) {
                    const float * qp = (const float *) q->data + ((size_t) h * N + r) * D;
                    double        m  = -INFINITY;
                    for (int c = 0; c < cells; c++) {
                        const float mv = ggml_fp16_to_fp32(((ggml_fp16_t *) mask->data)[(size_t) r * cells + c]);
                        const ggml_fp16_t * kp = (const ggml_fp16_t *) k->data + ((size_t) hk * cells + c) * D;
                        double              sc = 0;
                        for (int d = 0; d < D; d++) {
                            sc += (double) qp[d] * ggml_fp16_to_fp32(kp[d]);
                        }
                        w[c] = mv == -INFINITY ? -INFINITY : sc * scale;
                        m    = std::max(m, w[c]);
                    }
                    double l = 0;
                    std::fill(acc.begin(), acc.end(), 0.0);
                    for (int c = 0; c < cells; c++) {
                        const double e = m == -INFINITY || w[c] == -INFINITY ? 0.0 : std::exp(w[c] - m);
                        l += e;
                        const ggml_fp16_t * vp = (const ggml_fp16_t *) v->data + ((size_t) hk * cells + c) * D;
                        for (int d = 0; d < D; d++) {
                            acc[d] += e * ggml_fp16_to_fp32(vp[d]);
                        }
                    }
                    for (int d = 0; d < D; d++) {
                        const double  exact = l > 0 ? acc[d] / l : 0.0;
                        const size_t  i     = ((size_t) r * heads + h) * D + d;
                        ours                = std::max(ours, std::fabs(exact - ((const float *) out->data)[i]));
                        ggml                = std::max(ggml, std::fabs(exact - want[i]));
                        largest             = std::max(largest, std::fabs(exact));
                    }
                }
            }
            // worse than ggml's own error is a failure
            result = ours > 2 * ggml + 1e-6 * largest ? 1e9 : (largest > 0 ? ours / largest : ours);
        }
    }
    ggml_free(ctx);
    return result;
}

// Checks that the attention kernel computes a row the same, bit for bit,
// whatever the batch around it and wherever its cells lie: one query row
// (each of `heads` heads seeing `seen` cells of a `cache`-cell cache, the
// same keys and values every time) is computed alone on one thread over
// 256 cells, alone on two threads over every cell, as a row of 33 rows
// (the others seeing random cells) on two and on three threads, as a row of
// 100, alone with its cells 300 cells further, and as the first of 40 rows
// of its sequence (the others seeing its cells and more) with its cells 13
// cells further and a gap of 77 foreign cells in the middle. Returns how
// many of its outputs differ from the first run (0 for none), or -1 when
// the kernel does not take the shape, and 1e9 when it did not run.
double sipp_cpu_attention_invariance(int D, int heads, int kv_heads, int cache, int seen, unsigned seed) {
    const std::lock_guard<std::mutex> one_at_a_time(g_check);
    if (!sipp_cpu_gemm_register() || cache < 1024 || seen < 1 || seen > 256) {
        return -1;
    }
    const size_t     mem = (size_t) 160 * 1024 * 1024;
    ggml_init_params ip{ mem, nullptr, false };
    ggml_context *   ctx = ggml_init(ip);
    ggml_tensor *    k   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, cache, kv_heads, 1);
    ggml_tensor *    v   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, cache, kv_heads, 1);
    std::mt19937     rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // the row's own keys and values, and its query
    std::vector<ggml_fp16_t> own_k((size_t) seen * kv_heads * D), own_v(own_k.size());
    for (size_t i = 0; i < own_k.size(); i++) {
        own_k[i] = ggml_fp32_to_fp16(normal(rng));
        own_v[i] = ggml_fp32_to_fp16(normal(rng));
    }
    std::vector<float> target((size_t) heads * D);
    for (float & x : target) {
        x = normal(rng);
    }
    struct Run {
        int n_kv, threads, N, at, offset, gap;
        bool sequence;  // the other rows continue the row's sequence
    };
    const Run runs[] = {
        { 256, 1, 1, 0, 0, 0, false },    { cache, 2, 1, 0, 0, 0, false },   { 512, 2, 33, 17, 0, 0, false },
        { 512, 3, 33, 32, 0, 0, false },  { 768, 2, 100, 70, 0, 0, false }, { 1024, 2, 1, 0, 300, 0, false },
        { 1024, 2, 40, 0, 13, 77, true },
    };
    double             result = 0;
    std::vector<float> first;
    for (const Run & run : runs) {
        // every cell random, then the row's cells: `offset` on, a gap after half
        for (ggml_tensor * t : { k, v }) {
            for (int64_t i = 0; i < ggml_nelements(t); i++) {
                ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(normal(rng));
            }
        }
        std::vector<int> cells(seen);
        for (int i = 0; i < seen; i++) {
            cells[i] = run.offset + i + (i >= seen / 2 ? run.gap : 0);
            for (int hk = 0; hk < kv_heads; hk++) {
                const size_t at = ((size_t) hk * cache + cells[i]) * D;
                std::memcpy((ggml_fp16_t *) k->data + at, &own_k[((size_t) i * kv_heads + hk) * D], D * sizeof(ggml_fp16_t));
                std::memcpy((ggml_fp16_t *) v->data + at, &own_v[((size_t) i * kv_heads + hk) * D], D * sizeof(ggml_fp16_t));
            }
        }
        const int     n_kv = run.n_kv, N = run.N, at = run.at;
        ggml_tensor * kv   = ggml_view_4d(ctx, k, D, n_kv, kv_heads, 1, k->nb[1], k->nb[2], k->nb[3], 0);
        ggml_tensor * vv   = ggml_view_4d(ctx, v, D, n_kv, kv_heads, 1, v->nb[1], v->nb[2], v->nb[3], 0);
        ggml_tensor * q    = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, N, heads, 1);
        ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, N, 1, 1);
        const int     tail = cells[seen - 1] + 1;  // the sequence goes on from here
        for (int r = 0; r < N; r++) {
            const int other = (int) (rng() % (unsigned) n_kv);
            for (int h = 0; h < heads; h++) {
                for (int d = 0; d < D; d++) {
                    ((float *) q->data)[((size_t) h * N + r) * D + d] = r == at ? target[(size_t) h * D + d] : normal(rng);
                }
            }
            for (int c = 0; c < n_kv; c++) {
                bool sees;
                if (r == at) {
                    sees = std::binary_search(cells.begin(), cells.end(), c);
                } else if (run.sequence) {
                    sees = std::binary_search(cells.begin(), cells.end(), c) || (c >= tail && c < tail + r - at);
                } else {
                    sees = c <= other;
                }
                ((ggml_fp16_t *) mask->data)[(size_t) r * n_kv + c] = ggml_fp32_to_fp16(sees ? 0.0f : -INFINITY);
            }
        }
        ggml_tensor * out = ggml_flash_attn_ext(ctx, q, kv, vv, mask, 1.0f / std::sqrt((float) D), 0.0f, 0.0f);
        if (!sipp::attention_usable(out)) {
            result = -1;
            break;
        }
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        const unsigned long long before = sipp::attention_calls();
        ggml_graph_compute_with_ctx(ctx, gf, run.threads);
        if (sipp::attention_calls() == before) {
            result = 1e9;
            break;
        }
        std::vector<float> row((size_t) heads * D);
        for (int h = 0; h < heads; h++) {
            std::memcpy(&row[(size_t) h * D], (const char *) out->data + (h + (size_t) at * heads) * out->nb[1],
                        sizeof(float) * D);
        }
        if (first.empty()) {
            first = row;
        } else {
            for (size_t i = 0; i < row.size(); i++) {
                result += std::memcmp(&row[i], &first[i], sizeof(float)) != 0;
            }
        }
    }
    ggml_free(ctx);
    return result;
}

// Products the kernels have computed in this process.
unsigned long long sipp_cpu_gemm_calls(void) {
    return g_calls.load(std::memory_order_relaxed);
}

// Attention ops the attention kernel has computed in this process.
unsigned long long sipp_cpu_attention_calls(void) {
    return sipp::attention_calls();
}
}
