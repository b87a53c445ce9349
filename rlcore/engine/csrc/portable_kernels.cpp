// rlcore's portable CPU kernels: torch's matrix products (and sqrt) whose results are the same bits on every CPU.
//
// Every element of a product is one fused multiply-add chain over the summed dimension, in order, from +0:
//     c = 0; for k in 0..K-1: c = fma(a[i][k], b[k][j], c)
// The AVX-512, AVX2 and scalar kernels below all compute exactly that (vector lanes run over j, never over k; a
// block of k that ends keeps its partial sums in c and the next block goes on from them), so the result depends
// on the operands alone: not on the instruction set, the blocking (cache sizes), the number of threads, nor on
// which other rows or columns share the call. The AVX-512 kernel (14 x 32 tiles) is the one that makes this fast
// on CPUs that have it; the AVX2 kernel (6 x 16, as BLIS's Haswell kernel) on the others. See
// rlcore/engine/portable_ops.py for what is routed here and why.
//
// Built once per machine by rlcore.engine.portable_ops (g++ against the installed torch); loaded with
// torch.ops.load_library, it overrides the CPU kernels of the aten operators registered at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// The blocking: any values give the same bits (a k block's chains go on in the next one); set_blocking changes them
// for the tests that show just that.
int64_t KC = 256;   // k per packed block
int64_t MC = 112;   // rows per packed block of A (rounded down to a multiple of the kernel's rows)
int64_t NC = 3072;  // columns per packed block of B

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int g_isa = -1;
int g_threads = 1;

Isa detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

Isa isa() {
  if (g_isa < 0) g_isa = detect_isa();
  return static_cast<Isa>(g_isa);
}

bool has_avx2() {
  static const bool yes = detect_isa() != kScalar;
  return yes;
}

// ---- packing: A into panels of MR rows (k-major), B into panels of NR columns (k-major); zero-padded at the
// right and bottom edges (the padding's rows and columns are computed and thrown away; k is never padded).

bool has_avx2();

// dst[kk * width + r] = src[r * stride + kk] for r < rows, kk < k (a transposing copy: rows of the source become
// the panel's columns), zeros for rows <= r < width. 8 x 8 blocks through AVX2 registers where the CPU has them.
#if defined(__x86_64__)
__attribute__((target("avx2"))) void transpose8(const float* src, int64_t stride, float* dst, int64_t width) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + stride), r2 = _mm256_loadu_ps(src + 2 * stride),
         r3 = _mm256_loadu_ps(src + 3 * stride), r4 = _mm256_loadu_ps(src + 4 * stride),
         r5 = _mm256_loadu_ps(src + 5 * stride), r6 = _mm256_loadu_ps(src + 6 * stride),
         r7 = _mm256_loadu_ps(src + 7 * stride);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + width, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * width, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * width, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * width, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * width, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * width, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * width, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

void transpose_pack(const float* src, int64_t stride, int64_t rows, int64_t k, int64_t width, float* dst) {
  int64_t done_k = 0;
#if defined(__x86_64__)
  if (has_avx2() && rows >= 8 && width >= 8) {
    done_k = k - k % 8;
    // blocks of 8 rows; a last block overlapping the one before covers the rows left (it writes the same values)
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int64_t r = std::min(r0, rows - 8);
      for (int64_t k0 = 0; k0 < done_k; k0 += 8) transpose8(src + r * stride + k0, stride, dst + k0 * width + r, width);
    }
  }
#endif
  for (int64_t kk = done_k; kk < k; ++kk)
    for (int64_t r = 0; r < rows; ++r) dst[kk * width + r] = src[r * stride + kk];
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t r = rows; r < width; ++r) dst[kk * width + r] = 0.f;
}

// A into panels of MR rows, k-major (dst[panel][kk * mr + r]).
void pack_a(int64_t mr, int64_t m, int64_t k, const float* a, int64_t sa0, int64_t sa1, float* dst) {
  for (int64_t i0 = 0; i0 < m; i0 += mr) {
    const int64_t rows = std::min(mr, m - i0);
    float* d = dst + i0 * k;
    if (sa0 == 1) {  // A's columns are contiguous: copy a k-column of the panel at a time
      for (int64_t kk = 0; kk < k; ++kk) {
        float* out = d + kk * mr;
        std::memcpy(out, a + kk * sa1 + i0, rows * sizeof(float));
        for (int64_t r = rows; r < mr; ++r) out[r] = 0.f;
      }
    } else if (sa1 == 1) {  // rows of A contiguous
      transpose_pack(a + i0 * sa0, sa0, rows, k, mr, d);
    } else {
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t r = 0; r < mr; ++r) d[kk * mr + r] = r < rows ? a[(i0 + r) * sa0 + kk * sa1] : 0.f;
    }
  }
}

// B into panels of NR columns, k-major (dst[panel][kk * nr + c]).
void pack_b(int64_t nr, int64_t n, int64_t k, const float* b, int64_t sb0, int64_t sb1, float* dst) {
  for (int64_t j0 = 0; j0 < n; j0 += nr) {
    const int64_t cols = std::min(nr, n - j0);
    float* d = dst + j0 * k;
    if (sb1 == 1) {
      for (int64_t kk = 0; kk < k; ++kk) {
        float* out = d + kk * nr;
        std::memcpy(out, b + kk * sb0 + j0, cols * sizeof(float));
        for (int64_t c = cols; c < nr; ++c) out[c] = 0.f;
      }
    } else if (sb0 == 1) {  // columns of B contiguous (B stored transposed, as a linear layer's weight)
      transpose_pack(b + j0 * sb1, sb1, cols, k, nr, d);
    } else {
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t c = 0; c < nr; ++c) d[kk * nr + c] = c < cols ? b[kk * sb0 + (j0 + c) * sb1] : 0.f;
    }
  }
}

// ---- micro-kernels: a tile of MR x NR elements of C, k steps. `first`: the chains start at +0; otherwise they go
// on from the tile's current values.

void kernel_scalar(int64_t mr, int64_t nr, int64_t k, const float* a, const float* b, float* c, int64_t ldc,
                   bool first) {
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) {
      float acc = first ? 0.f : c[i * ldc + j];
      for (int64_t kk = 0; kk < k; ++kk) acc = std::fma(a[kk * mr + i], b[kk * nr + j], acc);
      c[i * ldc + j] = acc;
    }
}

#if defined(__x86_64__)

#define ROWS_14(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define ROWS_6(X) X(0) X(1) X(2) X(3) X(4) X(5)

__attribute__((target("avx512f"))) void kernel_avx512(int64_t k, const float* a, const float* b, float* c,
                                                      int64_t ldc, bool first) {
#define DECL(i) __m512 c##i##0, c##i##1;
  ROWS_14(DECL)
#undef DECL
  if (first) {
#define ZERO(i) c##i##0 = _mm512_setzero_ps(); c##i##1 = _mm512_setzero_ps();
    ROWS_14(ZERO)
#undef ZERO
  } else {
#define LOAD(i) c##i##0 = _mm512_loadu_ps(c + i * ldc); c##i##1 = _mm512_loadu_ps(c + i * ldc + 16);
    ROWS_14(LOAD)
#undef LOAD
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
    _mm_prefetch(reinterpret_cast<const char*>(b + 32 * 8), _MM_HINT_T0);
#define STEP(i) { const __m512 ai = _mm512_set1_ps(a[i]); \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1); }
    ROWS_14(STEP)
#undef STEP
    a += 14;
    b += 32;
  }
#define STORE(i) _mm512_storeu_ps(c + i * ldc, c##i##0); _mm512_storeu_ps(c + i * ldc + 16, c##i##1);
  ROWS_14(STORE)
#undef STORE
}

__attribute__((target("avx2,fma"))) void kernel_avx2(int64_t k, const float* a, const float* b, float* c,
                                                     int64_t ldc, bool first) {
#define DECL(i) __m256 c##i##0, c##i##1;
  ROWS_6(DECL)
#undef DECL
  if (first) {
#define ZERO(i) c##i##0 = _mm256_setzero_ps(); c##i##1 = _mm256_setzero_ps();
    ROWS_6(ZERO)
#undef ZERO
  } else {
#define LOAD(i) c##i##0 = _mm256_loadu_ps(c + i * ldc); c##i##1 = _mm256_loadu_ps(c + i * ldc + 8);
    ROWS_6(LOAD)
#undef LOAD
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * 8), _MM_HINT_T0);
#define STEP(i) { const __m256 ai = _mm256_broadcast_ss(a + i); \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1); }
    ROWS_6(STEP)
#undef STEP
    a += 6;
    b += 16;
  }
#define STORE(i) _mm256_storeu_ps(c + i * ldc, c##i##0); _mm256_storeu_ps(c + i * ldc + 8, c##i##1);
  ROWS_6(STORE)
#undef STORE
}

// ---- products with few columns (attention's per-head products, n <= 64): rows of C held in registers, k in order,
// no packing of A and one contiguous copy of B at most. The same chains as the packed kernels.

template <int NV>
__attribute__((target("avx512f"))) void small_rows_avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t sa0,
                                                          int64_t sa1, const float* b, float* c, int64_t ldc) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - 16 * (NV - 1))) - 1u);
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) {
    __m512 acc[4][NV];
    for (int r = 0; r < 4; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 bv[NV];
      for (int v = 0; v < NV - 1; ++v) bv[v] = _mm512_loadu_ps(b + kk * n + 16 * v);
      bv[NV - 1] = _mm512_maskz_loadu_ps(tail, b + kk * n + 16 * (NV - 1));
      for (int r = 0; r < 4; ++r) {
        const __m512 ar = _mm512_set1_ps(a[(i + r) * sa0 + kk * sa1]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(c + (i + r) * ldc + 16 * v, acc[r][v]);
      _mm512_mask_storeu_ps(c + (i + r) * ldc + 16 * (NV - 1), tail, acc[r][NV - 1]);
    }
  }
  for (; i < m; ++i) {
    __m512 acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m512 ar = _mm512_set1_ps(a[i * sa0 + kk * sa1]);
      for (int v = 0; v < NV - 1; ++v) acc[v] = _mm512_fmadd_ps(ar, _mm512_loadu_ps(b + kk * n + 16 * v), acc[v]);
      acc[NV - 1] = _mm512_fmadd_ps(ar, _mm512_maskz_loadu_ps(tail, b + kk * n + 16 * (NV - 1)), acc[NV - 1]);
    }
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[v]);
    _mm512_mask_storeu_ps(c + i * ldc + 16 * (NV - 1), tail, acc[NV - 1]);
  }
}

template <int NV>
__attribute__((target("avx2,fma"))) void small_rows_avx2(int64_t m, int64_t n, int64_t k, const float* a, int64_t sa0,
                                                        int64_t sa1, const float* b, float* c, int64_t ldc) {
  // the last vector's lanes beyond n are computed on zeros and not stored
  const int64_t last = n - 8 * (NV - 1);
  alignas(32) int32_t mask_bits[8];
  for (int j = 0; j < 8; ++j) mask_bits[j] = j < last ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits));
  for (int64_t i = 0; i < m; i += 2) {
    const int rows = m - i >= 2 ? 2 : 1;
    __m256 acc[2][NV];
    for (int r = 0; r < 2; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      __m256 bv[NV];
      for (int v = 0; v < NV - 1; ++v) bv[v] = _mm256_loadu_ps(b + kk * n + 8 * v);
      bv[NV - 1] = _mm256_maskload_ps(b + kk * n + 8 * (NV - 1), tail);
      for (int r = 0; r < rows; ++r) {
        const __m256 ar = _mm256_set1_ps(a[(i + r) * sa0 + kk * sa1]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int v = 0; v < NV - 1; ++v) _mm256_storeu_ps(c + (i + r) * ldc + 8 * v, acc[r][v]);
      _mm256_maskstore_ps(c + (i + r) * ldc + 8 * (NV - 1), tail, acc[r][NV - 1]);
    }
  }
}

// C = A @ B for n <= 64 with B row-major and contiguous ([k, n], row stride n); false if this CPU has no such kernel.
bool small_product(Isa which, int64_t m, int64_t n, int64_t k, const float* a, int64_t sa0, int64_t sa1,
                   const float* b, float* c, int64_t ldc) {
  if (which == kAvx512) {
    switch ((n + 15) / 16) {
      case 1: small_rows_avx512<1>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 2: small_rows_avx512<2>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 3: small_rows_avx512<3>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 4: small_rows_avx512<4>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
    }
  }
  if (which == kAvx2) {
    switch ((n + 7) / 8) {
      case 1: small_rows_avx2<1>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 2: small_rows_avx2<2>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 3: small_rows_avx2<3>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 4: small_rows_avx2<4>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 5: small_rows_avx2<5>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 6: small_rows_avx2<6>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 7: small_rows_avx2<7>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
      case 8: small_rows_avx2<8>(m, n, k, a, sa0, sa1, b, c, ldc); return true;
    }
  }
  return false;
}

#endif

struct Shape {
  int64_t mr, nr;
};

Shape tile_of(Isa which) {
  if (which == kAvx512) return {14, 32};
  if (which == kAvx2) return {6, 16};
  return {4, 16};
}

void run_tile(Isa which, Shape t, int64_t k, const float* a, const float* b, float* c, int64_t ldc, bool first) {
#if defined(__x86_64__)
  if (which == kAvx512) return kernel_avx512(k, a, b, c, ldc, first);
  if (which == kAvx2) return kernel_avx2(k, a, b, c, ldc, first);
#endif
  kernel_scalar(t.mr, t.nr, k, a, b, c, ldc, first);
}

// Products with fewer rows than this take the small kernels at any width (packing a few rows costs more than it saves)
constexpr int64_t kSmallRows = 8;
// ... and products of at most this many columns at any height, in chunks of 64 columns (attention's per-head products
// at a few dozen keys). set_small_cols changes it, for the tests and the measurements that compare the routes.
int64_t SMALL_COLS = 128;

struct Buffers {
  std::vector<float> a, b;
  float* aligned(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n + 16) v.resize(n + 16);
    auto p = reinterpret_cast<std::uintptr_t>(v.data());
    return reinterpret_cast<float*>((p + 63) & ~static_cast<std::uintptr_t>(63));
  }
};

// ---- products of a few rows by many columns (a decode step's linear layers: tens of rows of activations times a
// weight): packing B, the large operand, would cost about as much as the product. So C^T = B^T A^T is computed
// instead: A's rows packed (small) into panels whose vector lanes run over A's rows, B read where it lies, JR of its
// columns at a time as broadcast scalars; each element is still fma(B[kk][j], A[i][kk], c) over kk in order from +0,
// and fma(x, y, c) == fma(y, x, c) (the product is exact), so these are the packed kernels' chains, bit for bit.
// The tile [JR columns of B][lanes rows of A] is written to C transposed.

constexpr int64_t kWideJr = 8;     // columns of B per tile
// Products of kSmallRows..WIDE_ROWS rows and more than 64 columns take this path when B's columns are contiguous (a
// weight, transposed): B^T's rows are read along k then (across the rows of a row-major B, a large k ran at a third
// of the speed). set_wide_rows changes it (0: never), for the tests and the measurements that compare the two.
int64_t WIDE_ROWS = 128;
// ... and k up to this: all of A's rows are packed at once (128 x k floats, 8 MiB at most), not in blocks of k
constexpr int64_t kWideMaxK = 16384;

#if defined(__x86_64__)
// tile[r * 32 + i] = sum over kk of w[r * sw0 + kk * sw1] * p[kk * 32 + i], r < 8, i < 32. `next`: the next tile's
// rows of B^T (contiguous along k, row stride sw0), fetched into the cache a line every other k step meanwhile: B
// comes from memory once per product, and the tiles' own compute hides its latency.
__attribute__((target("avx512f"))) void wide_tile_avx512(int64_t k, const float* w, int64_t sw0, int64_t sw1,
                                                         const float* p, float* tile, const float* next) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
  const float *w0 = w, *w1 = w + sw0, *w2 = w + 2 * sw0, *w3 = w + 3 * sw0, *w4 = w + 4 * sw0, *w5 = w + 5 * sw0,
              *w6 = w + 6 * sw0, *w7 = w + 7 * sw0;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (next != nullptr && (kk & 1) == 0) {
      const int64_t line = kk >> 1;
      _mm_prefetch(reinterpret_cast<const char*>(next + (line & 7) * sw0 + (line >> 3) * 16), _MM_HINT_T0);
    }
    const __m512 p0 = _mm512_load_ps(p), p1 = _mm512_load_ps(p + 16);
    const int64_t o = kk * sw1;
#define STEP(r) { const __m512 x = _mm512_set1_ps(w##r[o]); \
    c##r##0 = _mm512_fmadd_ps(x, p0, c##r##0); c##r##1 = _mm512_fmadd_ps(x, p1, c##r##1); }
    STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
    p += 32;
  }
#define STORE(r) _mm512_store_ps(tile + r * 32, c##r##0); _mm512_store_ps(tile + r * 32 + 16, c##r##1);
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
}

// tile[r * 8 + i] = sum over kk of w[r * sw0 + kk * sw1] * p[kk * 8 + i], r < 8, i < 8; `next` as above
__attribute__((target("avx2,fma"))) void wide_tile_avx2(int64_t k, const float* w, int64_t sw0, int64_t sw1,
                                                       const float* p, float* tile, const float* next) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  const float *w0 = w, *w1 = w + sw0, *w2 = w + 2 * sw0, *w3 = w + 3 * sw0, *w4 = w + 4 * sw0, *w5 = w + 5 * sw0,
              *w6 = w + 6 * sw0, *w7 = w + 7 * sw0;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (next != nullptr && (kk & 1) == 0) {
      const int64_t line = kk >> 1;
      _mm_prefetch(reinterpret_cast<const char*>(next + (line & 7) * sw0 + (line >> 3) * 16), _MM_HINT_T0);
    }
    const __m256 p0 = _mm256_load_ps(p);
    const int64_t o = kk * sw1;
#define STEP(r) c##r = _mm256_fmadd_ps(_mm256_broadcast_ss(w##r + o), p0, c##r);
    STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
    p += 8;
  }
#define STORE(r) _mm256_store_ps(tile + r * 8, c##r);
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
}

// C[m, n] = A[m, k] @ B[k, n], m <= WIDE_ROWS, through C^T = B^T A^T (see above); an AVX-512 or AVX2 CPU. Any
// strides are computed right; B's columns contiguous (sb0 == 1) is what makes it fast.
void wide_product(Isa which, int64_t m, int64_t n, int64_t k, const float* a, int64_t sa0, int64_t sa1,
                  const float* b, int64_t sb0, int64_t sb1, float* c, int64_t ldc, Buffers& buf) {
  const int64_t lanes = which == kAvx512 ? 32 : 8;
  const int64_t panels = (m + lanes - 1) / lanes;
  // every panel of A's rows once, k-major: panel[q][kk * lanes + i] = A[q * lanes + i][kk] (A^T's columns)
  float* pa = buf.aligned(buf.a, panels * lanes * k);
  pack_b(lanes, m, k, a, sa1, sa0, pa);
  alignas(64) float tile[kWideJr * 32];
  for (int64_t j0 = 0; j0 < n; j0 += kWideJr) {
    const int64_t cols = std::min(kWideJr, n - j0);
    // B's columns j0.. as rows of B^T: element (r, kk) at w[r * sw0 + kk * sw1]; the last, short block zero-padded
    const float* w = b + j0 * sb1;
    int64_t sw0 = sb1, sw1 = sb0;
    if (cols < kWideJr) {
      float* pad = buf.aligned(buf.b, kWideJr * k);
      for (int64_t r = 0; r < kWideJr; ++r)
        for (int64_t kk = 0; kk < k; ++kk) pad[r * k + kk] = r < cols ? w[r * sw0 + kk * sw1] : 0.f;
      w = pad, sw0 = k, sw1 = 1;
    }
    // the next whole tile's rows, fetched during this tile's first panel (B^T's rows contiguous along k only)
    const float* next = sb0 == 1 && j0 + 2 * kWideJr <= n ? b + (j0 + kWideJr) * sb1 : nullptr;
    for (int64_t q = 0; q < panels; ++q) {
      const int64_t i0 = q * lanes, rows = std::min(lanes, m - i0);
      if (which == kAvx512) wide_tile_avx512(k, w, sw0, sw1, pa + q * lanes * k, tile, q == 0 ? next : nullptr);
      else wide_tile_avx2(k, w, sw0, sw1, pa + q * lanes * k, tile, q == 0 ? next : nullptr);
      // tile[r][i] is C[i0 + i][j0 + r]: 8 x 8 transposes where whole, element by element at the edges
      int64_t i = 0;
      if (cols == kWideJr)
        for (; i + 8 <= rows; i += 8) transpose8(tile + i, lanes, c + (i0 + i) * ldc + j0, ldc);
      for (; i < rows; ++i)
        for (int64_t r = 0; r < cols; ++r) c[(i0 + i) * ldc + j0 + r] = tile[r * lanes + i];
    }
  }
}
#endif

// C[m, n] (row stride ldc) = A[m, k] @ B[k, n] for one thread's rows; A's element (i, kk) at a[i * sa0 + kk * sa1].
void gemm_rows(int64_t m, int64_t n, int64_t k, const float* a, int64_t sa0, int64_t sa1, const float* b,
               int64_t sb0, int64_t sb1, float* c, int64_t ldc) {
  thread_local Buffers buf;
  const Isa which = isa();
  const Shape t = tile_of(which);
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    return;
  }
#if defined(__x86_64__)
  // few columns (attention's per-head products), or few rows of any width (a decode step's products of one query
  // row): no packing, the columns in chunks of at most 64, each chunk of B copied dense unless it already is
  if ((n <= SMALL_COLS || m < kSmallRows) && which != kScalar && m * n * k > 0) {
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
      const int64_t nc = std::min<int64_t>(64, n - j0);
      const float* bp = b + j0 * sb1;
      if (sb1 != 1 || sb0 != nc) {
        float* dense = buf.aligned(buf.b, k * nc);
        if (sb0 == 1) {  // column-major (a transposed view: attention's keys): 8 x 8 transposes
          transpose_pack(bp, sb1, nc, k, nc, dense);
        } else if (sb1 == 1) {  // row-major, wider than the chunk
          for (int64_t kk = 0; kk < k; ++kk) std::memcpy(dense + kk * nc, bp + kk * sb0, nc * sizeof(float));
        } else {
          for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t j = 0; j < nc; ++j) dense[kk * nc + j] = bp[kk * sb0 + j * sb1];
        }
        bp = dense;
      }
      TORCH_INTERNAL_ASSERT(small_product(which, m, nc, k, a, sa0, sa1, bp, c + j0, ldc));
    }
    return;
  }
  if (m <= WIDE_ROWS && n > 64 && k <= kWideMaxK && sb0 == 1 && which != kScalar) {  // few rows, many columns: B read where it lies
    wide_product(which, m, n, k, a, sa0, sa1, b, sb0, sb1, c, ldc, buf);
    return;
  }
#endif
  const int64_t mc = (MC / t.mr) * t.mr;
  float* pa = buf.aligned(buf.a, (mc + t.mr) * KC);
  float* pb = buf.aligned(buf.b, (NC + t.nr) * KC);
  alignas(64) float tile[16 * 32];
  for (int64_t jc = 0; jc < n; jc += NC) {
    const int64_t nc = std::min(NC, n - jc);
    for (int64_t pc = 0; pc < k; pc += KC) {
      const int64_t kc = std::min(KC, k - pc);
      const bool first = pc == 0;
      pack_b(t.nr, nc, kc, b + pc * sb0 + jc * sb1, sb0, sb1, pb);
      for (int64_t ic = 0; ic < m; ic += mc) {
        const int64_t mm = std::min(mc, m - ic);
        pack_a(t.mr, mm, kc, a + ic * sa0 + pc * sa1, sa0, sa1, pa);
        for (int64_t jr = 0; jr < nc; jr += t.nr) {
          const int64_t cols = std::min(t.nr, nc - jr);
          for (int64_t ir = 0; ir < mm; ir += t.mr) {
            const int64_t rows = std::min(t.mr, mm - ir);
            float* cp = c + (ic + ir) * ldc + jc + jr;
            const float* ap = pa + ir * kc;
            const float* bp = pb + jr * kc;
            if (rows == t.mr && cols == t.nr) {
              run_tile(which, t, kc, ap, bp, cp, ldc, first);
            } else {  // an edge tile: through a full-size scratch tile
              if (!first)
                for (int64_t i = 0; i < rows; ++i) std::memcpy(tile + i * t.nr, cp + i * ldc, cols * sizeof(float));
              run_tile(which, t, kc, ap, bp, tile, t.nr, first);
              for (int64_t i = 0; i < rows; ++i) std::memcpy(cp + i * ldc, tile + i * t.nr, cols * sizeof(float));
            }
          }
        }
      }
    }
  }
}

// Any dtype other than float32: the same chain written plainly, vectorised by the compiler over j only.
template <typename T>
void gemm_rows_plain(int64_t m, int64_t n, int64_t k, const T* a, int64_t sa0, int64_t sa1, const T* b, int64_t sb0,
                     int64_t sb1, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] = T(0);
    for (int64_t kk = 0; kk < k; ++kk) {
      const T x = a[i * sa0 + kk * sa1];
      const T* brow = b + kk * sb0;
      if constexpr (std::is_floating_point_v<T>) {
        for (int64_t j = 0; j < n; ++j) row[j] = std::fma(x, brow[j * sb1], row[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) row[j] += x * brow[j * sb1];
      }
    }
  }
}

// One matrix product of any supported dtype: float32 on the packed kernels, the others plainly.
template <typename T>
void gemm_any(int64_t m, int64_t n, int64_t k, const T* a, int64_t sa0, int64_t sa1, const T* b, int64_t sb0,
              int64_t sb1, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) gemm_rows(m, n, k, a, sa0, sa1, b, sb0, sb1, c, ldc);
  else gemm_rows_plain<T>(m, n, k, a, sa0, sa1, b, sb0, sb1, c, ldc);
}

// out (contiguous [batch, m, n]) = a [batch, m, k] @ b [batch, k, n] (a batch of one for 2-D operands). The work is
// shared out over the kernels' threads by matrices when there are several, by rows otherwise; either way each
// element is computed alone, so the split does not show in the result.
template <typename T>
void products_of(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const bool batched = a.dim() == 3;
  const int64_t batch = batched ? a.size(0) : 1;
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const int64_t sa = batched ? a.stride(0) : 0, sb = batched ? b.stride(0) : 0;
  const int64_t sa0 = a.stride(-2), sa1 = a.stride(-1), sb0 = b.stride(-2), sb1 = b.stride(-1);
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* pc = out.data_ptr<T>();
  // a work item: rows [r0, r1) of matrices [i0, i1)
  auto run = [&](int64_t i0, int64_t i1, int64_t r0, int64_t r1) {
    for (int64_t i = i0; i < i1; ++i)
      gemm_any<T>(r1 - r0, n, k, pa + i * sa + r0 * sa0, sa0, sa1, pb + i * sb, sb0, sb1, pc + (i * m + r0) * n, n);
  };
  const int64_t flops = batch * m * n * k;
  const int threads = flops < (1 << 18) ? 1 : static_cast<int>(std::min<int64_t>(g_threads, batch > 1 ? batch : m));
  if (threads <= 1) return run(0, batch, 0, m);
  std::vector<std::thread> pool;
  const int64_t items = batch > 1 ? batch : m, per = (items + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t lo = t * per, hi = std::min(items, lo + per);
    if (lo >= hi) break;
    if (batch > 1) pool.emplace_back(run, lo, hi, 0, m);
    else pool.emplace_back(run, 0, 1, lo, hi);
  }
  for (auto& th : pool) th.join();
}

void product_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (out.numel() == 0) return;
  AT_DISPATCH_SWITCH(out.scalar_type(), "rlcore_portable_product",
    AT_DISPATCH_CASE(at::kFloat, [&] { products_of<float>(a, b, out); })
    AT_DISPATCH_CASE(at::kDouble, [&] { products_of<double>(a, b, out); })
    AT_DISPATCH_CASE(at::kLong, [&] { products_of<int64_t>(a, b, out); })
    AT_DISPATCH_CASE(at::kInt, [&] { products_of<int32_t>(a, b, out); }));
}

at::ScalarType compute_type(const at::Tensor& a, const at::Tensor& b) {
  const auto t = at::promote_types(a.scalar_type(), b.scalar_type());
  TORCH_CHECK(!at::isComplexType(t), "rlcore portable kernels: complex matrix products are not supported");
  if (t == at::kBFloat16 || t == at::kHalf) return at::kFloat;  // computed in float32, rounded once at the end
  if (at::isIntegralType(t, /*includeBool=*/true)) return t == at::kInt ? at::kInt : at::kLong;
  return t;
}

// A matrix with a unit stride along one of its dimensions (row- or column-major), as the packing reads it.
at::Tensor packable(const at::Tensor& x, at::ScalarType t) {
  at::Tensor y = x.scalar_type() == t ? x : x.to(t);
  if (y.stride(-1) == 1 || y.stride(-2) == 1) return y;
  return y.contiguous();
}

at::Tensor k_mm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "mm: expected 2-D tensors, got ", a.dim(), "-D and ", b.dim(), "-D");
  TORCH_CHECK(a.size(1) == b.size(0), "mm: shapes cannot be multiplied (", a.size(0), "x", a.size(1), " and ",
              b.size(0), "x", b.size(1), ")");
  const auto t = compute_type(a, b);
  const auto result = at::promote_types(a.scalar_type(), b.scalar_type());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(t));
  product_into(packable(a, t), packable(b, t), out);
  return t == result ? out : out.to(result);
}

at::Tensor k_bmm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "bmm: expected 3-D tensors");
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), "bmm: shapes cannot be multiplied");
  const auto t = compute_type(a, b);
  const auto result = at::promote_types(a.scalar_type(), b.scalar_type());
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options().dtype(t));
  product_into(packable(a, t), packable(b, t), out);
  return t == result ? out : out.to(result);
}

at::Tensor scaled(at::Tensor product, const at::Tensor& bias, const at::Scalar& beta, const at::Scalar& alpha) {
  if (alpha.toDouble() != 1.0) product.mul_(alpha);
  if (beta.toDouble() != 0.0) {
    if (beta.toDouble() == 1.0) product.add_(bias);
    else product.add_(bias * beta);
  }
  return product;
}

at::Tensor& into(at::Tensor& out, const at::Tensor& value) {
  if (out.sizes() != value.sizes()) out.resize_(value.sizes());
  return out.copy_(value);
}

at::Tensor k_mv(const at::Tensor& a, const at::Tensor& v) { return k_mm(a, v.unsqueeze(1)).squeeze(1); }
at::Tensor k_dot(const at::Tensor& a, const at::Tensor& b) { return k_mm(a.unsqueeze(0), b.unsqueeze(1)).reshape({}); }

at::Tensor k_addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  return scaled(k_mm(a, b), c, beta, alpha);
}
at::Tensor k_baddbmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  return scaled(k_bmm(a, b), c, beta, alpha);
}
at::Tensor k_addmv(const at::Tensor& c, const at::Tensor& a, const at::Tensor& v, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  return scaled(k_mv(a, v), c, beta, alpha);
}

at::Tensor& k_mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) { return into(out, k_mm(a, b)); }
at::Tensor& k_bmm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) { return into(out, k_bmm(a, b)); }
at::Tensor& k_mv_out(const at::Tensor& a, const at::Tensor& v, at::Tensor& out) { return into(out, k_mv(a, v)); }
at::Tensor& k_addmm_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                      const at::Scalar& alpha, at::Tensor& out) {
  return into(out, k_addmm(c, a, b, beta, alpha));
}
at::Tensor& k_addmm_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  return c.copy_(k_addmm(c, a, b, beta, alpha));
}
at::Tensor& k_baddbmm_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                        const at::Scalar& alpha, at::Tensor& out) {
  return into(out, k_baddbmm(c, a, b, beta, alpha));
}
at::Tensor& k_baddbmm_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                     const at::Scalar& alpha) {
  return c.copy_(k_baddbmm(c, a, b, beta, alpha));
}
at::Tensor& k_addmv_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& v, const at::Scalar& beta,
                      const at::Scalar& alpha, at::Tensor& out) {
  return into(out, k_addmv(c, a, v, beta, alpha));
}
at::Tensor& k_addmv_(at::Tensor& c, const at::Tensor& a, const at::Tensor& v, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  return c.copy_(k_addmv(c, a, v, beta, alpha));
}

// ---- elementwise functions: MKL's vector math computes these on a CPU; here, SLEEF's AVX2 functions (the copy in
// torch's own library, the one torch's AVX2 loops call): the same code on every CPU with AVX2, the same bits.
// sqrt is correctly rounded (IEEE 754) by every implementation: the CPU's own instruction.

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
extern "C" {
#define SLEEF_F(name) __m256 Sleef_##name##f8_u10avx2(__m256); __m256d Sleef_##name##d4_u10avx2(__m256d);
SLEEF_F(exp) SLEEF_F(log) SLEEF_F(tanh) SLEEF_F(log2) SLEEF_F(log10) SLEEF_F(tan) SLEEF_F(atan) SLEEF_F(asin)
SLEEF_F(acos) SLEEF_F(erf)
#undef SLEEF_F
}

using VecF = __m256 (*)(__m256);
using VecD = __m256d (*)(__m256d);

template <typename T, typename V, typename F>
__attribute__((target("avx2,fma"))) void map_avx2(F fn, const T* in, T* out, int64_t n) {
  constexpr int64_t W = 32 / sizeof(T);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(out + i, fn(_mm256_loadu_ps(in + i)));
    else _mm256_storeu_pd(out + i, fn(_mm256_loadu_pd(in + i)));
  }
  if (i < n) {  // the tail through a full vector: each lane is computed alone, so its neighbours do not matter
    alignas(32) T buf[W] = {};
    std::memcpy(buf, in + i, (n - i) * sizeof(T));
    if constexpr (std::is_same_v<T, float>) _mm256_store_ps(buf, fn(_mm256_load_ps(buf)));
    else _mm256_store_pd(buf, fn(_mm256_load_pd(buf)));
    std::memcpy(out + i, buf, (n - i) * sizeof(T));
  }
}
#pragma GCC pop_options
#endif

struct Unary {
#if defined(__x86_64__)
  VecF f;
  VecD d;
#endif
  double (*scalar)(double);  // CPUs without AVX2: the C library (results of this CPU kind only)
};

#if defined(__x86_64__)
void map_vec(const Unary& op, const float* in, float* out, int64_t n) { map_avx2<float, __m256>(op.f, in, out, n); }
void map_vec(const Unary& op, const double* in, double* out, int64_t n) { map_avx2<double, __m256d>(op.d, in, out, n); }
#endif

at::Tensor floating(const at::Tensor& x) {
  if (x.is_floating_point()) return x.contiguous();
  return x.to(at::typeMetaToScalarType(at::get_default_dtype())).contiguous();
}

at::Tensor unary(const Unary& op, const at::Tensor& x) {
  at::Tensor src = floating(x);
  if (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kHalf)
    return unary(op, src.to(at::kFloat)).to(src.scalar_type());
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  const int64_t n = src.numel();
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "rlcore_portable_unary", [&] {
    const scalar_t* in = src.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
#if defined(__x86_64__)
    if (has_avx2()) return map_vec(op, in, o, n);  // what the CPU has, whatever the products were told to run
#endif
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<scalar_t>(op.scalar(static_cast<double>(in[i])));
  });
  return out;
}

#if defined(__x86_64__)
#define UNARY(name) const Unary k_##name##_op{Sleef_##name##f8_u10avx2, Sleef_##name##d4_u10avx2, \
    [](double v) { return std::name(v); }};
#else
#define UNARY(name) const Unary k_##name##_op{[](double v) { return std::name(v); }};
#endif
UNARY(exp) UNARY(log) UNARY(tanh) UNARY(log2) UNARY(log10) UNARY(tan) UNARY(atan) UNARY(asin) UNARY(acos) UNARY(erf)
#undef UNARY

at::Tensor k_sqrt(const at::Tensor& x) {
  at::Tensor src = floating(x);
  if (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kHalf)
    return k_sqrt(src.to(at::kFloat)).to(src.scalar_type());
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "rlcore_portable_sqrt", [&] {
    const scalar_t* in = src.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t n = src.numel();
    for (int64_t i = 0; i < n; ++i) o[i] = std::sqrt(in[i]);
  });
  return out;
}


// ---- SwiGLU, silu(g) * u, and its gradients: one pass each where torch's eager ops take two forward (silu, mul) and
// three backward (two muls, silu_backward) and keep silu(g) for the backward. Each element is computed with the
// expressions of torch's AVX2 loops (aten/src/ATen/native/cpu/Activation.cpp: silu, silu_backward; a product is
// one correctly rounded multiply): vectors of 8 two at a time with SLEEF's exp, and the last n % 16 elements with the
// scalar expression and the C library's exp, as torch's vectorized loop splits a contiguous range on one thread. So
// the bits are eager torch's in portable mode (torch's own loops on one thread, AVX2), which the tests check.

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
extern "C" __m256 Sleef_expf8_u10avx2(__m256);

__attribute__((target("avx2,fma"))) inline __m256 silu_denominator(__m256 x) {  // 1 + exp(-x)
  return _mm256_add_ps(_mm256_set1_ps(1.f), Sleef_expf8_u10avx2(_mm256_xor_ps(x, _mm256_set1_ps(-0.f))));
}

__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t h = i; h < i + 16; h += 8) {
      const __m256 x = _mm256_loadu_ps(g + h);
      _mm256_storeu_ps(y + h, _mm256_mul_ps(_mm256_div_ps(x, silu_denominator(x)), _mm256_loadu_ps(u + h)));
    }
  for (; i < n; ++i) y[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

__attribute__((target("avx2,fma"))) void swiglu_backward_avx2(const float* dy, const float* g, const float* u,
                                                               float* dg, float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t h = i; h < i + 16; h += 8) {
      const __m256 x = _mm256_loadu_ps(g + h), d = _mm256_loadu_ps(dy + h), den = silu_denominator(x);
      _mm256_storeu_ps(du + h, _mm256_mul_ps(d, _mm256_div_ps(x, den)));       // grad * silu(g)
      const __m256 ds = _mm256_mul_ps(d, _mm256_loadu_ps(u + h));               // grad * u: silu's output gradient
      const __m256 sig = _mm256_div_ps(one, den);
      // torch's binary computes 1 + x (1 - sigmoid) as one fused multiply-add (its compiler contracted it)
      const __m256 slope = _mm256_fmadd_ps(x, _mm256_sub_ps(one, sig), one);
      _mm256_storeu_ps(dg + h, _mm256_mul_ps(_mm256_mul_ps(ds, sig), slope));
    }
  for (; i < n; ++i) {
    const float x = g[i], den = 1.f + std::exp(-x), sig = 1.f / den, ds = dy[i] * u[i];
    du[i] = dy[i] * (x / den);
    dg[i] = ds * sig * std::fma(x, 1.f - sig, 1.f);
  }
}
#pragma GCC pop_options
#endif

bool swiglu_inputs(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.sizes() == b.sizes() &&
         a.is_contiguous() && b.is_contiguous() && !a.is_cuda();
}

at::Tensor k_swiglu(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(swiglu_inputs(g, u), "rlcore_portable::swiglu: two contiguous float32 CPU tensors of one shape");
  at::Tensor y = at::empty_like(g);
#if defined(__x86_64__)
  if (has_avx2()) {
    swiglu_avx2(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), g.numel());
    return y;
  }
#endif
  return at::silu(g) * u;  // no AVX2: torch's own loops, whose bits are this CPU's
}

std::tuple<at::Tensor, at::Tensor> k_swiglu_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(swiglu_inputs(g, u) && swiglu_inputs(dy, g),
              "rlcore_portable::swiglu_backward: three contiguous float32 CPU tensors of one shape");
  at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
#if defined(__x86_64__)
  if (has_avx2()) {
    swiglu_backward_avx2(dy.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(), dg.data_ptr<float>(),
                         du.data_ptr<float>(), g.numel());
    return {dg, du};
  }
#endif
  return {at::silu_backward(dy * u, g), dy * at::silu(g)};
}

// ---- Rotary embedding of a query or key, x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), and its input
// gradient: one pass each way where the eager expression takes five forward (mul, neg, cat, mul, add) and, backward,
// two products, a negation and two zero-filled slice gradients that autograd adds up. Every product and sum is rounded
// on its own, as there (this file is compiled without contraction), so the forward has the eager bits. Backward,
// autograd adds g cos, the slice gradient of x1 and that of x2 (each zero outside its half); whatever the order,
// that is (g cos + r) + 0 with r the rotated g sin: + 0 turns the one -0 those sums can give into +0, as they do.

// Rows of the last dimension (d elements, stride 1) of x and of cos and sin broadcast to x's shape.
template <typename F>
void for_each_row(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, F fn) {
  const int64_t dims = x.dim();
  std::vector<int64_t> index(dims - 1, 0);
  const int64_t rows = x.numel() / x.size(-1);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t ox = 0, oc = 0, os = 0;
    for (int64_t a = 0; a < dims - 1; ++a) {
      ox += index[a] * x.stride(a);
      oc += index[a] * cos.stride(a);
      os += index[a] * sin.stride(a);
    }
    fn(ox, oc, os);
    for (int64_t a = dims - 2; a >= 0; --a) {  // next index, last dimension fastest
      if (++index[a] < x.size(a)) break;
      index[a] = 0;
    }
  }
}

bool rotary_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
         !x.is_cuda() && x.dim() >= 1 && x.size(-1) % 2 == 0 && x.stride(-1) == 1 && cos.sizes() == x.sizes() &&
         sin.sizes() == x.sizes() && cos.stride(-1) == 1 && sin.stride(-1) == 1;
}

at::Tensor dense_rows(const at::Tensor& t) {
  return t.stride(-1) == 1 && t.is_non_overlapping_and_dense() ? t : t.contiguous();
}

at::Tensor k_rotary(const at::Tensor& x_raw, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  const at::Tensor x_in = dense_rows(x_raw);
  const at::Tensor cos = cos_in.expand_as(x_in), sin = sin_in.expand_as(x_in);
  TORCH_CHECK(rotary_inputs(x_in, cos, sin), "rlcore_portable::rotary: float32 CPU x, cos, sin broadcastable to x, "
              "an even last dimension of stride 1");
  at::Tensor y = at::empty_like(x_in);  // x's layout, as torch's elementwise loops give
  const int64_t d = x_in.size(-1), h = d / 2;
  const float *px = x_in.data_ptr<float>(), *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for_each_row(x_in, cos, sin, [&](int64_t ox, int64_t oc, int64_t os) {
    const float *xr = px + ox, *c = pc + oc, *s = ps + os;
    float* yr = py + ox;
    for (int64_t j = 0; j < h; ++j) {
      const float a = xr[j] * c[j], b = -xr[j + h] * s[j];
      yr[j] = a + b;
    }
    for (int64_t j = h; j < d; ++j) {
      const float a = xr[j] * c[j], b = xr[j - h] * s[j];
      yr[j] = a + b;
    }
  });
  return y;
}

at::Tensor k_rotary_backward(const at::Tensor& g_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  const at::Tensor g = dense_rows(g_in);
  const at::Tensor cos = cos_in.expand_as(g), sin = sin_in.expand_as(g);
  TORCH_CHECK(rotary_inputs(g, cos, sin), "rlcore_portable::rotary_backward: float32 CPU grad, cos, sin "
              "broadcastable to it, an even last dimension of stride 1");
  at::Tensor gx = at::empty_like(g);
  const int64_t d = g.size(-1), h = d / 2;
  const float *pg = g.data_ptr<float>(), *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  float* po = gx.data_ptr<float>();
  for_each_row(g, cos, sin, [&](int64_t og, int64_t oc, int64_t os) {
    const float *gr = pg + og, *c = pc + oc, *s = ps + os;
    float* out = po + og;
    for (int64_t j = 0; j < h; ++j) {
      const float a = gr[j] * c[j], r = gr[j + h] * s[j + h];
      out[j] = (a + r) + 0.f;
    }
    for (int64_t j = h; j < d; ++j) {
      const float a = gr[j] * c[j], r = -(gr[j - h] * s[j - h]);
      out[j] = (a + r) + 0.f;
    }
  });
  return gx;
}

// ---- a decode step's keys or values into the KV cache: cache[i, h, pos[i], :] = src[i, h, :] for every row i of src
// and head h. A copy, no arithmetic: torch's index_copy_ over the cache seen as [slots * heads * length, d] rows spent
// ~0.35 us a row on a CPU (more than the step's attention over that row at a few dozen positions).
void k_cache_write(at::Tensor cache, const at::Tensor& src, const at::Tensor& pos_in) {
  TORCH_CHECK(cache.dim() == 4 && src.dim() == 3 && pos_in.dim() == 1,
              "rlcore_portable::cache_write: cache [slots, heads, length, d], src [rows, heads, d], pos [rows]");
  const int64_t rows = src.size(0), heads = src.size(1), d = src.size(2), length = cache.size(2);
  TORCH_CHECK(cache.size(0) >= rows && cache.size(1) == heads && cache.size(3) == d && pos_in.size(0) == rows,
              "rlcore_portable::cache_write: shapes do not match (cache ", cache.sizes(), ", src ", src.sizes(),
              ", pos ", pos_in.sizes(), ")");
  TORCH_CHECK(cache.scalar_type() == src.scalar_type() && !cache.is_cuda() && !src.is_cuda() &&
              cache.stride(3) == 1 && src.stride(2) == 1,
              "rlcore_portable::cache_write: CPU tensors of one dtype, each with a unit stride along d");
  const at::Tensor pos = pos_in.to(at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < length, "rlcore_portable::cache_write: position ", p[i], " of row ", i,
                " outside the cache's ", length);
  const int64_t size = cache.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (i * cache.stride(0) + h * cache.stride(1) + p[i] * cache.stride(2)) * size,
                  from + (i * src.stride(0) + h * src.stride(1)) * size, d * size);
}

}  // namespace

// Python-side control (rlcore.engine.portable_ops): which kernels run and how many threads share a product's rows.
TORCH_LIBRARY(rlcore_portable, m) {
  m.def("set_isa(int isa) -> int");
  m.def("set_threads(int threads) -> int");
  m.def("set_blocking(int kc, int mc, int nc) -> int[]");
  m.def("set_wide_rows(int rows) -> int");
  m.def("set_small_cols(int cols) -> int");
  m.def("swiglu(Tensor g, Tensor u) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor g, Tensor u) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
  m.def("cache_write(Tensor(a!) cache, Tensor src, Tensor pos) -> ()");
  m.impl("set_isa", [](int64_t which) -> int64_t {
    if (which >= 0) g_isa = static_cast<int>(std::min<int64_t>(which, detect_isa()));
    return isa();
  });
  m.impl("set_threads", [](int64_t n) -> int64_t {
    if (n >= 1) g_threads = static_cast<int>(n);
    return g_threads;
  });
  m.impl("set_blocking", [](int64_t kc, int64_t mc, int64_t nc) -> std::vector<int64_t> {
    if (kc >= 1) KC = kc;
    if (mc >= 14) MC = mc;
    if (nc >= 1) NC = nc;
    return {KC, MC, NC};
  });
  m.impl("set_small_cols", [](int64_t cols) -> int64_t {
    if (cols >= 0) SMALL_COLS = cols;
    return SMALL_COLS;
  });
  m.impl("set_wide_rows", [](int64_t rows) -> int64_t {
    if (rows >= 0) WIDE_ROWS = rows;
    return WIDE_ROWS;
  });
}

// The operators on tensors as CPU kernels (not catch-all ones): the dispatcher then takes them through the layers
// above the kernels as it does aten's (a TorchDispatchMode sees each call: bench.update_ceiling times them so).
TORCH_LIBRARY_IMPL(rlcore_portable, CPU, m) {
  m.impl("swiglu", k_swiglu);
  m.impl("swiglu_backward", k_swiglu_backward);
  m.impl("rotary", k_rotary);
  m.impl("rotary_backward", k_rotary_backward);
  m.impl("cache_write", k_cache_write);
}

TORCH_LIBRARY_IMPL(aten, CPU, m) {
  m.impl("mm", k_mm);
  m.impl("mm.out", k_mm_out);
  m.impl("bmm", k_bmm);
  m.impl("bmm.out", k_bmm_out);
  m.impl("mv", k_mv);
  m.impl("mv.out", k_mv_out);
  m.impl("dot", k_dot);
  m.impl("addmm", k_addmm);
  m.impl("addmm.out", k_addmm_out);
  m.impl("addmm_", k_addmm_);
  m.impl("baddbmm", k_baddbmm);
  m.impl("baddbmm.out", k_baddbmm_out);
  m.impl("baddbmm_", k_baddbmm_);
  m.impl("addmv", k_addmv);
  m.impl("addmv.out", k_addmv_out);
  m.impl("addmv_", k_addmv_);
#define REGISTER(name, fn)                                                                              \
  m.impl(#name, [](const at::Tensor& x) { return fn(x); });                                             \
  m.impl(#name "_", [](at::Tensor& x) -> at::Tensor& { return x.copy_(fn(x)); });                      \
  m.impl(#name ".out", [](const at::Tensor& x, at::Tensor& out) -> at::Tensor& { return into(out, fn(x)); });
  REGISTER(sqrt, k_sqrt)
#define REGISTER_UNARY(name) REGISTER(name, [](const at::Tensor& v) { return unary(k_##name##_op, v); })
  REGISTER_UNARY(exp) REGISTER_UNARY(log) REGISTER_UNARY(tanh) REGISTER_UNARY(log2) REGISTER_UNARY(log10)
  REGISTER_UNARY(tan) REGISTER_UNARY(atan) REGISTER_UNARY(asin) REGISTER_UNARY(acos) REGISTER_UNARY(erf)
#undef REGISTER_UNARY
#undef REGISTER
}
