/* The int8 path of dense_attention_cpu.c (quantization="int8"), included by it
 * inside its vector paths: it uses that file's D, R, KC, its ISA's intrinsics and
 * vector_math.h, and int8_rows_cpu.c's quantize_row. */
#ifndef ENCDEC_DENSE_ATTENTION_INT8_H
#define ENCDEC_DENSE_ATTENTION_INT8_H

/* Int8 scores (quantization="int8": dense_attention(..., int8=True)).
 * Why: Whisper's encoder attention is ~55% of an int8 encoder's time, and its
 * float32 Q K^T runs 16 multiply-adds an FMA; vpdpbusd runs 64 (4 byte products a
 * lane), measured 6.1 G instructions/s a core against the FMA's 8.9 G here.
 * How (as SageAttention's int8 Q K^T): each key minus the mean key of its (batch,
 * head), which moves every score of a query by one constant, so the softmax is
 * unchanged while channels common to all keys stop spending the int8 range; then
 * each key and each scaled query row in symmetric int8 with its own scale
 * (int8_rows_cpu.c's quantize_row: max |x| / 127, round to nearest even). A score
 * is (acc - 128 sum_d q8[d]) * qscale * kscale[t] with acc = sum_d q8[d] (k8[t][d] + 128):
 * vpdpbusd multiplies unsigned by signed bytes, so keys are stored plus 128.
 * The softmax stays float32; P V below. Paths: AVX512-VNNI on the AVX-512 build,
 * AVX-VNNI on the AVX2 build (target attributes; the caller checks the CPU). */
#if defined(__AVX512F__)
#define QK8_TARGET __attribute__((target("avx512vnni")))
#else
#define QK8_TARGET __attribute__((target("avxvnni")))
#endif
/* acc += u8 . s8 by quads, in asm: GCC 12 copied every accumulator around each
 * vpdpbusd intrinsic (two moves an instruction, the int8 Q K^T no faster than
 * float32's). {vex}: the AVX2 build's is AVX-VNNI, not AVX512-VNNI's EVEX form. */
#define DPBUSD(acc, u8, s8) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8))
#define DPBUSD_VEX(acc, u8, s8) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8))

/* Where key t's quad g (dims 4g .. 4g + 3, as one int32) goes in the packed int8
 * K: panels of 16 keys, (ldk / 16, D / 4, 16) quads, so one vector load is 16 keys'
 * quad g. */
static inline int64_t k8_at(int64_t t, int g) { return (t & ~15) * (D / 4) + g * 16 + (t & 15); }

#if defined(__AVX512F__)
/* s[i][c .. c + 16 NV) for i < R: R x 16 NV int8 products in registers. */
#define QK8_TILE(NV)                                                                              \
    static inline __attribute__((always_inline)) QK8_TARGET void qk8_tile_##NV(                   \
        const int8_t *q8, const float *qscale, const int32_t *qc, const int32_t *k8,              \
        const float *ks, int64_t ldk, float *s, int64_t c) {                                      \
        __m512i acc[R][NV];                                                                       \
        for (int i = 0; i < R; i++)                                                               \
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_set1_epi32(qc[i]);                    \
        for (int g = 0; g < D / 4; g++) {                                                         \
            __m512i kv[NV];                                                                       \
            for (int j = 0; j < NV; j++) kv[j] = _mm512_loadu_si512((const void *)(k8 + k8_at(c + 16 * j, g))); \
            for (int i = 0; i < R; i++) {                                                         \
                int32_t quad;                                                                     \
                memcpy(&quad, q8 + i * D + 4 * g, sizeof quad);                                   \
                const __m512i qb = _mm512_set1_epi32(quad);                                       \
                for (int j = 0; j < NV; j++) DPBUSD(acc[i][j], kv[j], qb);                       \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < NV; j++) {                                                            \
            const __m512 kscale = _mm512_loadu_ps(ks + c + 16 * j);                               \
            for (int i = 0; i < R; i++)                                                           \
                _mm512_storeu_ps(s + i * ldk + c + 16 * j,                                        \
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]),                     \
                                               _mm512_mul_ps(kscale, _mm512_set1_ps(qscale[i])))); \
        }                                                                                         \
    }
QK8_TILE(4)
QK8_TILE(1)
#endif

/* s[i][0 .. ldk) for i < R: the int8 scores of the quantized query rows q8
 * (R x D, scales qscale, corrections qc[i] = -128 sum_d q8[i][d]) over the
 * packed keys k8 (scales ks, zero past tk). */
static QK8_TARGET void qk8_rows(const int8_t *q8, const float *qscale, const int32_t *qc,
                                const int32_t *k8, const float *ks, int64_t ldk, float *s) {
#if defined(__AVX512F__) /* 6 x 64 tiles (24 accumulators, 4 key vectors, one broadcast), then 6 x 16 */
    int64_t c = 0;
    for (; c + 64 <= ldk; c += 64) qk8_tile_4(q8, qscale, qc, k8, ks, ldk, s, c);
    for (; c < ldk; c += 16) qk8_tile_1(q8, qscale, qc, k8, ks, ldk, s, c);
#else /* 6 x 16 tiles: 12 accumulators, two key vectors, one broadcast: 15 of the 16 ymm */
    for (int64_t c = 0; c < ldk; c += 16) {
        __m256i acc[R][2];
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_set1_epi32(qc[i]);
        for (int g = 0; g < D / 4; g++) {
            const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k8 + k8_at(c, g)));
            const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k8 + k8_at(c, g) + 8));
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, q8 + i * D + 4 * g, sizeof quad);
                const __m256i qb = _mm256_set1_epi32(quad);
                DPBUSD_VEX(acc[i][0], k0, qb);
                DPBUSD_VEX(acc[i][1], k1, qb);
            }
        }
        for (int j = 0; j < 2; j++) {
            const __m256 kscale = _mm256_loadu_ps(ks + c + 8 * j);
            for (int i = 0; i < R; i++)
                _mm256_storeu_ps(s + i * ldk + c + 8 * j,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][j]),
                                               _mm256_mul_ps(kscale, _mm256_set1_ps(qscale[i]))));
        }
    }
#endif
}

/* The job's keys, minus their mean, in int8 (layout k8_at, plus 128 as bytes)
 * with one scale each (ks, zero for the padding keys past tk). */
static void pack_k8(const float *kb, int64_t k_st, int64_t tk, int64_t ldk, int32_t *k8, float *ks) {
    float mean[D] __attribute__((aligned(64))) = {0}, row[D] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tk; t++)
        for (int d = 0; d < D; d++) mean[d] += kb[t * k_st + d];
    for (int d = 0; d < D; d++) mean[d] /= (float)tk;
    int8_t q[D];
    for (int64_t t = 0; t < tk; t++) {
        for (int d = 0; d < D; d++) row[d] = kb[t * k_st + d] - mean[d];
        quantize_row(row, D, q, ks + t);
        for (int g = 0; g < D / 4; g++) {
            uint32_t quad;
            memcpy(&quad, q + 4 * g, sizeof quad);
            k8[k8_at(t, g)] = (int32_t)(quad ^ 0x80808080u);  /* each byte q -> q + 128 */
        }
    }
    for (int64_t t = tk; t < ldk; t++) {
        ks[t] = 0.f;
        for (int g = 0; g < D / 4; g++) k8[k8_at(t, g)] = (int32_t)0x80808080u;
    }
}

/* Int8 P V (with the int8 scores). P = exp(s - max s) is in (0, 1]: per row and
 * block of KC keys, unsigned 8 bits scaled by the block's largest value (a block
 * far from the row's peak keeps its own resolution: one scale a row lost the
 * small weights whose sum is most of a flat row's mass; in the peak's own block
 * weights under 1/510 of it still round to 0); V in int8 per channel
 * (its scale over the job's keys). A row's sum of P is taken from the quantized
 * values, so its weights still sum to one. Values in quads of 4 keys, (ldk / 4,
 * D) int32, as vpdpbusd reads them: 4 keys' bytes for a lane (a channel).
 * Measured (tiny.en dims, 4 x 1500 positions, 6 heads, 2 threads): float32
 * 54-55 ms, int8 scores 38.9, with int8 P V 30.2-30.6, P quantized in the
 * softmax's pass 27.7-28.2 (AVX-512); on the AVX2 build with AVX-VNNI 99-105,
 * 71, 53, 51 ms. WER on the 32 shipped clips: tiny.en 0.1486 (float32 0.1655),
 * base 0.1250 (0.1318). */
static void pack_v8(const float *vb, int64_t v_st, int64_t tk, int64_t ldk, int32_t *v8, float *vs) {
    float amax[D] __attribute__((aligned(64))) = {0}, inv[D] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tk; t++)
        for (int d = 0; d < D; d++) {
            const float a = fabsf(vb[t * v_st + d]);
            amax[d] = a > amax[d] ? a : amax[d];
        }
    for (int d = 0; d < D; d++) {
        vs[d] = amax[d] / 127.0f;
        inv[d] = amax[d] > 0.0f ? 127.0f / amax[d] : 0.0f;
    }
    /* a quad's 4 bytes from 4 keys' int32 lanes (|v * inv| <= 127: no clamp) */
    for (int64_t t4 = 0; t4 < ldk; t4 += 4)
        for (int d = 0; d < D; d += VM_VL) {
#if VM_VL == 16
            __m512i quad = _mm512_setzero_si512();
            for (int u = 0; u < 4 && t4 + u < tk; u++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(vb + (t4 + u) * v_st + d),
                                                                   _mm512_load_ps(inv + d)));
                quad = _mm512_or_si512(quad, _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xff)), 8 * u));
            }
            _mm512_storeu_si512((void *)(v8 + (t4 / 4) * D + d), quad);
#else
            __m256i quad = _mm256_setzero_si256();
            for (int u = 0; u < 4 && t4 + u < tk; u++) {
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(vb + (t4 + u) * v_st + d),
                                                                   _mm256_load_ps(inv + d)));
                quad = _mm256_or_si256(quad, _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0xff)), 8 * u));
            }
            _mm256_storeu_si256((__m256i *)(v8 + (t4 / 4) * D + d), quad);
#endif
        }
}

/* A score row s[0 .. tk) to its quantized P in one pass over the scores: with bm
 * each block's largest score and M the row's, p8[t] = round(255 exp(s[t] - bm))
 * (exp(s - M) scaled by its block's largest, exp(bm - M)) and ps[blk] =
 * exp(bm - M) / 255; bytes zero from tk to ldk. Returns the sum of the quantized
 * P. (Quantizing the float numerators afterwards took two more passes over the
 * row: 30% of the int8 attention's non-matmul time, on tiny.en's encoder.) */
static float softmax_p8_row(const float *s, int64_t tk, int64_t ldk, uint8_t *p8, float *ps) {
    const int64_t nb = (tk + KC - 1) / KC;
    float bm[nb], row_max = -INFINITY, sum = 0.0f;
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t0 = blk * KC, n = (t0 + KC < tk ? t0 + KC : tk) - t0;
        bm[blk] = vm_max_of(s + t0, n);
        row_max = bm[blk] > row_max ? bm[blk] : row_max;
    }
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t1 = (blk + 1) * KC < tk ? (blk + 1) * KC : tk;
        int64_t t = blk * KC, isum = 0;
        const vm_vec mv = VM_SET1(bm[blk]), s255 = VM_SET1(255.0f);
#if VM_VL == 16
        __m512i vsum = _mm512_setzero_si512();
        for (; t + 16 <= t1; t += 16) {
            const __m512i i32 = _mm512_cvtps_epi32(VM_MUL(vm_exp(VM_SUB(VM_LOAD(s + t), mv)), s255));
            vsum = _mm512_add_epi32(vsum, i32);
            _mm_storeu_si128((__m128i *)(p8 + t), _mm512_cvtusepi32_epi8(i32));
        }
        isum = _mm512_reduce_add_epi32(vsum);
#else
        __m256i vsum = _mm256_setzero_si256();
        for (; t + 8 <= t1; t += 8) {
            const __m256i i32 = _mm256_cvtps_epi32(VM_MUL(vm_exp(VM_SUB(VM_LOAD(s + t), mv)), s255));
            vsum = _mm256_add_epi32(vsum, i32);
            const __m128i i16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(p8 + t), _mm_packus_epi16(i16, i16));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, vsum);
        for (int u = 0; u < 8; u++) isum += lanes[u];
#endif
        if (t < t1) {  /* the tail through one padded lane block, as the lanes do it */
            float tail[VM_VL] __attribute__((aligned(64)));
            for (int u = 0; u < VM_VL; u++) tail[u] = t + u < t1 ? s[t + u] - bm[blk] : -INFINITY;
            VM_STORE(tail, VM_MUL(vm_exp(VM_LOAD(tail)), s255));
            for (const int64_t first = t; t < t1; t++) {
                const long v = lrintf(tail[t - first]);
                p8[t] = (uint8_t)v;
                isum += v;
            }
        }
        ps[blk] = expf(bm[blk] - row_max) / 255.0f;
        sum += ps[blk] * (float)isum;
    }
    memset(p8 + tk, 0, (size_t)(ldk - tk));
    return sum;
}

/* o[i] = inv[i] * vs * sum_blk ps[i][blk] sum_t p8[i][t] v8[t] for i < rows, over
 * ldk keys (zero past tk); p8 rows ldp bytes apart, ps rows nb apart. */
static QK8_TARGET void pv8_rows(const uint8_t *p8, int64_t ldp, const float *ps, int64_t nb, const int32_t *v8,
                                const float *vs, int64_t ldk, const float *inv, int rows, float *o, int64_t ldo) {
#if defined(__AVX512F__) /* 6 rows x 64 channels: 24 accumulators, 4 value vectors, one broadcast */
    __m512 tot[R][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) tot[i][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t t1 = (blk + 1) * KC < ldk ? (blk + 1) * KC : ldk;
        __m512i acc[R][4];
        for (int i = 0; i < R; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t t = blk * KC; t < t1; t += 4) {
            __m512i vq[4];
            for (int j = 0; j < 4; j++) vq[j] = _mm512_loadu_si512((const void *)(v8 + (t / 4) * D + 16 * j));
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, p8 + i * ldp + t, sizeof quad);
                const __m512i pb = _mm512_set1_epi32(quad);
                for (int j = 0; j < 4; j++) DPBUSD(acc[i][j], pb, vq[j]);
            }
        }
        for (int i = 0; i < R; i++) {
            const __m512 w = _mm512_set1_ps(ps[i * nb + blk]);
            for (int j = 0; j < 4; j++) tot[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), w, tot[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(o + i * ldo + 16 * j, _mm512_mul_ps(tot[i][j], _mm512_mul_ps(_mm512_loadu_ps(vs + 16 * j),
                                                                                      _mm512_set1_ps(inv[i]))));
#else /* pairs of rows x 32 channels: 8 accumulators, 4 value vectors, one broadcast */
    for (int i0 = 0; i0 < rows; i0 += 2)
        for (int c = 0; c < D; c += 32) {
            __m256 tot[2][4];
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) tot[i][j] = _mm256_setzero_ps();
            for (int64_t blk = 0; blk < nb; blk++) {
                const int64_t t1 = (blk + 1) * KC < ldk ? (blk + 1) * KC : ldk;
                __m256i acc[2][4];
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
                for (int64_t t = blk * KC; t < t1; t += 4) {
                    __m256i vq[4];
                    for (int j = 0; j < 4; j++)
                        vq[j] = _mm256_loadu_si256((const __m256i *)(v8 + (t / 4) * D + c + 8 * j));
                    for (int i = 0; i < 2; i++) {
                        int32_t quad;
                        memcpy(&quad, p8 + (i0 + i) * ldp + t, sizeof quad);
                        const __m256i pb = _mm256_set1_epi32(quad);
                        for (int j = 0; j < 4; j++) DPBUSD_VEX(acc[i][j], pb, vq[j]);
                    }
                }
                for (int i = 0; i < 2; i++) {
                    const __m256 w = _mm256_set1_ps(ps[(i0 + i) * nb + blk]);
                    for (int j = 0; j < 4; j++)
                        tot[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), w, tot[i][j]);
                }
            }
            for (int i = 0; i < 2 && i0 + i < rows; i++)
                for (int j = 0; j < 4; j++)
                    _mm256_storeu_ps(o + (i0 + i) * ldo + c + 8 * j,
                                     _mm256_mul_ps(tot[i][j], _mm256_mul_ps(_mm256_loadu_ps(vs + c + 8 * j),
                                                                            _mm256_set1_ps(inv[i0 + i]))));
        }
#endif
}

#endif /* ENCDEC_DENSE_ATTENTION_INT8_H */
