/* Which 512-bit instructions share the execution port of `vpdpbusd` (BENCHMARKS.md, "What
 * bounds the K-quant kernels at 9 rows").
 *
 * The K-quant kernels at 9 rows are bound by their multiply-class instructions, not by all of
 * their instructions: this probe shows which ones count. Each line runs 8 independent
 * `vpdpbusd` chains alone, then interleaved 1:1 (or 4:1) with 8 independent chains of another
 * instruction; if the pair takes as long as the `vpdpbusd` alone, the other instruction runs
 * on other ports (free in a kernel bound by `vpdpbusd`); if it takes twice as long, it competes.
 *
 *   gcc -O2 -march=native benches/ports.c -o /tmp/ports && /tmp/ports
 *
 * Needs AVX-512 VNNI and BF16. One thread; pin it (`taskset -c 0`) on a quiet machine. Check
 * the loops in `gcc -S` before trusting a "free" line: a compiler may fold repeated adds.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define DECL(i)                            \
    __m512i a##i = _mm512_set1_epi32(i);   \
    __m512i b##i = _mm512_set1_epi32(i);   \
    __m512 f##i = _mm512_set1_ps(i + 1.0f);
#define SINK(i) sink += _mm512_reduce_add_epi32(a##i) + _mm512_reduce_add_epi32(b##i) + \
                        (int)_mm512_reduce_add_ps(f##i);

#define DPBUSD(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
#define DPWSSD(i) b##i = _mm512_dpwssd_epi32(b##i, w, x);
#define MULLD(i) b##i = _mm512_mullo_epi32(b##i, w);
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, g, g);
#define DPBF16(i) f##i = _mm512_dpbf16_ps(f##i, (__m512bh)w, (__m512bh)x);
#define CVTNE2(i) b##i = (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b##i), g);
#define PERMW(i) b##i = _mm512_permutexvar_epi16(idx, b##i);
#define TERNLOG(i) b##i = _mm512_ternarylogic_epi32(b##i, w, m, 0xF8);
#define ADD(i) b##i = _mm512_add_epi32(b##i, w);
#define SHIFT(i) b##i = _mm512_srli_epi16(b##i, 4);
#define CVTDQ(i) b##i = _mm512_castps_si512(_mm512_cvtepi32_ps(b##i));

#define RUN(name, BODY)                                                        \
    do {                                                                       \
        double t0 = now();                                                     \
        for (long k = 0; k < n; k++) { BODY }                                  \
        double ns = (now() - t0) / n * 1e9;                                    \
        if (base == 0) base = ns;                                              \
        printf("%-32s %5.2f ns per 8 vpdpbusd  (%.2fx alone)\n", name, ns, ns / base); \
    } while (0)

int main(void) {
    R8(DECL)
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1), m = _mm512_set1_epi8(15);
    __m512i idx = _mm512_set1_epi16(3);
    __m512 g = _mm512_set1_ps(1.0001f);
    long n = 40000000;
    double base = 0;
    RUN("vpdpbusd alone", R8(DPBUSD));
    RUN("+ vpdpwssd 1:1", R8(DPBUSD) R8(DPWSSD));
    RUN("+ vpmulld 1:1", R8(DPBUSD) R8(MULLD));
    RUN("+ vpmulld 4:1", R8(DPBUSD) MULLD(0) MULLD(1));
    RUN("+ vfmadd 1:1", R8(DPBUSD) R8(FMA));
    RUN("+ vdpbf16ps 1:1", R8(DPBUSD) R8(DPBF16));
    RUN("+ vcvtne2ps2bf16 1:1", R8(DPBUSD) R8(CVTNE2));
    RUN("+ vpermw 1:1", R8(DPBUSD) R8(PERMW));
    RUN("+ vpternlogd 1:1", R8(DPBUSD) R8(TERNLOG));
    RUN("+ vpternlogd 4:1", R8(DPBUSD) TERNLOG(0) TERNLOG(1));
    RUN("+ vpaddd 1:1", R8(DPBUSD) R8(ADD));
    RUN("+ vpsrlw 1:1", R8(DPBUSD) R8(SHIFT));
    RUN("+ vcvtdq2ps 4:1", R8(DPBUSD) CVTDQ(0) CVTDQ(1));
    int sink = 0;
    R8(SINK)
    return sink == 42;
}
