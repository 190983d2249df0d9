/* Vector lanes for the CPU kernels that need more than FMAs: VM_VL lanes of
 * float (16 with AVX-512, 8 with AVX2+FMA; VM_VL undefined on the portable
 * build), loads, horizontal sum and max, lane comparisons as bits, sums in
 * double lanes, exp(), a row's maximum and the path name a build reports.
 *
 * vm_exp is Cephes' expf in lanes (range reduction by ln 2 in two parts, a
 * degree-5 polynomial) for x <= 0, the softmax numerators' range, ~1 ulp:
 * written for the dense attention kernel (measured there), shared by every
 * kernel that takes a softmax over thousands of entries a row (libm's expf
 * is a scalar call).
 */
#ifndef ENCDEC_VECTOR_MATH_H
#define ENCDEC_VECTOR_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
#define VM_VL 16
typedef __m512 vm_vec;
#define VM_LOAD(p) _mm512_loadu_ps(p)
#define VM_STORE(p, a) _mm512_storeu_ps(p, a)
#define VM_SET1(x) _mm512_set1_ps(x)
#define VM_ZERO() _mm512_setzero_ps()
#define VM_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VM_MUL(a, b) _mm512_mul_ps(a, b)
#define VM_FNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VM_ADD(a, b) _mm512_add_ps(a, b)
#define VM_SUB(a, b) _mm512_sub_ps(a, b)
#define VM_MAX(a, b) _mm512_max_ps(a, b)
#define VM_MIN(a, b) _mm512_min_ps(a, b)
#define VM_HSUM(a) _mm512_reduce_add_ps(a)
#define VM_HMAX(a) _mm512_reduce_max_ps(a)
#define VM_DIV(a, b) _mm512_div_ps(a, b)
#define VM_ABS(a) _mm512_abs_ps(a)
/* lanes of a where x < 0, of b elsewhere */
#define VM_BLEND_NEG(x, b, a) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a)
#define VM_EQ_BITS(a, b) ((unsigned)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ))  /* lane i -> bit i */
#define VM_NAN_BITS(a) ((unsigned)_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q))
/* VM_VL bfloat16 values (a KV cache held in bfloat16) widened to float lanes: a bfloat16 is a float's upper half */
#define VM_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* VM_VL signed bytes (an int8 K/V slot, paged_attention_i8.h) widened to float lanes */
#define VM_LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#else
#define VM_VL 8
typedef __m256 vm_vec;
#define VM_LOAD(p) _mm256_loadu_ps(p)
#define VM_STORE(p, a) _mm256_storeu_ps(p, a)
#define VM_SET1(x) _mm256_set1_ps(x)
#define VM_ZERO() _mm256_setzero_ps()
#define VM_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VM_MUL(a, b) _mm256_mul_ps(a, b)
#define VM_FNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define VM_ADD(a, b) _mm256_add_ps(a, b)
#define VM_SUB(a, b) _mm256_sub_ps(a, b)
#define VM_MAX(a, b) _mm256_max_ps(a, b)
#define VM_MIN(a, b) _mm256_min_ps(a, b)
static inline float vm_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vm_hmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#define VM_HSUM(a) vm_hsum(a)
#define VM_HMAX(a) vm_hmax(a)
#define VM_DIV(a, b) _mm256_div_ps(a, b)
#define VM_ABS(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)
#define VM_BLEND_NEG(x, b, a) _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ))
#define VM_EQ_BITS(a, b) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)))
#define VM_NAN_BITS(a) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)))
#define VM_LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VM_LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

/* The lane sums of four vectors at once, [sum a, sum b, sum c, sum d]: about
 * half the shuffles of four VM_HSUMs (a paged attention's scores at head size
 * 16 are one FMA and one horizontal sum each). */
static inline __m128 vm_hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  /* [a b c d | a b c d] halves */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#if VM_VL == 16
static inline __m256 vm_halves(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#define VM_HSUM4(a, b, c, d) vm_hsum4_256(vm_halves(a), vm_halves(b), vm_halves(c), vm_halves(d))
#else
#define VM_HSUM4(a, b, c, d) vm_hsum4_256(a, b, c, d)
#endif

/* Float lanes summed in double lanes (vm_dsum; VM_ACC_ADD takes half of v):
 * a softmax's ~35k terms in float lanes drift by 1e-5 relative (measured
 * against float64). */
#if VM_VL == 16
typedef __m512d vm_acc;
#define VM_ACC_ZERO() _mm512_setzero_pd()
#define VM_ACC_ADD(acc, v, half) _mm512_add_pd(acc, _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v)))
#define VM_ACC_SUM(a) _mm512_reduce_add_pd(a)
#else
typedef __m256d vm_acc;
#define VM_ACC_ZERO() _mm256_setzero_pd()
#define VM_ACC_ADD(acc, v, half) _mm256_add_pd(acc, _mm256_cvtps_pd(half ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v)))
static inline double vm_acc_sum(__m256d a) {
    double s[4];
    _mm256_storeu_pd(s, a);
    return (s[0] + s[1]) + (s[2] + s[3]);
}
#define VM_ACC_SUM(a) vm_acc_sum(a)
#endif
typedef struct { vm_acc lo, hi; } vm_dsum;  /* a running sum of float lanes, in double */
static inline vm_dsum vm_dsum_zero(void) { return (vm_dsum){VM_ACC_ZERO(), VM_ACC_ZERO()}; }
static inline void vm_dsum_add(vm_dsum *s, vm_vec v) {
    s->lo = VM_ACC_ADD(s->lo, v, 0);
    s->hi = VM_ACC_ADD(s->hi, v, 1);
}
static inline double vm_dsum_total(vm_dsum s) { return VM_ACC_SUM(s.lo) + VM_ACC_SUM(s.hi); }

/* exp(x - n ln 2) by Cephes' polynomial, ln 2 in two parts (the ISA's vm_exp
 * picks n and multiplies by 2^n). */
static inline vm_vec vm_exp_reduced(vm_vec x, vm_vec n) {
    vm_vec r = VM_FNMADD(n, VM_SET1(0.693359375f), x);
    r = VM_FNMADD(n, VM_SET1(-2.12194440e-4f), r);
    vm_vec p = VM_SET1(1.9875691500E-4f);
    p = VM_FMA(p, r, VM_SET1(1.3981999507E-3f));
    p = VM_FMA(p, r, VM_SET1(8.3334519073E-3f));
    p = VM_FMA(p, r, VM_SET1(4.1665795894E-2f));
    p = VM_FMA(p, r, VM_SET1(1.6666665459E-1f));
    p = VM_FMA(p, r, VM_SET1(5.0000001201E-1f));
    return VM_FMA(p, VM_MUL(r, r), VM_ADD(r, VM_SET1(1.0f)));
}

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (a softmax's scores minus their max): Cephes expf
 * polynomial on x - n ln2, |error| ~1 ulp; scalef rebuilds 2^n and flushes
 * huge negatives to 0. */
static inline __m512 vm_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(vm_exp_reduced(x, n), n);
}

#else
/* The same Cephes exp on 8 lanes. AVX2 has no scalef: n is rounded by adding
 * 1.5 * 2^23 + 127, whose low mantissa bits are then n + 127, shifted into the
 * exponent field to make 2^n (one FMA, a subtract and a shift instead of
 * round, convert, add and shift). Valid for n >= -126, so inputs are clamped
 * at -87.3: exp of anything below gives 2^-126 ~ 1e-38 instead of less, which
 * next to the row max's exp(0) = 1 changes no sum or weight in float32. */
static inline __m256 vm_exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654475f));
    const __m256 magic = _mm256_set1_ps(12583039.0f); /* 1.5 * 2^23 + 127 */
    __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
    __m256 n = _mm256_sub_ps(t, magic);
    return _mm256_mul_ps(vm_exp_reduced(x, n), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

#endif /* the lanes' exp */

/* Exact GELU, 0.5 x (1 + erf(x / sqrt 2)), in lanes: erf by Abramowitz and
 * Stegun 7.1.26 (|error| <= 1.5e-7, the approximation oneDNN's GELU post-op
 * takes), written as 1 + erf = q for x < 0 and 2 - q for x >= 0, with
 * q = poly(t) exp(-z^2), so negative inputs lose nothing to cancellation.
 * z is capped at 9: past it (|x| > 12.7) exp(-z^2) and q would be denormal,
 * which cost a microcode assist each (the int8 dequantization's GELU over
 * outputs of magnitude ~100: 3x slower), and the result is x or a value within
 * 1e-35 of 0 either way. */
static inline vm_vec vm_gelu(vm_vec x) {
    const vm_vec z = VM_MIN(VM_MUL(VM_ABS(x), VM_SET1(0.70710678118654752f)), VM_SET1(9.0f));
    const vm_vec t = VM_DIV(VM_SET1(1.0f), VM_FMA(z, VM_SET1(0.3275911f), VM_SET1(1.0f)));
    vm_vec p = VM_SET1(1.061405429f);
    p = VM_FMA(p, t, VM_SET1(-1.453152027f));
    p = VM_FMA(p, t, VM_SET1(1.421413741f));
    p = VM_FMA(p, t, VM_SET1(-0.284496736f));
    p = VM_FMA(p, t, VM_SET1(0.254829592f));
    const vm_vec q = VM_MUL(VM_MUL(p, t), vm_exp(VM_MUL(VM_SUB(VM_ZERO(), z), z)));
    const vm_vec one_plus_erf = VM_BLEND_NEG(x, VM_SUB(VM_SET1(2.0f), q), q);
    return VM_MUL(VM_MUL(VM_SET1(0.5f), x), one_plus_erf);
}
#endif /* a vector ISA */

/* One bfloat16 (the upper 16 bits of a float32) as a float: exact. */
static inline float vm_bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A float rounded to bfloat16 as torch's .to(torch.bfloat16) rounds a tensor
 * (to nearest, ties to even; a NaN becomes 0xFFFF, as ATen's vectorized
 * conversion makes it), so a K/V row the C kernels write to a bfloat16 cache
 * equals the one torch's cache write would. */
static inline uint16_t vm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* What a build runs, for each kernel's ``*_path()``. */
#if defined(VM_VL)
#define VM_PATH (VM_VL == 16 ? "avx512" : "avx2")
#else
#define VM_PATH "none"
#endif

/* The largest of x[0 .. n) (-inf for none); NaNs are skipped by the lanes. */
static inline float vm_max_of(const float *x, int64_t n) {
    int64_t t = 0;
    float mx = -INFINITY;
#if defined(VM_VL)
    vm_vec m = VM_SET1(-INFINITY);
    for (; t + VM_VL <= n; t += VM_VL) m = VM_MAX(m, VM_LOAD(x + t));
    mx = VM_HMAX(m);
#endif
    for (; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

#endif /* ENCDEC_VECTOR_MATH_H */
