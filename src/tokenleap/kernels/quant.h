/* tokenleap kernels: linears over GGUF quantized weights kept in their own blocks and bytes (the
 * formats of the table below, TLQ_FORMATS), row-invariant, on AVX2 integer dot products (included
 * by both kernel variants).
 *
 * As llama.cpp does (ggml's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0), the activations are
 * quantized per row to blocks of 32 int8 with one fp32 scale (d = max|x| / 127, q = round(x/d)),
 * and a weight block's dot product with an activation block is an exact integer sum
 * (vpmaddubsw on |w| and sign(x, w) or on unsigned nibbles, then vpmaddwd: every partial sum
 * fits int16 / int32). Integer sums are associative, so only the float steps need a fixed
 * order, and they have one: for output o of row m, an 8-lane fp32 accumulator takes
 * (d_w d_x) * isum_lanes block after block in order, a scalar takes Q4_1's m_w * d_x * sum(q_x)
 * block after block, and y = hsum8(acc) + that scalar (+ bias). Nothing depends on the other rows
 * or on the tile shape: a forward over k rows equals k one-row forwards bit for bit.
 *
 * The weights come from the file's blocks (ggml: Q4_0 {f16 d; u8 qs[16]} w = d (q - 8); Q4_1
 * {f16 d, m; u8 qs[16]} w = d q + m; Q8_0 {f16 d; i8 qs[32]}), repacked at load (QuantWeight) so
 * that a vector lane is an output, as llama.cpp's "repack" buffers do: eight outputs' blocks of
 * 32 inputs interleaved four inputs at a time, so one broadcast of four activations and one
 * vpmaddubsw advance eight outputs by four inputs, with no horizontal sums and the eight scales
 * loaded as one vector. Both exact formats, per group of 8 outputs and block of 32 inputs:
 *   Q4X8 (from Q4_1; Q40X8 from Q4_0: no m[8], m = -8 d): f16 d[8], f16 m[8], then 4 x 32 bytes: byte
 *        (t, o, i) holds q[o][4t + i] in its low nibble and q[o][16 + 4t + i] in its high one
 *        (160 bytes: the file's 5 bits per weight);
 *   Q8X8 (from Q8_0, and Q5_0 as int8 q - 16): f16 d[8], then 8 x 32 bytes: byte (g, o, i) =
 *        q[o][4g + i] (272 bytes);
 * A row's output o: per block, the exact integer sum (Q4: int16 sums of vpmaddubsw over the 8
 * groups, at most 8 * 2 * 15 * 127 = 30480; Q8: |w| x sign(x, w) pairs through vpmaddwd, or with
 * VNNI one vpdpbusd of (q_x + 128) as unsigned with w, less 128 sum(w) from one more per group),
 * then acc = fma(float(isum), d_w d_x, acc) and, for Q4, acc = fma(m_w, d_x sum(q_x), acc),
 * block after block: the same sequence in every tile. */
#pragma once

/* The translation units this header makes (build.py compiles the two of a split build at once, one
 * a core): TLQ_UNIT 0 (the default, the benchmarks' harnesses) all of it; 1 the kernel source's
 * unit, with the K-quants' groups functions only declared; 2 quant_k.c, those functions alone
 * (the header's exported functions become unused statics there and are dropped, and the settings
 * they share with the unit 1 are its). The functions are noinline in every unit: the same code. */
#ifndef TLQ_UNIT
#define TLQ_UNIT 0
#endif
#if TLQ_UNIT == 2
#define TLQ_API static __attribute__((unused)) /* unit 1 exports these */
#define TLQ_SETTING(name, value) extern __attribute__((visibility("hidden"))) int name
#else
#define TLQ_API
#if TLQ_UNIT == 1
#define TLQ_SETTING(name, value) __attribute__((visibility("hidden"))) int name = value
#else
#define TLQ_SETTING(name, value) static int name = value
#endif
#endif
#if TLQ_UNIT == 2 /* without the thread pool (its tl_init is unit 1's) */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#else
#include "pool.h"
#endif

#define TLQ_Q4X8 1
#define TLQ_Q8X8 2
#define TLQ_Q40X8 3 /* Q4_0 in its own 144 bytes: f16 d[8], then Q4X8's nibbles; m = -8 d in registers (exact) */
/* Q5_0 / Q5_1 in their own 176 / 192 bytes: Q40X8's / Q4X8's layout with q's low 4 bits as the
 * nibbles, then Q5K's 32 bytes of fifth bits (byte (o, i): input 4 t + i's at bit t, 16 + 4 t + i's
 * at bit 4 + t); w = d q - 16 d (Q5_0, formed in registers: exact) or d q + m (Q5_1), q in 0..31 */
#define TLQ_Q50X8 11
#define TLQ_Q51X8 12
/* IQ4_NL in its own 144 bytes, Q40X8's layout: w = d v[q] with v the format's non-linear grid of 16
 * int8 values (tlq_iq4nl); the kernel looks each nibble up (vpshufb) and sums as Q8X8 does */
#define TLQ_IQ4NL 4
static const int8_t tlq_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* IQ4_XS in its own bytes, per group of 8 outputs and superblock of 256 inputs (1088 bytes: the
 * file's 136 per output): f16 d[8]; scales_l as 8 x 4 bytes; scales_h as 8 x 2 bytes; then 8
 * blocks of Q4X8's 128 nibble bytes. Block j of output o: w = d (ls - 32) v[q], ls = the 4 bits
 * at 4 j of scales_l | the 2 bits at 2 j of scales_h << 4; d (ls - 32) is exact in fp32, so the
 * 32-input step is IQ4NL's with that scale */
#define TLQ_IQ4XS 8
#define TLQ_IQ4XS_SB 1088 /* bytes per group and superblock */
/* Q3_K in its own bytes, per group of 8 outputs and superblock of 256 inputs (880 bytes: the
 * file's 110 per output): f16 d[8]; the file's 12 bytes of 6-bit scales as three vectors of
 * 8 x 4 bytes (bytes 0-3, 4-7, 8-11 of each output's); then per block of 32 inputs 96 bytes:
 * 2 x 32 bytes of the values' low 2 bits (in vector u, byte (o, i) holds those of input
 * 4 (4 u + s) + i at bits 2 s) and 32 bytes of their third bits (byte (o, i): input 4 g + i's at
 * bit g). Sub-block k of 16 inputs: w = d (sc_k - 32) (q - 4), q = low | third << 2 in 0..7; the
 * 16-input integer sums of (q - 4) x are multiplied by their integer scales and added as
 * integers, one float step per block of 32 */
#define TLQ_Q3K 9
#define TLQ_Q3K_SB 880
/* Q2_K in its own bytes, per group of 8 outputs and superblock of 256 inputs (672 bytes: the
 * file's 84 per output): f16 d[8], f16 dmin[8]; the file's 16 scale bytes (sc | m << 4 per 16
 * inputs) as four vectors of 8 x 4 bytes; then per block of 32 inputs Q3K's 2 x 32 bytes of low
 * bits. Sub-block k: w = d sc_k q - dmin m_k, q in 0..3: per 16-input half the exact sums of q x
 * and of x, times sc and m, added as integers; two float steps per block of 32 */
#define TLQ_Q2K 10
#define TLQ_Q2K_SB 672

/* The K-quants in their own bytes, per group of 8 outputs and superblock of 256 inputs (the
 * file's 144 / 176 / 210 bytes per output, so 1152 / 1408 / 1680 per group: nothing widened).
 * Their activations are ggml's Q8_K (one scale per row and superblock, tl_quantize_q8k), so
 * the kernel (qk_tile) multiplies each block's exact integer sum by its integer sub-scale and
 * adds them as integers, with one or two float steps per superblock and row (the 32-input
 * formats take one or two per block of 32). Layouts:
 *   Q4K (Q4_K): f16 d[8], f16 dmin[8]; 64 bytes: byte (j, o) = sc[j][o] & 15 | (m[j][o] & 15) << 4;
 *        32 bytes: byte k = hi(k) | hi(k + 32) << 4 with hi(8 j + o) = sc >> 4 | (m >> 4) << 2; then
 *        8 blocks of Q4X8's 128 nibble bytes (header 128 bytes);
 *   Q6K (Q6_K): f16 d[8]; int8 sc[16][8] (per 16 inputs); then 8 blocks of 192 bytes: q's low 4
 *        bits as Q4X8's 128 nibble bytes, then 2 x 32 bytes of high bits: in vector u, byte
 *        (o, i) holds q[o][4 (4 u + s) + i] >> 4 at bits 2 s, 2 s + 1 (header 144 bytes);
 *        w = d sc (q - 32): q unpacked in registers (unsigned) against the signed activations,
 *        less 32 times their sum per 16 inputs;
 *   Q5K (Q5_K): Q4K's header; then 8 blocks of 160 bytes: Q4X8's 128 nibble bytes of q's low 4
 *        bits, then 32 bytes whose byte (o, i) holds the 5th bit of q[o][4 t + i] at bit t and of
 *        q[o][16 + 4 t + i] at bit 4 + t (header 128 bytes, 1408 in all: the file's 5.5 bits). */
#define TLQ_Q4K 5
#define TLQ_Q6K 6
#define TLQ_Q5K 7

/* The formats as one table, one row each (kernels/formats.py's FORMATS holds the same rows and
 * tests/kernels/test_formats.py checks them against tl_formats): GGML type id, the kernel's format,
 * inputs per block in the file, bytes per block in the file, and the kernel's bytes per group of
 * 8 outputs and 32 inputs (the superblock formats: on average). Every format is read in its file's
 * own bytes: the kernel's bytes are 8 x the file's per 32 inputs. */
#define TLQ_FORMATS(X)              \
    X(2, TLQ_Q40X8, 32, 18, 144)    \
    X(3, TLQ_Q4X8, 32, 20, 160)     \
    X(6, TLQ_Q50X8, 32, 22, 176)    \
    X(7, TLQ_Q51X8, 32, 24, 192)    \
    X(8, TLQ_Q8X8, 32, 34, 272)     \
    X(10, TLQ_Q2K, 256, 84, 84)     \
    X(11, TLQ_Q3K, 256, 110, 110)   \
    X(12, TLQ_Q4K, 256, 144, 144)   \
    X(13, TLQ_Q5K, 256, 176, 176)   \
    X(14, TLQ_Q6K, 256, 210, 210)   \
    X(20, TLQ_IQ4NL, 32, 18, 144)   \
    X(23, TLQ_IQ4XS, 256, 136, 136)

typedef struct {
    int32_t ggml_id, kernel_id, block_weights, file_bytes, group_bytes;
} tlq_format;
#define TLQ_ROW(g, k, b, f, gb) {g, k, b, f, gb},
static const tlq_format tlq_formats[] = {TLQ_FORMATS(TLQ_ROW)};
#undef TLQ_ROW
#define TLQ_NFORMATS ((int)(sizeof tlq_formats / sizeof tlq_formats[0]))

/* The table's rows into out (5 int32 each, at most max rows); returns the number of rows. */
TLQ_API int tl_formats(int32_t *out, int max) {
    for (int i = 0; i < TLQ_NFORMATS && i < max; i++) memcpy(out + 5 * i, &tlq_formats[i], sizeof(tlq_format));
    return TLQ_NFORMATS;
}

/* a stack of two formats in one call (tl_linear_q): f1 for groups [0, split), then f2 */
#define TLQ_STACK(f1, f2, split) ((f1) | (f2) << 4 | (split) << 8)

#define TLQ_VNNI 16 /* or'ed into a format: the integer sums on vpdpbusd (bit-identical to vpmaddubsw + vpmaddwd) */

/* VNNI (vpdpbusd on 256-bit vectors): AVX-512 VNNI (with AVX512VL) in the AVX-512 variant (which
 * defines TLQ_ALLOW_VNNI), or AVX-VNNI, the same instruction VEX-encoded, in the AVX2 variant
 * (Intel's AVX2-only client cores from Alder Lake on have it; Zen 3 does not), when the build's
 * -march=native has it; used when cpuid says so at load (tl_quant_vnni(-1)), switchable to
 * compare (tl_quant_vnni(0 / 1)). */
#if defined(TLQ_ALLOW_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TLQ_HAS_VNNI 1
#define TLQ_VNNI_CPU (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
static inline __m256i tlq_dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif !defined(TLQ_ALLOW_VNNI) && defined(__AVXVNNI__)
#define TLQ_HAS_VNNI 1
#define TLQ_VNNI_CPU __builtin_cpu_supports("avxvnni")
static inline __m256i tlq_dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
#define TLQ_HAS_VNNI 0
#define TLQ_VNNI_CPU 0
static inline __m256i tlq_dpbusd(__m256i acc, __m256i u8, __m256i s8) { (void)u8; (void)s8; return acc; }
#endif
static int tlq_use_vnni = -1; /* -1: not decided yet (cpuid on first use) */

/* The two units of a split build must agree on VNNI (kernels.c defines TLQ_ALLOW_VNNI; build.py
 * passes it to quant_k.c for that variant): unit 2 defines the symbol named for its setting and
 * unit 1 reads the one named for its own, so units that disagree fail to link. */
#define TLQ_CAT2(a, b) a##b
#define TLQ_CAT(a, b) TLQ_CAT2(a, b)
#define TLQ_UNITS_VNNI TLQ_CAT(tlq_units_vnni_, TLQ_HAS_VNNI)
#if TLQ_UNIT == 2
__attribute__((visibility("hidden"))) const int TLQ_UNITS_VNNI = 1;
#elif TLQ_UNIT == 1
extern __attribute__((visibility("hidden"))) const int TLQ_UNITS_VNNI;
#else
static const int TLQ_UNITS_VNNI = 1;
#endif

/* Set whether the quantized linears use VNNI (1 / 0; -1: as cpuid says); returns the setting in
 * force (0 when this build has no VNNI path). */
TLQ_API int tl_quant_vnni(int enable) {
    (void)*(const volatile int *)&TLQ_UNITS_VNNI; /* the link's check (above) */
    if (enable < 0) enable = tlq_use_vnni >= 0 ? tlq_use_vnni : (TLQ_HAS_VNNI && TLQ_VNNI_CPU);
    tlq_use_vnni = TLQ_HAS_VNNI && enable;
    return tlq_use_vnni;
}

/* the kernel's bytes per group and 32 inputs (0: not a format): a chain that folds to a constant
 * in each format's instantiation */
static inline int64_t q_group_bytes(int format) {
#define TLQ_GB(g, k, b, f, gb) format == (k) ? (gb) :
    return TLQ_FORMATS(TLQ_GB) 0;
#undef TLQ_GB
}

/* The 32-input formats' kinds (each folds to a constant in a format's instantiation): nibbles
 * plus fifth bits (Q5_0 / Q5_1), nibbles (those and Q4_0 / Q4_1), the non-linear grids (IQ4_NL /
 * IQ4_XS), and where a block's quants start (after f16 d[8], and m[8] for Q4_1 / Q5_1) */
static inline __attribute__((always_inline)) int q_is_q5(int format) { return format == TLQ_Q50X8 || format == TLQ_Q51X8; }
static inline __attribute__((always_inline)) int q_is_q4(int format) { return format == TLQ_Q4X8 || format == TLQ_Q40X8 || q_is_q5(format); }
static inline __attribute__((always_inline)) int q_is_nl(int format) { return format == TLQ_IQ4NL || format == TLQ_IQ4XS; }
static inline __attribute__((always_inline)) int64_t q_quant_offset(int format) { return format == TLQ_Q4X8 || format == TLQ_Q51X8 ? 32 : 16; }

/* Q6K: q (unsigned, 0..63; w = d sc (q - 32)) of inputs 4 g .. 4 g + 3 for the 8 outputs (Q8X8's
 * vector g) from a block's 192 bytes: vector g & 3's low (g < 4) or high nibbles, and the high
 * bits of vector g >> 2 */
static inline __attribute__((always_inline)) __m256i q6_vector(const uint8_t *blk, int g) {
    const __m256i lo4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const int t = g & 3;
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 32 * t));
    const __m256i lo = _mm256_and_si256(g < 4 ? raw : _mm256_srli_epi16(raw, 4), lo4);
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (g >> 2)));
    const __m256i hi = t == 0 ? _mm256_slli_epi16(hb, 4) : t == 1 ? _mm256_slli_epi16(hb, 2) : t == 2 ? hb : _mm256_srli_epi16(hb, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
}

/* Q5K: the 5th bit of vector t's low (inputs 4 t + i: bit t) and high (16 + 4 t + i: bit 4 + t)
 * nibbles, from the block's 32 bytes of high bits after its 128 nibble bytes */
static inline __attribute__((always_inline)) void q5_high(const uint8_t *blk, int t, __m256i *wl, __m256i *wh) {
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128)), m10 = _mm256_set1_epi8(0x10);
    const __m256i lo = t == 0 ? _mm256_slli_epi16(hb, 4) : t == 1 ? _mm256_slli_epi16(hb, 3) : t == 2 ? _mm256_slli_epi16(hb, 2) : _mm256_slli_epi16(hb, 1);
    const __m256i hi = t == 0 ? hb : t == 1 ? _mm256_srli_epi16(hb, 1) : t == 2 ? _mm256_srli_epi16(hb, 2) : _mm256_srli_epi16(hb, 3);
    *wl = _mm256_or_si256(*wl, _mm256_and_si256(lo, m10));
    *wh = _mm256_or_si256(*wh, _mm256_and_si256(hi, m10));
}

/* A superblock's header -> its integer scales, as the K tile multiplies them (8 outputs a vector,
 * one per 32-bit lane): sc[j] per block of 32 (Q4K / Q5K) or run of 16 (Q6K, 16 of them); with
 * `dup` each lane's scale in both of its int16 halves (a vpmaddwd of int16 pairs by it), else as
 * int32 (vpmulld); mp[k] pairs of the min terms' factors for vpmaddwd against paired activation
 * sums: Q4K / Q5K m[2k] | m[2k + 1] << 16 (k < 4), Q6K sc[2k] | sc[2k + 1] << 16 (k < 8). */
static inline __attribute__((always_inline)) void qk_scales(const uint8_t *sb, int format, int dup, __m256i sc[16], __m256i mp[8]) {
    if (format == TLQ_Q4K || format == TLQ_Q5K) {
        const __m256i m0f = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(sb + 96));
        /* in registers: 32-byte stores read back 8 bytes at a time stalled on store forwarding
         * (a fifth of a 4-row tile's time on Cascade Lake, s29) */
        for (int k = 0; k < 2; k++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(sb + 32 + 32 * k));
            const __m256i hk = _mm256_and_si256(k ? _mm256_srli_epi16(h, 4) : h, m0f);
            const __m256i scv = _mm256_or_si256(_mm256_and_si256(l, m0f), _mm256_and_si256(_mm256_slli_epi16(hk, 4), m30));
            const __m256i mnv = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m0f), _mm256_and_si256(_mm256_slli_epi16(hk, 2), m30));
            const __m128i s8[4] = {_mm256_castsi256_si128(scv), _mm_unpackhi_epi64(_mm256_castsi256_si128(scv), _mm256_castsi256_si128(scv)),
                                   _mm256_extracti128_si256(scv, 1), _mm_unpackhi_epi64(_mm256_extracti128_si256(scv, 1), _mm256_extracti128_si256(scv, 1))};
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_cvtepu8_epi32(s8[j]);
                sc[4 * k + j] = dup ? _mm256_or_si256(v, _mm256_slli_epi32(v, 16)) : v;
            }
            /* mp[2 k + u]: the mins of blocks 4 k + 2 u (low int16) and 4 k + 2 u + 1 (high), from half u of mnv */
            for (int u = 0; u < 2; u++) {
                const __m128i m16 = u ? _mm256_extracti128_si256(mnv, 1) : _mm256_castsi256_si128(mnv);
                mp[2 * k + u] = _mm256_or_si256(_mm256_cvtepu8_epi32(m16), _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(m16, m16)), 16));
            }
        }
    } else {
        const __m256i lo16 = _mm256_set1_epi32(0xffff);
        __m256i v[16];
        for (int j = 0; j < 16; j++) {
            v[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 16 + 8 * j)));
            sc[j] = dup ? _mm256_or_si256(_mm256_and_si256(v[j], lo16), _mm256_slli_epi32(v[j], 16)) : v[j];
        }
        for (int k = 0; k < 8; k++) mp[k] = _mm256_or_si256(_mm256_and_si256(v[2 * k], lo16), _mm256_slli_epi32(v[2 * k + 1], 16));
    }
}

/* 32 activations at inverse scale `id` -> 32 int8 (round to nearest even, in [-127, 127]), their
 * runs of 4 in the order `order` gives (q8_in_order, or q8_paired: runs 0, 4, 1, 5, 2, 6, 3, 7:
 * the inputs of a Q4X8 nibble byte's low and high halves side by side, `qk_x`); returns the sums
 * of q over inputs 0-15 and 16-31 */
#define q8_in_order() _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)
#define q8_paired() _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
static inline __attribute__((always_inline)) void q8_block(const float *xb, __m256 id, int8_t *out, int32_t sums[2], __m256i order) {
    __m256i qi[4];
    for (int k = 0; k < 4; k++)
        qi[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane: fix with a permute) */
    __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, order);
    _mm256_storeu_si256((__m256i *)out, p);
    for (int h = 0; h < 2; h++) {
        const __m256i s8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        sums[h] = _mm_cvtsi128_si32(t);
    }
}

/* max |x| over n (a multiple of 8) floats */
static inline float q8_amax(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

/* Activations for the 32-input formats: per row, per block of 32: d = max|x| / 127 (0 for an
 * all-zero block), q = round-to-nearest-even(x / d) in [-127, 127], s = d * sum(q) (ggml's Q8_1 `s`). */
TLQ_API void tl_quantize_q8(const float *x, int8_t *q, float *d, float *s, int64_t rows, int64_t in_dim) {
    const int64_t nb = in_dim / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * in_dim + b * 32;
            const float mx = q8_amax(xb, 32), db = mx / 127.0f;
            int32_t sums[2];
            q8_block(xb, _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f), q + r * in_dim + b * 32, sums, q8_in_order());
            d[r * nb + b] = db;
            s[r * nb + b] = db * (float)(sums[0] + sums[1]);
        }
}

/* Activations for the K-quants (ggml's Q8_K): per row, per superblock of 256 inputs one scale
 * d = max|x| / 127 and q as above (each block of 32 in q8_paired's order), and the sums of q the weights' integer corrections need,
 * paired for vpmaddwd (int16 each: |sum| <= 32 * 127): bs[k], k < 4: sum over block 2k | sum
 * over block 2k + 1 << 16 (blocks of 32); bs[4 + k], k < 8: the same over the superblock's 16
 * runs of 16 inputs. */
#define QK_BS 12
TLQ_API void tl_quantize_q8k(const float *x, int8_t *q, float *d, int32_t *bs, int64_t rows, int64_t in_dim) {
    const int64_t nsb = in_dim / 256;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            const float *xs = x + r * in_dim + sb * 256;
            const float mx = q8_amax(xs, 256);
            const __m256 id = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
            int32_t h[16];
            for (int b = 0; b < 8; b++) q8_block(xs + 32 * b, id, q + r * in_dim + sb * 256 + 32 * b, h + 2 * b, q8_paired());
            int32_t *o = bs + (r * nsb + sb) * QK_BS;
            for (int k = 0; k < 4; k++) o[k] = (int32_t)(((uint32_t)(h[4 * k] + h[4 * k + 1]) & 0xffffu) | (uint32_t)(h[4 * k + 2] + h[4 * k + 3]) << 16);
            for (int k = 0; k < 8; k++) o[4 + k] = (int32_t)(((uint32_t)h[2 * k] & 0xffffu) | (uint32_t)h[2 * k + 1] << 16);
            d[r * nsb + sb] = mx / 127.0f;
        }
}

/* rows per tile at most, on every ISA: AVX-512's 32 vector registers hold 8 rows' sums and
 * accumulators; AVX2's 16 hold 8 rows' integer sums, the weight vectors and a product (the rows'
 * float accumulators are touched once per block / superblock and may live in memory). AVX2 had 4
 * rows a tile until 2026-11-28: 8 rows ran as two passes over each group's weights */
#define QR 8
/* Keep a value in a register at this point (an empty asm that reads and writes it): the integer
 * sums are exact in any order, and GCC, free to reassociate them, computed all of a block's
 * products first and spilled them to the stack (16 registers); this pins one accumulation
 * order, row after row, so the products are consumed as they are made */
#if defined(__AVX512F__)
#define TLQ_KEEP(v) __asm__("" : "+v"(v))
#else
#define TLQ_KEEP(v) __asm__("" : "+x"(v))
#endif
/* Scheduling: each thread grabs runs of adjacent 32-output chunks (a contiguous stretch of the
 * weights), long first and shorter towards the end (pool.h's tl_next_guided), instead of one
 * chunk at a time: with the threads interleaving single chunks, each core's weight stream broke
 * every 20 KB and a one-row call (decode) read the Gemma 3 LM head at 34 GB/s; in a few long
 * runs, 50-80 GB/s of the ~75 two cores can read. */
/* software prefetch distance, in blocks of the weight stream (every cache line of the block) */
#define TLQ_PF 16
#define QO 4 /* groups of 8 outputs per tile at most */
#define QS 4 /* independent integer partial sums per row at most */

/* A Q8X8 block's weight vector g (the 8 outputs' int8 values of inputs 4 g .. 4 g + 3) from its
 * bytes q, or for IQ4NL / IQ4XS the same looked up from the nibbles: vector g & 3, low nibbles for
 * g < 4, high ones after */
static inline __attribute__((always_inline)) __m256i q8_weights(const uint8_t *q, int g, int nl) {
    if (!nl) return _mm256_loadu_si256((const __m256i *)(q + 32 * g));
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * (g & 3)));
    const __m256i nib = _mm256_and_si256(g < 4 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tlq_iq4nl)), nib);
}

/* Q3K: the 8 outputs' sub-block scales sc - 32 (int32 lanes) of sub-block k from the header */
static inline __attribute__((always_inline)) __m256i q3_scale(const uint8_t *sb, int k) {
    const __m256i low = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * ((k % 8) / 4)));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(sb + 80));
    const __m256i l4 = _mm256_and_si256(_mm256_srl_epi32(low, _mm_cvtsi32_si128(8 * (k % 4) + 4 * (k / 8))), _mm256_set1_epi32(15));
    const __m256i h2 = _mm256_and_si256(_mm256_srl_epi32(high, _mm_cvtsi32_si128(8 * (k % 4) + 2 * (k / 4))), _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(l4, _mm256_slli_epi32(h2, 4)), _mm256_set1_epi32(32));
}

/* Q3K / Q2K: a block's low 2 bits of weight vector g (unsigned 0..3; body: the block's bytes) */
static inline __attribute__((always_inline)) __m256i q_crumbs(const uint8_t *body, int g) {
    const __m256i crumbs = _mm256_loadu_si256((const __m256i *)(body + 32 * (g / 4)));
    return _mm256_and_si256(_mm256_srl_epi16(crumbs, _mm_cvtsi32_si128(2 * (g % 4))), _mm256_set1_epi8(3));
}

/* Q2K: the 8 outputs' scale (sc) and min factor (m) of sub-block k, int32 lanes */
static inline __attribute__((always_inline)) void q2_scale(const uint8_t *sb, int k, __m256i *sc, __m256i *m) {
    const __m256i v = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(sb + 32 + 32 * (k / 4))), _mm_cvtsi32_si128(8 * (k % 4)));
    *sc = _mm256_and_si256(v, _mm256_set1_epi32(15));
    *m = _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi32(15));
}

/* Q3K: a block's weight vector g as signed int8 q - 4 (body: the block's 96 bytes) */
static inline __attribute__((always_inline)) __m256i q3_weights(const uint8_t *body, int g) {
    const __m256i thirds = _mm256_loadu_si256((const __m256i *)(body + 64));
    const __m256i lo = q_crumbs(body, g);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(thirds, _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 2)), _mm256_set1_epi8(4));
}

/* A 32-input block's exact integer sums without VNNI, per row (isum): Q4_0 / Q4_1 / Q5_0 / Q5_1
 * nibbles (qb: the block's nibble bytes) as int16 sums of vpmaddubsw (4 vectors of Q4: <= 4 x 2 x
 * 2 x 15 x 127 = 30480; 2 of Q5: <= 31496) widened by vpmaddwd; Q8_0 / IQ4_NL / IQ4_XS bytes by
 * the sign form (|w| times x with w's sign). Row r's activation dword j of the block is
 * xv[r][j0 + j] (q_tile_xb's broadcast buffer) or, with xv NULL, broadcast from xrow[r] */
static inline __attribute__((always_inline)) void q_block_sums(const uint8_t *qb, int format, __m256i isum[QR], const int NR,
                                                               const int8_t *const xrow[QR], const __m256i (*xv)[64], int j0) {
#define Q_XV(r, j) (xv ? xv[r][j0 + (j)] : _mm256_set1_epi32(((const int32_t *)xrow[r])[j]))
    const int q5 = q_is_q5(format), q4 = q_is_q4(format), nl = q_is_nl(format);
    const __m256i lo4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    if (q4) {
        __m256i s16[QR];
        for (int r = 0; r < NR; r++) s16[r] = isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qb + 32 * t));
            __m256i wl = _mm256_and_si256(raw, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
            if (q5) q5_high(qb, t, &wl, &wh);
            for (int r = 0; r < NR; r++) {
                s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(wl, Q_XV(r, t)), _mm256_maddubs_epi16(wh, Q_XV(r, t + 4))));
                if (NR > 1) TLQ_KEEP(s16[r]);
                if (q5 && t == 1) {
                    isum[r] = _mm256_madd_epi16(s16[r], ones);
                    s16[r] = _mm256_setzero_si256();
                }
            }
        }
        for (int r = 0; r < NR; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], ones));
        return;
    }
    for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const __m256i wv = q8_weights(qb, g, nl);
        const __m256i wa = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < NR; r++) {
            const __m256i xs8 = _mm256_sign_epi8(Q_XV(r, g), wv);
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs8), ones));
            if (NR > 1) TLQ_KEEP(isum[r]);
        }
    }
#undef Q_XV
}

/* The min term's weight factor of a 32-input block (blk; dw: its d): Q4_0's -8 d, Q5_0's -16 d,
 * Q4_1's / Q5_1's m, Q2_K's -dmin (times sum(m x)); 0 for the others */
static inline __attribute__((always_inline)) __m256 q_min_factor(const uint8_t *blk, __m256 dw, int format) {
    return format == TLQ_Q40X8 ? _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f))
         : format == TLQ_Q50X8 ? _mm256_mul_ps(dw, _mm256_set1_ps(-16.0f))
         : format == TLQ_Q4X8 || format == TLQ_Q51X8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
         : format == TLQ_Q2K ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))))
                             : _mm256_setzero_ps();
}

/* A block's float steps for one row (isum: its exact integer sum; xd, xs: the row's block scale
 * and d sum q): acc = fma(float(isum), d_w d_x, acc), then for the Q4 / Q5 formats
 * acc = fma(mw, xs, acc) */
static inline __attribute__((always_inline)) __m256 q_float_step(__m256 acc, __m256i isum, __m256 dw, __m256 mw, float xd, float xs, int q4) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(xd)), acc);
    return q4 ? _mm256_fmadd_ps(mw, _mm256_set1_ps(xs), acc) : acc;
}

/* One tile: NR rows x NO groups of 8 outputs (groups g0 ..). */
static inline __attribute__((always_inline)) void q_tile(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y,
        int64_t m0, int64_t g0, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR, const int NO) {
    const int vnni = TLQ_HAS_VNNI && (format & TLQ_VNNI); /* a constant in each instantiation */
    format &= ~TLQ_VNNI;
    const int64_t nb = in_dim / 32, gb = q_group_bytes(format), group_stride = nb * gb;
    /* partial sums per row: enough chains in flight without spilling the 32 vector registers */
    const int NS = NR <= 2 ? 4 : NR <= 4 ? 2 : 1;
    const __m256i lo4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[QR][QO];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; bi++) {
        for (int j = 0; j < NO; j++) {
            const int q5 = q_is_q5(format), q4 = q_is_q4(format), nl = q_is_nl(format);
            const int64_t qoff = q_quant_offset(format);
            const uint8_t *blk = w + (g0 + j) * group_stride + bi * gb, *qb = blk + qoff;
            __m256 dw;
            if (format == TLQ_Q2K) { /* the superblock's header (d, dmin; the scales, read below), then block bi % 8 */
                const uint8_t *sb = w + (g0 + j) * group_stride + (bi >> 3) * TLQ_Q2K_SB;
                blk = sb;
                qb = sb + 160 + 64 * (bi & 7);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 84), _MM_HINT_T0);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 84 + 64), _MM_HINT_T0);
                dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            } else if (format == TLQ_Q3K) { /* the superblock's header (d; the sub-scales, read below), then block bi % 8 */
                const uint8_t *sb = w + (g0 + j) * group_stride + (bi >> 3) * TLQ_Q3K_SB;
                blk = sb;
                qb = sb + 112 + 96 * (bi & 7);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 110), _MM_HINT_T0);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 110 + 64), _MM_HINT_T0);
                dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            } else if (format == TLQ_IQ4XS) { /* the superblock's header, then block bi % 8's nibbles */
                const uint8_t *sb = w + (g0 + j) * group_stride + (bi >> 3) * TLQ_IQ4XS_SB;
                const int jb = (int)(bi & 7);
                qb = sb + 64 + 128 * jb;
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 136), _MM_HINT_T0);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 136 + 64), _MM_HINT_T0);
                if (m0 == 0) _mm_prefetch((const char *)(qb + TLQ_PF * 136 + 128), _MM_HINT_T0);
                const __m256i sl = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(sb + 16)), _mm_cvtsi32_si128(4 * jb));
                const __m256i sh = _mm256_srl_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sb + 48))), _mm_cvtsi32_si128(2 * jb));
                const __m256i ls = _mm256_or_si256(_mm256_and_si256(sl, _mm256_set1_epi32(15)), _mm256_slli_epi32(_mm256_and_si256(sh, _mm256_set1_epi32(3)), 4));
                dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
            } else {
                if (m0 == 0) /* later row tiles find the weights in cache */
                    for (int64_t pf = 0; pf < gb; pf += 64) _mm_prefetch((const char *)(blk + TLQ_PF * gb + pf), _MM_HINT_T0);
                dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            }
            __m256i isum[QR], msum[QR];
            const int8_t *xrow[QR];
            for (int r = 0; r < NR; r++) xrow[r] = xq + (m0 + r) * in_dim + bi * 32;
            if (format == TLQ_Q2K) { /* per 16-input half: the exact sums of q x and of x, times sc and m */
                const __m256i one8 = _mm256_set1_epi8(1);
                for (int r = 0; r < NR; r++) isum[r] = msum[r] = _mm256_setzero_si256();
                for (int h = 0; h < 2; h++) {
                    __m256i hs[QR], xsum[QR];
                    for (int r = 0; r < NR; r++) hs[r] = xsum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int s4 = 0; s4 < 4; s4++) {
                        const int g = 4 * h + s4;
                        const __m256i wv = q_crumbs(qb, g);
                        for (int r = 0; r < NR; r++) {
                            const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                            const __m256i xv = _mm256_set1_epi32(xr[g]);
                            if (vnni) {
                                hs[r] = tlq_dpbusd(hs[r], wv, xv);
                                xsum[r] = tlq_dpbusd(xsum[r], one8, xv);
                            } else {
                                hs[r] = _mm256_add_epi32(hs[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
                                xsum[r] = _mm256_add_epi32(xsum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(one8, xv), ones));
                                if (NR > 1) TLQ_KEEP(hs[r]);
                                if (NR > 1) TLQ_KEEP(xsum[r]);
                            }
                        }
                    }
                    __m256i sc, mn;
                    q2_scale(blk, 2 * (int)(bi & 7) + h, &sc, &mn);
                    for (int r = 0; r < NR; r++) {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(hs[r], sc));
                        msum[r] = _mm256_add_epi32(msum[r], _mm256_mullo_epi32(xsum[r], mn));
                    }
                }
            } else if (format == TLQ_Q3K) { /* per 16-input half: its exact sum of (q - 4) x times its scale */
                const __m256i u128 = _mm256_set1_epi8((char)0x80);
                for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
                for (int h = 0; h < 2; h++) {
                    __m256i hs[QR], w128 = _mm256_setzero_si256();
                    for (int r = 0; r < NR; r++) hs[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int s4 = 0; s4 < 4; s4++) {
                        const int g = 4 * h + s4;
                        const __m256i wv = q3_weights(qb, g);
                        if (vnni) { /* activations offset to unsigned, as Q8X8's VNNI form */
                            w128 = tlq_dpbusd(w128, u128, wv);
                            for (int r = 0; r < NR; r++) {
                                const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                                hs[r] = tlq_dpbusd(hs[r], _mm256_set1_epi32(xr[g]), wv);
                            }
                        } else {
                            const __m256i wa = _mm256_sign_epi8(wv, wv);
                            for (int r = 0; r < NR; r++) {
                                const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                                const __m256i xs8 = _mm256_sign_epi8(_mm256_set1_epi32(xr[g]), wv);
                                hs[r] = _mm256_add_epi32(hs[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs8), ones));
                                if (NR > 1) TLQ_KEEP(hs[r]);
                            }
                        }
                    }
                    const __m256i sc = q3_scale(blk, 2 * (int)(bi & 7) + h);
                    for (int r = 0; r < NR; r++)
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(vnni ? _mm256_sub_epi32(hs[r], w128) : hs[r], sc));
                }
            } else if (q4 && vnni) { /* vpdpbusd: the same exact integer sums, one instruction per 4 inputs */
                /* NS independent partial sums per row (added at the end: integer, so the same
                 * sum): one chain of 8 dependent vpdpbusd per block left a row latency-bound */
                __m256i part[QR][QS];
                for (int r = 0; r < NR; r++)
                    for (int p = 0; p < NS; p++) part[r][p] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qoff + 32 * t));
                    __m256i wl = _mm256_and_si256(raw, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
                    if (q5) q5_high(blk + qoff, t, &wl, &wh);
                    for (int r = 0; r < NR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                        part[r][(2 * t) % NS] = tlq_dpbusd(part[r][(2 * t) % NS], wl, _mm256_set1_epi32(xr[t]));
                        part[r][(2 * t + 1) % NS] = tlq_dpbusd(part[r][(2 * t + 1) % NS], wh, _mm256_set1_epi32(xr[t + 4]));
                    }
                }
                for (int r = 0; r < NR; r++) {
                    isum[r] = part[r][0];
                    for (int p = 1; p < NS; p++) isum[r] = _mm256_add_epi32(isum[r], part[r][p]);
                }
            } else if (q4) {
                q_block_sums(qb, format, isum, NR, xrow, NULL, 0);
            } else if (vnni) {
                /* activations offset to unsigned (xq ^ 0x80 = q + 128, done once per call), so one
                 * vpdpbusd per row and 4 inputs: sum w (q + 128) - 128 sum w, all exact int32
                 * (|sum| <= 32 * 255 * 128), the same integer sums as the sign form below */
                __m256i w128[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                const __m256i u128 = _mm256_set1_epi8((char)0x80);
                __m256i part[QR][QS];
                for (int r = 0; r < NR; r++)
                    for (int p = 0; p < NS; p++) part[r][p] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) {
                    const __m256i wv = q8_weights(qb, g, nl);
                    w128[g & 1] = tlq_dpbusd(w128[g & 1], u128, wv);
                    for (int r = 0; r < NR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                        part[r][g % NS] = tlq_dpbusd(part[r][g % NS], _mm256_set1_epi32(xr[g]), wv);
                    }
                }
                for (int r = 0; r < NR; r++) {
                    __m256i v = part[r][0];
                    for (int p = 1; p < NS; p++) v = _mm256_add_epi32(v, part[r][p]);
                    v = _mm256_sub_epi32(v, _mm256_add_epi32(w128[0], w128[1]));
                    isum[r] = v;
                }
            } else {
                q_block_sums(qb, format, isum, NR, xrow, NULL, 0);
            }
            const __m256 mw = q_min_factor(blk, dw, format);
            for (int r = 0; r < NR; r++) {
                const int64_t xi = (m0 + r) * nb + bi;
                acc[r][j] = q_float_step(acc[r][j], isum[r], dw, mw, xd[xi], q4 ? xs[xi] : 0.0f, q4);
                if (format == TLQ_Q2K) /* - dmin sum(m x), after the scaled sum */
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(mw, _mm256_set1_ps(xd[xi])), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            __m256 v = acc[r][j];
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + (g0 + j) * 8));
            float *dst = y + (m0 + r) * out_dim + (g0 + j) * 8;
            if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
            _mm256_storeu_ps(dst, v);
        }
}

#define Q_NO(NR_, MAXO)                                                                                   \
    switch (no < (MAXO) ? no : (MAXO)) {                                                                  \
        case 4: q_tile(xq, xd, xs, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_, 4); break;    \
        case 3: q_tile(xq, xd, xs, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_, 3); break;    \
        case 2: q_tile(xq, xd, xs, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_, 2); break;    \
        default: q_tile(xq, xd, xs, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_, 1); break;   \
    }

/* Groups [g_lo, g_hi) for all rows, one group (one weight stream) per tile and up to QR rows:
 * measured here, tiles over 2-4 groups ran a one-row call 2.4x slower. */
static inline __attribute__((always_inline)) void q_groups(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y, int64_t rows,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate) {
    const int64_t tile_g = 1, tile_r = QR;
    for (int64_t g = g_lo; g < g_hi; g += tile_g) {
        const int no = (int)(g_hi - g < tile_g ? g_hi - g : tile_g);
        for (int64_t m0 = 0; m0 < rows; m0 += tile_r) {
            switch (rows - m0 < tile_r ? rows - m0 : tile_r) {
                case 8: Q_NO(8, 1) break;
                case 7: Q_NO(7, 1) break;
                case 6: Q_NO(6, 1) break;
                case 5: Q_NO(5, 1) break;
                case 4: Q_NO(4, 1) break;
                case 3: Q_NO(3, 1) break;
                case 2: Q_NO(2, 1) break;
                default: Q_NO(1, 1) break;
            }
        }
    }
}

/* The K-quants (Q4K, Q5K, Q6K) against Q8_K activations (one scale per row and superblock of
 * 256: tl_quantize_q8k), as ggml's vec_dot_q4_K_q8_K does: per superblock and row, the blocks'
 * exact integer sums are multiplied by their integer sub-scales and added as integers (vpmaddwd
 * of the int16 sums by the scales, or with VNNI vpdpbusd sums times the scales by vpmulld), the
 * min terms likewise from the activations' paired block sums; then one or two float steps per
 * superblock: Q4K / Q5K acc = fma(float(S), d_w d_x, acc), acc = fma(float(M), -dmin_w d_x, acc);
 * Q6K acc = fma(float(S - 32 C), d_w d_x, acc) with C = sum over runs of 16 of sc times the run's
 * activation sum. Bounds (|q_x| <= 127): Q4K |S| <= 8 * 2 * 30480 * 63, Q5K twice that, Q6K
 * |S| <= 64 * 2 * 16002 * 128 and |32 C| <= 32 * 8 * 2 * 2032 * 128: all int32. Float steps in
 * one fixed order per output and row: a k-row call equals k one-row calls bit for bit. */
/* A Q4K / Q5K block's vector t: the 8 outputs' q for inputs 4 t .. 4 t + 3 (wl) and 16 + 4 t ..
 * (wh), with Q5K's 5th bits */
static inline __attribute__((always_inline)) void qk_nibbles(const uint8_t *blk, int t, int q5, __m256i *wl, __m256i *wh) {
    const __m256i lo4 = _mm256_set1_epi8(15), raw = _mm256_loadu_si256((const __m256i *)(blk + 32 * t));
    *wl = _mm256_and_si256(raw, lo4);
    *wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
    if (q5) q5_high(blk, t, wl, wh);
}

/* Q8_K activations, the runs of 4 of input t and t + 4 (quant.h's nibble halves) side by side */
static inline __attribute__((always_inline)) int32_t qk_x(const int8_t *xq, int64_t off, int quad) {
    return ((const int32_t *)(xq + off))[quad < 4 ? 2 * quad : 2 * quad - 7];
}

/* Prefetch the superblock two ahead an eighth per block of 32 (as the 32-input tiles prefetch
 * per block): all of it at once per superblock ran 5-8 rows ~15 % slower on cold weights */
static inline __attribute__((always_inline)) void qk_prefetch(const uint8_t *ahead, int64_t sbb, int bi) {
    for (int64_t pf = bi * sbb / 8; pf < (bi + 1) * sbb / 8; pf += 64) _mm_prefetch((const char *)(ahead + pf), _MM_HINT_T0);
}

/* Block bi's exact integer sums without VNNI, added to S[r] (the superblock's, per row): Q4K / Q5K
 * int16 sums of vpmaddubsw over its nibble vectors (Q5K flushed every two steps), one vpmaddwd by
 * the block's scale; Q6K per run of 16 two int16 sums (each <= 2 * 2 * 63 * 127 = 32004), one
 * vpmaddwd each by the run's scale. Row r's activation dword j of the block (memory order) is
 * xv[r][8 bi + j] (qk_tile_xb's broadcast buffer) or, with xv NULL, broadcast from xrow[r] */
static inline __attribute__((always_inline)) void qk_block_sums(const uint8_t *blk, int bi, int q5, int q6, const __m256i sc[16], __m256i S[QR],
                                                                const int NR, const int8_t *const xrow[QR], const __m256i (*xv)[64]) {
#define QK_XV(r, j) (xv ? xv[r][8 * bi + (j)] : _mm256_set1_epi32(((const int32_t *)xrow[r])[j]))
    if (q6) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i s16[QR];
#pragma GCC unroll 2
            for (int u = 0; u < 2; u++) {
                const int gi = 4 * h + 2 * u; /* quads gi, gi + 1: dwords qk_x reads */
                const int j0 = gi < 4 ? 2 * gi : 2 * gi - 7, j1 = gi + 1 < 4 ? 2 * gi + 2 : 2 * gi - 5;
                const __m256i w0 = q6_vector(blk, gi), w1 = q6_vector(blk, gi + 1);
                for (int r = 0; r < NR; r++) {
                    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, QK_XV(r, j0)), _mm256_maddubs_epi16(w1, QK_XV(r, j1)));
                    TLQ_KEEP(p);
                    if (u) {
                        S[r] = _mm256_add_epi32(S[r], _mm256_add_epi32(_mm256_madd_epi16(s16[r], sc[2 * bi + h]), _mm256_madd_epi16(p, sc[2 * bi + h])));
                    } else {
                        s16[r] = p;
                    }
                }
            }
        }
        return;
    }
    __m256i s16[QR];
    for (int r = 0; r < NR; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        __m256i wl, wh;
        qk_nibbles(blk, t, q5, &wl, &wh);
        for (int r = 0; r < NR; r++) {
            s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(wl, QK_XV(r, 2 * t)), _mm256_maddubs_epi16(wh, QK_XV(r, 2 * t + 1))));
            TLQ_KEEP(s16[r]);
        }
        if (q5 && (t & 1)) /* Q5: at most 4 * 2 * 31 * 127 = 31496 in int16 per two steps */
            for (int r = 0; r < NR; r++) {
                S[r] = _mm256_add_epi32(S[r], _mm256_madd_epi16(s16[r], sc[bi]));
                s16[r] = _mm256_setzero_si256();
            }
    }
    if (!q5)
        for (int r = 0; r < NR; r++) S[r] = _mm256_add_epi32(S[r], _mm256_madd_epi16(s16[r], sc[bi]));
#undef QK_XV
}

/* A superblock's float steps for one row (S: its integer sum; bs, dx: the row's paired activation
 * sums and scale of the superblock; d, nmin: the group's d and -dmin): the min terms' integer sum
 * M, then Q6K acc = fma(float(S - 32 M), d dx, acc), else acc = fma(float(S), d dx, acc) and
 * acc = fma(float(M), nmin dx, acc) */
static inline __attribute__((always_inline)) __m256 qk_float_steps(__m256 acc, __m256i S, const int32_t *bs, __m256 dx, __m256 d, __m256 nmin,
                                                                   const __m256i mp[8], int q6) {
    __m256i M = _mm256_setzero_si256();
    if (q6) {
        for (int k = 0; k < 8; k++) M = _mm256_add_epi32(M, _mm256_madd_epi16(mp[k], _mm256_set1_epi32(bs[4 + k])));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(S, _mm256_slli_epi32(M, 5))), _mm256_mul_ps(d, dx), acc);
    }
    for (int k = 0; k < 4; k++) M = _mm256_add_epi32(M, _mm256_madd_epi16(mp[k], _mm256_set1_epi32(bs[k])));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, dx), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(nmin, dx), acc);
}

/* The tile's outputs for row r of group g: + bias, then onto y when accumulating */
static inline __attribute__((always_inline)) void qk_store(__m256 v, const float *b, float *y, int64_t row, int64_t g, int64_t out_dim, int accumulate) {
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + g * 8));
    float *dst = y + row * out_dim + g * 8;
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
    _mm256_storeu_ps(dst, v);
}

static inline __attribute__((always_inline)) void qk_tile(
        const int8_t *xq, const float *xd, const int32_t *xb, const uint8_t *w, const float *b, float *y,
        int64_t m0, int64_t g, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR) {
    const int vnni = TLQ_HAS_VNNI && (format & TLQ_VNNI); /* a constant in each instantiation */
    format &= ~TLQ_VNNI;
    const int q6 = format == TLQ_Q6K, q5 = format == TLQ_Q5K;
    const int64_t nsb = in_dim / 256, sbb = 8 * q_group_bytes(format), head = q6 ? 144 : 128, bb = q6 ? 192 : q5 ? 160 : 128;
    const uint8_t *wg = w + g * nsb * sbb;
    __m256 acc[QR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nsb; sbi++) {
        const uint8_t *sb = wg + sbi * sbb;
        __m256i sc[16], mp[8], S[QR];
        qk_scales(sb, format, !vnni, sc, mp);
        for (int r = 0; r < NR; r++) S[r] = _mm256_setzero_si256();
        if (vnni) {
            const int NS = NR <= 2 ? 4 : NR <= 4 ? 2 : 1; /* independent partial sums per row */
            for (int bi = 0; bi < 8; bi++) {
                const uint8_t *blk = sb + head + bi * bb;
                const int64_t xo = sbi * 256 + bi * 32;
                if (m0 == 0) qk_prefetch(sb + 2 * sbb, sbb, bi); /* later row tiles find the weights in cache */
                __m256i part[QR][QS];
                for (int r = 0; r < NR; r++)
                    for (int p = 0; p < (q6 ? 4 : NS); p++) part[r][p] = _mm256_setzero_si256();
                if (q6) { /* two runs of 16 with their own scales: parts 0 / 1 (2 / 3 for 1-2 rows) */
                    const int NH = NR <= 2 ? 2 : 1;
#pragma GCC unroll 8
                    for (int gi = 0; gi < 8; gi++) {
                        const __m256i wv = q6_vector(blk, gi);
                        const int p = (gi >> 2) * NH + (gi & (NH - 1));
                        for (int r = 0; r < NR; r++)
                            part[r][p] = tlq_dpbusd(part[r][p], wv, _mm256_set1_epi32(qk_x(xq, (m0 + r) * in_dim + xo, gi)));
                    }
                    for (int r = 0; r < NR; r++) {
                        const __m256i lo = NH == 2 ? _mm256_add_epi32(part[r][0], part[r][1]) : part[r][0];
                        const __m256i hi = NH == 2 ? _mm256_add_epi32(part[r][2], part[r][3]) : part[r][1];
                        S[r] = _mm256_add_epi32(S[r], _mm256_add_epi32(_mm256_mullo_epi32(lo, sc[2 * bi]), _mm256_mullo_epi32(hi, sc[2 * bi + 1])));
                    }
                    continue;
                }
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m256i wl, wh;
                    qk_nibbles(blk, t, q5, &wl, &wh);
                    for (int r = 0; r < NR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + xo);
                        part[r][(2 * t) % NS] = tlq_dpbusd(part[r][(2 * t) % NS], wl, _mm256_set1_epi32(xr[2 * t]));
                        part[r][(2 * t + 1) % NS] = tlq_dpbusd(part[r][(2 * t + 1) % NS], wh, _mm256_set1_epi32(xr[2 * t + 1]));
                    }
                }
                for (int r = 0; r < NR; r++) {
                    __m256i v = part[r][0];
                    for (int p = 1; p < NS; p++) v = _mm256_add_epi32(v, part[r][p]);
                    S[r] = _mm256_add_epi32(S[r], _mm256_mullo_epi32(v, sc[bi]));
                }
            }
        } else {
            for (int bi = 0; bi < 8; bi++) {
                const int64_t xo = sbi * 256 + bi * 32;
                if (m0 == 0) qk_prefetch(sb + 2 * sbb, sbb, bi); /* later row tiles find the weights in cache */
                const int8_t *xrow[QR];
                for (int r = 0; r < NR; r++) xrow[r] = xq + (m0 + r) * in_dim + xo;
                qk_block_sums(sb + head + bi * bb, bi, q5, q6, sc, S, NR, xrow, NULL);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        const __m256 nmin = q6 ? d : _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16))), _mm256_set1_ps(-0.0f));
        for (int r = 0; r < NR; r++)
            acc[r] = qk_float_steps(acc[r], S[r], xb + ((m0 + r) * nsb + sbi) * QK_BS, _mm256_set1_ps(xd[(m0 + r) * nsb + sbi]), d, nmin, mp, q6);
    }
    for (int r = 0; r < NR; r++) qk_store(acc[r], b, y, m0 + r, g, out_dim, accumulate);
}

/* The K tile without VNNI for up to 8 rows, superblock-major over a run of groups (QK_XB_G at a
 * time): per superblock, each row's 64 runs of four activations are broadcast once into a
 * 2 KB-a-row buffer that stays in L1 while the run's groups pass, and vpmaddubsw reads them as
 * its memory operand. The group-major tile (qk_tile) broadcast them again for every group: one
 * vpbroadcastd per vpmaddubsw, a third of the tile's instructions (on Zen 3 each takes a
 * vector pipe, on Intel a front-end slot). The rows' float accumulators live in a small array
 * between superblocks. Each output's integer sums and float steps are qk_tile's, in the same
 * order (superblock after superblock, then bias, then the accumulation): the same bits. */
#define QK_XB_G 16 /* groups a pass */
TLQ_SETTING(tlq_xb_rows, 4); /* the superblock-major tile from this many rows up, QR at a time (0: never): 2-3 rows measured 0.93-1.12x the time on Cascade Lake (s29) */

/* The step the tile `ahead` (<= the pass's groups) tiles after group g's step s reads, in a pass's
 * order (step-major over groups [g_lo, g_hi); a step: a superblock, or q_tile_xb's run of blocks,
 * of `step` bytes, `stride` bytes a group), for its prefetch; NULL past the last of nsteps */
static inline __attribute__((always_inline)) const uint8_t *qk_xb_ahead(const uint8_t *w, int64_t g, int64_t g_lo, int64_t g_hi, int64_t s,
                                                                        int64_t nsteps, int64_t stride, int64_t step, int ahead) {
    int64_t g2 = g + ahead, s2 = s;
    if (g2 >= g_hi) g2 -= g_hi - g_lo, s2++;
    return s2 < nsteps ? w + g2 * stride + s2 * step : NULL;
}

/* The broadcast buffer's fill: dst[j] = x32[j] in every dword, j < 8 n (unrolled by 8: the loop's
 * counter and compare took as many ALU slots as the broadcasts' stores, a tenth of an 8-row tile
 * on Golden Cove) */
static inline __attribute__((always_inline)) void q_xv_fill(__m256i *dst, const int32_t *x32, int n) {
    for (int i = 0; i < n; i++) {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) dst[8 * i + k] = _mm256_set1_epi32(x32[8 * i + k]);
    }
}

/* all the call's rows (one tile of at most QR) */
static inline __attribute__((always_inline)) void qk_tile_xb(
        const int8_t *xq, const float *xd, const int32_t *xb, const uint8_t *w, const float *b, float *y,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR) {
    const int q6 = format == TLQ_Q6K, q5 = format == TLQ_Q5K;
    const int64_t nsb = in_dim / 256, sbb = 8 * q_group_bytes(format), head = q6 ? 144 : 128, bb = q6 ? 192 : q5 ? 160 : 128;
    __m256i xv[QR][64]; /* row r's broadcast runs of four activations of the superblock, in memory order */
    __m256 acc[QK_XB_G][QR];
    for (int64_t s = 0; s < nsb; s++) {
        for (int r = 0; r < NR; r++) q_xv_fill(xv[r], (const int32_t *)(xq + r * in_dim + s * 256), 8);
        for (int64_t g = g_lo; g < g_hi; g++) {
            const uint8_t *sb = w + g * nsb * sbb + s * sbb;
            const uint8_t *ahead = qk_xb_ahead(w, g, g_lo, g_hi, s, nsb, nsb * sbb, sbb, g_hi - g_lo < 2 ? g_hi - g_lo : 2);
            __m256i sc[16], mp[8], S[QR];
            qk_scales(sb, format, 1, sc, mp);
            for (int r = 0; r < NR; r++) S[r] = _mm256_setzero_si256();
            for (int bi = 0; bi < 8; bi++) {
                if (ahead) qk_prefetch(ahead, sbb, bi);
                qk_block_sums(sb + head + bi * bb, bi, q5, q6, sc, S, NR, NULL, (const __m256i (*)[64])xv);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            const __m256 nmin = q6 ? d : _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16))), _mm256_set1_ps(-0.0f));
            for (int r = 0; r < NR; r++)
                acc[g - g_lo][r] = qk_float_steps(s ? acc[g - g_lo][r] : _mm256_setzero_ps(), S[r], xb + (r * nsb + s) * QK_BS,
                                                  _mm256_set1_ps(xd[r * nsb + s]), d, nmin, mp, q6);
        }
    }
    for (int64_t g = g_lo; g < g_hi; g++)
        for (int r = 0; r < NR; r++) qk_store(acc[g - g_lo][r], b, y, r, g, out_dim, accumulate);
}

/* The 32-input formats' tile without VNNI for up to 8 rows (Q4_0 and Q5_0 take it: TLQ_HAS_Q_XB),
 * as qk_tile_xb: run-major over QK_XB_G groups, a run being Q_XB_B blocks of 32 inputs whose
 * activations each row broadcasts once into the buffer vpmaddubsw reads (the group-major tile
 * broadcast them for every group: on Zen 3 each broadcast takes a vector pipe; llvm-mca's model
 * puts an 8-row Q4_0 block at 43 cycles against 75-78, Q5_0 62 against 85-96). Per output and row the
 * block's integer sums and float steps are q_tile's, block after block, then bias and
 * accumulation: the same bits. */
#define Q_XB_B 8 /* blocks of 32 a run (64 broadcast dwords a row) */
static inline __attribute__((always_inline)) void q_tile_xb(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR) {
    const int q4 = q_is_q4(format);
    const int64_t nb = in_dim / 32, gb = q_group_bytes(format), stride = nb * gb, nruns = (nb + Q_XB_B - 1) / Q_XB_B;
    const int64_t qoff = q_quant_offset(format);
    __m256i xv[QR][64]; /* row r's broadcast runs of four activations of the run's blocks, in memory order */
    __m256 acc[QK_XB_G][QR];
    for (int64_t s = 0; s < nruns; s++) {
        const int64_t b0 = s * Q_XB_B;
        const int nbr = nb - b0 < Q_XB_B ? (int)(nb - b0) : Q_XB_B;
        for (int r = 0; r < NR; r++) q_xv_fill(xv[r], (const int32_t *)(xq + r * in_dim + b0 * 32), nbr);
        for (int64_t g = g_lo; g < g_hi; g++) {
            const uint8_t *run = w + g * stride + b0 * gb;
            const uint8_t *ahead = qk_xb_ahead(w, g, g_lo, g_hi, s, nruns, stride, Q_XB_B * gb, g_hi - g_lo < 2 ? g_hi - g_lo : 2);
            for (int bl = 0; bl < nbr; bl++) {
                const uint8_t *blk = run + bl * gb;
                if (ahead)
                    for (int64_t pf = 0; pf < gb; pf += 64) _mm_prefetch((const char *)(ahead + bl * gb + pf), _MM_HINT_T0);
                __m256i isum[QR];
                q_block_sums(blk + qoff, format, isum, NR, NULL, (const __m256i (*)[64])xv, 8 * bl);
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)), mw = q_min_factor(blk, dw, format);
                for (int r = 0; r < NR; r++) {
                    const int64_t xi = r * nb + b0 + bl;
                    acc[g - g_lo][r] = q_float_step(b0 + bl ? acc[g - g_lo][r] : _mm256_setzero_ps(), isum[r], dw, mw, xd[xi],
                                                    q4 ? xs[xi] : 0.0f, q4);
                }
            }
        }
    }
    for (int64_t g = g_lo; g < g_hi; g++)
        for (int r = 0; r < NR; r++) qk_store(acc[g - g_lo][r], b, y, r, g, out_dim, accumulate);
}

/* The K tile over two groups at once (16 outputs a 512-bit vector; AVX-512 VNNI only): group g in
 * the low half, g + 1 in the high half, each half loaded from its own group's stream, so one
 * broadcast of four activations feeds 16 outputs (the 8-output tile spends as many broadcasts as
 * vpdpbusd). Every lane computes exactly what qk_tile computes for its output (the same exact
 * integer sums, the same float steps in the same order): the same bits. Used from
 * tlq_pair_rows rows up (tl_quant_pair), and at any row count from TLQ_PAIR_IN inputs up. */
#if TLQ_HAS_VNNI && defined(TLQ_ALLOW_VNNI) && defined(__AVX512BW__)
#define TLQ_HAS_PAIR 1
#define TLQ_PF2 2    /* superblocks ahead into L1 (1 to 16 measured alike at 5 rows) */
#define TLQ_PF2_L2 8 /* and into L2, up to 6 rows (4-5 rows on cold weights: 0.78-0.99x the time with it) */
static inline __attribute__((always_inline)) __m512i qk_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)), _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __attribute__((always_inline)) __m512i qk_join(__m256i a, __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
/* acc + the dot products of u8 w with the four int8 at x, broadcast from memory in the instruction
 * ({1to16}: GCC issued a separate vpbroadcastd for each; 1.1x the 8-row tile's rate in cache) */
static inline __attribute__((always_inline)) __m512i qk_dpbusd_b(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}
/* qk_nibbles for the two groups' blocks b0 / b1 */
static inline __attribute__((always_inline)) void qk_nibbles2(const uint8_t *b0, const uint8_t *b1, int t, int q5, __m512i *wl, __m512i *wh) {
    const __m512i lo4 = _mm512_set1_epi8(15), raw = qk_pair(b0 + 32 * t, b1 + 32 * t);
    *wl = _mm512_and_si512(raw, lo4);
    *wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
    if (q5) {
        const __m512i hb = qk_pair(b0 + 128, b1 + 128), m10 = _mm512_set1_epi8(0x10);
        const __m512i lo = t == 0 ? _mm512_slli_epi16(hb, 4) : t == 1 ? _mm512_slli_epi16(hb, 3) : t == 2 ? _mm512_slli_epi16(hb, 2) : _mm512_slli_epi16(hb, 1);
        const __m512i hi = t == 0 ? hb : t == 1 ? _mm512_srli_epi16(hb, 1) : t == 2 ? _mm512_srli_epi16(hb, 2) : _mm512_srli_epi16(hb, 3);
        *wl = _mm512_or_si512(*wl, _mm512_and_si512(lo, m10));
        *wh = _mm512_or_si512(*wh, _mm512_and_si512(hi, m10));
    }
}
/* q6_vector for the two groups' blocks b0 / b1 */
static inline __attribute__((always_inline)) __m512i q6_vector2(const uint8_t *b0, const uint8_t *b1, int g) {
    const __m512i lo4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const int t = g & 3;
    const __m512i raw = qk_pair(b0 + 32 * t, b1 + 32 * t);
    const __m512i lo = _mm512_and_si512(g < 4 ? raw : _mm512_srli_epi16(raw, 4), lo4);
    const __m512i hb = qk_pair(b0 + 128 + 32 * (g >> 2), b1 + 128 + 32 * (g >> 2));
    const __m512i hi = t == 0 ? _mm512_slli_epi16(hb, 4) : t == 1 ? _mm512_slli_epi16(hb, 2) : t == 2 ? hb : _mm512_srli_epi16(hb, 2);
    return _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
}
/* two groups' f16 factors at `off` in their superblock headers -> 16 floats */
static inline __attribute__((always_inline)) __m512 qk_half2(const uint8_t *s0, const uint8_t *s1, int off) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s0 + off))),
                                                   _mm_loadu_si128((const __m128i *)(s1 + off)), 1));
}

static inline __attribute__((always_inline)) void qk_tile2(
        const int8_t *xq, const float *xd, const int32_t *xb, const uint8_t *w, const float *b, float *y,
        int64_t m0, int64_t g, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR) {
    format &= ~TLQ_VNNI;
    const int q6 = format == TLQ_Q6K, q5 = format == TLQ_Q5K;
    const int64_t nsb = in_dim / 256, sbb = 8 * q_group_bytes(format), head = q6 ? 144 : 128, bb = q6 ? 192 : q5 ? 160 : 128;
    const uint8_t *wg0 = w + g * nsb * sbb, *wg1 = wg0 + nsb * sbb;
    /* independent partial sums per row; Q4K: always the two 16-input halves of a block (its
     * low and high nibbles), each scaled by vpdpwssd */
    const int NS = format == TLQ_Q4K ? 2 : NR <= 2 ? 4 : NR <= 4 ? 2 : 1;
    __m512 acc[QR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sbi = 0; sbi < nsb; sbi++) {
        const uint8_t *s0 = wg0 + sbi * sbb, *s1 = wg1 + sbi * sbb;
        /* TLQ_PF2 superblocks ahead in each stream into L1, TLQ_PF2_L2 into L2; past a stream's
         * end, the next pair's same stream (the next group is this pair's other stream, already
         * on its way) */
        const int64_t ahead = TLQ_PF2 * sbb + (sbi + TLQ_PF2 >= nsb ? nsb * sbb : 0);
        const int64_t far = TLQ_PF2_L2 * sbb + (sbi + TLQ_PF2_L2 >= nsb ? nsb * sbb : 0);
        __m256i sc0[16], mp0[8], sc1[16], mp1[8];
        qk_scales(s0, format, 0, sc0, mp0);
        qk_scales(s1, format, 0, sc1, mp1);
        __m512i S[QR];
        for (int r = 0; r < NR; r++) S[r] = _mm512_setzero_si512();
        for (int bi = 0; bi < 8; bi++) {
            const uint8_t *b0 = s0 + head + bi * bb, *b1 = s1 + head + bi * bb;
            const int64_t xo = sbi * 256 + bi * 32;
            if (m0 == 0) { /* the first rows' tile brings the weights in; the later tiles find them in cache */
                qk_prefetch(s0 + ahead, sbb, bi);
                qk_prefetch(s1 + ahead, sbb, bi);
            }
            if (NR <= 6 && m0 == 0) /* NR: a constant per instantiation; 8 rows measured 0.97-1.05x the time with it */
                for (int64_t pf = bi * sbb / 8; pf < (bi + 1) * sbb / 8; pf += 64) {
                    _mm_prefetch((const char *)(s0 + far + pf), _MM_HINT_T1);
                    _mm_prefetch((const char *)(s1 + far + pf), _MM_HINT_T1);
                }
            __m512i part[QR][QS];
            for (int r = 0; r < NR; r++)
                for (int p = 0; p < (q6 ? 4 : NS); p++) part[r][p] = _mm512_setzero_si512();
            if (q6) { /* two runs of 16 with their own scales: parts 0 / 1 (2 / 3 for 1-2 rows) */
                const int NH = NR <= 2 ? 2 : 1;
#pragma GCC unroll 8
                for (int gi = 0; gi < 8; gi++) {
                    const __m512i wv = q6_vector2(b0, b1, gi);
                    const int p = (gi >> 2) * NH + (gi & (NH - 1));
                    for (int r = 0; r < NR; r++)
                        part[r][p] = qk_dpbusd_b(part[r][p], wv, (const int32_t *)(xq + (m0 + r) * in_dim + xo) + (gi < 4 ? 2 * gi : 2 * gi - 7));
                }
                const __m512i slo = qk_join(sc0[2 * bi], sc1[2 * bi]), shi = qk_join(sc0[2 * bi + 1], sc1[2 * bi + 1]);
                for (int r = 0; r < NR; r++) {
                    const __m512i lo = NH == 2 ? _mm512_add_epi32(part[r][0], part[r][1]) : part[r][0];
                    const __m512i hi = NH == 2 ? _mm512_add_epi32(part[r][2], part[r][3]) : part[r][1];
                    S[r] = _mm512_add_epi32(S[r], _mm512_add_epi32(_mm512_mullo_epi32(lo, slo), _mm512_mullo_epi32(hi, shi)));
                }
                continue;
            }
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m512i wl, wh;
                qk_nibbles2(b0, b1, t, q5, &wl, &wh);
                for (int r = 0; r < NR; r++) {
                    const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + xo);
                    part[r][(2 * t) % NS] = qk_dpbusd_b(part[r][(2 * t) % NS], wl, xr + 2 * t);
                    part[r][(2 * t + 1) % NS] = qk_dpbusd_b(part[r][(2 * t + 1) % NS], wh, xr + 2 * t + 1);
                }
            }
            const __m512i scv = qk_join(sc0[bi], sc1[bi]);
            if (format == TLQ_Q4K) { /* each half's sum fits int16 (<= 16 * 15 * 127): S += half * scale as int16 pairs */
                for (int r = 0; r < NR; r++) S[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(S[r], part[r][0], scv), part[r][1], scv);
                continue;
            }
            for (int r = 0; r < NR; r++) {
                __m512i v = part[r][0];
                for (int p = 1; p < NS; p++) v = _mm512_add_epi32(v, part[r][p]);
                S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(v, scv));
            }
        }
        const __m512 d = qk_half2(s0, s1, 0);
        const __m512 nmin = q6 ? d : _mm512_xor_ps(qk_half2(s0, s1, 16), _mm512_set1_ps(-0.0f));
        __m512i mp[8];
        for (int k = 0; k < (q6 ? 8 : 4); k++) mp[k] = qk_join(mp0[k], mp1[k]);
        for (int r = 0; r < NR; r++) {
            const int32_t *bs = xb + ((m0 + r) * nsb + sbi) * QK_BS;
            const __m512 dx = _mm512_set1_ps(xd[(m0 + r) * nsb + sbi]);
            __m512i M = _mm512_setzero_si512();
            if (q6) {
                for (int k = 0; k < 8; k++) M = _mm512_add_epi32(M, _mm512_madd_epi16(mp[k], _mm512_set1_epi32(bs[4 + k])));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(S[r], _mm512_slli_epi32(M, 5))), _mm512_mul_ps(d, dx), acc[r]);
            } else {
                for (int k = 0; k < 4; k++) M = _mm512_add_epi32(M, _mm512_madd_epi16(mp[k], _mm512_set1_epi32(bs[k])));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(d, dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(nmin, dx), acc[r]);
            }
        }
    }
    for (int r = 0; r < NR; r++) {
        __m512 v = acc[r];
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + g * 8));
        float *dst = y + (m0 + r) * out_dim + g * 8;
        if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(dst), v);
        _mm512_storeu_ps(dst, v);
    }
}

/* The 32-input Q4 / Q5 formats' tile over two groups (Q4X8, Q40X8, Q50X8, Q51X8; 16 outputs a
 * 512-bit vector, AVX-512 VNNI), as qk_tile2 is the K-quants': group g in the low half, g + 1 in
 * the high half, one broadcast of four activations feeding 16 outputs. Each lane takes q_tile's
 * steps for its output (the same exact block sums, then acc = fma(float(isum), d_w d_x, acc) and
 * acc = fma(m_w, s_x, acc) block after block): the same bits. Used from tlq_pair_rows rows up:
 * prompt prefill and verification, where the 8-output tile spent half its time on float steps. */
static inline __attribute__((always_inline)) void q_tile2(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y,
        int64_t m0, int64_t g, int64_t in_dim, int64_t out_dim, int format, int accumulate, const int NR) {
    format &= ~TLQ_VNNI;
    const int q5 = q_is_q5(format);
    const int64_t nb = in_dim / 32, gb = q_group_bytes(format), group_stride = nb * gb;
    const int64_t qoff = q_quant_offset(format);
    const int NS = NR <= 2 ? 4 : NR <= 4 ? 2 : 1; /* independent partial sums per row */
    const uint8_t *w0 = w + g * group_stride, *w1 = w0 + group_stride;
    __m512 acc[QR];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t bi = 0; bi < nb; bi++) {
        const uint8_t *b0 = w0 + bi * gb, *b1 = w1 + bi * gb;
        if (m0 == 0) /* the first rows' tile brings the weights in; the later tiles find them in cache */
            for (int64_t pf = 0; pf < gb; pf += 64) {
                _mm_prefetch((const char *)(b0 + TLQ_PF * gb + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(b1 + TLQ_PF * gb + pf), _MM_HINT_T0);
            }
        __m512i part[QR][QS];
        for (int r = 0; r < NR; r++)
            for (int p = 0; p < NS; p++) part[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512i wl, wh;
            qk_nibbles2(b0 + qoff, b1 + qoff, t, q5, &wl, &wh);
            for (int r = 0; r < NR; r++) {
                const int32_t *xr = (const int32_t *)(xq + (m0 + r) * in_dim + bi * 32);
                part[r][(2 * t) % NS] = qk_dpbusd_b(part[r][(2 * t) % NS], wl, xr + t);
                part[r][(2 * t + 1) % NS] = qk_dpbusd_b(part[r][(2 * t + 1) % NS], wh, xr + t + 4);
            }
        }
        const __m512 dw = qk_half2(b0, b1, 0);
        /* the min term's weight factor, as q_tile's: Q4_0's -8 d, Q5_0's -16 d, Q4_1's / Q5_1's m */
        const __m512 mw = format == TLQ_Q40X8 ? _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f))
                        : format == TLQ_Q50X8 ? _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f))
                                              : qk_half2(b0, b1, 16);
        for (int r = 0; r < NR; r++) {
            __m512i isum = part[r][0];
            for (int p = 1; p < NS; p++) isum = _mm512_add_epi32(isum, part[r][p]);
            const int64_t xi = (m0 + r) * nb + bi;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(xd[xi])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[xi]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        __m512 v = acc[r];
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + g * 8));
        float *dst = y + (m0 + r) * out_dim + g * 8;
        if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(dst), v);
        _mm512_storeu_ps(dst, v);
    }
}
#else
#define TLQ_HAS_PAIR 0
#endif
TLQ_SETTING(tlq_pair_rows, 4); /* the two-group tile from this many rows up (0: never) */
/* ... and at any row count from this many inputs up (a down projection's): one row's cold stream
 * through it ran at 0.83 of a plain read where the 8-output tile ran at 0.66 (Q4_K [4096, 14336],
 * the fast memory state; 0.91 vs 0.88 in the slow one; Q6_K likewise), while at 2,048-4,096 inputs
 * it gained in the fast state and lost in the slow one (benchmarks/quant_stream.py, s21) */
#define TLQ_PAIR_IN 8192

/* Set from how many rows the K-quants and the 32-input Q4 / Q5 formats use the two-group tiles (0: never; -1: leave as is);
 * returns the setting in force (0 when this build has no such tile). */
TLQ_API int tl_quant_pair(int rows) {
    if (rows >= 0) tlq_pair_rows = rows;
    return TLQ_HAS_PAIR ? tlq_pair_rows : 0;
}

/* Set from how many rows the linears without VNNI take the buffered tiles (the K-quants'
 * superblock-major one; Q4_0 / Q5_0's run-major one, from Q_XB_MIN_ROWS), QR rows at a time (0:
 * never; -1: leave as is); returns the setting in force. */
TLQ_API int tl_quant_xb(int rows) {
    if (rows >= 0) tlq_xb_rows = rows;
    return tlq_xb_rows;
}

/* T(NR) for n rows (1 <= n <= QR), each row count its own instantiation of the tile */
#define QK_BY_ROWS(n, T)                                                                                        \
    switch (n) {                                                                                                 \
        case 8: T(8); break;                                                                                     \
        case 7: T(7); break;                                                                                     \
        case 6: T(6); break;                                                                                     \
        case 5: T(5); break;                                                                                     \
        case 4: T(4); break;                                                                                     \
        case 3: T(3); break;                                                                                     \
        case 2: T(2); break;                                                                                     \
        default: T(1); break;                                                                                    \
    }

static inline __attribute__((always_inline)) void qk_groups(
        const int8_t *xq, const float *xd, const int32_t *xb, const uint8_t *w, const float *b, float *y, int64_t rows,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate) {
#if TLQ_HAS_PAIR
    const int pair = (format & TLQ_VNNI) && tlq_pair_rows > 0 && (rows >= tlq_pair_rows || in_dim >= TLQ_PAIR_IN);
    for (; pair && g_lo + 1 < g_hi; g_lo += 2)
        for (int64_t m0 = 0; m0 < rows; m0 += QR) {
#define QK_T(NR_) qk_tile2(xq, xd, xb, w, b, y, m0, g_lo, in_dim, out_dim, format, accumulate, NR_)
            QK_BY_ROWS(rows - m0 < QR ? rows - m0 : QR, QK_T)
#undef QK_T
        }
#endif
    if (!(format & TLQ_VNNI) && tlq_xb_rows > 0 && rows >= tlq_xb_rows) {
        /* over QR rows (prompt prefill, a long draft's verification) the tile takes them QR at a
         * time while the run's weights stay in cache; a last tile under tlq_xb_rows rows goes
         * group-major, as such a call would */
        const int64_t nsb = in_dim / 256;
        for (int64_t gl = g_lo; gl < g_hi; gl += QK_XB_G) {
            const int64_t gh = gl + QK_XB_G < g_hi ? gl + QK_XB_G : g_hi;
            for (int64_t m0 = 0; m0 < rows; m0 += QR) {
                const int64_t n = rows - m0 < QR ? rows - m0 : QR;
                if (n < tlq_xb_rows) {
                    for (int64_t g = gl; g < gh; g++) {
#define QK_T(NR_) qk_tile(xq, xd, xb, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_)
                        QK_BY_ROWS(n, QK_T)
#undef QK_T
                    }
                    continue;
                }
#define QK_T(NR_)                                                                                                 \
    qk_tile_xb(xq + m0 * in_dim, xd + m0 * nsb, xb + m0 * nsb * QK_BS, w, b, y + m0 * out_dim, gl, gh, in_dim, out_dim, \
               format, accumulate, NR_)
                QK_BY_ROWS(n, QK_T)
#undef QK_T
            }
        }
        return;
    }
    for (int64_t g = g_lo; g < g_hi; g++)
        for (int64_t m0 = 0; m0 < rows; m0 += QR) {
#define QK_T(NR_) qk_tile(xq, xd, xb, w, b, y, m0, g, in_dim, out_dim, format, accumulate, NR_)
            QK_BY_ROWS(rows - m0 < QR ? rows - m0 : QR, QK_T)
#undef QK_T
        }
}

/* A groups function of its own for format F (`groups` instantiated with it; XS: the type of the
 * activations' third array, the K-quants' paired sums or the 32-input formats' d sum q) */
#define TLQ_GROUPS_FN(fname, groups, F, XS) TLQ_GROUPS_DEF(static, fname, groups, F, XS)
#define TLQ_GROUPS_DEF(linkage, fname, groups, F, XS)                                                                       \
    linkage __attribute__((noinline)) void fname(const int8_t *xq, const float *xd, XS xs, const uint8_t *w, const float *b,   \
                                                float *y, int64_t rows, int64_t g_lo, int64_t g_hi, int64_t in_dim,         \
                                                int64_t out_dim, int accumulate) {                                          \
        groups(xq, xd, xs, w, b, y, rows, g_lo, g_hi, in_dim, out_dim, (F), accumulate);                                     \
    }
/* one function per K format (and VNNI or not): all of them inlined into one made the compiler
 * schedule the one-row Q6K tile 13 % slower */
#if TLQ_UNIT == 0
#define QK_FORMAT(name, F) TLQ_GROUPS_FN(qk_groups_##name, qk_groups, F, const int32_t *)
#elif TLQ_UNIT == 2
#define QK_FORMAT(name, F) TLQ_GROUPS_DEF(__attribute__((visibility("hidden"))), qk_groups_##name, qk_groups, F, const int32_t *)
#else /* defined in quant_k.c */
#define QK_FORMAT(name, F)                                                                                             \
    __attribute__((visibility("hidden"))) void qk_groups_##name(const int8_t *, const float *, const int32_t *,       \
                                                               const uint8_t *, const float *, float *, int64_t,      \
                                                               int64_t, int64_t, int64_t, int64_t, int);
#endif
QK_FORMAT(q4k, TLQ_Q4K)
QK_FORMAT(q4k_vnni, TLQ_Q4K | TLQ_VNNI)
QK_FORMAT(q5k, TLQ_Q5K)
QK_FORMAT(q5k_vnni, TLQ_Q5K | TLQ_VNNI)
QK_FORMAT(q6k, TLQ_Q6K)
QK_FORMAT(q6k_vnni, TLQ_Q6K | TLQ_VNNI)

#if TLQ_UNIT != 2 /* the rest: the kernel source's unit (it needs that source's tl_gelu_mul) */

/* Groups [g_lo, g_hi) by the run-major tile, QK_XB_G at a time; one function per format (inlined
 * into q_run, the tiles made the variant's build ~25 s longer). Only in builds without VNNI (the
 * AVX2 variant; AVX-512 without VNNI), where they are the multi-row path; only Q4_0 and Q5_0
 * (each costs the build a few seconds): Q8_0 ran 1.04-1.11x the time on Cascade Lake (its 272-byte
 * blocks leave 4-8 rows near the memory's rate, and the run order breaks the stream), Q4_1,
 * Q5_1 and IQ4_NL are rare; they run group-major. */
#define TLQ_HAS_Q_XB (!TLQ_HAS_VNNI)
/* and from 6 rows: at 4 rows Q4_0 ran 0.93-1.06x the time on Cascade Lake (forwards 1.38x -> 1.49x
 * one row), at 8 rows 0.96-1.02x (forwards 2.73x -> 2.58x); llvm-mca's Zen 3 model puts a 4-row
 * block under its read time from memory either way, where the run order only costs */
#define Q_XB_MIN_ROWS 6
#if TLQ_HAS_Q_XB
/* rows: from tlq_xb_rows and Q_XB_MIN_ROWS up, QR at a time while the run's weights stay in cache
 * (as qk_groups); a last tile under that many rows group-major, as such a call would */
static inline __attribute__((always_inline)) void q_groups_xb(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y, int64_t rows,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate) {
    const int64_t nb = in_dim / 32, from = tlq_xb_rows > Q_XB_MIN_ROWS ? tlq_xb_rows : Q_XB_MIN_ROWS;
    for (int64_t gl = g_lo; gl < g_hi; gl += QK_XB_G) {
        const int64_t gh = gl + QK_XB_G < g_hi ? gl + QK_XB_G : g_hi;
        for (int64_t m0 = 0; m0 < rows; m0 += QR) {
            const int64_t n = rows - m0 < QR ? rows - m0 : QR;
            const int8_t *xq_m = xq + m0 * in_dim;
            const float *xd_m = xd + m0 * nb, *xs_m = xs + m0 * nb;
            if (n < from) {
                q_groups(xq_m, xd_m, xs_m, w, b, y + m0 * out_dim, n, gl, gh, in_dim, out_dim, format, accumulate);
                continue;
            }
#define Q_T(NR_) q_tile_xb(xq_m, xd_m, xs_m, w, b, y + m0 * out_dim, gl, gh, in_dim, out_dim, format, accumulate, NR_)
            switch (n) { /* Q_XB_MIN_ROWS .. QR */
                case 8: Q_T(8); break;
                case 7: Q_T(7); break;
                default: Q_T(6); break;
            }
#undef Q_T
        }
    }
}
TLQ_GROUPS_FN(q_groups_xb_q40, q_groups_xb, TLQ_Q40X8, const float *)
TLQ_GROUPS_FN(q_groups_xb_q50, q_groups_xb, TLQ_Q50X8, const float *)
#endif

/* The 32-input formats' groups: with VNNI, from tlq_pair_rows rows up, the Q4 / Q5 formats' pairs
 * of groups by q_tile2; without it, Q4_0 / Q5_0 from 6 rows by the run-major tile; then any group
 * left by q_groups */
static inline __attribute__((always_inline)) void q_groups_paired(
        const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *b, float *y, int64_t rows,
        int64_t g_lo, int64_t g_hi, int64_t in_dim, int64_t out_dim, int format, int accumulate) {
#if TLQ_HAS_PAIR
    const int pair = q_is_q4(format & ~TLQ_VNNI) && (format & TLQ_VNNI) && tlq_pair_rows > 0 && rows >= tlq_pair_rows;
    for (; pair && g_lo + 1 < g_hi; g_lo += 2)
        for (int64_t m0 = 0; m0 < rows; m0 += QR) {
#define Q_T(NR_) q_tile2(xq, xd, xs, w, b, y, m0, g_lo, in_dim, out_dim, format, accumulate, NR_)
            QK_BY_ROWS(rows - m0 < QR ? rows - m0 : QR, Q_T)
#undef Q_T
        }
#endif
#if TLQ_HAS_Q_XB
    /* from tlq_xb_rows and Q_XB_MIN_ROWS rows up: the run-major tile */
    if (tlq_xb_rows > 0 && rows >= tlq_xb_rows && rows >= Q_XB_MIN_ROWS) {
#define Q_XB(name) q_groups_xb_##name(xq, xd, xs, w, b, y, rows, g_lo, g_hi, in_dim, out_dim, accumulate)
        switch (format) {
            case TLQ_Q40X8: Q_XB(q40); return;
            case TLQ_Q50X8: Q_XB(q50); return;
            default: break;
        }
#undef Q_XB
    }
#endif
    q_groups(xq, xd, xs, w, b, y, rows, g_lo, g_hi, in_dim, out_dim, format, accumulate);
}

/* one part's activations: the 32-input formats' (q, d, s = d sum q per block of 32) or the
 * K-quants' (q, d per superblock, bs: tl_quantize_q8k's paired sums) */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *bs;
} q_act;

typedef struct {
    tl_counter ctr;
    q_act a1, a2;           /* each part's activations */
    const uint8_t *w, *w2;  /* w2: based so that group g of the second part is at w2 + g * its group stride */
    const float *b;
    float *y;
    int64_t rows, in_dim, out_dim, split; /* split: the first group of the second part (out_dim / 8: none) */
    int format, format2, accumulate;
} q_job;

#define Q_CHUNK 4 /* groups of 8 outputs per scheduling chunk */

static inline int q_is_k(int format) { return format == TLQ_Q4K || format == TLQ_Q5K || format == TLQ_Q6K; }
/* the 32-input formats summed with signed int8 weights (their VNNI form reads the activations + 128) */
static inline int q_signed(int format) { return format == TLQ_Q8X8 || q_is_nl(format) || format == TLQ_Q3K; }

static void q_run(const q_job *j, const q_act *a, const uint8_t *w, int format, int64_t lo, int64_t hi) {
    if (lo >= hi) return;
#define Q_GROUPS(F) q_groups_paired(a->q, a->d, a->s, w, j->b, j->y, j->rows, lo, hi, j->in_dim, j->out_dim, (F), j->accumulate)
#define QK_GROUPS(F) qk_groups_##F(a->q, a->d, a->bs, w, j->b, j->y, j->rows, lo, hi, j->in_dim, j->out_dim, j->accumulate)
    switch (format) { /* one instantiation per format (and VNNI or not): the branches on it fold away */
        case TLQ_Q4X8: Q_GROUPS(TLQ_Q4X8); break;
        case TLQ_Q4X8 | TLQ_VNNI: Q_GROUPS(TLQ_Q4X8 | TLQ_VNNI); break;
        case TLQ_Q40X8: Q_GROUPS(TLQ_Q40X8); break;
        case TLQ_Q40X8 | TLQ_VNNI: Q_GROUPS(TLQ_Q40X8 | TLQ_VNNI); break;
        case TLQ_Q50X8: Q_GROUPS(TLQ_Q50X8); break;
        case TLQ_Q50X8 | TLQ_VNNI: Q_GROUPS(TLQ_Q50X8 | TLQ_VNNI); break;
        case TLQ_Q51X8: Q_GROUPS(TLQ_Q51X8); break;
        case TLQ_Q51X8 | TLQ_VNNI: Q_GROUPS(TLQ_Q51X8 | TLQ_VNNI); break;
        case TLQ_Q8X8: Q_GROUPS(TLQ_Q8X8); break;
        case TLQ_Q8X8 | TLQ_VNNI: Q_GROUPS(TLQ_Q8X8 | TLQ_VNNI); break;
        case TLQ_IQ4NL: Q_GROUPS(TLQ_IQ4NL); break;
        case TLQ_IQ4NL | TLQ_VNNI: Q_GROUPS(TLQ_IQ4NL | TLQ_VNNI); break;
        case TLQ_IQ4XS: Q_GROUPS(TLQ_IQ4XS); break;
        case TLQ_IQ4XS | TLQ_VNNI: Q_GROUPS(TLQ_IQ4XS | TLQ_VNNI); break;
        case TLQ_Q3K: Q_GROUPS(TLQ_Q3K); break;
        case TLQ_Q3K | TLQ_VNNI: Q_GROUPS(TLQ_Q3K | TLQ_VNNI); break;
        case TLQ_Q2K: Q_GROUPS(TLQ_Q2K); break;
        case TLQ_Q2K | TLQ_VNNI: Q_GROUPS(TLQ_Q2K | TLQ_VNNI); break;
        case TLQ_Q4K: QK_GROUPS(q4k); break;
        case TLQ_Q4K | TLQ_VNNI: QK_GROUPS(q4k_vnni); break;
        case TLQ_Q6K: QK_GROUPS(q6k); break;
        case TLQ_Q6K | TLQ_VNNI: QK_GROUPS(q6k_vnni); break;
        case TLQ_Q5K: QK_GROUPS(q5k); break;
        case TLQ_Q5K | TLQ_VNNI: QK_GROUPS(q5k_vnni); break;
        default: break;
    }
#undef Q_GROUPS
#undef QK_GROUPS
}

static void q_task(void *ctx, int tid, int nthreads) {
    q_job *j = (q_job *)ctx;
    (void)tid;
    int64_t end;
    for (int64_t c = tl_next_guided(&j->ctr, &end, nthreads); c < j->ctr.count; c = tl_next_guided(&j->ctr, &end, nthreads)) {
        const int64_t ngroups = j->out_dim / 8;
        const int64_t lo = c * Q_CHUNK, hi = end * Q_CHUNK < ngroups ? end * Q_CHUNK : ngroups;
        q_run(j, &j->a1, j->w, j->format, lo, hi < j->split ? hi : j->split);
        q_run(j, &j->a2, j->w2, j->format2, lo > j->split ? lo : j->split, hi);
    }
}

int tl_quant_group_bytes(int format) { return (int)q_group_bytes(format); }

/* The gated MLP's input from (gate | up) [rows, 2f]: `kind` TL_GLU_SILU or TL_GLU_GELU_TANH. */
static void tl_glu_mul(const float *gu, float *y, int64_t rows, int64_t f, int kind) {
    if (kind == TL_GLU_GELU_TANH) tl_gelu_mul(gu, y, rows, f);
    else tl_silu_mul(gu, y, rows, f);
}

/* A linear's activation preparation, row by row: RMSNorm or the GLU into `tmp` (when asked),
 * then the 32-input formats' int8 blocks (and their copy / VNNI flip) and the K-quants' Q8_K
 * blocks. Each row's bytes depend on that row alone, so the rows may be split over the pool's
 * threads (from TLQ_PREP_PAR activations: one thread prepared them while the other waited, ~100 us
 * for 8 rows of a 8,960-input down projection) and the linear's bits do not change. */
typedef struct {
    const float *x, *norm_w;
    float eps;
    int glu;
    float *tmp;
    int8_t *xq;
    float *xd, *xs;
    int any32;
    int8_t *copy, *flipped; /* the second 32-input buffer (or NULL), the one flipped for VNNI (or NULL) */
    int8_t *kq;             /* the K-quants' (NULL: none) */
    float *kd;
    int32_t *kb;
    int64_t rows, in_dim;
} q_prep;

#define TLQ_PREP_PAR 8192 /* rows x inputs from which the preparation is split over the threads */

static void q_prep_rows(const q_prep *p, int64_t r0, int64_t r1) {
    const int64_t in = p->in_dim, nb = in / 32, nsb = in / 256;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = p->x + r * (p->glu ? 2 * in : in);
        if (p->norm_w || p->glu) {
            float *t = p->tmp + r * in;
            if (p->glu) tl_glu_mul(x, t, 1, in, p->glu);
            else tl_rmsnorm(x, p->norm_w, t, 1, in, p->eps);
            x = t;
        }
        if (p->any32) {
            int8_t *q = p->xq + r * in;
            tl_quantize_q8(x, q, p->xd + r * nb, p->xs + r * nb, 1, in);
            if (p->copy) memcpy(p->copy + r * in, q, (size_t)in);
            if (p->flipped) {
                const __m256i flip = _mm256_set1_epi8((char)0x80);
                int8_t *f = p->flipped + r * in;
                for (int64_t i = 0; i < in; i += 32)
                    _mm256_storeu_si256((__m256i *)(f + i), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(f + i)), flip));
            }
        }
        if (p->kq) tl_quantize_q8k(x, p->kq + r * in, p->kd + r * nsb, p->kb + r * nsb * QK_BS, 1, in);
    }
}

static void q_prep_task(void *ctx, int tid, int nthreads) {
    const q_prep *p = (const q_prep *)ctx;
    q_prep_rows(p, p->rows * tid / nthreads, p->rows * (tid + 1) / nthreads);
}

/* y[m, o] (+)= w[o] . x[m] as above (+ b[o]); x fp32 [rows, in_dim], quantized first into
 * `scratch` (with R = rows * in_dim: R + R / 4 bytes for the 32-input formats' activations, 4 R
 * more when fusing, then R more for a second copy (a stack of two 32-input formats of which
 * VNNI flips one) or R + R / 5 for the K-quants' activations: 7 R in all is always enough);
 * in_dim a multiple of 32 (of 256 for the K-quants), out_dim of 8; w: out_dim / 8 groups of in_dim / 32 blocks in
 * `format`, or a stack of two formats (a fused QKV whose V has another type, as Q4_K_M files
 * give: TLQ_STACK(f1, f2, split)): groups [0, split) in f1, then groups [split, out_dim / 8) in
 * f2 (its bytes right after f1's), each output computed as it would be alone. Fused inputs (one
 * call instead of two, the same bits): with `norm_w`, x is RMSNormed
 * first (tl_rmsnorm, `eps`); with `glu` (TL_GLU_*), x is [rows, 2 in_dim] = (gate | up) and the
 * input is tl_glu_mul(x): silu(gate) * up, or gelu_tanh(gate) * up. */
void tl_linear_q(const float *x, const float *norm_w, float eps, int glu, uint8_t *scratch, const uint8_t *w,
                 int format, const float *b, float *y, int64_t rows, int64_t in_dim, int64_t out_dim, int accumulate) {
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + rows * in_dim), *xs = xd + rows * (in_dim / 32);
    const int64_t ngroups = out_dim / 8, chunks = (ngroups + Q_CHUNK - 1) / Q_CHUNK;
    const int f1 = format & 15, f2 = (format >> 4) & 15;
    const int k1 = q_is_k(f1), k2 = f2 && q_is_k(f2), any32 = !k1 || (f2 && !k2);
    const int64_t split = f2 ? (int64_t)(format >> 8) : ngroups;
    if (tlq_use_vnni < 0) tl_quant_vnni(-1);
    uint8_t *extra = scratch + rows * in_dim * ((norm_w || glu) ? 5 : 1) + 8 * rows * (in_dim / 32);
    q_act a32 = {xq, xd, xs, NULL}, a32b = a32, ak = {NULL, NULL, NULL, NULL};
    /* the VNNI int8 forms read q + 128 as unsigned: flipped in place, or into a second buffer
     * when only one part of a stack of two 32-input formats wants it */
    const int flip1 = any32 && tlq_use_vnni && q_signed(f1), flip2 = any32 && tlq_use_vnni && q_signed(f2);
    if (any32 && f2 && !k1 && !k2 && flip1 != flip2) a32b.q = (const int8_t *)extra;
    if (k1 || k2) { /* the K-quants' activations after the 32-input ones (no second copy is then needed) */
        float *kd = (float *)(extra + rows * in_dim);
        ak = (q_act){(const int8_t *)extra, kd, NULL, (const int32_t *)(kd + rows * (in_dim / 256))};
    }
    q_prep prep = {x, norm_w, eps, glu, xs + rows * (in_dim / 32), xq, xd, xs, any32, a32b.q != xq ? (int8_t *)a32b.q : NULL,
                   flip1 ? xq : flip2 ? (int8_t *)a32b.q : NULL, (int8_t *)ak.q, (float *)ak.d, (int32_t *)ak.bs, rows, in_dim};
    if (rows >= 2 && pool.n > 1 && rows * in_dim >= TLQ_PREP_PAR) tl_parallel(q_prep_task, &prep);
    else q_prep_rows(&prep, 0, rows);
    const int64_t grab = 1; /* the smallest grab (tl_next_guided) */
    const int64_t nb = in_dim / 32, gs1 = nb * q_group_bytes(f1), gs2 = f2 ? nb * q_group_bytes(f2) : 0;
    const uint8_t *w2 = (const uint8_t *)((uintptr_t)w + (uintptr_t)(split * gs1) - (uintptr_t)(split * gs2));
    const int vnni = tlq_use_vnni ? TLQ_VNNI : 0;
    q_job job = {{0, chunks, grab}, k1 ? ak : a32, k2 ? ak : a32b, w, w2, b, y, rows, in_dim, out_dim, split,
                 f1 | vnni, f2 ? f2 | vnni : 0, accumulate};
    tl_parallel(q_task, &job);
}
#endif /* TLQ_UNIT != 2 */
