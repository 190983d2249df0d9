/* Vector lanes for the CPU kernels that need more than FMAs: VM_VL lanes of
 * float (16 with AVX-512, 8 with AVX2+FMA; VM_VL undefined on the portable
 * build), loads, horizontal sum and max, lane comparisons as bits, and exp().
 *
 * vm_exp is Cephes' expf in lanes (range reduction by ln 2 in two parts, a
 * degree-5 polynomial) for x <= 0, the softmax numerators' range: within
 * 2 ulp of libm's expf, and 0 below -87.3 where expf is denormal. libm's
 * expf is a scalar call; this is one of the reasons the kernels that take a
 * softmax over thousands of entries a row have a vector path.
 */
#ifndef ENCDEC_VECTOR_MATH_H
#define ENCDEC_VECTOR_MATH_H
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
#define VM_VL 16
typedef __m512 vm_vec;
typedef __m512i vm_ivec;
#define VM_LOAD(p) _mm512_loadu_ps(p)
#define VM_STORE(p, a) _mm512_storeu_ps(p, a)
#define VM_SET1(x) _mm512_set1_ps(x)
#define VM_ZERO() _mm512_setzero_ps()
#define VM_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VM_MUL(a, b) _mm512_mul_ps(a, b)
#define VM_ADD(a, b) _mm512_add_ps(a, b)
#define VM_SUB(a, b) _mm512_sub_ps(a, b)
#define VM_MAX(a, b) _mm512_max_ps(a, b)
#define VM_FLOOR(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define VM_CVT(a) _mm512_cvttps_epi32(a)
#define VM_POW2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23))
#define VM_HSUM(a) _mm512_reduce_add_ps(a)
#define VM_HMAX(a) _mm512_reduce_max_ps(a)
#define VM_BLEND_LT(x, lim, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lim, _CMP_LT_OQ), a, b)
#define VM_EQ_BITS(a, b) ((unsigned)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ))  /* lane i -> bit i */
#else
#define VM_VL 8
typedef __m256 vm_vec;
typedef __m256i vm_ivec;
#define VM_LOAD(p) _mm256_loadu_ps(p)
#define VM_STORE(p, a) _mm256_storeu_ps(p, a)
#define VM_SET1(x) _mm256_set1_ps(x)
#define VM_ZERO() _mm256_setzero_ps()
#define VM_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VM_MUL(a, b) _mm256_mul_ps(a, b)
#define VM_ADD(a, b) _mm256_add_ps(a, b)
#define VM_SUB(a, b) _mm256_sub_ps(a, b)
#define VM_MAX(a, b) _mm256_max_ps(a, b)
#define VM_FLOOR(a) _mm256_floor_ps(a)
#define VM_CVT(a) _mm256_cvttps_epi32(a)
#define VM_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23))
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
#define VM_BLEND_LT(x, lim, a, b) _mm256_blendv_ps(a, b, _mm256_cmp_ps(x, lim, _CMP_LT_OQ))
#define VM_EQ_BITS(a, b) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)))
#endif

/* exp(x) in lanes for x <= 0 (the header). */
static inline vm_vec vm_exp(vm_vec x) {
    const vm_vec lo = VM_SET1(-87.33654f);
    const vm_vec under = VM_BLEND_LT(x, lo, VM_SET1(1.f), VM_ZERO());  /* 0 where x < lo */
    x = VM_MAX(x, lo);
    const vm_vec n = VM_FLOOR(VM_FMA(x, VM_SET1(1.44269504088896341f), VM_SET1(0.5f)));
    x = VM_SUB(x, VM_MUL(n, VM_SET1(0.693359375f)));
    x = VM_SUB(x, VM_MUL(n, VM_SET1(-2.12194440e-4f)));
    vm_vec p = VM_SET1(1.9875691500e-4f);
    p = VM_FMA(p, x, VM_SET1(1.3981999507e-3f));
    p = VM_FMA(p, x, VM_SET1(8.3334519073e-3f));
    p = VM_FMA(p, x, VM_SET1(4.1665795894e-2f));
    p = VM_FMA(p, x, VM_SET1(1.6666665459e-1f));
    p = VM_FMA(p, x, VM_SET1(5.0000001201e-1f));
    p = VM_FMA(p, VM_MUL(x, x), VM_ADD(x, VM_SET1(1.f)));
    return VM_MUL(VM_MUL(p, VM_POW2(VM_CVT(n))), under);
}
#endif

#endif
