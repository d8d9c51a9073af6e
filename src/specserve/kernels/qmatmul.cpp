// y = x @ W^T where W stays in its GGUF block format (Q4_K, Q6_K, Q8_0, Q5_0, Q4_1, Q4_0).
//
// Decode is memory-bound: a step costs the bytes of the weights it reads. Reading the 4-bit
// blocks as stored (4.5 bits per weight for Q4_K) instead of a float or int8 copy is the
// whole point. The activations are rounded to int8 once per call (one scale per block of 32,
// or of 256 for the K-quants, the granularity their scales live at) so the inner loops are
// integer multiply-adds (AVX2 `maddubs`: 32 byte products per instruction); the float work is
// one fused multiply-add per weight block.
//
// Each output element depends only on its own input row: rows are quantized independently and
// every row is reduced in the same order whatever M is, so a token's logits do not depend on
// which other tokens share the batch (speculative verification and batching stay bit-exact
// with single-token decoding).
//
// Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 are also read in an 8-row interleaved layout made at load time
// (see "Interleaved K-quants"), which is what matrices with a multiple of 8 rows use on AVX2;
// with AVX-512 (BW + VNNI), pairs of those groups are stored together and passes of several
// activation rows read both in 512-bit registers (see "Two groups per pass").
//
// Threading: tiles of 16 output rows, a contiguous share per torch OpenMP thread, the tail shared
// out (parallel_tiles).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#include <cpuid.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SPECSERVE_AVX2 1
#else
#define SPECSERVE_AVX2 0
#endif
// AVX512-VNNI (with 256-bit forms): one vpdpbusd does the u8 x s8 products of four bytes, their
// sum and the int32 accumulate that take maddubs + madd + add on AVX2. The interleaved kernels
// use it when it is there; their integer sums are the same (the AVX2 forms never saturate on
// the values fed to them), so both builds give bit-identical results.
#if SPECSERVE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECSERVE_VNNI 1
#else
#define SPECSERVE_VNNI 0
#endif
// AVX-512 (BW + VNNI): the multi-row passes take two 8-row groups at once in 512-bit registers
// (see "Two groups per pass"). Where the core executes 512-bit vpdpbusd at full width (Zen 5,
// Intel server cores) that doubles the int8 multiply-adds per cycle of a verify or prefill pass.
#if SPECSERVE_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define SPECSERVE_AVX512 1
#else
#define SPECSERVE_AVX512 0
#endif
// AMX-INT8 (Sapphire Rapids and later): wide passes over Q4_K take the tile unit (see "AMX
// tiles"); the process must be granted the tile registers at run time.
#if SPECSERVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define SPECSERVE_AMX 1
#include <sys/syscall.h>
#else
#define SPECSERVE_AMX 0
#endif

namespace {

// GGML type ids (gguf.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ6_K = 14;
// The same K-quants with 8 rows interleaved (see "Interleaved K-quants" below); specserve's own
// layouts, built at load time by specserve.models.block_linear.interleave_rows.
constexpr int64_t kQ4_0_X8 = 102;
constexpr int64_t kQ4_1_X8 = 103;
constexpr int64_t kQ5_0_X8 = 106;
constexpr int64_t kQ8_0_X8 = 108;
constexpr int64_t kQ4_K_X8 = 112;
constexpr int64_t kQ6_K_X8 = 114;
// The x8 layouts again, two 8-row groups per stored row with their blocks alternating (block b of
// the first group, then block b of the second): built where the kernels have the AVX-512 path,
// which reads both groups in one 512-bit pass (see "Two groups per pass").
constexpr int64_t kPaired = 100;  // x16 id = x8 id + kPaired

inline bool interleaved(int64_t qtype) { return qtype > 100; }

struct TypeInfo {
  int64_t block_values;  // weights per block (per row)
  int64_t block_bytes;   // bytes per block of all `rows` rows
  int64_t act_block;     // activation quantization block for this weight type
  int64_t rows = 1;      // rows stored together (interleaved layouts: 8)
};

TypeInfo type_info(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, 32};
    case kQ4_1: return {32, 20, 32};
    case kQ5_0: return {32, 22, 32};
    case kQ8_0: return {32, 34, 32};
    case kQ4_K: return {256, 144, 256};
    case kQ6_K: return {256, 210, 256};
    case kQ4_0_X8: return {32, 144, 32, 8};
    case kQ4_1_X8: return {32, 160, 32, 8};
    case kQ5_0_X8: return {32, 176, 32, 8};
    case kQ8_0_X8: return {32, 272, 32, 8};
    case kQ4_K_X8: return {256, 1184, 256, 8};
    case kQ6_K_X8: return {256, 1680, 256, 8};
    case kQ4_0_X8 + kPaired:
    case kQ4_1_X8 + kPaired:
    case kQ5_0_X8 + kPaired:
    case kQ8_0_X8 + kPaired:
    case kQ4_K_X8 + kPaired:
    case kQ6_K_X8 + kPaired: {
      TypeInfo info = type_info(qtype - kPaired);
      info.block_bytes *= 2;
      info.rows = 16;
      return info;
    }
    default: TORCH_CHECK(false, "specserve qmatmul: unsupported GGML type ", qtype);
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Activations of M rows rounded to int8: q[m*K + i] ~= x / d[block], plus sums of q per 16 and
// per 32 values (the weight formats with an offset or a zero point need them).
struct Acts {
  const int8_t* q;
  const float* d;
  const int16_t* s16;
  const int16_t* s32;
  // -32 * the sum of each 8 values (|.| <= 32512): Q6_K's value offset, where the VNNI kernels
  // start a chain over those 8 values so that it ends at sum((q - 32) * x).
  const int16_t* z8;
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t qa, int8_t* q, float* d, int16_t* s16, int16_t* s32, int16_t* z8) {
  const int64_t nblocks = K / qa;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* src = x + m * K + b * qa;
      int8_t* dst = q + m * K + b * qa;
#if SPECSERVE_AVX2
      // The largest |x| of the block, eight lanes at a time (max is exact in any order; maxps
      // returns its second operand when the first is NaN, so NaNs are skipped as std::max does).
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t i = 0; i < qa; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + i), magnitude), vmax);
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
      float amax = 0.f;
      for (int64_t i = 0; i < qa; ++i) amax = std::max(amax, std::fabs(src[i]));
#endif
      const float scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      d[m * nblocks + b] = scale;
#if SPECSERVE_AVX2
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
      int16_t* sums = s16 + m * (K / 16) + b * (qa / 16);
      for (int64_t i = 0; i < qa; i += 32) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i), vinv));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), vinv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 16), vinv));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 24), vinv));
        // packs work within 128-bit lanes; the permute restores element order.
        __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
        // Sums of each 8 and 16 values: psadbw adds 8 bytes as unsigned, so shift them by 128 first.
        const __m256i sad = _mm256_sub_epi64(_mm256_sad_epu8(_mm256_xor_si256(packed, bias), _mm256_setzero_si256()), _mm256_set1_epi64x(8 * 128));
        const int64_t e0 = _mm256_extract_epi64(sad, 0), e1 = _mm256_extract_epi64(sad, 1);
        const int64_t e2 = _mm256_extract_epi64(sad, 2), e3 = _mm256_extract_epi64(sad, 3);
        sums[i / 16] = static_cast<int16_t>(e0 + e1);
        sums[i / 16 + 1] = static_cast<int16_t>(e2 + e3);
        int16_t* z = z8 + m * (K / 8) + (b * qa + i) / 8;
        z[0] = static_cast<int16_t>(-32 * e0);
        z[1] = static_cast<int16_t>(-32 * e1);
        z[2] = static_cast<int16_t>(-32 * e2);
        z[3] = static_cast<int16_t>(-32 * e3);
      }
#else
      for (int64_t i = 0; i < qa; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
#endif
    }
#if !SPECSERVE_AVX2
    for (int64_t g = 0; g < K / 16; ++g) {
      const int8_t* v = q + m * K + g * 16;
      int lo = 0, hi = 0;
      for (int i = 0; i < 8; ++i) lo += v[i], hi += v[8 + i];
      s16[m * (K / 16) + g] = static_cast<int16_t>(lo + hi);
      z8[m * (K / 8) + 2 * g] = static_cast<int16_t>(-32 * lo);
      z8[m * (K / 8) + 2 * g + 1] = static_cast<int16_t>(-32 * hi);
    }
#endif
    for (int64_t g = 0; g < K / 32; ++g)
      s32[m * (K / 32) + g] = static_cast<int16_t>(s16[m * (K / 16) + 2 * g] + s16[m * (K / 16) + 2 * g + 1]);
  }
}

// Q4_K packs 8 six-bit scales and 8 six-bit mins for its 32-value sub-blocks into 12 bytes.
// Word-wise: bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7
// the same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7.
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, top = 0x03030303u;
  const uint32_t sc_lo = w[0] & six, mn_lo = w[1] & six;
  const uint32_t sc_hi = (w[2] & four) | (((w[0] >> 6) & top) << 4);
  const uint32_t mn_hi = ((w[2] >> 4) & four) | (((w[1] >> 6) & top) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4);
  std::memcpy(mn + 4, &mn_hi, 4);
}

#if SPECSERVE_AVX2

// Software prefetch: each kernel asks for the cache lines `g_prefetch_ahead` bytes past the block
// it is about to read, into L2 (T1: an L1 prefetch would hold a line-fill buffer the loads need).
// Weights stream from DRAM once per step and the multiply-adds of a block take about as long as
// its load; without the prefetch the core mostly alternates between computing and waiting. On a
// 2-vCPU Xeon VM a 1.5B Q4_K_M decode step went from 55 to 44 ms (5-token verify: 86 to 61 ms);
// 2 KiB ahead was the best of 0.5-8 KiB there. set_prefetch_distance / $SPECSERVE_PREFETCH tune it.
//
// Passes over several activation rows keep a distance of their own. They spend longer on each
// block, yet want to run further ahead: on a 2-vCPU Zen 5 the 1.5B's 9-token forward took 40-44 ms
// at 2 KiB, 35-36 at 4 KiB and 32-34 at 8 KiB, while its 1-token step moved by under 5% across
// the same distances (alternating processes; the hardware prefetcher keeps up with the fast
// one-row stream on its own, not with the slower multi-row one).
std::atomic<int64_t> g_prefetch_ahead{2048};
std::atomic<int64_t> g_prefetch_ahead_rows{8192};

// One cache line into L2, as _mm_prefetch(p, _MM_HINT_T1), but as a volatile asm statement, which
// the compiler may not delete: GCC 12 dropped loops of _mm_prefetch (nothing else in them) from
// every block kernel of some builds, which then ran as if nothing were prefetched (session 76; see
// test_every_compiled_kernel_prefetches_the_weights_it_will_read).
inline void prefetch_line(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// The prefetch distance of a pass over M activation rows.
inline int64_t prefetch_distance(int M) {
  return (M > 1 ? g_prefetch_ahead_rows : g_prefetch_ahead).load(std::memory_order_relaxed);
}

// Part `part` of `parts` of prefetch_ahead(blk, bytes, ahead), for kernels that walk a large block
// in sub-blocks: one slice per sub-block instead of every line at once. A burst of 20-40
// prefetches at each block start overflows the core's queue of outstanding misses; spread out,
// a Q4_K pass over one activation row in 512-bit registers went from 0.78x to 0.92x the 256-bit
// one's speed, single-threaded from DRAM (Zen 5).
// slice_lines says which lines those are; prefetch_lines asks for them (from line `from` on).
struct SliceLines {
  const char* p;
  int n;
};

inline SliceLines slice_lines(const uint8_t* blk, int64_t bytes, int64_t ahead, int part, int parts) {
  if (ahead <= 0) return {nullptr, 0};
  const int64_t lo = part * bytes / parts & ~int64_t{63};
  const int64_t hi = part + 1 == parts ? bytes : (part + 1) * bytes / parts & ~int64_t{63};
  return {reinterpret_cast<const char*>(blk) + ahead + lo, static_cast<int>((hi - lo + 63) / 64)};
}

inline void prefetch_lines(const SliceLines& s, int from = 0) {
  for (int l = from; l < s.n; ++l) prefetch_line(s.p + 64 * l);
}

inline void prefetch_slice(const uint8_t* blk, int64_t bytes, int64_t ahead, int part, int parts) {
  prefetch_lines(slice_lines(blk, bytes, ahead, part, parts));
}

// Every line of a block `ahead` bytes further on: the one slice of one part.
inline void prefetch_ahead(const uint8_t* blk, int64_t bytes, int64_t ahead) { prefetch_slice(blk, bytes, ahead, 0, 1); }

// The cache lines of prefetch_slice(blk, bytes, ahead, part, parts), asked for one per activation
// row of the pass (prefetch_share) instead of all before the rows' multiply-adds. Where a pass's
// arithmetic takes about as long as its weights' traffic (a verify pass of 4-12 rows), the memory
// time was mostly not hidden behind it: a 2-vCPU Xeon VM (AMX, family 6 model 167) spent 10.4 ms
// on the Qwen2.5-Coder-1.5B's Q6_K LM head at 9 rows where the same rows took 6.8 ms from cache
// and one row 5.4-6.4 ms from DRAM. A plain loop streaming 192 MiB per thread with 9 rows of
// vpdpbusd per 256 bytes, arithmetic about as long as the traffic, lost 16-25% to it at its best
// prefetch distance with the multiplier in a register and 33-48% once each multiply-add read its
// 4 activation bytes with a broadcast load, as these kernels do: the prefetches, issued in a burst
// among those loads, seem to wait for them.
// Spread one a row, the 1.5B's 197 products at 5 / 9 rows went from 51.1-51.6 to 45.9-47.7 / from
// 59.5-60.4 to 55.0-56.1 ms, whole forwards of 4 / 5 / 9 tokens 44.8-45.3 -> 41.4 / 48.3-49.4 ->
// 42.6-42.8 / 56.8-57.7 -> 51.6 ms (processes alternating). Spreading them evenly over the rows
// instead (row m asking for lines [m n / M, (m + 1) n / M)) gained at 5 rows but not at 9. The
// 256-bit kernels ask for the whole slice before a multi-row pass's rows (one a row there made the
// 3-row passes 8% slower, and an AVX2 build's 3-17-row forwards 2-8% slower) and, in a one-row
// pass, after the sub-block's loads: one-token forwards 37.3-37.5 -> 35.7-36.1 ms on that Xeon
// (38.2-38.6 -> 36.7-37.0 built for AVX2 only).
inline void prefetch_share(const SliceLines& s, int m, int M) {
  if (m < s.n) prefetch_line(s.p + 64 * m);  // one line a row, from the first row
  if (m + 1 == M) prefetch_lines(s, M);  // fewer rows than lines: the rest
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// 32 unsigned bytes times 32 signed bytes -> 16 int16 sums of adjacent products.
inline __m256i dot16_us(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }

// ... -> 8 int32 sums of 4 adjacent products.
inline __m256i dot32_us(__m256i u, __m256i s) { return _mm256_madd_epi16(dot16_us(u, s), _mm256_set1_epi16(1)); }

// Signed times signed: move the sign of a onto b so a can be used as unsigned.
inline __m256i dot32_ss(__m256i a, __m256i b) { return dot32_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 packed bytes -> 32 values: low nibbles first (elements 0..15), then high nibbles.
inline __m256i nibbles_16(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), mask), _mm_and_si128(t, mask));
}

// Bit i of a 32-bit word -> byte i equal to 0x10 when set, else 0.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

template <int MT>
void dot_q8_0(const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t ahead = prefetch_distance(MT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    prefetch_ahead(blk, 34, ahead);
    const float dw = half_to_float(blk);
    const __m256i w = load32(blk + 2);
    for (int m = 0; m < MT; ++m) {
      const int64_t xb = b;
      const __m256 p = _mm256_cvtepi32_ps(dot32_ss(w, load32(a[m].q + xb * 32)));
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * a[m].d[xb]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]);
}

template <int MT>
void dot_q4_1(const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  __m256 acc[MT];
  float offset[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
    offset[m] = 0.f;
  }
  const int64_t ahead = prefetch_distance(MT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 20;
    prefetch_ahead(blk, 20, ahead);
    const float dw = half_to_float(blk);
    const float mw = half_to_float(blk + 2);
    const __m256i w = nibbles_16(blk + 4);
    for (int m = 0; m < MT; ++m) {
      const int64_t xb = b;
      const float dx = a[m].d[xb];
      const __m256 p = _mm256_cvtepi32_ps(dot32_us(w, load32(a[m].q + xb * 32)));
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * dx), acc[m]);
      offset[m] += mw * dx * static_cast<float>(a[m].s32[xb]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]) + offset[m];
}

// Q5_0, and Q4_0 (the same without the fifth bits).
template <int MT, int kBits>
void dot_q5_0(const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  constexpr int64_t kBytes = kBits == 5 ? 22 : 18;
  constexpr float kZero = kBits == 5 ? 16.f : 8.f;  // value = q - kZero
  __m256 acc[MT];
  float offset[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
    offset[m] = 0.f;
  }
  const int64_t ahead = prefetch_distance(MT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    prefetch_ahead(blk, kBytes, ahead);
    const float dw = half_to_float(blk);
    __m256i w = nibbles_16(blk + kBytes - 16);
    if constexpr (kBits == 5) {
      uint32_t high;
      std::memcpy(&high, blk + 2, 4);
      w = _mm256_or_si256(w, fifth_bits(high));
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = a[m].d[b];
      const __m256 p = _mm256_cvtepi32_ps(dot32_us(w, load32(a[m].q + b * 32)));
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * dx), acc[m]);
      offset[m] -= kZero * dw * dx * static_cast<float>(a[m].s32[b]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]) + offset[m];
}

template <int MT>
void dot_q4_k(const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  __m128 offset[MT];  // - dmin * min * sum(x) terms
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
    offset[m] = _mm_setzero_ps();
  }
  const int64_t ahead = prefetch_distance(MT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 144;
    prefetch_ahead(blk, 144, ahead);
    const float d = half_to_float(blk);
    const float dmin = half_to_float(blk + 2);
    uint8_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    const uint8_t* qs = blk + 16;
    const int64_t xb = b;  // activation block (256 values)
    __m256i sumi[MT];
    for (int m = 0; m < MT; ++m) sumi[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 64 values: sub-block 2c in the low nibbles, 2c+1 in the high ones
      const __m256i packed = load32(qs + 32 * c);
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      const __m256i sc_lo = _mm256_set1_epi16(sc[2 * c]);
      const __m256i sc_hi = _mm256_set1_epi16(sc[2 * c + 1]);
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = a[m].q + xb * 256 + 64 * c;
        const __m256i p_lo = _mm256_madd_epi16(dot16_us(lo, load32(x)), sc_lo);
        const __m256i p_hi = _mm256_madd_epi16(dot16_us(hi, load32(x + 32)), sc_hi);
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = a[m].d[xb];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * dx), acc[m]);
      const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a[m].s32 + xb * 8));
      offset[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, sums)), _mm_set1_ps(-dmin * dx), offset[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum(_mm256_add_ps(acc[m], _mm256_castps128_ps256(offset[m])));
}

template <int MT>
void dot_q6_k(const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t ahead = prefetch_distance(MT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    prefetch_ahead(blk, 210, ahead);
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const int64_t xb = b;
    __m256i sumi[MT];
    for (int m = 0; m < MT; ++m) sumi[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {  // two halves of 128 values
      const __m256i A = load32(ql + 64 * h);
      const __m256i B = load32(ql + 64 * h + 32);
      const __m256i H = load32(qh + 32 * h);
      __m256i q[4];  // 6-bit values 0..63 of elements 128h + 32i .. +32
      q[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_slli_epi16(_mm256_and_si256(H, two), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(B, low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), two), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), two), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), two), 4));
      for (int i = 0; i < 4; ++i) {
        const int g = 8 * h + 2 * i;  // scale of the first 16 values; g + 1 for the next 16
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = a[m].q + xb * 256 + 128 * h + 32 * i;
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(dot16_us(q[i], load32(x)), scales));
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float dx = a[m].d[xb];
      // value = sc * (q - 32): subtract 32 * sum over groups of sc * sum(x), still in integers
      const __m256i zero = _mm256_madd_epi16(scales16, load32(a[m].s16 + xb * 16));
      const __m256i total = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(zero, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]);
}

// ---- Interleaved K-quants: 8 rows per group, one block of 256 values of each row together.
//
// The row-at-a-time kernels above spend most of their time decoding scales and reducing
// vectors, not reading memory: on a 2-core AVX2 machine one core does ~12 GB/s of Q4_K, less
// than its share of DRAM bandwidth. Storing 8 rows side by side turns those per-row scalar steps
// into one vector step for 8 rows: a 32-byte load holds 4 consecutive values of each of the 8
// rows (low nibbles; the high nibbles hold the next 4), each is multiplied by 4 activations
// broadcast to all rows, and the per-sub-block scales of the 8 rows are one vector.
//
// Q4_K x8 group block (1184 bytes; 8 x 144 = 1152 in the file), read front to back:
//   [0, 16)   d of rows 0..7 (float16)        [16, 32)  dmin of rows 0..7 (float16)
//   [32, 96)  min[p][r][e] of sub-block 2p+e  (uint8, 6-bit values)
//   then per sub-block j = 0..7, 136 bytes at 96 + 136j:
//     scale[r] (8 x uint8), qs[i][r][k] (128): low nibble = value 32j+8i+k of row r, high = 32j+8i+4+k
// Q6_K x8 group block (1680 bytes, as in the file), read front to back:
//   [0, 16)   d of rows 0..7 (float16)
//   then per 32-value chunk c = 0..7, 208 bytes at 16 + 208c:
//     scale[r][e] of 16-value group 2c+e (16 x int8),
//     ql[i][r][k] (128): low 4 bits of value 32c+8i+k (low nibble) and 32c+8i+4+k (high nibble),
//     qh[h][r][k] (64): top 2 bits of values 32c+16h+{k, 4+k, 8+k, 12+k} at bits 0, 2, 4, 6
// Q8_0 x8 group block (272 bytes, as in the file): d of rows 0..7 (float16), then
//   qs[i][r][k] (256): value 4i+k of row r (int8)
// Q5_0 x8 group block (176 bytes, as in the file): d of rows 0..7 (float16), then
//   qs[i][r][k] (128): low 4 bits of value 8i+k (low nibble) and 8i+4+k (high nibble),
//   qh[r][k] (32): bit v = fifth bit of value 4v+k
// Q4_0 x8 group block (144 bytes, as in the file): Q5_0's first 144 bytes (no fifth bits)
// Q4_1 x8 group block (160 bytes, as in the file): d of rows 0..7 (float16), m of rows 0..7
//   (float16), then qs as Q4_0's
//
// Integer ranges: a maddubs lane is at most 2 * 15 * 127 (Q4_K) or 2 * 63 * 127 (Q6_K), so 8
// (Q4_K sub-block) or 2 (Q6_K) of them are summed in int16 without overflow before the scale.
// Each row's arithmetic is the same whatever the other rows of x are (bit-exact batching).

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Multi-row passes. A verify step (K + 1 tokens), a batch of decodes and a prefill chunk all
// multiply several activation rows by the same weights. Each kernel below unpacks a weight
// block (or sub-block) into registers once and then runs every activation row of the pass over
// it, so the unpacking is paid once per block, not once per row. What each row accumulates
// (int32 block sums, float32 totals) lives in a small scratch array in L1, not in registers:
// with per-row register accumulators the kernels spilled from 5 rows on and a 9-token verify
// cost 3.2 single-token steps on a 2-core AVX2 EPYC. For 1-4 rows the same code is instantiated
// with a fixed row count (MT), whose accumulator arrays the compiler keeps in registers: that is
// faster there than the L1 scratch (measured: 1-row Q4_K 0.37 vs 0.51 ms). Passes of 5-15 rows
// (verify steps, small decode batches) get a fixed count too, their row loops unrolled (see
// dot_x8_g). Per row, the integer sums are exact and
// the float operations are the same, in the same order, for any number of rows in the pass, so
// results stay bit-identical to single-row calls (and between the AVX2 and VNNI builds).
constexpr int kPassRows = 32;  // activation rows per pass over an 8-row weight group

// The multi-row kernels over G groups keep each group's sums apart (accs: G arrays of `stride`
// floats, 8 per activation row); out takes them row by row: out[(m * G + g) * 8 + r].
inline void zero_groups(float* accs, int G, int64_t stride, int M) {
  for (int g = 0; g < G; ++g) std::memset(accs + g * stride, 0, sizeof(float) * 8 * M);
}

inline void write_groups(float* out, const float* accs, int G, int64_t stride, int M) {
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) std::memcpy(out + (m * G + g) * 8, accs + g * stride + 8 * m, sizeof(float) * 8);
}

// A Q4_K x8 sub-block's 8 six-bit scales (one a row, at sub), each in both int16 halves of its row's lane.
inline __m256i q4_k_x8_scales(const uint8_t* sub) {
  const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub)));
  return _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
}

// A Q6_K x8 chunk's 16 int8 scales widened (scale[r][e] for 16-value groups 2c + e), and each
// row's scale of group e in both int16 halves of its lane.
inline __m256i q6_k_x8_scales(const uint8_t* chunk) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
}
inline __m256i q6_k_x8_scale_of(__m256i sc16, int e) {
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                       2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
  return _mm256_shuffle_epi8(sc16, e == 0 ? even : odd);
}

// Half h of a Q6_K x8 chunk unpacked: v[k * stride] holds values 16h + 4k + i (i = 0..3) of each
// row, 0..63 (ql's low 4 bits with qh's top 2).
inline void q6_k_x8_values(const uint8_t* chunk, int h, __m256i* v, int stride) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i top = _mm256_set1_epi8(0x30);
  const __m256i H = load32(chunk + 144 + 32 * h);
  const __m256i L0 = load32(chunk + 16 + 64 * h);
  const __m256i L1 = load32(chunk + 16 + 64 * h + 32);
  v[0] = _mm256_or_si256(_mm256_and_si256(L0, low), _mm256_and_si256(_mm256_slli_epi16(H, 4), top));
  v[stride] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), low), _mm256_and_si256(_mm256_slli_epi16(H, 2), top));
  v[2 * stride] = _mm256_or_si256(_mm256_and_si256(L1, low), _mm256_and_si256(H, top));
  v[3 * stride] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), low), _mm256_and_si256(_mm256_srli_epi16(H, 2), top));
}

// The end of a Q4_K x8 block for M activation rows: the mins (sum over sub-blocks of min * the sum
// of x over the sub-block) and the block's float step into acc (8 floats a row).
inline void q4_k_x8_block_end(const uint8_t* blk, const int32_t* sumi, float* acc, const Acts* a, int64_t b, int M) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
  __m256i mins[4];
  for (int p = 0; p < 4; ++p) mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * p)));
  for (int m = 0; m < M; ++m) {
    __m256i summ = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      int32_t pair;
      std::memcpy(&pair, a[m].s32 + b * 8 + 2 * p, 4);
      summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pair)));
    }
    const __m256 dx = _mm256_set1_ps(a[m].d[b]);
    const __m256i si = _mm256_load_si256(reinterpret_cast<const __m256i*>(sumi + 8 * m));
    __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, dx), _mm256_load_ps(acc + 8 * m));
    r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, dx), r);
    _mm256_store_ps(acc + 8 * m, r);
  }
}

// Q6_K's: acc += d * dx * sumi.
inline void q6_k_x8_block_end(const uint8_t* blk, const int32_t* sumi, float* acc, const Acts* a, int64_t b, int M) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  for (int m = 0; m < M; ++m) {
    const __m256i si = _mm256_load_si256(reinterpret_cast<const __m256i*>(sumi + 8 * m));
    _mm256_store_ps(acc + 8 * m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])),
                                                 _mm256_load_ps(acc + 8 * m)));
  }
}

template <int MT, int G>
void dot_q4_k_x8(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) float accs[G][kRows * 8];
  alignas(32) int32_t sumi[kRows * 8];
  zero_groups(accs[0], G, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b)
  for (int gi = 0; gi < G; ++gi) {
    float* acc = accs[gi];
    const uint8_t* blk = grp + gi * gap + b * step;
    for (int m = 0; m < M; ++m) _mm256_store_si256(reinterpret_cast<__m256i*>(sumi + 8 * m), _mm256_setzero_si256());
    for (int j = 0; j < 8; ++j) {
      const SliceLines pf = slice_lines(blk, 1184, ahead, j, 8);
      if (M > 1) prefetch_lines(pf);  // several rows: the whole slice before the loads
      const uint8_t* sub = blk + 96 + 136 * j;
#if SPECSERVE_VNNI
      const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub)));
#else
      const __m256i sc = q4_k_x8_scales(sub);
#endif
      __m256i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i packed = load32(sub + 8 + 32 * i);
        lo[i] = _mm256_and_si256(packed, low);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      }
      const int64_t off = b * 256 + 32 * j;
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        if (M == 1) prefetch_lines(pf);  // one row: after them
        const int8_t* x = a[m].q + off;
        __m256i* s = reinterpret_cast<__m256i*>(sumi + 8 * m);
#if SPECSERVE_VNNI
        // Low and high nibbles in two int32 chains (one chain of 8 waits on its own latency),
        // each of 16 values, |.| <= 16 * 15 * 128 < 2^15: so each is an int16 in its lane's low
        // half, and vpdpwssd with the lane's (scale, 0) pair adds it times the scale, the exact
        // int32 sum one vpmulld of their sum gave, in 2 instructions instead of 4 (vpmulld is
        // two on Intel). Two vpmaddwd and their adds instead had cost a slot more (Zen 4).
        __m256i plo = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[0], bcast4(x));
        __m256i phi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi[0], bcast4(x + 4));
        for (int i = 1; i < 4; ++i) {
          plo = _mm256_dpbusd_epi32(plo, lo[i], bcast4(x + 8 * i));
          phi = _mm256_dpbusd_epi32(phi, hi[i], bcast4(x + 8 * i + 4));
        }
        *s = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(*s, plo, s32), phi, s32);
#else
        // 8 maddubs lanes of at most 2 * 15 * 127 each still fit int16.
        __m256i p = _mm256_maddubs_epi16(lo[0], bcast4(x));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[0], bcast4(x + 4)));
        for (int i = 1; i < 4; ++i) {
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[i], bcast4(x + 8 * i)));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[i], bcast4(x + 8 * i + 4)));
        }
        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, sc));
#endif
      }
    }
    q4_k_x8_block_end(blk, sumi, acc, a, b, M);
  }
  write_groups(out, accs[0], G, kRows * 8, M);
}

#if SPECSERVE_AVX2 && !SPECSERVE_VNNI
// Two 8-row Q4_K groups at once (blocks `gap` bytes apart), AVX2 without VNNI: each activation
// broadcast feeds both groups' multiply-adds. A Zen 3 core (AVX2 only; family 25 model 1) issues
// at most four vector operations a cycle and, with the broadcast a vector load and a shuffle-pipe
// operation each, the one-group pass spends 26 of them on every row's sub-block (8 broadcasts, 8
// maddubs, 8 int16 adds, the scale's madd and the int32 add): llvm-mca puts it at 6.6 cycles,
// measured ~8. Shared, a group's sub-block costs 4 broadcasts and, the 16 unpacked registers of
// two groups being more than AVX2 has, a madd and an add more (each sub-block goes in two halves
// of 16 values, each half's int16 sum scaled on its own): 5.4 cycles by llvm-mca. Each half sum
// is at most 4 * 2 * 15 * 127, so the int32 sums are the ones the one-group pass makes (bit-identical).
template <int MT>
void dot_q4_k_x8_pair(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) float accs[2][kRows * 8];
  alignas(32) int32_t sums[2][kRows * 8];
  // Through an opaque pointer: GCC otherwise splits the array into a copy it stores each sum to
  // as well (two stores per row and half where one is needed).
  int32_t (*sumi)[kRows * 8] = sums;
  asm("" : "+r"(sumi));
  zero_groups(accs[0], 2, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk0 = grp + b * step;
    const uint8_t* blk1 = blk0 + gap;
    std::memset(sumi[0], 0, sizeof(int32_t) * 8 * M);
    std::memset(sumi[1], 0, sizeof(int32_t) * 8 * M);
    for (int j = 0; j < 8; ++j) {
      prefetch_lines(slice_lines(blk0, 1184, ahead, j, 8));
      prefetch_lines(slice_lines(blk1, 1184, ahead, j, 8));
      const uint8_t* sub0 = blk0 + 96 + 136 * j;
      const uint8_t* sub1 = blk1 + 96 + 136 * j;
      const __m256i sc0 = q4_k_x8_scales(sub0), sc1 = q4_k_x8_scales(sub1);
      const int64_t off = b * 256 + 32 * j;
      for (int h = 0; h < 2; ++h) {
        // w[2i + g]: low nibbles of quarter 2h + i of group g (values 8i + k of the half), w[4 + 2i + g]: high (8i + 4 + k)
        __m256i w[8];
        for (int i = 0; i < 2; ++i) {
          const __m256i p0 = load32(sub0 + 8 + 32 * (2 * h + i));
          const __m256i p1 = load32(sub1 + 8 + 32 * (2 * h + i));
          w[2 * i] = _mm256_and_si256(p0, low);
          w[2 * i + 1] = _mm256_and_si256(p1, low);
          w[4 + 2 * i] = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low);
          w[4 + 2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low);
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a[m].q + off + 16 * h;
          __m256i xa = bcast4(x), xb = bcast4(x + 4);
          __m256i q0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xa), _mm256_maddubs_epi16(w[4], xb));
          __m256i q1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[1], xa), _mm256_maddubs_epi16(w[5], xb));
          xa = bcast4(x + 8), xb = bcast4(x + 12);
          q0 = _mm256_add_epi16(q0, _mm256_add_epi16(_mm256_maddubs_epi16(w[2], xa), _mm256_maddubs_epi16(w[6], xb)));
          q1 = _mm256_add_epi16(q1, _mm256_add_epi16(_mm256_maddubs_epi16(w[3], xa), _mm256_maddubs_epi16(w[7], xb)));
          __m256i* s0 = reinterpret_cast<__m256i*>(sumi[0] + 8 * m);
          __m256i* s1 = reinterpret_cast<__m256i*>(sumi[1] + 8 * m);
          *s0 = _mm256_add_epi32(*s0, _mm256_madd_epi16(q0, sc0));
          *s1 = _mm256_add_epi32(*s1, _mm256_madd_epi16(q1, sc1));
        }
      }
    }
    // The block's end reads the sums back from memory: told nothing of them, GCC kept a second
    // copy of every sum on the stack across the row loop to spare those loads (llvm-mca: the
    // 9-row loop 48.5 -> 60.5 cycles).
    asm volatile("" ::: "memory");
    q4_k_x8_block_end(blk0, sumi[0], accs[0], a, b, M);
    q4_k_x8_block_end(blk1, sumi[1], accs[1], a, b, M);
  }
  write_groups(out, accs[0], 2, kRows * 8, M);
}
#endif

template <int MT, int G>
void dot_q6_k_x8(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  alignas(32) float accs[G][kRows * 8];
  alignas(32) int32_t sumi[kRows * 8];
  zero_groups(accs[0], G, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b)
  for (int gi = 0; gi < G; ++gi) {
    float* acc = accs[gi];
    const uint8_t* blk = grp + gi * gap + b * step;
    for (int m = 0; m < M; ++m) _mm256_store_si256(reinterpret_cast<__m256i*>(sumi + 8 * m), _mm256_setzero_si256());
    for (int c = 0; c < 8; ++c) {  // 32 values: 16-value groups 2c and 2c+1 = scale pair c
      const SliceLines pf = slice_lines(blk, 1680, ahead, c, 8);
      if (M > 1) prefetch_lines(pf);  // several rows: the whole slice before the loads
      const uint8_t* chunk = blk + 16 + 208 * c;
      const __m256i sc16 = q6_k_x8_scales(chunk);
#if SPECSERVE_VNNI
      // Each row's scale as the int16 pair (scale, 0): vpdpwssd then adds scale * (low half).
      const __m256i sc_a = _mm256_srli_epi32(q6_k_x8_scale_of(sc16, 0), 16);
      const __m256i sc_b = _mm256_srli_epi32(q6_k_x8_scale_of(sc16, 1), 16);
#else
      const __m256i sc_a = q6_k_x8_scale_of(sc16, 0), sc_b = q6_k_x8_scale_of(sc16, 1);
#endif
      __m256i v[8];  // v[4h + k]: values 16h + 4k + i (i = 0..3) of each row
      for (int h = 0; h < 2; ++h) q6_k_x8_values(chunk, h, v + 4 * h, 1);
      const int64_t off = b * 256 + 32 * c;
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        if (M == 1) prefetch_lines(pf);  // one row: after them
        const int8_t* x = a[m].q + off;
        __m256i* s = reinterpret_cast<__m256i*>(sumi + 8 * m);
#if SPECSERVE_VNNI
        for (int g = 0; g < 2; ++g) {  // 16-value group 2c + g: values 16g .. 16g + 15
          // Two chains of 8 values, each from -32 * the sum of its x (value = q - 32; see
          // dot_q6_k_x16), ending at |.| <= 8 * 32 * 127 < 2^15: one vpdpwssd each with the
          // row's (scale, 0) pair.
          const __m256i sg = g == 0 ? sc_a : sc_b;
          const int16_t* z = a[m].z8 + b * 32 + 4 * c + 2 * g;
          const __m256i pa = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_set1_epi16(z[0]), v[4 * g + 0], bcast4(x + 16 * g)),
                                                 v[4 * g + 1], bcast4(x + 16 * g + 4));
          const __m256i pb = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_set1_epi16(z[1]), v[4 * g + 2], bcast4(x + 16 * g + 8)),
                                                 v[4 * g + 3], bcast4(x + 16 * g + 12));
          *s = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(*s, pa, sg), pb, sg);
        }
#else
        // value = q - 32: subtract 32 * scale * sum(x) per 16-value group
        int32_t pair;
        std::memcpy(&pair, a[m].s16 + b * 16 + 2 * c, 4);
        __m256i t = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_set1_epi32(pair)), 5);
        for (int g = 0; g < 2; ++g) {  // 16-value group 2c + g: values 16g .. 16g + 15
          const __m256i sg = g == 0 ? sc_a : sc_b;
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(v[4 * g + 0], bcast4(x + 16 * g)),
                                              _mm256_maddubs_epi16(v[4 * g + 1], bcast4(x + 16 * g + 4)));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(v[4 * g + 2], bcast4(x + 16 * g + 8)),
                                              _mm256_maddubs_epi16(v[4 * g + 3], bcast4(x + 16 * g + 12)));
          *s = _mm256_add_epi32(*s, _mm256_add_epi32(_mm256_madd_epi16(p0, sg), _mm256_madd_epi16(p1, sg)));
        }
        *s = _mm256_sub_epi32(*s, t);
#endif
      }
    }
    q6_k_x8_block_end(blk, sumi, acc, a, b, M);
  }
  write_groups(out, accs[0], G, kRows * 8, M);
}

#if SPECSERVE_AVX2 && !SPECSERVE_VNNI
// Two 8-row Q6_K groups at once, as dot_q4_k_x8_pair: each chunk's two 16-value halves in turn,
// the four activation broadcasts of a half (and the pair of 16-value sums for the offset) shared
// by both groups; each group gets the int32 sums dot_q6_k_x8 makes (added in another order,
// which changes nothing in integers), so the results are bit-identical.
template <int MT>
void dot_q6_k_x8_pair(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  alignas(32) float accs[2][kRows * 8];
  alignas(32) int32_t sums[2][kRows * 8];
  int32_t (*sumi)[kRows * 8] = sums;  // opaque, as in dot_q4_k_x8_pair
  asm("" : "+r"(sumi));
  zero_groups(accs[0], 2, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[2] = {grp + b * step, grp + b * step + gap};
    std::memset(sumi[0], 0, sizeof(int32_t) * 8 * M);
    std::memset(sumi[1], 0, sizeof(int32_t) * 8 * M);
    for (int c = 0; c < 8; ++c) {
      prefetch_lines(slice_lines(blk[0], 1680, ahead, c, 8));
      prefetch_lines(slice_lines(blk[1], 1680, ahead, c, 8));
      const uint8_t* chunk[2] = {blk[0] + 16 + 208 * c, blk[1] + 16 + 208 * c};
      const __m256i sc16_0 = q6_k_x8_scales(chunk[0]), sc16_1 = q6_k_x8_scales(chunk[1]);
      const int64_t off = b * 256 + 32 * c;
      // value = q - 32: subtract 32 * scale * sum(x) per 16-value group, first
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, a[m].s16 + b * 16 + 2 * c, 4);
        const __m256i xs = _mm256_set1_epi32(pair);
        __m256i* s0 = reinterpret_cast<__m256i*>(sumi[0] + 8 * m);
        __m256i* s1 = reinterpret_cast<__m256i*>(sumi[1] + 8 * m);
        *s0 = _mm256_sub_epi32(*s0, _mm256_slli_epi32(_mm256_madd_epi16(sc16_0, xs), 5));
        *s1 = _mm256_sub_epi32(*s1, _mm256_slli_epi32(_mm256_madd_epi16(sc16_1, xs), 5));
      }
      for (int g = 0; g < 2; ++g) {  // 16-value group 2c + g: values 16g .. 16g + 15
        const __m256i sg0 = q6_k_x8_scale_of(sc16_0, g), sg1 = q6_k_x8_scale_of(sc16_1, g);
        __m256i v[8];  // v[2k + e]: values 16g + 4k + i of group e's rows
        for (int e = 0; e < 2; ++e) q6_k_x8_values(chunk[e], g, v + e, 2);
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a[m].q + off + 16 * g;
          __m256i* s0 = reinterpret_cast<__m256i*>(sumi[0] + 8 * m);
          __m256i* s1 = reinterpret_cast<__m256i*>(sumi[1] + 8 * m);
          // Each int16 pair sum scaled and added as soon as it is made (integer sums: the order
          // changes nothing), so that few registers are live beside the eight of weights.
          __m256i xa = bcast4(x), xb = bcast4(x + 4);
          __m256i r0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[0], xa), _mm256_maddubs_epi16(v[2], xb)), sg0);
          __m256i r1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[1], xa), _mm256_maddubs_epi16(v[3], xb)), sg1);
          xa = bcast4(x + 8), xb = bcast4(x + 12);
          r0 = _mm256_add_epi32(r0, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[4], xa), _mm256_maddubs_epi16(v[6], xb)), sg0));
          r1 = _mm256_add_epi32(r1, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[5], xa), _mm256_maddubs_epi16(v[7], xb)), sg1));
          *s0 = _mm256_add_epi32(*s0, r0);
          *s1 = _mm256_add_epi32(*s1, r1);
        }
      }
    }
    asm volatile("" ::: "memory");  // as in dot_q4_k_x8_pair
    for (int g = 0; g < 2; ++g) q6_k_x8_block_end(blk[g], sumi[g], accs[g], a, b, M);
  }
  write_groups(out, accs[0], 2, kRows * 8, M);
}
#endif

template <int MT, int G>
void dot_q8_0_x8(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  alignas(32) float accs[G][kRows * 8];
  zero_groups(accs[0], G, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
#if !SPECSERVE_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b)
  for (int gi = 0; gi < G; ++gi) {
    float* acc = accs[gi];
    const uint8_t* blk = grp + gi * gap + b * step;
    prefetch_ahead(blk, 272, ahead);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    // |w| as unsigned bytes, the sign moved onto x: 8 registers of |w| and 8 of w do not fit
    // beside the row loop, so the weights are re-read from L1 per row (loads are cheap).
    const uint8_t* ws = blk + 16;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a[m].q + b * 32;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // two dependency chains
      for (int i = 0; i < 8; i += 2) {
        const __m256i w0 = load32(ws + 32 * i), w1 = load32(ws + 32 * i + 32);
        const __m256i x0 = _mm256_sign_epi8(bcast4(x + 4 * i), w0), x1 = _mm256_sign_epi8(bcast4(x + 4 * i + 4), w1);
#if SPECSERVE_VNNI
        s0 = _mm256_dpbusd_epi32(s0, _mm256_sign_epi8(w0, w0), x0);
        s1 = _mm256_dpbusd_epi32(s1, _mm256_sign_epi8(w1, w1), x1);
#else
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), x0), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), x1), ones));
#endif
      }
      _mm256_store_ps(acc + 8 * m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                                                   _mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])), _mm256_load_ps(acc + 8 * m)));
    }
  }
  write_groups(out, accs[0], G, kRows * 8, M);
}

// Q5_0 and Q4_0 (which is Q5_0 without the fifth bits: 4.5 bits per weight; specserve
// requantizes a draft's 32-value blocks to it under --quantization int4) share one kernel.
// One 32-value block of 8 interleaved rows against one activation row: v[2i + h] holds values
// 8i + 4h + k (k = 0..3) of each row as unsigned bytes below 32; returns the 8 rows' int32 dots.
inline __m256i dot_x8_block32(const __m256i* v, const int8_t* x) {
#if SPECSERVE_VNNI
  __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();  // two chains (see dot_q4_k_x8)
  for (int i = 0; i < 8; i += 2) {
    d0 = _mm256_dpbusd_epi32(d0, v[i], bcast4(x + 4 * i));
    d1 = _mm256_dpbusd_epi32(d1, v[i + 1], bcast4(x + 4 * i + 4));
  }
  return _mm256_add_epi32(d0, d1);
#else
  // a maddubs lane is at most 2 * 31 * 127: four of them still fit in int16
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p0 = _mm256_maddubs_epi16(v[0], bcast4(x));
  __m256i p1 = _mm256_maddubs_epi16(v[4], bcast4(x + 16));
  p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(v[1], bcast4(x + 4)));
  p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(v[5], bcast4(x + 20)));
  p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(v[2], bcast4(x + 8)));
  p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(v[6], bcast4(x + 24)));
  p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(v[3], bcast4(x + 12)));
  p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(v[7], bcast4(x + 28)));
  return _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
#endif
}

// The 32-value formats with 4-bit nibbles in Q4_0's interleaved layout: Q4_0 (value = q - 8),
// Q5_0 (a fifth bit, value = q - 16) and Q4_1 (value = d * q + m, q = 0..15, no fixed zero point).
// A block's sum is d * dx * (sum(q * xq) - zero * sum(xq)), or for Q4_1
// d * dx * sum(q * xq) + m * dx * sum(xq): the same integer dot, then the activation block's sum
// (s32) times the zero point or the row's min. Q4_1's 8-row block (160 bytes) is d of rows 0-7
// (fp16), m of rows 0-7 (fp16), then the nibbles as Q4_0's.
template <int MT, int G, int64_t kType>
void dot_q4_q5_x8(const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  constexpr bool kMin = kType == kQ4_1_X8;
  constexpr int64_t kBytes = kType == kQ5_0_X8 ? 176 : kMin ? 160 : 144;
  constexpr int64_t kNibbles = kMin ? 32 : 16;  // where the interleaved nibbles start
  constexpr int32_t kZero = kType == kQ5_0_X8 ? 16 : 8;  // value = q - kZero (Q4_0, Q5_0)
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) float accs[G][kRows * 8];
  zero_groups(accs[0], G, kRows * 8, M);
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b)
  for (int gi = 0; gi < G; ++gi) {
    float* acc = accs[gi];
    const uint8_t* blk = grp + gi * gap + b * step;
    prefetch_ahead(blk, kBytes, ahead);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 mn = kMin ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16))) : _mm256_setzero_ps();
    __m256i v[8];  // v[2i + h]: values 8i + 4h + k of each row, 0..2^bits - 1
    for (int i = 0; i < 4; ++i) {
      const __m256i L = load32(blk + kNibbles + 32 * i);
      v[2 * i] = _mm256_and_si256(L, low);
      v[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(L, 4), low);
    }
    if constexpr (kType == kQ5_0_X8) {
      const __m256i bit = _mm256_set1_epi8(0x10);
      const __m256i H = load32(blk + 144);
      v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(H, 4), bit));
      v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(H, 3), bit));
      v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(H, 2), bit));
      v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(H, 1), bit));
      v[4] = _mm256_or_si256(v[4], _mm256_and_si256(H, bit));
      v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_srli_epi16(H, 1), bit));
      v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(H, 2), bit));
      v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(H, 3), bit));
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256i dot = dot_x8_block32(v, a[m].q + b * 32);
      const __m256 dx = _mm256_set1_ps(a[m].d[b]);
      if constexpr (kMin) {
        __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), _mm256_load_ps(acc + 8 * m));
        r = _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(a[m].s32[b])), _mm256_mul_ps(mn, dx), r);
        _mm256_store_ps(acc + 8 * m, r);
      } else {
        const __m256i sumi = _mm256_sub_epi32(dot, _mm256_set1_epi32(kZero * a[m].s32[b]));
        _mm256_store_ps(acc + 8 * m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dx), _mm256_load_ps(acc + 8 * m)));
      }
    }
  }
  write_groups(out, accs[0], G, kRows * 8, M);
}

#if SPECSERVE_AVX512
// ---- Two groups per pass (AVX-512): rows 0-7 of a 512-bit register come from one 8-row group,
// rows 8-15 from the next, so every instruction of the row loop does the work of two 256-bit
// ones. Each lane runs the 256-bit kernels' arithmetic unchanged: the integer sums are exact and
// the float steps are the same operations in the same order, so a row's result is bit-identical
// whichever kernel computed it (test_vnni_kernels_are_bit_identical_to_the_avx2_ones).
//
// The two groups are stored paired (x16 ids): block b of the first group, then block b of the
// second, so a pass reads one sequential stream. Reading the two groups from where the x8 layout
// keeps them (a row of blocks apart) made the same pass 10-30% slower wherever the weights come
// from DRAM. Passes of fewer rows than g_wide_min_rows read a paired row with the 256-bit kernels
// (G = 2: both groups block by block, the same order in memory).

inline __m512i join32(const uint8_t* p0, const uint8_t* p1) {  // 32 bytes of each group
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(p0)), load32(p1), 1);
}

inline __m256i join16(const uint8_t* p0, const uint8_t* p1) {  // 16 bytes of each group
  return _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
}

inline __m128i join8(const uint8_t* p0, const uint8_t* p1) {  // 8 bytes of each group
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
}

inline __m512 halves16(const uint8_t* p0, const uint8_t* p1) { return _mm512_cvtph_ps(join16(p0, p1)); }  // 8 float16 of each

inline __m512i bcast4z(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A paired Q4_K block's float step for rows 0..M: acc[m] += d * dx * sumi(m) - dmin * dx * (the
// mins times the activations' 32-value sums), d / dmin / mins from the block at b0 / b1. The
// 512-bit and the tile kernels both end each block here, so their results agree bit for bit
// whenever their integer sums do.
template <typename Sumi>
inline void q4_k_x16_block_step(const uint8_t* b0, const uint8_t* b1, int64_t b, const Acts* a, int M, Sumi&& sumi, __m512* acc) {
  const __m512 d = halves16(b0, b1);
  const __m512 dmin = halves16(b0 + 16, b1 + 16);
  __m512i mins[4];
  for (int p = 0; p < 4; ++p) mins[p] = _mm512_cvtepu8_epi16(join16(b0 + 32 + 16 * p, b1 + 32 + 16 * p));
  for (int m = 0; m < M; ++m) {
    __m512i summ = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      int32_t pair;
      std::memcpy(&pair, a[m].s32 + b * 8 + 2 * p, 4);
      summ = _mm512_dpwssd_epi32(summ, mins[p], _mm512_set1_epi32(pair));
    }
    const __m512 dx = _mm512_set1_ps(a[m].d[b]);
    const __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi(m)), _mm512_mul_ps(d, dx), acc[m]);
    acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), r);
  }
}

template <int MT>
void dot_q4_k_x16(const uint8_t* grp, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows];
  __m512i sumi[kRows];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = grp + b * 2 * 1184;
    const uint8_t* b1 = b0 + 1184;
    for (int m = 0; m < M; ++m) sumi[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const SliceLines pf = slice_lines(b0, 2 * 1184, ahead, j, 8);
      const uint8_t* s0 = b0 + 96 + 136 * j;
      const uint8_t* s1 = b1 + 96 + 136 * j;
      const __m512i s32 = _mm512_cvtepu8_epi32(join8(s0, s1));
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = join32(s0 + 8 + 32 * i, s1 + 8 + 32 * i);
        lo[i] = _mm512_and_si512(packed, low);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
      const int64_t off = b * 256 + 32 * j;
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        prefetch_share(pf, m, M);
        const int8_t* x = a[m].q + off;
        __m512i plo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast4z(x));
        __m512i phi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], bcast4z(x + 4));
        for (int i = 1; i < 4; ++i) {
          plo = _mm512_dpbusd_epi32(plo, lo[i], bcast4z(x + 8 * i));
          phi = _mm512_dpbusd_epi32(phi, hi[i], bcast4z(x + 8 * i + 4));
        }
        sumi[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sumi[m], plo, s32), phi, s32);
      }
    }
    q4_k_x16_block_step(b0, b1, b, a, M, [&](int m) { return sumi[m]; }, acc);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

template <int MT>
void dot_q6_k_x16(const uint8_t* grp, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  constexpr int kGroups = MT == 5 ? 1 : 2;  // 16-value groups unpacked per pass over the rows (below)
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi8(0x30);
  const __m512i even = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
  const __m512i odd = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
  __m512 acc[kRows];
  __m512i sumi[kRows];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = grp + b * 2 * 1680;
    const uint8_t* b1 = b0 + 1680;
    for (int m = 0; m < M; ++m) sumi[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const SliceLines pf = slice_lines(b0, 2 * 1680, ahead, c, 8);
      const uint8_t* c0 = b0 + 16 + 208 * c;
      const uint8_t* c1 = b1 + 16 + 208 * c;
      const __m512i sc16 = _mm512_cvtepi8_epi16(join16(c0, c1));
      // Each row's scale as the int16 pair (scale, 0): vpdpwssd then adds scale * (low half).
      const __m512i sc_a = _mm512_srli_epi32(_mm512_shuffle_epi8(sc16, even), 16);
      const __m512i sc_b = _mm512_srli_epi32(_mm512_shuffle_epi8(sc16, odd), 16);
      const int64_t off = b * 256 + 32 * c;
      // The 16-value groups g0 .. g0 + kGroups - 1 of the chunk are unpacked, then every row runs
      // over them: both at once, or (five rows) one at a time, 4 registers of values live instead
      // of 8. At five rows GCC spilled the 8 and reloaded them per row: the 1.5B's Q6_K down_proj
      // took 670-678 us at 5 rows where 4 took 482, 605 one group at a time (which costs 3-4 rows
      // 9-15% and 6-17 rows 1-10%, so they keep both). The rows' arithmetic is the same either way.
      for (int g0 = 0; g0 < 2; g0 += kGroups) {
        __m512i v[4 * kGroups];
        for (int u = 0; u < kGroups; ++u) {
          const int g = g0 + u;
          const __m512i H = join32(c0 + 144 + 32 * g, c1 + 144 + 32 * g);
          const __m512i L0 = join32(c0 + 16 + 64 * g, c1 + 16 + 64 * g);
          const __m512i L1 = join32(c0 + 48 + 64 * g, c1 + 48 + 64 * g);
          v[4 * u + 0] = _mm512_or_si512(_mm512_and_si512(L0, low), _mm512_and_si512(_mm512_slli_epi16(H, 4), top));
          v[4 * u + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), low), _mm512_and_si512(_mm512_slli_epi16(H, 2), top));
          v[4 * u + 2] = _mm512_or_si512(_mm512_and_si512(L1, low), _mm512_and_si512(H, top));
          v[4 * u + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), low), _mm512_and_si512(_mm512_srli_epi16(H, 2), top));
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          if (g0 == 0) prefetch_share(pf, m, M);
          const int8_t* x = a[m].q + off;
          __m512i s = sumi[m];
          // Chains of 8 values, each starting at -32 * the sum of its x (an int16 broadcast to
          // both halves of each lane): it ends at sum((q - 32) * x) in the low half, |.| <= 8 *
          // 32 * 127 < 2^15, and one vpdpwssd with the lane's (scale, 0) pair adds it times the
          // 16-value group's scale (the high half, times 0, is ignored). Exactly the int32 sum a
          // vpmulld per group gave; per row and 32 values 12 vector instructions instead of 18.
          for (int u = 0; u < kGroups; ++u)
            for (int h = 0; h < 2; ++h) {
              const int g = g0 + u;
              const int8_t* xh = x + 16 * g + 8 * h;
              __m512i p = _mm512_dpbusd_epi32(_mm512_set1_epi16(a[m].z8[b * 32 + 4 * c + 2 * g + h]), v[4 * u + 2 * h], bcast4z(xh));
              p = _mm512_dpbusd_epi32(p, v[4 * u + 2 * h + 1], bcast4z(xh + 4));
              s = _mm512_dpwssd_epi32(s, p, g == 0 ? sc_a : sc_b);
            }
          sumi[m] = s;
        }
      }
    }
    const __m512 d = halves16(b0, b1);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[m]), _mm512_mul_ps(d, _mm512_set1_ps(a[m].d[b])), acc[m]);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// Q8_0 without the sign trick (AVX-512 has no vpsignb): w + 128 is an unsigned byte, and
// sum((w + 128) * x) - 128 * sum(x) is the same exact integer as sum(w * x).
template <int MT>
void dot_q8_0_x16(const uint8_t* grp, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[kRows];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = grp + b * 2 * 272;
    const uint8_t* b1 = b0 + 272;
    const SliceLines pf = slice_lines(b0, 2 * 272, ahead, 0, 1);
    const __m512 d = halves16(b0, b1);
    __m512i w[8];
    for (int i = 0; i < 8; ++i) w[i] = _mm512_xor_si512(join32(b0 + 16 + 32 * i, b1 + 16 + 32 * i), flip);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      prefetch_share(pf, m, M);
      const int8_t* x = a[m].q + b * 32;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[i], bcast4z(x + 4 * i));
        s1 = _mm512_dpbusd_epi32(s1, w[i + 1], bcast4z(x + 4 * i + 4));
      }
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * a[m].s32[b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a[m].d[b])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

template <int MT, int64_t kType>
void dot_q4_q5_x16(const uint8_t* grp, int64_t nb, const Acts* a, int M_, float* out) {
  constexpr int kRows = MT > 0 ? MT : kPassRows;
  const int M = MT > 0 ? MT : M_;
  constexpr bool kMin = kType == kQ4_1_X8;
  constexpr int64_t kBytes = kType == kQ5_0_X8 ? 176 : kMin ? 160 : 144;
  constexpr int64_t kNibbles = kMin ? 32 : 16;
  constexpr int32_t kZero = kType == kQ5_0_X8 ? 16 : 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(M);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = grp + b * 2 * kBytes;
    const uint8_t* b1 = b0 + kBytes;
    const SliceLines pf = slice_lines(b0, 2 * kBytes, ahead, 0, 1);
    const __m512 d = halves16(b0, b1);
    const __m512 mn = kMin ? halves16(b0 + 16, b1 + 16) : _mm512_setzero_ps();
    __m512i v[8];
    for (int i = 0; i < 4; ++i) {
      const __m512i L = join32(b0 + kNibbles + 32 * i, b1 + kNibbles + 32 * i);
      v[2 * i] = _mm512_and_si512(L, low);
      v[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(L, 4), low);
    }
    if constexpr (kType == kQ5_0_X8) {
      const __m512i bit = _mm512_set1_epi8(0x10);
      const __m512i H = join32(b0 + 144, b1 + 144);
      v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(H, 4), bit));
      v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(H, 3), bit));
      v[2] = _mm512_or_si512(v[2], _mm512_and_si512(_mm512_slli_epi16(H, 2), bit));
      v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_slli_epi16(H, 1), bit));
      v[4] = _mm512_or_si512(v[4], _mm512_and_si512(H, bit));
      v[5] = _mm512_or_si512(v[5], _mm512_and_si512(_mm512_srli_epi16(H, 1), bit));
      v[6] = _mm512_or_si512(v[6], _mm512_and_si512(_mm512_srli_epi16(H, 2), bit));
      v[7] = _mm512_or_si512(v[7], _mm512_and_si512(_mm512_srli_epi16(H, 3), bit));
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      prefetch_share(pf, m, M);
      const int8_t* x = a[m].q + b * 32;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        d0 = _mm512_dpbusd_epi32(d0, v[i], bcast4z(x + 4 * i));
        d1 = _mm512_dpbusd_epi32(d1, v[i + 1], bcast4z(x + 4 * i + 4));
      }
      const __m512i dot = _mm512_add_epi32(d0, d1);
      const __m512 dx = _mm512_set1_ps(a[m].d[b]);
      if constexpr (kMin) {
        const __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(a[m].s32[b])), _mm512_mul_ps(mn, dx), r);
      } else {
        const __m512i sumi = _mm512_sub_epi32(dot, _mm512_set1_epi32(kZero * a[m].s32[b]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, dx), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}
#if SPECSERVE_AMX
// ---- AMX tiles (Intel Sapphire Rapids and later): passes of many activation rows over a paired
// Q4_K row's 16 weight rows. One TDPBSUD multiplies up to 16 activation rows (signed int8, tile A:
// rows x 64 bytes) by 16 weight rows (unsigned, tile B: 16 rows of 16 x 4 bytes) into 16 x 16 int32
// sums (tile C). The x16 layout's low / high nibbles of 32 bytes of a group are values 4i..4i+3 of
// its 8 rows, i.e. B's rows once unpacked. Each 32-value sub-block has its own 6-bit scale, which
// goes into B: scale = 16 hi + lo (lo <= 15, hi <= 3), so q * lo <= 225 and q * hi <= 45 fit B's
// unsigned bytes, B_lo = q * lo and B_hi = q * hi (one vpmullw per register each: a 16-bit lane
// holds two values <= 15 and neither product carries into the other byte). C_lo and C_hi then sum
// over the whole 256-value block, 64 values per instruction, and C_lo + 16 C_hi is exactly the
// int32 sum of scale * dot over the sub-blocks that dot_q4_k_x16 forms; the float steps are the
// same operations in the same order, so every row's result is bit-identical to the 512-bit
// kernel's (test_amx_passes_are_bit_identical_to_the_512_bit_ones).
//
// The first tile kernel gave each sub-block its own C (K = 32) and scaled it per row with vpmulld
// after a tile store: ~65 cycles per sub-block whatever the rows. Scaling B costs 16 vpmullw and 16
// stores per sub-block, ~31 cycles, beside ~19 of tile work (L1-resident microbenchmark), and
// nothing per row but the block's sums. On a 2-vCPU Xeon VM (AVX-512, AMX; it reports family 6
// model 167), Qwen2.5-Coder-1.5B Q4_K_M on `auto`, the scaled tiles from 10 rows against the
// per-sub-block ones from 16, old and new processes alternating (best of 2): forwards of 12 / 17 /
// 33 tokens 76.9 -> 73.4 / 107.4 -> 95.2 / 186.1 -> 157.6 ms, decode batch 16 / 32 94.7 -> 83.6 /
// 167.8 -> 142.6 ms, a 256-token prefill chunk 1425 -> 1256 ms. Against the 512-bit kernel, one request of n tokens: 0.98x at n = 9,
// 1.02x at 10, 1.05x at 11, 1.06x at 12 (the 0.5B, partly L3-resident: 1.00x / 1.01x / 1.02x /
// 1.02x). Hence g_amx_min_rows = 10. Below ~10 rows the 512-bit kernel's per-row work (8 vpdpbusd
// per sub-block) still costs less than unpacking and scaling B. Q6_K's signed 8-bit scales per 16
// values do not split into B's bytes this way; its tile kernel (one C per 16 values) was 0.84-0.91x
// the 512-bit one at 2-33 rows and is not kept.
//
// Tile state is per thread: each pass makes sure its thread holds the configuration it needs
// (tile_config). Linux hands out the tile registers only to a process that asks (arch_prctl);
// amx_ready() asks once, and without them the 512-bit kernels run instead. GCC's tile intrinsics
// paste the tile number into the instruction text, so the tile ids below are literal numbers.

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
  unsigned long bits = 0;
  if (syscall(SYS_arch_prctl, kGetPerm, &bits) == 0 && (bits >> kXtileData) & 1) return true;
  if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
  return syscall(SYS_arch_prctl, kGetPerm, &bits) == 0 && ((bits >> kXtileData) & 1);
}

bool amx_ready() {
  static const bool ready = request_amx();
  return ready;
}

// Tiles for a pass of r0 + r1 activation rows: A (0 / 1: r0 / r1 rows of 64 bytes), B (2: the low
// part of the scales, 3: the high part; 16 rows of 16 x 4 bytes, 64 values), C (4 / 5: rows 0..
// against B 2 / 3, 6 / 7: rows 16..). The thread's configuration is read back first and loaded only
// when it differs: other code in the thread (oneDNN's AMX kernels under torch) may have loaded its
// own or released the tiles since this thread's last pass, so nothing is assumed from an earlier call.
inline void tile_config(int r0, int r1) {
  TileConfig want;
  const int h1 = r1 > 0 ? r1 : r0;
  const int rows[8] = {r0, h1, 16, 16, r0, r0, h1, h1};
  for (int t = 0; t < 8; ++t) {
    want.rows[t] = static_cast<uint8_t>(rows[t]);
    want.colsb[t] = 64;
  }
  TileConfig now;
  _tile_storeconfig(&now);
  if (std::memcmp(&now, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

// Q4_K, as dot_q4_k_x16, with each sub-block's scale inside B (see the section's comment).
void dot_q4_k_x16_amx(const uint8_t* grp, int64_t nb, const Acts* a, int M, float* out) {
  const int r0 = std::min(M, 16), r1 = M - r0;
  const int64_t stride = M > 1 ? a[1].q - a[0].q : 0;
  tile_config(r0, r1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i low4 = _mm512_set1_epi32(15);
  alignas(64) uint8_t bt[2][2][16 * 64];
  alignas(64) int32_t cbuf[2][4][16 * 16];
  __m512 acc[kPassRows];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(M);
  // B of sub-blocks 2p and 2p + 1 (bt[p & 1]): their low-part and high-part tiles.
  const auto prepare = [&](const uint8_t* b0, const uint8_t* b1, int p) {
    for (int j = 2 * p; j < 2 * p + 2; ++j) {
      prefetch_slice(b0, 2 * 1184, ahead, j, 8);
      const uint8_t* s0 = b0 + 96 + 136 * j;
      const uint8_t* s1 = b1 + 96 + 136 * j;
      const __m512i s32 = _mm512_cvtepu8_epi32(join8(s0, s1));
      const __m512i lo4 = _mm512_and_si512(s32, low4);
      const __m512i hi2 = _mm512_srli_epi32(s32, 4);
      const __m512i slo = _mm512_or_si512(lo4, _mm512_slli_epi32(lo4, 16));
      const __m512i shi = _mm512_or_si512(hi2, _mm512_slli_epi32(hi2, 16));
      uint8_t* dl = bt[p & 1][0] + (j & 1) * 512;
      uint8_t* dh = bt[p & 1][1] + (j & 1) * 512;
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = join32(s0 + 8 + 32 * i, s1 + 8 + 32 * i);
        const __m512i l = _mm512_and_si512(packed, low);
        const __m512i h = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        _mm512_store_si512(dl + 128 * i, _mm512_mullo_epi16(l, slo));
        _mm512_store_si512(dl + 128 * i + 64, _mm512_mullo_epi16(h, slo));
        _mm512_store_si512(dh + 128 * i, _mm512_mullo_epi16(l, shi));
        _mm512_store_si512(dh + 128 * i + 64, _mm512_mullo_epi16(h, shi));
      }
    }
  };
  const auto multiply = [&](int64_t b, int p) {
    asm volatile("" ::: "memory");  // tileloadd reads bt: the stores into it come first
    const int8_t* x = a[0].q + b * 256 + 64 * p;
    _tile_loadd(2, bt[p & 1][0], 64);
    _tile_loadd(3, bt[p & 1][1], 64);
    _tile_loadd(0, x, stride);
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 0, 3);
    if (r1 > 0) {
      _tile_loadd(1, x + 16 * stride, stride);
      _tile_dpbsud(6, 1, 2);
      _tile_dpbsud(7, 1, 3);
    }
    asm volatile("" ::: "memory");  // and the next stores into bt come after these loads
  };
  // Block b's float step from its sums, C_lo + 16 C_hi (cbuf[b & 1]).
  const auto scale = [&](int64_t b) {
    const int32_t (*c)[16 * 16] = cbuf[b & 1];
    const auto sumi = [&](int m) {
      const int h = m < 16 ? 0 : 2, row = m < 16 ? m : m - 16;
      return _mm512_add_epi32(_mm512_load_si512(c[h] + 16 * row), _mm512_slli_epi32(_mm512_load_si512(c[h + 1] + 16 * row), 4));
    };
    const uint8_t* b0 = grp + b * 2 * 1184;
    q4_k_x16_block_step(b0, b0 + 1184, b, a, M, sumi, acc);
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = grp + b * 2 * 1184;
    const uint8_t* b1 = b0 + 1184;
    _tile_zero(4);
    _tile_zero(5);
    if (r1 > 0) {
      _tile_zero(6);
      _tile_zero(7);
    }
    // Pair p's tiles wait for its stores to reach the cache: pair p + 1 is prepared in between.
    prepare(b0, b1, 0);
    for (int p = 0; p < 4; ++p) {
      if (p < 3) prepare(b0, b1, p + 1);
      multiply(b, p);
    }
    int32_t (*c)[16 * 16] = cbuf[b & 1];
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    if (r1 > 0) {
      _tile_stored(6, c[2], 64);
      _tile_stored(7, c[3], 64);
    }
    // Block b - 1's sums, stored a block ago: vector loads wait for tile stores still in flight.
    asm volatile("" ::: "memory");
    if (b > 0) scale(b - 1);
  }
  asm volatile("" ::: "memory");
  if (nb > 0) scale(nb - 1);
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// Activation rows from which a pass over a paired Q4_K row takes the tiles (0: never).
std::atomic<int> g_amx_min_rows{10};

// Tile A reads the activation rows at one stride: quantize_acts lays them out so.
inline bool amx_pass(int64_t q8, const Acts* a, int mt) {
  const int from = g_amx_min_rows.load(std::memory_order_relaxed);
  if (from <= 0 || mt < from || q8 != kQ4_K_X8 || !amx_ready()) return false;
  const int64_t stride = mt > 1 ? a[1].q - a[0].q : 0;
  for (int m = 2; m < mt; ++m)
    if (a[m].q - a[0].q != m * stride) return false;
  return true;
}
#endif  // SPECSERVE_AMX
#endif  // SPECSERVE_AVX512

#else  // portable fallback: decode a block to integers, integer dot, same scaling as above

template <int MT>
void dot_generic(int64_t qtype, const uint8_t* row, int64_t nb, const Acts* a, float* out) {
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
  const TypeInfo info = type_info(qtype);
  int vals[256];
  float scale[256];  // per value
  float shift[256];  // value = scale * q + shift
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * info.block_bytes;
    const int n = static_cast<int>(info.block_values);
    if (qtype == kQ8_0) {
      const float d = half_to_float(blk);
      for (int i = 0; i < 32; ++i) { vals[i] = static_cast<int8_t>(blk[2 + i]); scale[i] = d; shift[i] = 0.f; }
    } else if (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0) {
      const float d = half_to_float(blk);
      const uint8_t* qs = blk + (qtype == kQ4_0 ? 2 : qtype == kQ4_1 ? 4 : 6);
      uint32_t high = 0;
      if (qtype == kQ5_0) std::memcpy(&high, blk + 2, 4);
      const float sh = qtype == kQ4_1 ? half_to_float(blk + 2) : qtype == kQ5_0 ? -16.f * d : -8.f * d;
      for (int i = 0; i < 16; ++i) {
        vals[i] = (qs[i] & 0xF) | (((high >> i) & 1) << 4);
        vals[i + 16] = (qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4);
      }
      for (int i = 0; i < 32; ++i) { scale[i] = d; shift[i] = sh; }
    } else if (qtype == kQ4_K) {
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      uint8_t sc[8], mn[8];
      q4k_scales(blk + 4, sc, mn);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = blk[16 + 32 * c + l];
          vals[64 * c + l] = byte & 0xF;
          vals[64 * c + 32 + l] = byte >> 4;
        }
      for (int i = 0; i < 256; ++i) { scale[i] = d * sc[i / 32]; shift[i] = -dmin * mn[i / 32]; }
    } else {  // Q6_K
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_to_float(blk + 208);
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* L = ql + 64 * h;
          const uint8_t H = qh[32 * h + l];
          vals[128 * h + l] = (L[l] & 0xF) | ((H & 3) << 4);
          vals[128 * h + l + 32] = (L[l + 32] & 0xF) | (((H >> 2) & 3) << 4);
          vals[128 * h + l + 64] = (L[l] >> 4) | (((H >> 4) & 3) << 4);
          vals[128 * h + l + 96] = (L[l + 32] >> 4) | (((H >> 6) & 3) << 4);
        }
      for (int i = 0; i < 256; ++i) { scale[i] = d * sc[i / 16]; shift[i] = -32.f * d * sc[i / 16]; }
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t start = b * n;
      for (int i = 0; i < n; ++i) {
        const float x = a[m].q[start + i] * a[m].d[(start + i) / info.act_block];
        out[m] += x * (scale[i] * vals[i] + shift[i]);
      }
    }
  }
}

#endif

template <int MT>
void dot_rows(int64_t qtype, const uint8_t* row, int64_t nb, const Acts* a, float* out) {
#if SPECSERVE_AVX2
  switch (qtype) {
    case kQ4_K: return dot_q4_k<MT>(row, nb, a, out);
    case kQ6_K: return dot_q6_k<MT>(row, nb, a, out);
    case kQ8_0: return dot_q8_0<MT>(row, nb, a, out);
    case kQ5_0: return dot_q5_0<MT, 5>(row, nb, a, out);
    case kQ4_0: return dot_q5_0<MT, 4>(row, nb, a, out);
    default: return dot_q4_1<MT>(row, nb, a, out);
  }
#else
  TORCH_CHECK(!interleaved(qtype), "qmatmul: interleaved layouts need the AVX2 build");
  dot_generic<MT>(qtype, row, nb, a, out);
#endif
}

// One weight matrix of a (possibly fused) product: its blocks and where its outputs go.
struct Segment {
  const uint8_t* w;
  int64_t row_bytes;  // bytes per stored row (per group of `rows` rows for interleaved layouts)
  int64_t nb;         // blocks per row
  int64_t qtype;
  int64_t n;          // rows (outputs)
  int64_t rows;       // rows per stored row: 1, or 8 for interleaved layouts
  const float* bias;
  int act;            // which activation quantization (0: 32-value blocks, 1: 256-value blocks)
};

struct QuantizedActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s16, s32;
  std::vector<int16_t> z8;
  std::vector<Acts> rows;
};

void quantize_acts(const float* x, int64_t M, int64_t K, int64_t qa, QuantizedActs& out) {
  out.q.resize(M * K);
  out.d.resize(M * (K / qa));
  out.s16.resize(M * (K / 16));
  out.s32.resize(M * (K / 32));
  out.z8.resize(M * (K / 8));
  quantize_rows(x, M, K, qa, out.q.data(), out.d.data(), out.s16.data(), out.s32.data(), out.z8.data());
  out.rows.resize(M);
  for (int64_t m = 0; m < M; ++m)
    out.rows[m] = {out.q.data() + m * K, out.d.data() + m * (K / qa), out.s16.data() + m * (K / 16),
                   out.s32.data() + m * (K / 32), out.z8.data() + m * (K / 8)};
}

#if SPECSERVE_AVX2
// Interleaved layouts: up to kPassRows activation rows per pass over each weight block, of G
// groups whose blocks lie `gap` bytes apart (block b of the first group at grp + b * step).
template <int MT, int G>
void dot_x8_t(int64_t qtype, const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M, float* out) {
  switch (qtype) {
    case kQ4_K_X8:
#if !SPECSERVE_VNNI
      if constexpr (G == 2) return dot_q4_k_x8_pair<MT>(grp, gap, step, nb, a, M, out);
#endif
      return dot_q4_k_x8<MT, G>(grp, gap, step, nb, a, M, out);
    case kQ6_K_X8:
#if !SPECSERVE_VNNI
      if constexpr (G == 2) return dot_q6_k_x8_pair<MT>(grp, gap, step, nb, a, M, out);
#endif
      return dot_q6_k_x8<MT, G>(grp, gap, step, nb, a, M, out);
    case kQ8_0_X8: return dot_q8_0_x8<MT, G>(grp, gap, step, nb, a, M, out);
    case kQ4_0_X8: return dot_q4_q5_x8<MT, G, kQ4_0_X8>(grp, gap, step, nb, a, M, out);
    case kQ4_1_X8: return dot_q4_q5_x8<MT, G, kQ4_1_X8>(grp, gap, step, nb, a, M, out);
    default: return dot_q4_q5_x8<MT, G, kQ5_0_X8>(grp, gap, step, nb, a, M, out);
  }
}

// Passes of 1-15 rows run a kernel compiled for their row count (MT), 16 and more one loop
// (MT = 0). With the count fixed the row loops are unrolled with each row's activation pointer
// held across sub-blocks instead of reloaded by a loop. An AVX2 build on a Zen 4 (family 25 model
// 17), whole forwards of the Qwen2.5-Coder-1.5B (Q4_K_M) timed in one process, fixed counts from 5
// rows against the loop, alternating (76-90 rounds): 5 / 6 / 8 / 9 / 11 / 13 / 15 tokens 56.7 /
// 61.6 / 78.4 / 90.6 / 103.7 / 118.7 / 146.0 ms with the loop, 54.0 / 58.8 / 73.6 / 85.7 / 98.8 /
// 114.1 / 140.0 fixed (faster in 66-88 of the rounds); 16 tokens 148.1 -> 156.6, slower, so 16
// rows and more keep the loop.
template <int G, int MT = 1>
void dot_x8_g(int64_t qtype, const uint8_t* grp, int64_t gap, int64_t step, int64_t nb, const Acts* a, int M, float* out) {
  if constexpr (MT > 15)
    dot_x8_t<0, G>(qtype, grp, gap, step, nb, a, M, out);
  else if (M == MT)
    dot_x8_t<MT, G>(qtype, grp, gap, step, nb, a, M, out);
  else
    dot_x8_g<G, MT + 1>(qtype, grp, gap, step, nb, a, M, out);
}

#endif

#if SPECSERVE_AVX512
template <int MT>
void dot_x16_t(int64_t qtype, const uint8_t* grp, int64_t nb, const Acts* a, int M, float* out) {
  switch (qtype) {
    case kQ4_K_X8: return dot_q4_k_x16<MT>(grp, nb, a, M, out);
    case kQ6_K_X8: return dot_q6_k_x16<MT>(grp, nb, a, M, out);
    case kQ8_0_X8: return dot_q8_0_x16<MT>(grp, nb, a, M, out);
    case kQ4_0_X8: return dot_q4_q5_x16<MT, kQ4_0_X8>(grp, nb, a, M, out);
    case kQ4_1_X8: return dot_q4_q5_x16<MT, kQ4_1_X8>(grp, nb, a, M, out);
    default: return dot_q4_q5_x16<MT, kQ5_0_X8>(grp, nb, a, M, out);
  }
}

// A paired row (two 8-row groups, blocks alternating) against M activation rows: out[m * 16 + r].
void dot_x16(int64_t qtype, const uint8_t* grp, int64_t nb, const Acts* a, int M, float* out) {
  switch (M) {
    case 1: return dot_x16_t<1>(qtype, grp, nb, a, M, out);
    case 2: return dot_x16_t<2>(qtype, grp, nb, a, M, out);
    case 3: return dot_x16_t<3>(qtype, grp, nb, a, M, out);
    case 4: return dot_x16_t<4>(qtype, grp, nb, a, M, out);
    case 5: return dot_x16_t<5>(qtype, grp, nb, a, M, out);
    case 6: return dot_x16_t<6>(qtype, grp, nb, a, M, out);
    case 7: return dot_x16_t<7>(qtype, grp, nb, a, M, out);
    case 8: return dot_x16_t<8>(qtype, grp, nb, a, M, out);
    case 9: return dot_x16_t<9>(qtype, grp, nb, a, M, out);
    case 10: return dot_x16_t<10>(qtype, grp, nb, a, M, out);
    case 11: return dot_x16_t<11>(qtype, grp, nb, a, M, out);
    case 12: return dot_x16_t<12>(qtype, grp, nb, a, M, out);
    case 13: return dot_x16_t<13>(qtype, grp, nb, a, M, out);
    case 14: return dot_x16_t<14>(qtype, grp, nb, a, M, out);
    case 15: return dot_x16_t<15>(qtype, grp, nb, a, M, out);
    case 16: return dot_x16_t<16>(qtype, grp, nb, a, M, out);
    default: return dot_x16_t<0>(qtype, grp, nb, a, M, out);
  }
}

// Activation rows from which a pass over a paired stored row runs 512 bits wide (fewer take the
// 256-bit kernels over both groups; more than kPassRows: never wide). On a 2-vCPU Zen 5 EPYC,
// Qwen2.5-Coder-1.5B Q4_K_M forwards of n tokens, 512-bit over 256-bit: 0.94x at n = 1, 0.95x
// at 2, 0.99x at 3, 1.08x at 4, 1.44x at 5 (the 256-bit kernels keep their sums in registers up
// to 4 rows only), 1.66x at 9. Since the 512-bit kernels spread their prefetches over the rows
// (prefetch_share), the 2-vCPU Xeon VM measured 1.04x at n = 1, 1.14x at 2, 1.18x at 3 (before:
// 1.05x at 2 and 3, threshold 4). The engine measures it per machine at start-up
// (specserve.kernels.tune_wide_passes); set_wide_min_rows changes it.
std::atomic<int> g_wide_min_rows{5};
#endif

#if SPECSERVE_AVX2
// Activation rows from which an AVX2 build (no VNNI) takes two 8-row Q4_K or Q6_K groups per pass
// (dot_q4_k_x8_pair, dot_q6_k_x8_pair; 0: never). On a 2-vCPU Zen 3 EPYC (AVX2 only), one
// thread, 2048 x 1536 products from the last-level cache, paired over one-group passes: Q4_K 1.00
// / 1.05 / 0.92 / 0.91 / 1.01 / 0.99 / 1.13 / 1.10 / 1.17 / 1.20x at 1 / 2 / 3 / 4 / 5 / 6 / 8 /
// 9 / 16 / 32 rows, Q6_K 1.00 / 0.91 / 0.91 / 0.90 / 1.01 / 1.04 / 1.09 / 1.04 / 1.26 / 1.33x
// (1-4 rows: the one-group kernels keep their sums in registers). The Qwen2.5-Coder-1.5B's
// products of a 5-token forward, both threads, streamed from memory, lost 6% paired (30 rounds
// alternating), those of 9 tokens gained 1-3%, of 17 and 33 tokens 7-17%: so from 8 rows.
// Only AMD cores by default: there a broadcast from memory also takes a vector pipe, which the
// pairing saves; on Intel cores it is a load alone, and the pairing's extra multiply-add and add
// per group and sub-block would be the only change (not measured: no AVX2-only Intel machine here).
// set_pair_min_rows changes it.
bool amd_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0;
#else
  return false;
#endif
}
std::atomic<int> g_pair_min_rows{SPECSERVE_VNNI || !amd_cpu() ? 0 : 8};

inline bool pair_pass(int64_t qtype, int rows) {
  const int from = g_pair_min_rows.load(std::memory_order_relaxed);
  return !SPECSERVE_VNNI && (qtype == kQ4_K_X8 || qtype == kQ6_K_X8) && from > 0 && rows >= from;
}
#endif

// Dot products of rows [n0, n1) of `seg` with M activation rows; emit(m, n, value) receives every
// result. Interleaved layouts take passes of up to kPassRows activation rows over each 8-row
// group, or both groups of a paired row (n0 and n1 are then multiples of 8, or of 16 for paired
// layouts: segments and tiles are); the row-at-a-time kernels take tiles of up to 4 rows (they run
// out of registers past that).
template <typename Emit>
void segment_rows(const Segment& seg, const Acts* acts, int64_t M, int64_t n0, int64_t n1, Emit&& emit) {
  const int64_t R = seg.rows;
  // A tile's results out[i * R + r] (activation rows m.., weight rows n..) to emit, activation row
  // by activation row: each row's R results are one contiguous run of the output, where M runs a
  // power-of-two stride apart share an L1 set (column by column: -30% at M = 16, N = 4096).
  const auto emit_tile = [&](const float* out, int64_t m, int64_t mt, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < mt; ++i)
      for (int64_t r = 0; r < rows; ++r) emit(m + i, n + r, out[i * rows + r] + (seg.bias ? seg.bias[n + r] : 0.f));
  };
#if SPECSERVE_AVX2
  if (R == 8 || R == 16) {
    // x8: one group per stored row; x16: two, their blocks alternating (block bytes B each).
    const int64_t q8 = R == 16 ? seg.qtype - kPaired : seg.qtype;
    const int64_t B = type_info(q8).block_bytes;
    alignas(64) float out[kPassRows * 16];
    for (int64_t m = 0; m < M; m += kPassRows) {
      const int mt = static_cast<int>(std::min<int64_t>(kPassRows, M - m));
      for (int64_t n = n0; n < n1; n += R) {
        const uint8_t* grp = seg.w + (n / R) * seg.row_bytes;
        if (R == 8) {
          if (n + 16 <= n1 && pair_pass(q8, mt)) {  // two groups, stored one after the other
            dot_x8_g<2>(q8, grp, seg.row_bytes, B, seg.nb, acts + m, mt, out);
            emit_tile(out, m, mt, n, 16);
            n += 8;
            continue;
          }
          dot_x8_g<1>(q8, grp, 0, B, seg.nb, acts + m, mt, out);
        } else {
#if SPECSERVE_AMX
          if (amx_pass(q8, acts + m, mt))
            dot_q4_k_x16_amx(grp, seg.nb, acts + m, mt, out);
          else
#endif
#if SPECSERVE_AVX512
          if (mt >= g_wide_min_rows.load(std::memory_order_relaxed))
            dot_x16(q8, grp, seg.nb, acts + m, mt, out);
          else
#endif
            dot_x8_g<2>(q8, grp, B, 2 * B, seg.nb, acts + m, mt, out);
        }
        emit_tile(out, m, mt, n, R);
      }
    }
    return;
  }
#endif
  float out[4 * 8];
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t mt = std::min<int64_t>(4, M - m);
    for (int64_t n = n0; n < n1; n += R) {
      const uint8_t* row = seg.w + (n / R) * seg.row_bytes;
      switch (mt) {
        case 4: dot_rows<4>(seg.qtype, row, seg.nb, acts + m, out); break;
        case 3: dot_rows<3>(seg.qtype, row, seg.nb, acts + m, out); break;
        case 2: dot_rows<2>(seg.qtype, row, seg.nb, acts + m, out); break;
        default: dot_rows<1>(seg.qtype, row, seg.nb, acts + m, out); break;
      }
      emit_tile(out, m, mt, n, R);
    }
  }
}

constexpr int64_t kRowTile = 16;  // weight rows whose blocks stay in cache while every activation tile passes (a multiple of 8)

// Activation rows per sweep over a product's weight tiles. Every tile of kRowTile weight rows takes
// all the sweep's rows in turn, so their quantized activations (rows x K bytes) are read again for
// each tile; past the L2 they come from L3 each time (a 512-row prefill chunk of the 1.5B's
// 8960-wide down projection: 4.6 MB, read once for each of its 96 tiles). Sweeps of at most a
// quarter of the L2 keep them there, at the price of streaming the weights once per sweep instead
// of once, which only prefill-sized passes (kSweepFrom rows and more) repay: a decode batch of 64
// in two sweeps read the down projections' weights from DRAM twice (+4% per step). Sweeps are
// whole passes (multiples of 32 rows, the widest pass), so no row's arithmetic changes. On a
// 2-vCPU Xeon (2 MiB L2), Qwen2.5-Coder-1.5B `auto`: a 512-token prefill chunk 2.73-2.80 ->
// 2.45-2.53 s (a quarter of the L2; half: 2.49-2.59), 256 tokens 1.24-1.25 -> 1.19 s; the
// 1536 x 8960 Q6_K product at 1,024 rows 88 -> 68-71 ms.
constexpr int64_t kSweepFrom = 128;

int64_t l2_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (v > 0) return static_cast<int64_t>(v);
#endif
    return int64_t{512} << 10;
  }();
  return bytes;
}

int64_t activation_chunk(int64_t M, int64_t K) {
  constexpr int64_t kWhole = 32;
  const int64_t budget = l2_bytes() / 4;
  if (M < kSweepFrom || M * K <= budget) return M;
  return std::max<int64_t>(kWhole, budget / K / kWhole * kWhole);
}

// Run body(t0, t1) over tiles [0, tiles) with the threads pulling tiles from a shared counter,
// each grab a share of what is left (so the last grabs are single tiles and neither thread waits
// long for the other at the end). For work whose items differ in size (a prefill's attention).
template <typename Body>
void parallel_guided(int64_t tiles, Body&& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  if (threads <= 1) {
    body(0, tiles);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t t0 = next.load(std::memory_order_relaxed);
    for (;;) {
      if (t0 >= tiles) break;
      const int64_t take = std::max<int64_t>(1, (tiles - t0) / (threads * 4));
      if (!next.compare_exchange_weak(t0, t0 + take, std::memory_order_relaxed)) continue;  // t0 reloaded
      body(t0, std::min(tiles, t0 + take));
      t0 = next.load(std::memory_order_relaxed);
    }
  });
}

// Run body(t0, t1) over tiles [0, tiles) of a weight matrix: each thread owns a contiguous share
// and runs it front to back in shrinking chunks, so its weight rows stream in address order; a
// thread done with its own share takes single tiles from the back of the others'. A shared
// counter (parallel_guided) interleaved the threads' chunks and restarted every stream at each
// grab, and a SmolLM2 decode step ran no faster on two threads than on one. Owned shares, 2 Zen 5
// vCPUs, old and new alternating in one process: SmolLM2 step 3.34 -> 2.67 ms (greedy decoding
// 263 -> 344 tok/s), 9-token verify 5.25 -> 4.36; Qwen 0.5B int4 7.34 -> 6.73; Qwen 1.5B 23.1 ->
// 22.3, 9 tokens 31.3 -> 28.4; prompts unchanged. The stealing keeps what the counter was for: a
// thread slowed by the OS or by the other's memory traffic is helped out at the end.
template <typename Body>
void parallel_tiles(int64_t tiles, Body&& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  if (threads <= 1) {
    body(0, tiles);
    return;
  }
  TORCH_CHECK(tiles < (int64_t{1} << 31), "parallel_tiles: too many tiles");
  struct alignas(64) Share {
    std::atomic<uint64_t> range;  // first tile left in the low 32 bits, end in the high 32
  };
  const auto pack = [](uint64_t lo, uint64_t hi) { return lo | hi << 32; };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) shares[t].range.store(pack(tiles * t / threads, tiles * (t + 1) / threads));
  // Claims tiles [a, b) of a share: a quarter of what is left from its front (its owner), or its
  // last tile (another thread). False once the share is empty.
  const auto claim = [&](std::atomic<uint64_t>& share, bool front, int64_t& a, int64_t& b) {
    for (uint64_t r = share.load(std::memory_order_relaxed);;) {  // a failed exchange reloads r
      const int64_t lo = static_cast<int64_t>(r & 0xffffffffu), hi = static_cast<int64_t>(r >> 32);
      if (lo >= hi) return false;
      a = front ? lo : hi - 1;
      b = front ? lo + std::max<int64_t>(1, (hi - lo) / 4) : hi;
      if (share.compare_exchange_weak(r, front ? pack(b, hi) : pack(lo, a), std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t me = first, a, b; me < last; ++me) {
      while (claim(shares[me].range, true, a, b)) body(a, b);
      for (int64_t k = 1; k < threads; ++k)
        while (claim(shares[(me + k) % threads].range, false, a, b)) body(a, b);
    }
  });
}

// y = [x @ W_0^T + b_0, x @ W_1^T + b_1, ...]  (or silu(x @ W_0^T) * (x @ W_1^T) with silu_mul)
#if SPECSERVE_AVX2
// e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-5 polynomial for e^r, then 2^n put
// into the exponent; ~1 ulp). Inputs below -87.3 give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)), zero_below);
}
#endif

#if SPECSERVE_AVX512
// exp8's arithmetic on 16 lanes: every step the same IEEE operation per lane (floor as a
// round-down roundscale), so each lane's result is bit for bit exp8's.
inline __m512 exp16(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n)));
}
#endif

// out[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] for n values. Each value goes through
// the same vector arithmetic wherever it sits (a short tail is padded to 8), so a product's
// result never depends on its column's place in a tile. Scalar expf here was ~8% of a 9-token
// forward of the 1.5B.
inline void silu_mul_into(const float* g, const float* u, float* out, int64_t n) {
#if SPECSERVE_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  const auto eight = [&](const float* gp, const float* up, float* op) {
    const __m256 gv = _mm256_loadu_ps(gp);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(op, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(up)));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) eight(g + i, u + i, out + i);
  if (i < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::memcpy(gt, g + i, sizeof(float) * (n - i));
    std::memcpy(ut, u + i, sizeof(float) * (n - i));
    eight(gt, ut, ot);
    std::memcpy(out + i, ot, sizeof(float) * (n - i));
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

// A kernel's float32 output: the caller's buffer where it gives one (it must be contiguous and of
// `sizes`: DecoderStack makes its per-layer outputs once per call), else a new tensor.
torch::Tensor output_into(const torch::Tensor* out, at::IntArrayRef sizes, const char* who) {
  if (out == nullptr) return torch::empty(sizes, torch::kFloat32);
  TORCH_CHECK(out->scalar_type() == torch::kFloat32 && out->is_contiguous() && out->sizes() == sizes, who,
              ": the output buffer must be a contiguous float32 tensor of shape ", sizes);
  return *out;
}

// qmatmul_multi writing into `out` where one is given (output_into).
torch::Tensor qmatmul_multi_into(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                 const std::vector<c10::optional<torch::Tensor>>& biases, bool silu_mul, const torch::Tensor* out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qmatmul: x must be a float32 [M, K] matrix");
  TORCH_CHECK(!ws.empty() && ws.size() == qtypes.size() && ws.size() == biases.size(), "qmatmul: one qtype and bias per weight");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  std::vector<Segment> segs;
  std::vector<torch::Tensor> keep;  // contiguous float32 biases
  bool need_act[2] = {false, false};
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto& w = ws[i];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "qmatmul: w must be contiguous uint8 [N, row_bytes]");
    const TypeInfo info = type_info(qtypes[i]);
    TORCH_CHECK(K % info.block_values == 0 && K % info.act_block == 0, "qmatmul: K=", K, " is not a multiple of the block size");
    const int64_t nb = K / info.block_values;
    TORCH_CHECK(w.size(1) == nb * info.block_bytes, "qmatmul: w has ", w.size(1), " bytes per row, expected ", nb * info.block_bytes);
    const int64_t n = w.size(0) * info.rows;
    const float* bias_ptr = nullptr;
    if (biases[i].has_value() && biases[i]->defined()) {
      keep.push_back(biases[i]->contiguous().to(torch::kFloat32));
      TORCH_CHECK(keep.back().numel() == n, "qmatmul: bias has ", keep.back().numel(), " values, expected ", n);
      bias_ptr = keep.back().data_ptr<float>();
    }
    const int act = info.act_block == 256 ? 1 : 0;
    need_act[act] = true;
    segs.push_back({w.data_ptr<uint8_t>(), w.size(1), nb, qtypes[i], n, info.rows, bias_ptr, act});
    total += n;
  }
  if (silu_mul) TORCH_CHECK(segs.size() == 2 && segs[0].n == segs[1].n, "qmatmul: silu_mul needs two weights of equal rows");
  const int64_t N = silu_mul ? segs[0].n : total;
  auto y = output_into(out, {M, N}, "qmatmul");
  if (M == 0 || N == 0) return y;

  QuantizedActs qa[2];
  for (int a = 0; a < 2; ++a)
    if (need_act[a]) quantize_acts(xc.data_ptr<float>(), M, K, a == 1 ? 256 : 32, qa[a]);
  float* yp = y.data_ptr<float>();

  const int64_t chunk = activation_chunk(M, K);
  if (silu_mul) {
    const Segment& g = segs[0];
    const Segment& u = segs[1];
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t mc = std::min(chunk, M - m0);
      parallel_tiles((N + kRowTile - 1) / kRowTile, [&](int64_t t0, int64_t t1) {
        const int64_t begin = t0 * kRowTile, end = std::min(N, t1 * kRowTile);
        std::vector<float> gate(mc * kRowTile), up(mc * kRowTile);
        for (int64_t n0 = begin; n0 < end; n0 += kRowTile) {
          const int64_t n1 = std::min(end, n0 + kRowTile);
          segment_rows(g, qa[g.act].rows.data() + m0, mc, n0, n1, [&](int64_t m, int64_t n, float v) { gate[m * kRowTile + n - n0] = v; });
          segment_rows(u, qa[u.act].rows.data() + m0, mc, n0, n1, [&](int64_t m, int64_t n, float v) { up[m * kRowTile + n - n0] = v; });
          for (int64_t m = 0; m < mc; ++m)
            silu_mul_into(gate.data() + m * kRowTile, up.data() + m * kRowTile, yp + (m0 + m) * N + n0, n1 - n0);
        }
      });
    }
    return y;
  }
  // Tiles of kRowTile rows, each within one segment (so interleaved groups are never split).
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (segment, first row)
  std::vector<int64_t> col(segs.size(), 0);         // first output column of each segment
  for (size_t i = 0; i < segs.size(); ++i) {
    col[i] = i == 0 ? 0 : col[i - 1] + segs[i - 1].n;
    for (int64_t n0 = 0; n0 < segs[i].n; n0 += kRowTile) tiles.emplace_back(static_cast<int64_t>(i), n0);
  }
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t mc = std::min(chunk, M - m0);
    parallel_tiles(static_cast<int64_t>(tiles.size()), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const Segment& seg = segs[tiles[t].first];
        const int64_t c = col[tiles[t].first], n0 = tiles[t].second;
        segment_rows(seg, qa[seg.act].rows.data() + m0, mc, n0, std::min(seg.n, n0 + kRowTile),
                     [&](int64_t m, int64_t n, float v) { yp[(m0 + m) * N + c + n] = v; });
      }
    });
  }
  return y;
}

torch::Tensor qmatmul_multi(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& qtypes,
                            const std::vector<c10::optional<torch::Tensor>>& biases, bool silu_mul) {
  return qmatmul_multi_into(x, ws, qtypes, biases, silu_mul, nullptr);
}

torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, const c10::optional<torch::Tensor>& bias) {
  return qmatmul_multi(x, {w}, {qtype}, {bias}, false);
}

// The index of the largest of x[0, n), n >= 1: the first of equal ones, and the first NaN where
// there is one (torch.argmax's rule: NaN counts as the largest). Greedy decoding reads this over
// every logits row of a step; torch's argmax took 0.11 ms per 152k-id row on a 2-vCPU Xeon (1.8
// ms for a 15-node verify), this ~0.02.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, at = 0;
  float best = x[0];
#if SPECSERVE_AVX2
  if (n >= 32) {
    // Four accumulators, each a running (max, index) per lane over its own 8 of every 32 values:
    // a lane replaces its value only by a strictly larger one, so it keeps the first of equals.
    __m256 m[4], bad = _mm256_setzero_ps();
    __m256i idx[4], cur[4];
    const __m256i step = _mm256_set1_epi32(32);
    for (int a = 0; a < 4; ++a) {
      m[a] = _mm256_loadu_ps(x + 8 * a);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(m[a], m[a], _CMP_UNORD_Q));
      idx[a] = cur[a] = _mm256_setr_epi32(8 * a, 8 * a + 1, 8 * a + 2, 8 * a + 3, 8 * a + 4, 8 * a + 5, 8 * a + 6, 8 * a + 7);
    }
    for (i = 32; i + 32 <= n; i += 32) {
      for (int a = 0; a < 4; ++a) {
        cur[a] = _mm256_add_epi32(cur[a], step);
        const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
        const __m256 gt = _mm256_cmp_ps(v, m[a], _CMP_GT_OQ);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m[a] = _mm256_blendv_ps(m[a], v, gt);
        idx[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx[a]), _mm256_castsi256_ps(cur[a]), gt));
      }
    }
    if (_mm256_movemask_ps(bad)) {  // a NaN among the first i values: the first one is the answer
      for (int64_t j = 0; j < i; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(32) float mv[32];
    alignas(32) int32_t iv[32];
    for (int a = 0; a < 4; ++a) {
      _mm256_store_ps(mv + 8 * a, m[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(iv + 8 * a), idx[a]);
    }
    best = mv[0], at = iv[0];
    for (int l = 1; l < 32; ++l)  // the largest value, and of equal ones the smallest index
      if (mv[l] > best || (mv[l] == best && iv[l] < at)) best = mv[l], at = iv[l];
  }
#endif
  for (; i < n; ++i) {  // the rest (all of x without the vector loop), in order: later indices win only when strictly larger
    if (std::isnan(x[i])) return i;
    if (x[i] > best) best = x[i], at = i;
  }
  return at;
}

// argmax over the last dimension of a float32 [R, V] matrix, rows in parallel: int64 [R].
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(1) == 1,
              "argmax_rows: CPU float32 [rows, values] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of 1 to 2^31 - 1 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, torch::kLong);
  const float* base = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dst[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

// The k largest values of x[0, n) above -inf in descending order (of equal values the lower index
// first) into vals / idx; returns how many there are (<= k). A NaN sets *nan. One compare per value
// against the k-th kept one, 32 at a time; the few that pass are inserted in order.
int select_top(const float* x, int64_t n, int k, float* vals, int64_t* idx, bool* nan) {
  int have = 0;
  float thr = -INFINITY;  // once k are kept, a value enters only when it is larger than the k-th
  bool bad = false;
  auto offer = [&](float v, int64_t i) {
    if (!(v > thr)) {
      bad |= std::isnan(v);
      return;
    }
    int pos = have < k ? have++ : k - 1;  // a new slot, or the smallest kept value's
    while (pos > 0 && vals[pos - 1] < v) {  // past the smaller ones only: equal values keep their order
      vals[pos] = vals[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    vals[pos] = v;
    idx[pos] = i;
    if (have == k) thr = vals[k - 1];
  };
  int64_t i = 0;
#if SPECSERVE_AVX2
  __m256 vnan = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m256 t = _mm256_set1_ps(thr);
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    vnan = _mm256_or_ps(vnan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    const __m256 any = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, t, _CMP_GT_OQ), _mm256_cmp_ps(b, t, _CMP_GT_OQ)),
                                    _mm256_or_ps(_mm256_cmp_ps(c, t, _CMP_GT_OQ), _mm256_cmp_ps(d, t, _CMP_GT_OQ)));
    if (_mm256_movemask_ps(any))
      for (int j = 0; j < 32; ++j) offer(x[i + j], i + j);
  }
  bad |= _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) offer(x[i], i);
  *nan = bad;
  return have;
}

// The order every selection here keeps: larger value first, of equal values the lower index.
inline bool ranks_before(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// select_top for a larger k: a threshold from a sample of the row (its rank there chosen so that
// about 2k values lie above it), one vector pass collecting the values above it, and a partial sort
// of those (value desc, index asc: select_top's order); select_top itself where too few pass. Top-256
// of a 49k-value row: ~130 us by insertion, ~25 this way.
int select_top_wide(const float* x, int64_t n, int k, float* vals, int64_t* idx, bool* nan) {
  const int64_t step = std::max<int64_t>(1, k / 8);
  if (n < 16 * static_cast<int64_t>(k)) return select_top(x, n, k, vals, idx, nan);
  thread_local std::vector<float> sample;
  thread_local std::vector<std::pair<float, int64_t>> above;
  sample.clear();
  for (int64_t i = 0; i < n; i += step)
    if (!std::isnan(x[i])) sample.push_back(x[i]);
  const int64_t rank = std::min<int64_t>(static_cast<int64_t>(sample.size()) - 1,
                                         2 * static_cast<int64_t>(k) * static_cast<int64_t>(sample.size()) / n);
  if (rank < 0) return select_top(x, n, k, vals, idx, nan);
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
  const float t0 = sample[rank];
  above.clear();
  bool bad = false;
  int64_t i = 0;
#if SPECSERVE_AVX2
  const __m256 vt = _mm256_set1_ps(t0);
  __m256 vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    int m = _mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_GT_OQ));
    while (m) {
      const int j = __builtin_ctz(m);
      above.emplace_back(x[i + j], i + j);
      m &= m - 1;
    }
  }
  bad = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    bad |= std::isnan(x[i]);
    if (x[i] > t0) above.emplace_back(x[i], i);
  }
  if (bad) {
    *nan = true;
    return 0;
  }
  if (static_cast<int64_t>(above.size()) < k) return select_top(x, n, k, vals, idx, nan);
  std::partial_sort(above.begin(), above.begin() + k, above.end(), ranks_before);
  for (int j = 0; j < k; ++j) vals[j] = above[j].first, idx[j] = above[j].second;
  *nan = false;
  return k;
}

// e[i] = exp(x[i] - mx) (0 for -inf and below e^-87.3) for i < n; returns their sum in float64.
// With Wide, values below e^-87.3 down to the float32 denormals too (as expf gives them): a softmax
// keeps every token whose probability float32 can hold.
template <bool Wide = false>
double exp_shifted(const float* x, int64_t n, float mx, float* e) {
  int64_t i = 0;
  double sum = 0.0;
#if SPECSERVE_AVX2
  auto exp = [](__m256 v) {
    if constexpr (Wide) {
      const __m256 low = _mm256_cmp_ps(v, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
      if (_mm256_movemask_ps(low))  // e^v = e^(v + 32) e^-32, the product rounding into the denormals
        return _mm256_blendv_ps(exp8(v), _mm256_mul_ps(exp8(_mm256_add_ps(v, _mm256_set1_ps(32.f))), _mm256_set1_ps(1.26641655e-14f)), low);
    }
    return exp8(v);
  };
  __m256d acc = _mm256_setzero_pd();
  const __m256 vm = _mm256_set1_ps(mx);
  // Each group of 8 adds its halves lane by lane into 4 float64 lanes, groups in order: the
  // association every build and width keeps (the sum's bits never depend on the vector width).
  auto add8 = [&acc](__m256 v) {
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
  };
#if SPECSERVE_AVX512
  {  // 16 lanes of exp16, which is exp8 lane for lane: half the exp work of a 49k-id row
    auto exp16w = [](__m512 v) {
      if constexpr (Wide) {
        const __mmask16 low = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
        if (low)
          return _mm512_mask_blend_ps(low, exp16(v), _mm512_mul_ps(exp16(_mm512_add_ps(v, _mm512_set1_ps(32.f))),
                                                                   _mm512_set1_ps(1.26641655e-14f)));
      }
      return exp16(v);
    };
    const __m512 vm16 = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = exp16w(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm16));
      _mm512_storeu_ps(e + i, v);
      add8(_mm512_castps512_ps256(v));
      add8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 v = exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(e + i, v);
    add8(v);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  if (i < n) {  // the tail through the same exp
    alignas(32) float t[8];
    for (int j = 0; j < 8; ++j) t[j] = i + j < n ? x[i + j] - mx : -INFINITY;
    _mm256_store_ps(t, exp(_mm256_load_ps(t)));
    for (int64_t j = i; j < n; ++j) {
      e[j] = t[j - i];
      sum += e[j];
    }
  }
#else
  for (; i < n; ++i) {
    e[i] = x[i] - mx < -87.3f && !Wide ? 0.f : std::exp(x[i] - mx);
    sum += e[i];
  }
#endif
  return sum;
}

bool topk_lse_row(const float* x, int64_t n, int k, float* vals, int64_t* idx, float* lse) {
  bool bad = false;
  const int have = select_top(x, n, k, vals, idx, &bad);
  if (bad || have < k || vals[0] == INFINITY) return false;
  const float mx = vals[0];
  float sum = 0.f;
  int64_t i = 0;
#if SPECSERVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(mx);
#if SPECSERVE_AVX512
  const __m512 vm16 = _mm512_set1_ps(mx);
  __m512 acc16 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc16 = _mm512_add_ps(acc16, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm16)));
  sum = _mm512_reduce_add_ps(acc16);
#endif
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
  sum += hsum(acc);
#endif
  for (; i < n; ++i) sum += std::exp(x[i] - mx);
  *lse = mx + std::log(sum);
  return true;
}

// One row of sampling's truncation (sampler.process_logits: vLLM's order): y = x / temperature;
// min-p drops y < max(y) + log(min_p); top-k keeps the k largest (of equal values the lower ids);
// top-p keeps, in descending order (equal values by ascending id), every token the mass strictly
// before which is below top_p times the mass of what top-k kept (so never the first). Dropped
// tokens get -inf. Masses are e^(y - max) in float32 summed in float64. The nucleus is first looked
// for among the TRUNC_CANDIDATES largest; a wider one is cut by buckets of e's float bits (16 per
// octave), only the bucket the cut falls in being ordered. False where the row holds a NaN or +inf
// or nothing above -inf (the caller asks torch).
constexpr int TRUNC_CANDIDATES = 256;
constexpr int TRUNC_MAX_KEPT = TRUNC_CANDIDATES;  // softmax_kept_'s most kept tokens

// y = softmax(y) in place (-inf -> 0), mx being y's largest value: e^(y - mx) through exp8, summed in
// float64.
void softmax_row_(float* y, int64_t n, float mx) {
  const double total = exp_shifted<true>(y, n, mx, y);
  const float inv = static_cast<float>(1.0 / total);
  int64_t i = 0;
#if SPECSERVE_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), vinv));
#endif
  for (; i < n; ++i) y[i] *= inv;
}

// softmax_row_ of a row whose only values above -inf sit at ids[0..m) (a top-k's or a nucleus's
// tokens), bit for bit what the dense pass gives, without an exp over the rest: the same exp of
// each kept value, and their float64 sum in the dense pass's association (per group of 8, the two
// halves lane by lane into 4 lanes, groups in order, the lanes then the tail added; a dropped
// token's e^-inf is a +0 that adds nothing). ids are sorted here.
void softmax_kept_(float* y, int64_t n, float mx, int64_t* ids, int m) {
  std::sort(ids, ids + m);
  float kv[TRUNC_MAX_KEPT], ke[TRUNC_MAX_KEPT];
  for (int j = 0; j < m; ++j) kv[j] = y[ids[j]];
  exp_shifted<true>(kv, m, mx, ke);  // lane by lane the dense pass's exp of each value
  double sum = 0.0;
#if SPECSERVE_AVX2
  const int64_t vec_end = n - n % 8;  // the dense pass's vector groups; the rest is its tail
  double lane[4] = {0.0, 0.0, 0.0, 0.0};
  int j = 0;
  while (j < m && ids[j] < vec_end) {
    const int64_t g = ids[j] & ~int64_t{7};
    double lo[4] = {0.0, 0.0, 0.0, 0.0}, hi[4] = {0.0, 0.0, 0.0, 0.0};
    for (; j < m && ids[j] < g + 8; ++j) {
      const int64_t r = ids[j] - g;
      (r < 4 ? lo[r] : hi[r - 4]) = static_cast<double>(ke[j]);
    }
    for (int l = 0; l < 4; ++l) lane[l] += lo[l] + hi[l];  // (a lane without a kept token adds +0: exact)
  }
  sum = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  for (; j < m; ++j) sum += ke[j];
#else
  for (int j = 0; j < m; ++j) sum += ke[j];
#endif
  const float inv = static_cast<float>(1.0 / sum);
  std::fill(y, y + n, 0.f);
  for (int j = 0; j < m; ++j) y[ids[j]] = ke[j] * inv;
}

// With probs, y is then the softmax of that (dense, or over the kept tokens alone where they are a
// short known list: the same bits).
bool truncate_row(const float* x, float* y, int64_t n, float temp, int64_t top_k, float top_p, float min_p,
                  std::vector<float>& e, bool probs) {
  float mx = -INFINITY;
  bool bad = false;
  int64_t i0 = 0;
#if SPECSERVE_AVX2
  {
    const __m256 vt = _mm256_set1_ps(temp);
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
#if SPECSERVE_AVX512
    {  // the same IEEE division lane for lane, 16 at a time
      const __m512 vt16 = _mm512_set1_ps(temp);
      __m512 vmax16 = _mm512_set1_ps(-INFINITY);
      __mmask16 nan16 = 0;
      for (; i0 + 16 <= n; i0 += 16) {
        const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i0), vt16);
        _mm512_storeu_ps(y + i0, v);
        nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax16 = _mm512_max_ps(vmax16, v);
      }
      vmax = _mm256_max_ps(_mm512_castps512_ps256(vmax16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(vmax16), 1)));
      bad = nan16 != 0;
    }
#endif
    for (; i0 + 8 <= n; i0 += 8) {
      const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i0), vt);
      _mm256_storeu_ps(y + i0, v);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) mx = std::max(mx, v);
    bad = bad || _mm256_movemask_ps(vnan) != 0;
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    y[i] = x[i] / temp;
    bad |= std::isnan(y[i]);
    mx = std::max(mx, y[i]);
  }
  if (bad || mx == INFINITY || mx == -INFINITY) return false;
  const float row_max = mx;  // no truncation drops it (min-p's floor is below it, top-k and top-p keep it)
  if (min_p > 0.f) {
    const float floor = mx + std::log(min_p);
    for (int64_t i = 0; i < n; ++i)
      if (y[i] < floor) y[i] = -INFINITY;
  }
  const bool nucleus = top_p < 1.f;
  const int64_t k = top_k > 0 && top_k < n ? top_k : n;
  // With probs, the softmax of what is kept: where the kept tokens are a known short list, only theirs.
  auto dense = [&]() {
    if (probs) softmax_row_(y, n, row_max);
    return true;
  };
  auto sparse = [&](int64_t* ids, int m) {
    if (probs) softmax_kept_(y, n, row_max, ids, m);
    return true;
  };
  if (k == n && !nucleus) return dense();
  float cv[TRUNC_CANDIDATES];
  int64_t ci[TRUNC_CANDIDATES];
  int c = 0;  // candidates: the largest kept values in order
  bool all_in = false;  // every kept token is among the candidates
  if (k < n && k <= TRUNC_CANDIDATES) {
    c = k <= 64 ? select_top(y, n, static_cast<int>(k), cv, ci, &bad) : select_top_wide(y, n, static_cast<int>(k), cv, ci, &bad);
    for (int64_t i = 0; i < n; ++i) y[i] = -INFINITY;
    for (int j = 0; j < c; ++j) y[ci[j]] = cv[j];
    all_in = true;
  } else if (k < n) {  // a wide top-k: partition (value desc, id asc) at k
    std::vector<std::pair<float, int64_t>> kept;
    for (int64_t i = 0; i < n; ++i)
      if (y[i] > -INFINITY) kept.emplace_back(y[i], i);
    if (static_cast<int64_t>(kept.size()) > k) {
      std::nth_element(kept.begin(), kept.begin() + k, kept.end(), ranks_before);
      for (auto it = kept.begin() + k; it != kept.end(); ++it) y[it->second] = -INFINITY;
    }
  }
  if (!nucleus) return all_in ? sparse(ci, c) : dense();
  if (!all_in) c = select_top_wide(y, n, TRUNC_CANDIDATES, cv, ci, &bad);
  if (c == 0) return false;
  mx = cv[0];
  float ce[TRUNC_CANDIDATES];  // the candidates' masses (the same exp wherever a value sits)
  double total;
  if (all_in) {  // top-k kept only candidates: their masses are all there is
    total = exp_shifted(cv, c, mx, ce);
  } else {
    if (static_cast<int64_t>(e.size()) < n) e.resize(n);
    total = exp_shifted(y, n, mx, e.data());
    for (int j = 0; j < c; ++j) ce[j] = e[ci[j]];
  }
  const double target = static_cast<double>(top_p) * total;
  double mass = 0.0;
  int keep = 0;
  while (keep < c && mass < target) mass += ce[keep++];
  if (mass >= target || all_in || c < TRUNC_CANDIDATES) {  // the cut falls among the candidates
    for (int j = keep; j < c; ++j) y[ci[j]] = -INFINITY;
    if (!all_in && c == TRUNC_CANDIDATES) {  // the tokens below the candidates
      const float last = cv[c - 1];
      int64_t i = 0;
#if SPECSERVE_AVX2
      const __m256 vl = _mm256_set1_ps(last), ninf = _mm256_set1_ps(-INFINITY);
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(y + i);
        _mm256_storeu_ps(y + i, _mm256_blendv_ps(v, ninf, _mm256_cmp_ps(v, vl, _CMP_LT_OQ)));
      }
#endif
      for (; i < n; ++i)
        if (y[i] < last) y[i] = -INFINITY;
      for (i = ci[c - 1] + 1; i < n; ++i)  // equal to the last candidate, after it: not a candidate
        if (y[i] == last) y[i] = -INFINITY;
    }
    return sparse(ci, keep);
  }
  // A wide nucleus: masses by bucket of e's float bits (positive floats order as their bits).
  constexpr int SHIFT = 19, BUCKETS = 1 << (31 - SHIFT);
  std::vector<double> bmass(BUCKETS, 0.0);
  auto bucket = [&](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return static_cast<int>(bits >> SHIFT);
  };
  for (int64_t i = 0; i < n; ++i) bmass[bucket(e[i])] += e[i];
  double above = 0.0;
  int cut = BUCKETS - 1;
  for (; cut > 0; --cut) {
    if (above + bmass[cut] >= target) break;
    above += bmass[cut];
  }
  std::vector<std::pair<float, int64_t>> edge;  // the cut bucket's tokens, by value desc, id asc
  for (int64_t i = 0; i < n; ++i) {
    const int b = bucket(e[i]);
    if (b == cut) edge.emplace_back(y[i], i);
    else if (b < cut) y[i] = -INFINITY;
  }
  std::sort(edge.begin(), edge.end(), ranks_before);
  for (const auto& [v, i] : edge) {
    if (above >= target) y[i] = -INFINITY;
    above += e[i];
  }
  return dense();
}

// truncate_row over each row of float32 [R, V] logits, rows in parallel: (the processed logits, whether
// every row was answered).
// The per-row sampling settings of truncate_rows and sample_rows, checked against their logits x
// (CPU float32 [rows, values], rows contiguous; the settings [rows], contiguous).
struct RowSettings {
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  const float* min_p;
};

RowSettings row_settings(const char* fn, const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                         const torch::Tensor& top_p, const torch::Tensor& min_p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(1) == 1,
              fn, ": CPU float32 [rows, values] with contiguous rows");
  const int64_t rows = x.size(0);
  for (const auto* t : {&temperature, &top_p, &min_p})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                fn, ": float32 [rows] settings");
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == torch::kLong && top_k.is_contiguous(),
              fn, ": int64 [rows] top_k");
  return {temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>()};
}

std::tuple<torch::Tensor, bool> truncate_rows(const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                                              const torch::Tensor& top_p, const torch::Tensor& min_p, bool probs) {
  const RowSettings set = row_settings("truncate_rows", x, temperature, top_k, top_p, min_p);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, n}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> e;  // kept: a fresh 0.6 MB buffer a call cost its page faults
    for (int64_t r = r0; r < r1; ++r) {
      if (!truncate_row(xp + r * stride, op + r * n, n, set.temperature[r], set.top_k[r], set.top_p[r], set.min_p[r], e, probs))
        ok = false;
    }
  });
  return {out, ok.load()};
}

// topk_lse_row over each row of a float32 [R, V] matrix, rows in parallel: (values [R, k], indices
// int64 [R, k], logsumexp [R], whether every row was answered).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, bool> topk_rows(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(1) == 1,
              "topk_rows: CPU float32 [rows, values] with contiguous rows");
  TORCH_CHECK(k >= 1 && k <= 64 && k <= x.size(1) && x.size(1) < (int64_t{1} << 31),
              "topk_rows: k in [1, min(64, values)], rows of fewer than 2^31 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto vals = torch::empty({rows, k}, torch::kFloat32);
  auto idx = torch::empty({rows, k}, torch::kLong);
  auto lse = torch::empty({rows}, torch::kFloat32);
  const float* base = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      if (!topk_lse_row(base + r * stride, n, static_cast<int>(k), vp + r * k, ip + r * k, lp + r)) ok = false;
  });
  return {vals, idx, lse, ok.load()};
}

// Which of the 8 values at p are nonzero (a NaN counts), as bits. 256 bits wide on purpose: with
// 512-bit instructions in flight the float64 adds of the running sum, a dependent chain, ran at
// twice their latency (a dense 49k-id row's total 26 -> 50 us on a Xeon).
inline uint32_t nonzero_bits8(const float* p) {
#if SPECSERVE_AVX2
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_NEQ_UQ)));
#else
  uint32_t m = 0;
  for (int j = 0; j < 8; ++j) m |= static_cast<uint32_t>(p[j] != 0) << j;
  return m;
#endif
}

// The first index whose running float64 sum of p reaches u * (the whole row's sum), clamped to the row:
// torch.searchsorted(p.double().cumsum(-1), u * total) exactly (a zero adds nothing to a float64 sum,
// so only the nonzero values are added, in order; a float row skips its zeros 8 at a time, a
// truncated row being mostly zeros). -1 for a row with a NaN, an infinity, a negative value or no
// mass (the caller asks torch).
template <typename T>
int64_t inverse_cdf_row(const T* p, int64_t n, double u) {
  constexpr bool kVec = std::is_same_v<T, float> && SPECSERVE_AVX2;
  constexpr int W = 8;
  constexpr uint32_t kAll = 0xFFu;
  double total = 0.0;
  int64_t i = 0;
  if constexpr (kVec) {
    for (; i + W <= n; i += W) {
      uint32_t m = nonzero_bits8(reinterpret_cast<const float*>(p) + i);
      if (m == kAll) {
        for (int j = 0; j < W; ++j) total += static_cast<double>(p[i + j]);
      } else {
        for (; m; m &= m - 1) total += static_cast<double>(p[i + __builtin_ctz(m)]);
      }
    }
  }
  for (; i < n; ++i)
    if (p[i] != 0) total += static_cast<double>(p[i]);
  if (!(total > 0.0) || std::isinf(total)) return -1;  // NaN, infinite or empty
  const double target = u * total;
  double run = 0.0;
  int64_t last = n - 1;
  auto take = [&](int64_t j) {  // (true: the draw is j)
    run += static_cast<double>(p[j]);
    last = j;
    return run >= target;
  };
  i = 0;
  if constexpr (kVec) {
    for (; i + W <= n; i += W) {
      uint32_t m = nonzero_bits8(reinterpret_cast<const float*>(p) + i);
      for (; m; m &= m - 1) {
        const int64_t j = i + __builtin_ctz(m);
        if (p[j] < 0) return -1;
        if (take(j)) return j;
      }
    }
  }
  for (; i < n; ++i) {
    if (p[i] == 0) continue;
    if (p[i] < 0) return -1;
    if (take(i)) return i;
  }
  return last;  // (u * total <= total: not reached)
}

// inverse_cdf_row over each row of a float32 or float64 [R, V] matrix with u float64 [R], rows in
// parallel: (int64 [R], whether every row was answered).
std::tuple<torch::Tensor, bool> inverse_cdf_rows(const torch::Tensor& p, const torch::Tensor& u) {
  TORCH_CHECK(p.dim() == 2 && (p.scalar_type() == torch::kFloat32 || p.scalar_type() == torch::kFloat64) && p.device().is_cpu() &&
              p.stride(1) == 1 && p.size(1) > 0, "inverse_cdf_rows: CPU float32 / float64 [rows, values] with contiguous rows");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == p.size(0) && u.scalar_type() == torch::kFloat64 && u.is_contiguous(),
              "inverse_cdf_rows: float64 [rows] uniforms");
  const int64_t rows = p.size(0), n = p.size(1), stride = p.stride(0);
  auto out = torch::empty({rows}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      op[r] = p.scalar_type() == torch::kFloat32 ? inverse_cdf_row(p.data_ptr<float>() + r * stride, n, up[r])
                                                 : inverse_cdf_row(p.data_ptr<double>() + r * stride, n, up[r]);
      if (op[r] < 0) ok = false;
    }
  });
  return {out, ok.load()};
}

// Per row: truncate_row with probs, then inverse_cdf_row with u[r], in a scratch row instead of an
// [R, V] tensor: the index inverse_cdf_rows(truncate_rows(x, ..., probs = true), u) gives, bit for
// bit, for one call instead of two and no allocation (sampler.Sampler's draw without drafts).
// Temperatures below greedy_eps count as 1 (process_logits: those rows' draws are not used).
// (tokens int64 [R], whether every row was answered; rows that were not: -1.)
std::tuple<torch::Tensor, bool> sample_rows(const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                                            const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u,
                                            double greedy_eps) {
  const RowSettings set = row_settings("sample_rows", x, temperature, top_k, top_p, min_p);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == torch::kFloat64 && u.is_contiguous(),
              "sample_rows: float64 [rows] uniforms");
  auto out = torch::empty({rows}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> e, y;  // kept between calls (fresh pages cost their faults)
    if (static_cast<int64_t>(y.size()) < n) y.resize(n);
    for (int64_t r = r0; r < r1; ++r) {
      const float t = set.temperature[r] < static_cast<float>(greedy_eps) ? 1.f : set.temperature[r];  // (torch compares in float32)
      op[r] = truncate_row(xp + r * stride, y.data(), n, t, set.top_k[r], set.top_p[r], set.min_p[r], e, true)
                  ? inverse_cdf_row(y.data(), n, up[r]) : -1;
      if (op[r] < 0) ok = false;
    }
  });
  return {out, ok.load()};
}

// x / sqrt(mean(x^2) + eps) * weight per row (float32), into `out` where one is given (output_into).
torch::Tensor rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor* out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "rms_norm: float32 [M, H] input");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const int64_t M = xc.size(0), H = xc.size(1);
  TORCH_CHECK(wc.numel() == H, "rms_norm: weight has ", wc.numel(), " values, expected ", H);
  auto y = output_into(out, xc.sizes(), "rms_norm");
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += r[i] * r[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) yp[m * H + i] = wp[i] * (r[i] * inv);
  }
  return y;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) { return rms_norm_into(x, weight, eps, nullptr); }

// Rotate-half RoPE in place on q [T, Hq, D] and k [T, Hk, D] (heads and values contiguous per
// token; the token stride may be anything): (a, b) -> (a cos - b sin, b cos + a sin) for the
// pairs (i, i + D/2), angles from the cos/sin tables [P, D/2] at each token's position.
void rope_(torch::Tensor q, torch::Tensor k, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions) {
  const auto pos = positions.contiguous().to(torch::kInt64);
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == half, "rope: tables must be contiguous [P, D/2]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (torch::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->stride(2) == 1 && t->stride(1) == D && t->size(0) == T, "rope: float32 [T, H, D] with contiguous heads");
    float* base = t->data_ptr<float>();
    const int64_t H = t->size(1), ts = t->stride(0);
    for (int64_t i = 0; i < T; ++i) {
      TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0), "rope: position ", pp[i], " outside the table");
      const float* c = cos.data_ptr<float>() + pp[i] * half;
      const float* s = sin.data_ptr<float>() + pp[i] * half;
      for (int64_t h = 0; h < H; ++h) {
        float* v = base + i * ts + h * D;
        for (int64_t j = 0; j < half; ++j) {
          const float a = v[j], b = v[j + half];
          v[j] = a * c[j] - b * s[j];
          v[j + half] = b * c[j] + a * s[j];
        }
      }
    }
  }
}


// In place: p[i] = exp(p[i] - max(p)); returns sum(p) (0 for an empty row) and max(p) in *max_out.
// The arithmetic depends only on n and the values, so a row's weights never depend on the rest of
// the step. Scalar std::exp here used to be most of a long prompt's attention time.
inline float softmax_part_(float* p, int64_t n, float* max_out) {
#if SPECSERVE_AVX2
  const int64_t full = n - n % 8;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < full; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + i));
  float mx = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) mx = std::max(mx, v);
  for (int64_t i = full; i < n; ++i) mx = std::max(mx, p[i]);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vden = _mm256_setzero_ps();
  int64_t i0 = 0;
#if SPECSERVE_AVX512
  // 16 at a time, each half added to the sum in the 8-wide order (the same sum, bit for bit).
  const __m512 vm16 = _mm512_set1_ps(mx);
  for (; i0 + 16 <= full; i0 += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i0), vm16));
    _mm512_storeu_ps(p + i0, e);
    vden = _mm256_add_ps(vden, _mm512_castps512_ps256(e));
    vden = _mm256_add_ps(vden, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (int64_t i = i0; i < full; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
    _mm256_storeu_ps(p + i, e);
    vden = _mm256_add_ps(vden, e);
  }
  if (full < n) {  // the tail through the same exp: lanes past n are -inf, so exactly 0
    for (int i = 0; i < 8; ++i) lanes[i] = full + i < n ? p[full + i] - mx : -INFINITY;
    const __m256 e = exp8(_mm256_load_ps(lanes));
    vden = _mm256_add_ps(vden, e);
    _mm256_store_ps(lanes, e);
    for (int64_t i = full; i < n; ++i) p[i] = lanes[i - full];
  }
  const float den = hsum(vden);
#else
  float mx = -INFINITY, den = 0.f;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - mx);
    den += p[i];
  }
#endif
  *max_out = mx;
  return den;
}

// A token's keys are weighed and summed in splits of kAttnSplitKeys (by their place in its list of
// allowed keys), and the splits' partial softmax sums and value sums merged in split order
// (merge_splits). The splits depend on nothing but that list, so a token gets the same bits in a
// decode step, a verify tile or a prefill, alone or batched, on any number of threads; and one
// split (up to kAttnSplitKeys keys) is exactly one softmax over all of them. Splits let a decode
// step share one long request's keys among threads: whole (request, KV head) items left one
// thread with two of SmolLM2's three heads (one request at 2,500 keys: 100 us a layer on 2
// threads against 134 on one), and a batch-1 decode with Qwen's two heads used two threads of any
// number.
constexpr int64_t kAttnSplitKeys = 1024;

inline int64_t attn_splits(int64_t n) { return std::max<int64_t>(1, (n + kAttnSplitKeys - 1) / kAttnSplitKeys); }
constexpr int64_t kAllSplits = std::numeric_limits<int64_t>::max() / kAttnSplitKeys;  // a split range: every split

// o[g * D + c] for G heads from S splits' partials: mx[s * ms + g] and den[s * ms + g], each split's
// max and sum of exp(score - max), and acc[s * stride + g * D + c], its values weighted by those.
// Each split is rescaled to the largest max and the splits summed in order; one split gives
// acc / den, bit for bit what one softmax over all the keys gives.
inline void merge_splits(int64_t S, int64_t G, int64_t D, const float* mx, const float* den, int64_t ms, const float* acc,
                         int64_t stride, float* o) {
  for (int64_t g = 0; g < G; ++g) {
    if (S == 1) {
      const float inv = den[g] > 0.f ? 1.f / den[g] : 0.f;
      for (int64_t c = 0; c < D; ++c) o[g * D + c] = acc[g * D + c] * inv;
      continue;
    }
    float m = -INFINITY;
    for (int64_t s = 0; s < S; ++s) m = std::max(m, mx[s * ms + g]);
    thread_local std::vector<float> w;
    w.resize(S);
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      w[s] = mx[s * ms + g] == -INFINITY ? 0.f : std::exp(mx[s * ms + g] - m);
      total += den[s * ms + g] * w[s];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t c = 0; c < D; ++c) {
      float a = 0.f;
      for (int64_t s = 0; s < S; ++s) a += acc[s * stride + g * D + c] * w[s];
      o[g * D + c] = a * inv;
    }
  }
}

#if SPECSERVE_AVX2
// Key and value rows are gathered through the block tables (another KV head's rows between
// them), so the hardware prefetchers miss them: each loop asks for the row kAttnAheadBytes of
// rows on, into L2. A 2,150-token decode's 30 layers of SmolLM2 attention (float32 KV, from
// DRAM), Zen 5: 11.0 -> 5.7 ms on one thread, 7.2 -> 4.3 ms on two (8-32 KB ahead measured);
// D = 128: 14.6 -> 10.1 / 8.1 -> 6.7 ms; a 256-token context unchanged.
constexpr int64_t kAttnAheadBytes = 32768;

// Float16 and int8 rows: 8 KB ahead. In one process, fp16 pages, SmolLM2 shapes, 30 layers, block
// tables shuffled: batch 32 at 256 keys 611 -> 370 us a layer, batch 8 at 512 200 -> 144, one
// request at 4,000 keys 180 -> 171 (16 KB: 435 / 163 / 169). Float32 keeps 32 KB, best for a long
// single context (327 against 353 us at 8 KB; 8 KB was 3-18% faster for batches).
template <typename KT>
inline int64_t attn_ahead_rows(int64_t D) {
  return (sizeof(KT) == 4 ? kAttnAheadBytes : kAttnAheadBytes / 4) / (D * static_cast<int64_t>(sizeof(KT)));
}

template <typename KT>
inline void prefetch_row(const KT* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(KT)); o += 64) prefetch_line(p + o);
}

// Eight cache values as float32: a float32 cache's as they are, a float16 cache's widened (exact,
// so the arithmetic after the load is the same for both).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// An int8 cache's values as they are (its per-(slot, head) scales apply after: see paged_attention_t).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// hsum of four vectors at once, [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]: each sum in
// hsum's order, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so bit for bit the same, in
// 12 shuffles and adds where four hsums take 24 (a key's score must not depend on whether it
// falls in a block of four or in the tail).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {  // by value: an array argument made GCC spill one accumulator
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  // lanes: [r0 r1 r2 r3] of a[0] | of a[1] (s01), of a[2] | of a[3] (s23), r = low half + high half
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));  // r0 + r2, r1 + r3
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));  // [a0 a2 a0 a2 | a1 a3 a1 a3]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
}

// Scores of GH query heads (rows of q, D apart) against KB keys: each score is one chain of
// fused multiply-adds over D in 8-value steps, then hsum, so it depends only on q and that key
// whatever GH and KB are. Each key chunk is loaded once for all GH heads.
template <int GH, int KB, typename KT>
inline void scores_block(const float* q, const KT* k, const int64_t* off, int64_t D, float scale, float* out, int64_t n) {
  __m256 acc[GH][KB];
  for (int h = 0; h < GH; ++h)
    for (int u = 0; u < KB; ++u) acc[h][u] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 kr[KB];
    for (int u = 0; u < KB; ++u) kr[u] = load8(k + off[u] + c);
    for (int h = 0; h < GH; ++h) {
      const __m256 qc = _mm256_loadu_ps(q + h * D + c);
      for (int u = 0; u < KB; ++u) acc[h][u] = _mm256_fmadd_ps(qc, kr[u], acc[h][u]);
    }
  }
  if constexpr (KB == 4) {
    const __m128 sc = _mm_set1_ps(scale);
    for (int h = 0; h < GH; ++h) _mm_storeu_ps(out + h * n, _mm_mul_ps(hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), sc));
  } else {
    for (int h = 0; h < GH; ++h)
      for (int u = 0; u < KB; ++u) out[h * n + u] = hsum(acc[h][u]) * scale;
  }
}

#if SPECSERVE_AVX512
// Eight floats at a and eight at b in one register (AVX-512F forms only, no DQ needed); the top eight back.
inline __m512 join8(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
inline __m512 join8(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
inline __m512 join8(const int8_t* a, const int8_t* b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)))));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

// hsum4 of the four 8-lane halves of a and b ([a low, a high, b low, b high]) in 512-bit steps:
// each 128-bit quarter of u holds one key's r_j = l_j + l_(j+4), then (r0 + r2) + (r1 + r3) in
// lane 0 of each quarter, the very additions hsum4 makes (so bit for bit its result) in 8
// instructions where extracting the halves and hsum4 took 16.
inline __m128 hsum4_x2(__m512 a, __m512 b) {
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(1, 0, 3, 2)));  // r0 + r2, r1 + r3 (twice)
  const __m512 w = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));  // lane 0: (r0 + r2) + (r1 + r3)
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
}

// scores_block<GH, 4> with two keys per 512-bit register (lanes 0-7 one key, 8-15 the next):
// each key's 8 lanes run the same fused multiply-add chain over D as the 256-bit kernel and
// hsum4 adds them up in hsum's order, so every score is bit for bit the 256-bit one, from half
// the multiply-add instructions (a 2,048-token verify of 9 tokens spends most of its attention
// here).
template <int GH, typename KT>
inline void scores_block_x2(const float* q, const KT* k, const int64_t* off, int64_t D, float scale, float* out, int64_t n) {
  __m512 acc[GH][2];
  for (int h = 0; h < GH; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
  const KT *k0 = k + off[0], *k1 = k + off[1], *k2 = k + off[2], *k3 = k + off[3];
  for (int64_t c = 0; c < D; c += 8) {
    const __m512 k01 = join8(k0 + c, k1 + c), k23 = join8(k2 + c, k3 + c);
    for (int h = 0; h < GH; ++h) {
      const __m512 qc = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + h * D + c))));
      acc[h][0] = _mm512_fmadd_ps(qc, k01, acc[h][0]);
      acc[h][1] = _mm512_fmadd_ps(qc, k23, acc[h][1]);
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
  for (int h = 0; h < GH; ++h) _mm_storeu_ps(out + h * n, _mm_mul_ps(hsum4_x2(acc[h][0], acc[h][1]), sc));
}
#endif

// Scores of n keys for GH heads; head h's go to out[h * stride + i]. A key's score does not
// depend on which block of 4 it falls in, so any split of the keys gives the same values.
template <int GH, typename KT>
inline void scores_heads(const float* q, const KT* k, const int64_t* off, int64_t n, int64_t stride, int64_t D, float scale,
                         float* out) {
  const int64_t ahead = attn_ahead_rows<KT>(D);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (i + ahead + 4 <= n)
      for (int u = 0; u < 4; ++u) prefetch_row(k + off[i + ahead + u], D);
#if SPECSERVE_AVX512
    scores_block_x2<GH, KT>(q, k, off + i, D, scale, out + i, stride);
#else
    scores_block<GH, 4, KT>(q, k, off + i, D, scale, out + i, stride);
#endif
  }
  for (; i < n; ++i) scores_block<GH, 1, KT>(q, k, off + i, D, scale, out + i, stride);
}

#if SPECSERVE_AVX512
// The AVX-512 values sweep over the n keys for columns [c, c + 16 * NG) of GH rows, row h's
// weights at w[h][i] and its sums at acc_out[h] (a query head of one token, or of any token of a
// tile whose keys these are): each key's weights broadcast once and its row's NG 16-value pieces
// loaded once for all GH rows.
template <int GH, int NG, typename KT>
inline void values_sweep512(const float* const* w, const KT* v, const int64_t* off, int64_t n, int64_t c, int64_t ahead,
                            float* const* acc_out) {
  __m512 acc[GH][NG];
  for (int h = 0; h < GH; ++h)
    for (int g = 0; g < NG; ++g) acc[h][g] = _mm512_loadu_ps(acc_out[h] + c + 16 * g);
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n)
      for (int64_t b = 0; b < 16 * NG * static_cast<int64_t>(sizeof(KT)); b += 64)  // every line (one in four missed the rest)
        _mm_prefetch(reinterpret_cast<const char*>(v + off[i + ahead] + c) + b, _MM_HINT_T1);
    __m512 wb[GH];
    for (int h = 0; h < GH; ++h) wb[h] = _mm512_set1_ps(w[h][i]);
    const KT* vr = v + off[i] + c;
    for (int g = 0; g < NG; ++g) {
      const __m512 x = load16(vr + 16 * g);
      for (int h = 0; h < GH; ++h) acc[h][g] = _mm512_fmadd_ps(wb[h], x, acc[h][g]);
    }
  }
  for (int h = 0; h < GH; ++h)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(acc_out[h] + c + 16 * g, acc[h][g]);
}

// values_sweep512 over min(NG, groups) registers of columns from c; returns the columns it took.
template <int GH, int NG, typename KT>
inline int64_t values_sweep_upto(const float* const* w, const KT* v, const int64_t* off, int64_t n, int64_t c, int64_t ahead,
                                 float* const* acc_out, int64_t groups) {
  if constexpr (NG > 1)
    if (groups < NG) return values_sweep_upto<GH, NG - 1, KT>(w, v, off, n, c, ahead, acc_out, groups);
  values_sweep512<GH, NG, KT>(w, v, off, n, c, ahead, acc_out);
  return 16 * NG;
}

// Every column of GH rows in sweeps of 16 columns per 512-bit register, as many registers per
// sweep as GH rows leave room for (at most 24 accumulators): per column the same multiply-adds in
// the same key order as one register per sweep, but each value row is read in one sweep instead
// of D / 16 (SmolLM2's rows are 4 such pieces, each a cache line a whole row's stride from the next).
template <int GH, typename KT>
inline void values_rows512(const float* const* w, const KT* v, const int64_t* off, int64_t n, int64_t D, float* const* acc_out) {
  constexpr int kGroups = GH <= 3 ? 8 : GH == 4 ? 6 : 4;
  const int64_t ahead = attn_ahead_rows<KT>(D);
  for (int64_t c = 0; c < D;) c += values_sweep_upto<GH, kGroups, KT>(w, v, off, n, c, ahead, acc_out, (D - c) / 16);
}
#endif

// acc[h * D + c] += sum_i w[h * stride + i] * v_i[c] for GH heads and n keys, summed in key
// order per value onto what acc holds (so keys may come in chunks: the sums are the same);
// 16 values of the head at a time (AVX2) or up to 128 (AVX-512), each value row piece loaded
// once for all GH heads.
template <int GH, typename KT>
inline void values_heads(const float* w, int64_t stride, const KT* v, const int64_t* off, int64_t n, int64_t D, float* acc_out) {
#if SPECSERVE_AVX512
  if (D % 16 == 0) {  // values_rows512
    const float* wr[GH];
    float* ar[GH];
    for (int h = 0; h < GH; ++h) wr[h] = w + h * stride, ar[h] = acc_out + h * D;
    values_rows512<GH, KT>(wr, v, off, n, D, ar);
    return;
  }
#endif
  const int64_t ahead = attn_ahead_rows<KT>(D);
  for (int64_t c = 0; c < D; c += 16) {
    const bool two = c + 16 <= D;
    __m256 acc[GH][2];
    for (int h = 0; h < GH; ++h) {
      acc[h][0] = _mm256_loadu_ps(acc_out + h * D + c);
      acc[h][1] = two ? _mm256_loadu_ps(acc_out + h * D + c + 8) : _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + ahead < n) _mm_prefetch(reinterpret_cast<const char*>(v + off[i + ahead] + c), _MM_HINT_T1);
      const KT* vr = v + off[i] + c;
      const __m256 v0 = load8(vr);
      const __m256 v1 = two ? load8(vr + 8) : _mm256_setzero_ps();
      for (int h = 0; h < GH; ++h) {
        const __m256 wh = _mm256_set1_ps(w[h * stride + i]);
        acc[h][0] = _mm256_fmadd_ps(wh, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(wh, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < GH; ++h) {
      _mm256_storeu_ps(acc_out + h * D + c, acc[h][0]);
      if (two) _mm256_storeu_ps(acc_out + h * D + c + 8, acc[h][1]);
    }
  }
}
#endif

// Scores out[g * stride + i] = scale * <q_g, k_i> for G query heads (rows of q) against the n
// key rows at k + off[i]; then, after the softmax, acc_g += sum_i w[g * stride + i] * v_i. The
// heads of one KV group go through together so each key and value row is read once, not once
// per head.
template <typename KT>
inline void attention_scores(const float* q, int64_t G, const KT* k, const int64_t* off, int64_t n, int64_t stride, int64_t D,
                             float scale, float* out) {
#if SPECSERVE_AVX2
  if (D % 8 == 0) {
#if SPECSERVE_AVX512
    constexpr int64_t kHeads = 6;  // 12 accumulators of 32 registers: each pair of keys loaded once for six heads
#else
    constexpr int64_t kHeads = 3;
#endif
    for (int64_t g = 0; g < G; g += kHeads) {
      switch (std::min<int64_t>(kHeads, G - g)) {
#if SPECSERVE_AVX512
        case 6: scores_heads<6, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
        case 5: scores_heads<5, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
        case 4: scores_heads<4, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
#endif
        case 3: scores_heads<3, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
        case 2: scores_heads<2, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
        default: scores_heads<1, KT>(q + g * D, k, off, n, stride, D, scale, out + g * stride); break;
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) {
      float dot = 0.f;
      for (int64_t c = 0; c < D; ++c) dot = std::fma(q[g * D + c], static_cast<float>(k[off[i] + c]), dot);  // fused whatever KT is
      out[g * stride + i] = dot * scale;
    }
}

#if SPECSERVE_AVX512
// Scores of a tile's tokens over the keys they all see (a verify's context, the keys a prefill
// tile's tokens share), from keys widened and turned on their side once for the tile:
// kt[c * M + j] is key j's value c. Each score is the arithmetic of scores_block, bit for bit:
// lane l's chain of multiply-adds over c = l, l + 8, ... from zero, the eight chains added in
// hsum's order, times scale; only here lane l's chain is a register of 16 keys, so there is no
// horizontal sum per key and no widening per token. Scores of 8 tokens x 3 heads against 128 keys
// of 64 values (SmolLM2, one thread, Zen 4, float16 keys): 6.9 -> 4.9 us with the turn (0.7 us)
// counted; 8 x 6 heads against 64 keys of 128 (Qwen 1.5B): 10.9 -> 8.5 us. With fewer rows the
// turn costs what it saves (2 x 6 heads: 2.7 / 2.6 us; 3 x 3: 2.6 / 2.6; 4 x 3: 1.7 / 1.4), hence
// kSideRows and at least kSideTokens.
constexpr int64_t kSideRows = 12, kSideTokens = 3;

inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  const auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int j = 0; j < 16; j += 4) {
    r[j] = lo(t[j], t[j + 2]);
    r[j + 1] = hi(t[j], t[j + 2]);
    r[j + 2] = lo(t[j + 1], t[j + 3]);
    r[j + 3] = hi(t[j + 1], t[j + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; ++j) {
      t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
      t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// kt[c * M + j] = value c of the key row at k + off[j] for j < m, 0 for m <= j < M (M: m rounded
// up to 16); D a multiple of 16. Rows ahead asked for within the m, as the other kernels do (the
// attention's chunk loop asks for the next chunk's first rows).
template <typename KT>
inline void keys_on_side(const KT* k, const int64_t* off, int64_t m, int64_t D, float* kt, int64_t M) {
  const int64_t ahead = attn_ahead_rows<KT>(D);
  for (int64_t j0 = 0; j0 < M; j0 += 16) {
    for (int64_t j = j0 + ahead; j < std::min(m, j0 + ahead + 16); ++j) prefetch_row(k + off[j], D);
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = j0 + j < m ? load16(k + off[j0 + j] + c0) : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (c0 + c) * M + j0, r[c]);
    }
  }
}

// Scores of P rows (query rows q[p], D values each) against keys [j0, j0 + 16 R) of kt, into
// out[p][j] for j < m. Lanes l and l + 4 go through one pass and are added at its end, so four
// sums wait for the last additions ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), not eight
// (16 tokens x 3 heads x 128 keys of 64 values: 9.2 -> 8.6 us with the turn).
template <int P, int R>
inline void side_scores_block(const float* const* q, const float* kt, int64_t M, int64_t j0, int64_t m, int64_t D, float scale,
                              float* const* out) {
  __m512 part[4][P][R];  // lane l's chain + lane l + 4's
  for (int l = 0; l < 4; ++l) {
    __m512 a[P][R], b[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) a[p][r] = b[p][r] = _mm512_setzero_ps();
    for (int64_t c = l; c < D; c += 8) {
      __m512 k0[R], k4[R];
      for (int r = 0; r < R; ++r) {
        k0[r] = _mm512_loadu_ps(kt + c * M + j0 + 16 * r);
        k4[r] = _mm512_loadu_ps(kt + (c + 4) * M + j0 + 16 * r);
      }
      for (int p = 0; p < P; ++p) {
        const __m512 x = _mm512_set1_ps(q[p][c]), y = _mm512_set1_ps(q[p][c + 4]);
        for (int r = 0; r < R; ++r) {
          a[p][r] = _mm512_fmadd_ps(x, k0[r], a[p][r]);
          b[p][r] = _mm512_fmadd_ps(y, k4[r], b[p][r]);
        }
      }
    }
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) part[l][p][r] = _mm512_add_ps(a[p][r], b[p][r]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(part[0][p][r], part[2][p][r]), _mm512_add_ps(part[1][p][r], part[3][p][r])), sc);
      const int64_t j = j0 + 16 * r;
      if (j + 16 <= m)
        _mm512_storeu_ps(out[p] + j, s);
      else if (j < m)
        _mm512_mask_storeu_ps(out[p] + j, static_cast<__mmask16>((1u << (m - j)) - 1), s);
    }
}

template <int P>
inline void side_scores_rows(const float* const* q, const float* kt, int64_t M, int64_t m, int64_t D, float scale,
                             float* const* out) {
  int64_t j0 = 0;
  for (; j0 + 32 <= M; j0 += 32) side_scores_block<P, 2>(q, kt, M, j0, m, D, scale, out);
  for (; j0 < M; j0 += 16) side_scores_block<P, 1>(q, kt, M, j0, m, D, scale, out);
}

// out[r][j] = scale * <q[r], key j> for `rows` query rows against the m keys turned into kt.
inline void side_scores(const float* const* q, int64_t rows, const float* kt, int64_t M, int64_t m, int64_t D, float scale,
                        float* const* out) {
  for (int64_t i = 0; i < rows; i += 6) {
    switch (std::min<int64_t>(6, rows - i)) {
      case 6: side_scores_rows<6>(q + i, kt, M, m, D, scale, out + i); break;
      case 5: side_scores_rows<5>(q + i, kt, M, m, D, scale, out + i); break;
      case 4: side_scores_rows<4>(q + i, kt, M, m, D, scale, out + i); break;
      case 3: side_scores_rows<3>(q + i, kt, M, m, D, scale, out + i); break;
      case 2: side_scores_rows<2>(q + i, kt, M, m, D, scale, out + i); break;
      default: side_scores_rows<1>(q + i, kt, M, m, D, scale, out + i); break;
    }
  }
}

// acc[r][c] += sum_i w[r][i] * v_i[c] for `rows` rows sharing the n value rows at v + off[i]
// (the heads of a tile's tokens over keys they all see): values_heads' sums, each value row
// read once for up to 6 rows of any of the tokens.
template <typename KT>
inline void values_side(const float* const* w, int64_t rows, const KT* v, const int64_t* off, int64_t n, int64_t D,
                        float* const* acc) {
  for (int64_t i = 0; i < rows; i += 6) {
    switch (std::min<int64_t>(6, rows - i)) {
      case 6: values_rows512<6, KT>(w + i, v, off, n, D, acc + i); break;
      case 5: values_rows512<5, KT>(w + i, v, off, n, D, acc + i); break;
      case 4: values_rows512<4, KT>(w + i, v, off, n, D, acc + i); break;
      case 3: values_rows512<3, KT>(w + i, v, off, n, D, acc + i); break;
      case 2: values_rows512<2, KT>(w + i, v, off, n, D, acc + i); break;
      default: values_rows512<1, KT>(w + i, v, off, n, D, acc + i); break;
    }
  }
}
#endif

template <typename KT>
inline void attention_values(const float* w, int64_t G, int64_t stride, const KT* v, const int64_t* off, int64_t n, int64_t D,
                             float* acc) {
#if SPECSERVE_AVX2
  if (D % 8 == 0) {
    for (int64_t g = 0; g < G; g += 6) {
      switch (std::min<int64_t>(6, G - g)) {
        case 6: values_heads<6, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
        case 5: values_heads<5, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
        case 4: values_heads<4, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
        case 3: values_heads<3, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
        case 2: values_heads<2, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
        default: values_heads<1, KT>(w + g * stride, stride, v, off, n, D, acc + g * D); break;
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D; ++c) {
      float a = acc[g * D + c];
      for (int64_t i = 0; i < n; ++i) a = std::fma(w[g * stride + i], static_cast<float>(v[off[i] + c]), a);
      acc[g * D + c] = a;
    }
}

// The first rows a pass reads before its own prefetches (attn_ahead_rows on) take over: asked for
// together at its start, not met as one demand miss after another (a batch's short contexts had
// no prefetch at all: they end before the prefetch distance). Same process, fp16 pages, SmolLM2
// shapes, 30 layers, shuffled tables, 32 KB ahead: batch 32 at 256 keys 511 -> 314 us a layer,
// at 1,024 keys 1,322 -> 1,118; batch 8 at 512 keys 195 -> 132; Qwen shapes batch 32 at 256 keys
// 577 -> 484; one request at 1,024-4,000 keys and float32 pages within 2-7%.
template <typename KT>
inline void warm_rows(const KT* base, const int64_t* off, int64_t n, int64_t D) {
#if SPECSERVE_AVX2
  const int64_t rows = std::min(n, attn_ahead_rows<KT>(D));
  for (int64_t i = 0; i < rows; ++i) prefetch_row(base + off[i], D);
#endif
}

// Consecutive tokens of one request that share a pass over their keys. 16, not 8: a prefill tile
// widens and turns its keys once for twice the rows (keys_on_side), SmolLM2 prefill of 7,908
// tokens 21.6-22.0 -> 20.8-21.1 s on the Zen 4.
constexpr int64_t kAttnTile = 16;
constexpr int64_t kAttnChunkBytes = 16384;  // key (or value) rows read once per chunk for the whole tile

// Attention of a few new tokens per request over the paged KV cache, without gathering pages:
// token t (row r of request b in the padded batch) attends to every key j with
// mask[b, 0, r, j], read from slot block_tables[b][j / BS] * BS + j % BS. Per (token, KV head),
// the query heads sharing that KV head go together so each key and value row is loaded once.
// Up to kAttnTile consecutive tokens of one request (a prefill chunk, a draft) go through their
// keys together, a chunk of kAttnChunkBytes at a time, so the chunk is read from memory once
// for the tile instead of once per token (a 2,048-token prefill re-read its keys from L3 for
// every token: ~30% of the FMA peak). Used for every step shape, so a token never changes path
// with its batch; and the tiling changes no arithmetic (a key's score does not depend on its
// neighbours, and each output sums its values in key order onto its split's accumulator; the
// splits of kAttnSplitKeys keys depend only on the token's own key list: merge_splits).
// KT: the cache's element type, float, c10::Half or int8_t. Float16 pages widen exactly as they
// load, so a float16 cache gives bit for bit what a float32 cache holding the same rounded values
// would. An int8 cache (kscale / vscale: a float32 scale per slot and KV head) runs the same loops
// on its integer values: each key's score is then multiplied by its k scale, and each softmax
// weight by its value's v scale before the values pass.
template <typename KT>
torch::Tensor paged_attention_t(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                const torch::Tensor& block_tables, const torch::Tensor& mask, const torch::Tensor& query_index,
                                double scale, const float* kscale = nullptr, const float* vscale = nullptr,
                                const torch::Tensor* out_buf = nullptr) {
  constexpr bool kScaled = std::is_same_v<KT, int8_t>;
  const auto qc = q.contiguous();
  const auto bt = block_tables.contiguous();
  const auto mk = mask.contiguous();
  const auto qi = query_index.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: contiguous caches");
  TORCH_CHECK(bt.scalar_type() == torch::kInt64 && qi.scalar_type() == torch::kInt64 && mk.scalar_type() == torch::kBool,
              "paged_attention: int64 tables/indices and a bool mask");
  const int64_t T = qc.size(0), Hq = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t MB = bt.size(1), Q = mk.size(2), L = mk.size(3);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D && L <= MB * BS, "paged_attention: shapes disagree");
  const int64_t G = Hq / Hkv;
  auto out = output_into(out_buf, qc.sizes(), "paged_attention");
  const float* qp = qc.data_ptr<float>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const bool* mp = mk.data_ptr<bool>();
  const int64_t* qip = qi.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Two passes per (token, KV head): scores of every allowed key for the G query heads, then
  // softmax weights and one sweep over the values. (An online softmax would rescale the
  // accumulator at every key: twice the vector work and two exp per key.) Each query row's
  // arithmetic depends only on its own compacted list of allowed keys: a tree node sees its
  // prefix and ancestors in the same order as the same token in a plain sequence would.
  std::vector<int64_t> tile_start;  // token tiles: runs of <= kAttnTile tokens of one request
  // A run of r consecutive tokens of one request splits into ceil(r / kAttnTile) tiles. Where the
  // KV heads do not divide among the threads (SmolLM2's 3 on 2), the tiles are of even size, and a
  // run of 9-16 tokens makes two (9 tokens: 5 + 4, not 9 or 8 + 1), so the threads' shares of a
  // verify step come out even: one 9-token SmolLM2 layer at 2,048 keys 298 -> 251-264 us on 2
  // Zen 5 threads (against 8 + 1). Otherwise full tiles share each key read among more tokens
  // (Qwen's 2 heads: 412-441 us full, 426-449 even, noise).
  const bool even = Hkv % std::max(at::get_num_threads(), 1) != 0;
  for (int64_t t0 = 0; t0 < T;) {
    int64_t t1 = t0 + 1;
    while (t1 < T && qip[t1] / Q == qip[t0] / Q) ++t1;
    const int64_t run = t1 - t0, parts = std::max((run + kAttnTile - 1) / kAttnTile, even && run > 8 ? int64_t{2} : int64_t{1});
    for (int64_t i = 0; i < parts; ++i) tile_start.push_back(t0 + (even ? run * i / parts : i * kAttnTile));
    t0 = t1;
  }
  tile_start.push_back(T);
  const int64_t tiles = static_cast<int64_t>(tile_start.size()) - 1;
  const int64_t chunk = std::max<int64_t>(16, kAttnChunkBytes / (D * static_cast<int64_t>(sizeof(KT))));
  const int64_t side_keys = (chunk + 15) / 16 * 16;  // keys_on_side's room
  // Items (tile, KV head). A prefill's many tiles see ever more keys: the shared counter hands out
  // the last (longest) tiles first and the short ones even out the end (a static split gave one
  // thread three quarters of a causal prefill's work). Decode batches (one token per tile, like
  // work per item) and steps of few items keep the static split by work below, measured faster
  // for them.
  const bool longest_first = tiles < T && tiles * Hkv >= 4 * at::get_num_threads();
  // Splits [j0, j1) of item (tile, KV head): each token's keys from j0 * kAttnSplitKeys to its
  // end or j1 * kAttnSplitKeys. An item no other thread shares (part null) gives each token its
  // output here; a shared one's range leaves each token u's partials of split s at
  // part + (u * S + s) * unit, S the splits of the tile's longest list (max and sum per head, then
  // the weighted values), and merge_splits runs after.
  const int64_t unit = G * (2 + D);
  // Scratch kept per thread across calls (a decode step's items are short, and grabs many), looked
  // up once per thread's share and passed to each item (a thread_local's address per item cost a
  // batch-32 decode layer 7%), with the tile whose key lists it holds (a tile's items are consecutive).
  struct Scratch {
    std::vector<int64_t> slots[kAttnTile], slot_ids[kAttnTile];
    std::vector<float> p[kAttnTile], acc, mxs, dens, kt;
    std::vector<const float*> rows_in;  // per (token, head) of a tile: a query or weight row
    std::vector<float*> rows_out;       // and its scores or value sums
    int64_t tile = -1;
    int64_t n[kAttnTile];
    int64_t common = 0;  // leading keys the tile's tokens list alike
  };
  const auto scratch = []() -> Scratch& {
    thread_local Scratch scr;
    scr.tile = -1;  // key lists are this call's
    return scr;
  };
  const auto attend = [&](Scratch& scr, int64_t item, int64_t j0, int64_t j1, float* part) {
    auto& slots = scr.slots;
    auto& slot_ids = scr.slot_ids;
    auto& p = scr.p;
    auto& acc = scr.acc;
    auto& mxs = scr.mxs;
    auto& dens = scr.dens;
    int64_t n[kAttnTile];  // a local copy: stores through the key lists cannot alias it
    const int64_t tile = longest_first ? tiles - 1 - item / Hkv : item / Hkv, kvh = item % Hkv;
    const int64_t t0 = tile_start[tile], nt = tile_start[tile + 1] - t0;
#if SPECSERVE_AVX512
    const bool side = nt >= kSideTokens && nt * G >= kSideRows && D % 16 == 0;
#else
    const bool side = false;
#endif
    // Each token's allowed key rows as offsets of KV head 0's part (head kvh's is kvh * D further
    // on), listed once for all the tile's KV heads: a long context's mask is read once a token,
    // not once a head.
    if (tile != scr.tile) {
      scr.tile = tile;
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t b = qip[t0 + u] / Q, r = qip[t0 + u] % Q;
        const bool* allowed = mp + (b * Q + r) * L;
        // Written through raw pointers into lists that only grow (push_back was not inlined:
        // 3.5% of a float16 prefill's attention, 12.5% of an int8 one's with its second list).
        if (static_cast<int64_t>(slots[u].size()) < L) slots[u].resize(L);
        if (kScaled && static_cast<int64_t>(slot_ids[u].size()) < L) slot_ids[u].resize(L);
        int64_t* out = slots[u].data();
        int64_t* ids = kScaled ? slot_ids[u].data() : nullptr;
        int64_t cnt = 0;
        for (int64_t blk = 0; blk * BS < L; ++blk) {
          const int64_t base = btp[b * MB + blk] * BS, j0b = blk * BS, j1b = std::min(L, j0b + BS);
          for (int64_t j = j0b; j < j1b; ++j)
            if (allowed[j]) {
              out[cnt] = (base + j - j0b) * Hkv * D;  // element offset of the key row
              if constexpr (kScaled) ids[cnt] = base + j - j0b;
              ++cnt;
            }
        }
        scr.n[u] = cnt;
        if (static_cast<int64_t>(p[u].size()) < G * cnt) p[u].resize(G * cnt);
      }
      scr.common = 0;
#if SPECSERVE_AVX512
      if (side) {
        int64_t common = scr.n[0];
        for (int64_t u = 1; u < nt; ++u)
          common = std::mismatch(slots[0].data(), slots[0].data() + std::min(common, scr.n[u]), slots[u].data()).first - slots[0].data();
        scr.common = common;
        scr.rows_in.resize(nt * G);
        scr.rows_out.resize(nt * G);
        if (static_cast<int64_t>(scr.kt.size()) < side_keys * D) scr.kt.resize(side_keys * D);
      }
#endif
    }
    std::copy_n(scr.n, nt, n);
    // Token u's keys in this call: [lo, hi[u]); its splits [j0, s1[u]).
    int64_t hi[kAttnTile], s1[kAttnTile], soff[kAttnTile + 1];
    const int64_t lo = j0 * kAttnSplitKeys;
    int64_t far = lo;
    soff[0] = 0;
    for (int64_t u = 0; u < nt; ++u) {
      hi[u] = std::min(n[u], j1 * kAttnSplitKeys);
      s1[u] = std::min(j1, attn_splits(n[u]));
      soff[u + 1] = soff[u] + std::max<int64_t>(0, s1[u] - j0);
      far = std::max(far, hi[u]);
    }
    const KT* kh = kp + kvh * D;
    const KT* vh = vp + kvh * D;
    const int64_t step = nt > 1 ? chunk : std::max<int64_t>(far - lo, 1);  // one token: nothing to share
    // A tile's passes go a chunk at a time, each kernel asking for rows ahead only within its
    // chunk: each chunk asks for the next one's first rows (of the token with the longest list,
    // whose rows the others' lists begin with in a prefill tile or a draft). Without it a 2-token
    // tile at 8,000 keys met the first half of every chunk as demand misses.
    int64_t longest = 0;
    for (int64_t u = 1; u < nt; ++u)
      if (hi[u] > hi[longest]) longest = u;
    const auto warm_next = [&](const KT* base, int64_t c1, int64_t end) {
      if (nt > 1 && c1 < end) warm_rows(base, slots[longest].data() + c1, end - c1, D);
    };
    // Keys [lo, shared): every token of the tile has them at the same places in its list, and in
    // this call. Their scores and value sums go through the side kernels for all the tile's rows
    // at once (keys_on_side, side_scores, values_side); the rest token by token.
    int64_t shared = lo;
    if (side) {
      shared = scr.common;
      for (int64_t u = 0; u < nt; ++u) shared = std::min(shared, hi[u]);
    }
#if SPECSERVE_AVX512
    const auto side_rows = [&](int64_t c0, bool weights, int64_t sp) {  // the tile's rows from key c0
      for (int64_t u = 0; u < nt; ++u)
        for (int64_t g = 0; g < G; ++g) {
          scr.rows_in[u * G + g] = weights ? p[u].data() + g * n[u] + c0 : qp + ((t0 + u) * Hq + kvh * G + g) * D;
          scr.rows_out[u * G + g] = weights ? acc.data() + ((soff[u] + sp - j0) * G + g) * D : p[u].data() + g * n[u] + c0;
        }
    };
#endif
    for (int64_t u = 0; u < nt; ++u)
      if (lo < hi[u]) warm_rows(kh, slots[u].data() + lo, hi[u] - lo, D);
    for (int64_t c0 = lo; c0 < far; c0 += step) {
      warm_next(kh, c0 + step, hi[longest]);
      const int64_t s0 = std::clamp(shared, c0, c0 + step);  // this chunk's side keys end
#if SPECSERVE_AVX512
      if (s0 > c0) {
        const int64_t m = s0 - c0, M = (m + 15) / 16 * 16;
        keys_on_side(kh, slots[0].data() + c0, m, D, scr.kt.data(), M);
        side_rows(c0, false, 0);
        side_scores(scr.rows_in.data(), nt * G, scr.kt.data(), M, m, D, sc, scr.rows_out.data());
      }
#endif
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t e = std::min(c0 + step, hi[u]);
        if (s0 < e)
          attention_scores(qp + ((t0 + u) * Hq + kvh * G) * D, G, kh, slots[u].data() + s0, e - s0, n[u], D, sc, p[u].data() + s0);
      }
    }
    if constexpr (kScaled)  // an int8 key's score: its integer dot product times the key's scale
      for (int64_t u = 0; u < nt; ++u)
        for (int64_t i = lo; i < hi[u]; ++i) {
          const float ks = kscale[slot_ids[u][i] * Hkv + kvh];
          for (int64_t g = 0; g < G; ++g) p[u][g * n[u] + i] *= ks;
        }
    // Per split: weights exp(score - the split's max), their sum (mxs / dens [split][g]).
    mxs.resize(soff[nt] * G);
    dens.resize(soff[nt] * G);
    for (int64_t u = 0; u < nt; ++u)
      for (int64_t sp = j0; sp < s1[u]; ++sp) {
        const int64_t a = sp * kAttnSplitKeys, len = std::min(n[u], a + kAttnSplitKeys) - a;
        const int64_t at = (soff[u] + sp - j0) * G;
        for (int64_t g = 0; g < G; ++g) dens[at + g] = softmax_part_(p[u].data() + g * n[u] + a, len, &mxs[at + g]);
      }
    if constexpr (kScaled)  // and each weight carries its value's scale into the integer values
      for (int64_t u = 0; u < nt; ++u)
        for (int64_t i = lo; i < hi[u]; ++i) {
          const float vs = vscale[slot_ids[u][i] * Hkv + kvh];
          for (int64_t g = 0; g < G; ++g) p[u][g * n[u] + i] *= vs;
        }
    // Values: each split summed in key order onto its own accumulator [split][g][D].
    acc.assign(soff[nt] * G * D, 0.f);
    for (int64_t u = 0; u < nt; ++u)
      if (lo < hi[u]) warm_rows(vh, slots[u].data() + lo, hi[u] - lo, D);
    for (int64_t a = lo; a < far; a += kAttnSplitKeys) {
      const int64_t sp = a / kAttnSplitKeys, b = std::min(far, a + kAttnSplitKeys);
      if (a > lo)  // each pass prefetches only within its own keys: ask for the next split's first rows
        for (int64_t u = 0; u < nt; ++u)
          if (a < hi[u]) warm_rows(vh, slots[u].data() + a, hi[u] - a, D);
      for (int64_t c0 = a; c0 < b; c0 += step) {
        warm_next(vh, c0 + step, std::min(b, hi[longest]));
        const int64_t s0 = std::clamp(shared, c0, std::min(c0 + step, b));
#if SPECSERVE_AVX512
        if (s0 > c0) {
          side_rows(c0, true, sp);
          values_side(scr.rows_in.data(), nt * G, vh, slots[0].data() + c0, s0 - c0, D, scr.rows_out.data());
        }
#endif
        for (int64_t u = 0; u < nt; ++u) {
          const int64_t e = std::min({hi[u], b, c0 + step});
          if (s0 < e)
            attention_values(p[u].data() + s0, G, n[u], vh, slots[u].data() + s0, e - s0, D, acc.data() + (soff[u] + sp - j0) * G * D);
        }
      }
    }
    int64_t item_splits = 0;  // splits of the tile's longest list: the room each token has in part
    for (int64_t u = 0; u < nt; ++u) item_splits = std::max(item_splits, attn_splits(n[u]));
    for (int64_t u = 0; u < nt; ++u) {
      const int64_t S = s1[u] - j0, at = soff[u];
      if (S <= 0) continue;
      if (part == nullptr) {  // every split of this token: its output
        merge_splits(S, G, D, mxs.data() + at * G, dens.data() + at * G, G, acc.data() + at * G * D, G * D,
                     op + ((t0 + u) * Hq + kvh * G) * D);
        continue;
      }
      for (int64_t s = 0; s < S; ++s) {  // an item shared between threads: this share's partials
        float* dst = part + (u * item_splits + j0 + s) * unit;
        std::copy_n(mxs.data() + (at + s) * G, G, dst);
        std::copy_n(dens.data() + (at + s) * G, G, dst + G);
        std::copy_n(acc.data() + (at + s) * G * D, G * D, dst + 2 * G);
      }
    }
  };
  const auto run = [&](int64_t begin, int64_t end) {
    Scratch& scr = scratch();
    for (int64_t item = begin; item < end; ++item) attend(scr, item, 0, kAllSplits, nullptr);
  };
  const int64_t items = tiles * Hkv;
  const int64_t threads = at::get_num_threads();
  if (longest_first) {
    parallel_guided(items, run);
    return out;
  }
  if (threads <= 1) {
    run(0, items);
    return out;
  }
  // Decode batches and verify steps (few items): a static split over (item, key split) units, cut
  // where the keys to read (the work) are halved: an even split of items by count put a
  // 2,150-token request's every KV head on one thread and a 150-token neighbour's on the other,
  // and the long request decoded at one thread's speed (SmolLM2, 2 threads: 16.5 ms per token
  // beside a short request vs 12.7 alone); whole items still left one thread two of SmolLM2's
  // three heads of a lone long request, and of a lone request's 2-8-token verify tile (T(2) at
  // 8,000 keys 2.8 x T(1)). An item's unit s is split s of each of its tokens' key lists.
  std::vector<int64_t> keys(T), first(items + 1, 0), room(items + 1, 0);  // keys of each token; first unit and partials of each item
  for (int64_t t = 0; t < T; ++t) {
    const bool* allowed = mp + qip[t] * L;
    keys[t] = std::count(allowed, allowed + L, true);
  }
  std::vector<int64_t> splits(tiles, 0);  // of each tile's longest list
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t u = tile_start[t]; u < tile_start[t + 1]; ++u) splits[t] = std::max(splits[t], attn_splits(keys[u]));
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / Hkv;
    first[i + 1] = first[i] + splits[t];
    room[i + 1] = room[i] + splits[t] * (tile_start[t + 1] - tile_start[t]);
  }
  const int64_t units = first[items];
  std::vector<int64_t> work(units + 1, 0);  // keys (+ 1 per unit) of units [0, u)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / Hkv;
    for (int64_t s = 0; s < splits[t]; ++s) {
      int64_t k = 1;
      for (int64_t u = tile_start[t]; u < tile_start[t + 1]; ++u)
        k += std::clamp<int64_t>(keys[u] - s * kAttnSplitKeys, 0, kAttnSplitKeys);
      work[first[i] + s + 1] = work[first[i] + s] + k;
    }
  }
  const double total = static_cast<double>(work[units]);
  const int64_t shares = std::min(threads, units);
  std::vector<int64_t> cut(shares + 1, units);
  cut[0] = 0;
  for (int64_t u = 0, th = 1; u < units && th < shares; ++u) {
    const double mid = 0.5 * (work[u] + work[u + 1]);
    while (th < shares && mid >= total * th / shares) cut[th++] = u;  // unit u's middle lies in a later share
  }
  std::vector<char> is_shared(items, 0);  // items cut between shares
  bool any_shared = false;
  for (int64_t i = 0, th = 1; i < items; ++i) {
    while (th < shares && cut[th] <= first[i]) ++th;
    is_shared[i] = th < shares && cut[th] < first[i + 1];
    any_shared |= is_shared[i] != 0;
  }
  std::vector<float> parts;  // their partials: [item's room][G * (2 + D)]
  if (any_shared) parts.resize(room[items] * unit);
  const auto share = [&](int64_t sh) {
    Scratch& scr = scratch();
    int64_t u = cut[sh];
    const int64_t e = cut[sh + 1];
    int64_t i = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
    for (; u < e; ++i) {
      const int64_t j0 = u - first[i], j1 = std::min(e, first[i + 1]) - first[i];
      attend(scr, i, j0, j1, is_shared[i] ? parts.data() + room[i] * unit : nullptr);
      u = first[i] + j1;
    }
  };
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t sh = s0; sh < s1; ++sh) share(sh);
  });
  for (int64_t i = 0; i < items; ++i) {  // the shared items' tokens, each merged in split order from its partials
    if (!is_shared[i]) continue;
    const int64_t t = i / Hkv;
    for (int64_t u = tile_start[t]; u < tile_start[t + 1]; ++u) {
      const float* part = parts.data() + (room[i] + (u - tile_start[t]) * splits[t]) * unit;
      merge_splits(attn_splits(keys[u]), G, D, part, part + G, unit, part + 2 * G, unit, op + (u * Hq + i % Hkv * G) * D);
    }
  }
  return out;
}

// Native paged attention over a float32, float16 or int8 cache (k and v of one type; int8 with
// its float32 [blocks, block_size, n_kv] k and v scales); q is float32.
// paged_attention writing into `out` where one is given (output_into).
torch::Tensor paged_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& mask, const torch::Tensor& query_index,
                                   double scale, const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                                   const torch::Tensor* out) {
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == kt &&
                  (kt == torch::kFloat32 || kt == torch::kHalf || kt == torch::kChar),
              "paged_attention: a float32 query and float32, float16 or int8 caches");
  const bool int8 = kt == torch::kChar;
  TORCH_CHECK(k_scale.has_value() == int8 && v_scale.has_value() == int8, "paged_attention: k and v scales with (only) an int8 cache");
  if (int8) {
    const auto& ks = *k_scale;
    const auto& vs = *v_scale;
    TORCH_CHECK(ks.scalar_type() == torch::kFloat32 && vs.scalar_type() == torch::kFloat32 && ks.is_contiguous() && vs.is_contiguous() &&
                    ks.dim() == 3 && ks.sizes() == vs.sizes() && ks.size(0) == k_cache.size(0) && ks.size(1) == k_cache.size(1) &&
                    ks.size(2) == k_cache.size(2),
                "paged_attention: contiguous float32 [blocks, block_size, n_kv] scales");
    return paged_attention_t<int8_t>(q, k_cache, v_cache, block_tables, mask, query_index, scale, ks.data_ptr<float>(),
                                     vs.data_ptr<float>(), out);
  }
  if (kt == torch::kHalf) return paged_attention_t<c10::Half>(q, k_cache, v_cache, block_tables, mask, query_index, scale, nullptr, nullptr, out);
  return paged_attention_t<float>(q, k_cache, v_cache, block_tables, mask, query_index, scale, nullptr, nullptr, out);
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& mask, const torch::Tensor& query_index,
                              double scale, const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  return paged_attention_into(q, k_cache, v_cache, block_tables, mask, query_index, scale, k_scale, v_scale, nullptr);
}

// The 8-row interleaved layout of Q4_K / Q6_K / Q8_0 / Q5_0 / Q4_0 / Q4_1 rows (see "Interleaved K-quants" above).
// One block of a GGUF row decoded to float32 in specserve.models.gguf_quants's arithmetic (ggml's
// reference order), so the values are bit-identical to decoding the whole tensor there: no fused
// multiply-add (q * d + m rounds the product first).
__attribute__((optimize("fp-contract=off"))) void dequantize_block(int64_t qtype, const uint8_t* blk, float* out) {
  switch (qtype) {
    case kQ4_0: {  // [f16 d][16 bytes of nibbles]: (q - 8) * d, value j low nibble of byte j, j + 16 high
      const float d = half_to_float(blk);
      for (int j = 0; j < 16; ++j) {
        out[j] = (static_cast<float>(blk[2 + j] & 15) - 8.0f) * d;
        out[j + 16] = (static_cast<float>(blk[2 + j] >> 4) - 8.0f) * d;
      }
      break;
    }
    case kQ4_1: {  // [f16 d][f16 m][16 bytes of nibbles]: q * d + m
      const float d = half_to_float(blk), m = half_to_float(blk + 2);
      for (int j = 0; j < 16; ++j) {
        const float lo = static_cast<float>(blk[4 + j] & 15) * d, hi = static_cast<float>(blk[4 + j] >> 4) * d;
        out[j] = lo + m;
        out[j + 16] = hi + m;
      }
      break;
    }
    case kQ5_0: {  // [f16 d][u32 fifth bits][16 bytes of nibbles]: (q - 16) * d
      const float d = half_to_float(blk);
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      for (int j = 0; j < 16; ++j) {
        const int lo = (blk[6 + j] & 15) | (((qh >> j) & 1) << 4);
        const int hi = (blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = (static_cast<float>(lo) - 16.0f) * d;
        out[j + 16] = (static_cast<float>(hi) - 16.0f) * d;
      }
      break;
    }
    case kQ8_0: {  // [f16 d][32 int8]: q * d
      const float d = half_to_float(blk);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
      break;
    }
    case kQ4_K: {  // [f16 d][f16 dmin][12 bytes of 6-bit scales/mins][128 bytes of nibbles]: q * (d * sc) - dmin * mn
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      const uint8_t *a = blk + 4, *b = blk + 8, *c = blk + 12, *q = blk + 16;
      for (int s = 0; s < 8; ++s) {
        const int sc = s < 4 ? a[s] & 63 : (c[s - 4] & 15) | ((a[s - 4] >> 6) << 4);
        const int mn = s < 4 ? b[s] & 63 : (c[s - 4] >> 4) | ((b[s - 4] >> 6) << 4);
        const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(mn);
        const uint8_t* run = q + 32 * (s / 2);  // sub-blocks 2c and 2c + 1: low and high nibbles of run c
        for (int l = 0; l < 32; ++l) {
          const float v = static_cast<float>(s % 2 ? run[l] >> 4 : run[l] & 15) * scale;
          out[32 * s + l] = v - offset;
        }
      }
      break;
    }
    case kQ6_K: {  // [128 bytes low nibbles][64 bytes 2-bit highs][16 int8 scales][f16 d]: (q - 32) * (d * sc)
      const float d = half_to_float(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 4; ++k) {
          const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
          const uint8_t* qh = blk + 128 + 32 * h;
          for (int l = 0; l < 32; ++l) {
            const int idx = 128 * h + 32 * k + l;
            const int q = (k < 2 ? ql[l] & 15 : ql[l] >> 4) | (((qh[l] >> (2 * k)) & 3) << 4);
            out[idx] = (static_cast<float>(q) - 32.0f) * (d * static_cast<float>(sc[idx / 16]));
          }
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "dequantize_rows: unsupported GGML type ", qtype);
  }
}

// Rows `ids` of a matrix in GGUF blocks (uint8 [N, row_bytes], the file's layout) as float32
// [len(ids), cols]: an embedding lookup without decoding the table.
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t qtype, const torch::Tensor& ids, int64_t cols) {
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ6_K || qtype == kQ8_0 || qtype == kQ5_0 || qtype == kQ4_0 || qtype == kQ4_1,
              "dequantize_rows: Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 or Q4_1");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.device().is_cpu(),
              "dequantize_rows: contiguous CPU uint8 [N, row_bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "dequantize_rows: ids must be int64 [n]");
  const TypeInfo info = type_info(qtype);
  TORCH_CHECK(cols > 0 && cols % info.block_values == 0 && w.size(1) == cols / info.block_values * info.block_bytes,
              "dequantize_rows: ", cols, " columns do not match rows of ", w.size(1), " bytes");
  const auto idx = ids.contiguous();
  const int64_t n = idx.size(0), nb = cols / info.block_values, row_bytes = w.size(1), rows = w.size(0);
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // (IndexError in Python, as nn.Embedding raises)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < rows, "token id ", id[i], " out of range for an embedding of ", rows, " rows");
  auto out = torch::empty({n, cols}, torch::kFloat32);
  const uint8_t* base = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = base + id[r] * row_bytes;
      for (int64_t b = 0; b < nb; ++b) dequantize_block(qtype, row + b * info.block_bytes, dst + r * cols + b * info.block_values);
    }
  });
  return out;
}

torch::Tensor interleave_rows(const torch::Tensor& w, int64_t qtype, bool paired) {
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ6_K || qtype == kQ8_0 || qtype == kQ5_0 || qtype == kQ4_0 || qtype == kQ4_1,
              "interleave_rows: Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 or Q4_1");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(0) % 8 == 0,
              "interleave_rows: contiguous uint8 [N, row_bytes] with N a multiple of 8");
  TORCH_CHECK(!paired || w.size(0) % 16 == 0, "interleave_rows: pairing groups needs N a multiple of 16");
  const TypeInfo in = type_info(qtype), out_info = type_info(qtype + 100);
  TORCH_CHECK(w.size(1) % in.block_bytes == 0, "interleave_rows: row bytes are not whole blocks");
  const int64_t G = w.size(0) / 8, nb = w.size(1) / in.block_bytes, row_bytes = w.size(1);
  auto out = paired ? torch::empty({G / 2, 2 * nb * out_info.block_bytes}, w.options())
                    : torch::empty({G, nb * out_info.block_bytes}, w.options());
  const uint8_t* src_base = w.data_ptr<uint8_t>();
  uint8_t* out_base = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    uint8_t vals[8][256];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src[8];
        for (int r = 0; r < 8; ++r) src[r] = src_base + (8 * g + r) * row_bytes + b * in.block_bytes;
        const int64_t slot = paired ? (g / 2) * 2 * nb + 2 * b + g % 2 : g * nb + b;  // paired: blocks alternate
        uint8_t* dst = out_base + slot * out_info.block_bytes;
        if (qtype == kQ8_0 || qtype == kQ5_0 || qtype == kQ4_0 || qtype == kQ4_1) {
          for (int r = 0; r < 8; ++r) std::memcpy(dst + 2 * r, src[r], 2);
          if (qtype == kQ4_1)
            for (int r = 0; r < 8; ++r) std::memcpy(dst + 16 + 2 * r, src[r] + 2, 2);
          if (qtype == kQ8_0) {
            for (int i = 0; i < 8; ++i)
              for (int r = 0; r < 8; ++r) std::memcpy(dst + 16 + 32 * i + 4 * r, src[r] + 2 + 4 * i, 4);
            continue;
          }
          const int qs = qtype == kQ4_0 ? 2 : qtype == kQ4_1 ? 4 : 6;
          const int64_t at = qtype == kQ4_1 ? 32 : 16;  // where the interleaved nibbles start
          for (int r = 0; r < 8; ++r) {
            uint32_t qh = 0;
            if (qtype == kQ5_0) std::memcpy(&qh, src[r] + 2, 4);
            for (int j = 0; j < 16; ++j) {
              vals[r][j] = (src[r][qs + j] & 0xF) | (((qh >> j) & 1) << 4);
              vals[r][j + 16] = (src[r][qs + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            }
          }
          for (int i = 0; i < 4; ++i)
            for (int r = 0; r < 8; ++r)
              for (int k = 0; k < 4; ++k)
                dst[at + 32 * i + 4 * r + k] =
                    static_cast<uint8_t>((vals[r][8 * i + k] & 0xF) | ((vals[r][8 * i + 4 + k] & 0xF) << 4));
          if (qtype != kQ5_0) continue;
          for (int r = 0; r < 8; ++r)
            for (int k = 0; k < 4; ++k) {
              int byte = 0;
              for (int v = 0; v < 8; ++v) byte |= (vals[r][4 * v + k] >> 4) << v;
              dst[144 + 4 * r + k] = static_cast<uint8_t>(byte);
            }
        } else if (qtype == kQ4_K) {
          uint8_t sc[8][8], mn[8][8];
          for (int r = 0; r < 8; ++r) {
            std::memcpy(dst + 2 * r, src[r], 2);
            std::memcpy(dst + 16 + 2 * r, src[r] + 2, 2);
            q4k_scales(src[r] + 4, sc[r], mn[r]);
            for (int c = 0; c < 4; ++c)
              for (int l = 0; l < 32; ++l) {
                const uint8_t byte = src[r][16 + 32 * c + l];
                vals[r][64 * c + l] = byte & 0xF;
                vals[r][64 * c + 32 + l] = byte >> 4;
              }
            for (int p = 0; p < 4; ++p)
              for (int e = 0; e < 2; ++e) dst[32 + 16 * p + 2 * r + e] = mn[r][2 * p + e];
          }
          for (int j = 0; j < 8; ++j) {
            uint8_t* sub = dst + 96 + 136 * j;
            for (int r = 0; r < 8; ++r) sub[r] = sc[r][j];
            for (int i = 0; i < 4; ++i)
              for (int r = 0; r < 8; ++r)
                for (int k = 0; k < 4; ++k)
                  sub[8 + 32 * i + 4 * r + k] =
                      static_cast<uint8_t>(vals[r][32 * j + 8 * i + k] | (vals[r][32 * j + 8 * i + 4 + k] << 4));
          }
        } else {
          for (int r = 0; r < 8; ++r) {
            std::memcpy(dst + 2 * r, src[r] + 208, 2);
            const uint8_t* ql = src[r];
            const uint8_t* qh = src[r] + 128;
            for (int h = 0; h < 2; ++h)
              for (int l = 0; l < 32; ++l) {
                const uint8_t a = ql[64 * h + l], bb = ql[64 * h + 32 + l], t = qh[32 * h + l];
                vals[r][128 * h + l] = (a & 0xF) | ((t & 3) << 4);
                vals[r][128 * h + 32 + l] = (bb & 0xF) | (((t >> 2) & 3) << 4);
                vals[r][128 * h + 64 + l] = (a >> 4) | (((t >> 4) & 3) << 4);
                vals[r][128 * h + 96 + l] = (bb >> 4) | (((t >> 6) & 3) << 4);
              }
          }
          for (int c = 0; c < 8; ++c) {
            uint8_t* chunk = dst + 16 + 208 * c;
            for (int r = 0; r < 8; ++r)
              for (int e = 0; e < 2; ++e) chunk[2 * r + e] = src[r][192 + 2 * c + e];
            for (int i = 0; i < 4; ++i)
              for (int r = 0; r < 8; ++r)
                for (int k = 0; k < 4; ++k)
                  chunk[16 + 32 * i + 4 * r + k] =
                      static_cast<uint8_t>((vals[r][32 * c + 8 * i + k] & 0xF) | ((vals[r][32 * c + 8 * i + 4 + k] & 0xF) << 4));
            for (int h = 0; h < 2; ++h)
              for (int r = 0; r < 8; ++r)
                for (int k = 0; k < 4; ++k) {
                  int byte = 0;
                  for (int f = 0; f < 4; ++f) byte |= (vals[r][32 * c + 16 * h + 4 * f + k] >> 4) << (2 * f);
                  chunk[144 + 32 * h + 4 * r + k] = static_cast<uint8_t>(byte);
                }
          }
        }
      }
    }
  });
  return out;
}

// Store the new tokens' keys and values [T, Hkv, D] into their cache slots (float32 cache).
// An int8 cache's quantization of one (token, head) row of d values, as specserve.attention.quantize_kv
// computes it: scale = max(amax |x|, 1e-8) / 127, q = round-half-even(x / scale) clamped to +-127.
inline void quantize_row(const float* x, int64_t d, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float sc = std::max(amax, 1e-8f) / 127.0f;
  for (int64_t i = 0; i < d; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / sc), -127.f, 127.f));
  *scale = sc;
}

void write_kv_slots(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                    const torch::Tensor& slots, torch::Tensor* k_scale = nullptr, torch::Tensor* v_scale = nullptr) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv: slot ", sp[t], " outside the cache");
  for (auto [src, dst, scl] : {std::tuple{&k, &k_cache, k_scale}, std::tuple{&v, &v_cache, v_scale}}) {
    const float* s = src->data_ptr<float>();
    const int64_t ts = src->stride(0);
    if (dst->scalar_type() == torch::kChar) {  // per (token, head): int8 values and their float32 scale
      const int64_t heads = src->size(1), d = src->size(2);
      int8_t* d8 = dst->data_ptr<int8_t>();
      float* sc = scl->data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h) quantize_row(s + t * ts + h * d, d, d8 + sp[t] * row + h * d, sc + sp[t] * heads + h);
      continue;
    }
    if (dst->scalar_type() == torch::kHalf) {  // rounded to nearest even, as torch's .to(float16)
      c10::Half* d = dst->data_ptr<c10::Half>();
      for (int64_t t = 0; t < T; ++t) {
        const float* a = s + t * ts;
        c10::Half* b = d + sp[t] * row;
        int64_t i = 0;
#if SPECSERVE_AVX2
        for (; i + 8 <= row; i += 8)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(b + i), _mm256_cvtps_ph(_mm256_loadu_ps(a + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < row; ++i) b[i] = c10::Half(a[i]);
      }
      continue;
    }
    float* d = dst->data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) std::memcpy(d + sp[t] * row, s + t * ts, row * sizeof(float));
  }
}

// x += y, both float32 [M, H] contiguous.
void add_(torch::Tensor& x, const torch::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) xp[i] += yp[i];
}

// A whole decoder stack (pre-norm Llama/Qwen2 blocks with block-quantized projections and a
// float32, float16 or int8 paged KV cache) in one call: the per-layer Python of the module path (module calls,
// views, residual adds: ~0.15 ms a layer, several ms of a ~45 ms decode step) disappears.
// It runs the very same kernels in the same order as that path, so results are bit-identical.
class DecoderStack {
 public:
  // Per layer, in this order: weights [input_norm, q, k, v, o, post_norm, gate, up, down],
  // qtypes [q, k, v, o, gate, up, down], biases [q, k, v] (None where absent).
  DecoderStack(std::vector<torch::Tensor> weights, std::vector<int64_t> qtypes, std::vector<c10::optional<torch::Tensor>> biases,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : w_(std::move(weights)), qt_(std::move(qtypes)), b_(std::move(biases)), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps) {
    layers_ = static_cast<int64_t>(w_.size()) / 9;
    TORCH_CHECK(layers_ > 0 && static_cast<int64_t>(w_.size()) == 9 * layers_ && static_cast<int64_t>(qt_.size()) == 7 * layers_ &&
                    static_cast<int64_t>(b_.size()) == 3 * layers_, "DecoderStack: 9 weights, 7 qtypes and 3 biases per layer");
  }

  int64_t num_layers() const { return layers_; }

  // x [T, hidden] -> hidden states after the last layer (before the final norm); kv holds
  // (k_cache, v_cache) per layer; the rest is the step's attention metadata.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                        std::vector<torch::Tensor> kv, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& mask, const torch::Tensor& query_index, double scale) {
    return run(x_in, positions, cos, sin, std::move(kv), slot_mapping, block_tables, mask, query_index, scale, {}, nullptr);
  }

  // forward, also keeping the residual stream after each layer count in `capture` (ascending,
  // within [1, layers)): [those streams..., the last layer's output]. One call where splitting
  // the stack at those layers took three (0.35 ms more of a 3.7 ms SmolLM2 step); the same
  // kernels in the same order, so every tensor is bit-identical to the split calls'.
  std::vector<torch::Tensor> forward_capturing(const torch::Tensor& x_in, const torch::Tensor& positions, const torch::Tensor& cos,
                                               const torch::Tensor& sin, std::vector<torch::Tensor> kv, const torch::Tensor& slot_mapping,
                                               const torch::Tensor& block_tables, const torch::Tensor& mask, const torch::Tensor& query_index,
                                               double scale, const std::vector<int64_t>& capture) {
    for (size_t i = 0; i < capture.size(); ++i)
      TORCH_CHECK(capture[i] > 0 && capture[i] < layers_ && (i == 0 || capture[i] > capture[i - 1]),
                  "DecoderStack: capture layers must ascend within [1, ", layers_, ")");
    std::vector<torch::Tensor> out;
    out.push_back(run(x_in, positions, cos, sin, std::move(kv), slot_mapping, block_tables, mask, query_index, scale, capture, &out));
    return out;
  }

 private:
  torch::Tensor run(const torch::Tensor& x_in, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                    std::vector<torch::Tensor> kv, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& mask, const torch::Tensor& query_index, double scale, const std::vector<int64_t>& capture,
                    std::vector<torch::Tensor>* captured) {
    const int64_t parts = layers_ > 0 ? static_cast<int64_t>(kv.size()) / layers_ : 0;
    TORCH_CHECK(static_cast<int64_t>(kv.size()) == parts * layers_ && (parts == 2 || parts == 4),
                "DecoderStack: one (k, v) cache pair per layer (int8: k, v, k scales, v scales)");
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "DecoderStack: float32 [T, hidden] input");
    auto x = x_in.contiguous().clone();
    const int64_t T = x.size(0), qs = hq_ * d_, ks = hkv_ * d_;
    const auto slots = slot_mapping.contiguous().to(torch::kInt64);
    TORCH_CHECK(slots.numel() == T, "DecoderStack: one slot per token");
    // Every layer's outputs go to buffers made once here (q/k/v and the attention's rows are
    // views made once): at one token a layer's new tensors and views cost more than the work they
    // hold, and after a layer's weights have streamed through the caches the allocator's and the
    // dispatcher's memory is cold. SmolLM2 greedy decoding on a 2-vCPU Xeon, old and new
    // processes alternating: 122-180 -> 140-207 tok/s (+10-30%, five pairs); Qwen 1.5B and 0.5B
    // unchanged. The kernels and their order are the same, so every value is too.
    const int64_t hidden = x.size(1), inter = w_[8].size(1) / type_info(qt_[6]).block_bytes * type_info(qt_[6]).block_values;
    auto h = torch::empty({T, hidden}, x.options());
    auto qkv = torch::empty({T, qs + 2 * ks}, x.options());
    auto proj = torch::empty({T, hidden}, x.options());
    auto act = torch::empty({T, inter}, x.options());
    auto q = qkv.narrow(1, 0, qs).view({T, hq_, d_});
    auto k = qkv.narrow(1, qs, ks).view({T, hkv_, d_});
    auto v = qkv.narrow(1, qs + ks, ks).view({T, hkv_, d_});
    auto att = torch::empty({T, hq_, d_}, x.options());
    auto att_rows = att.view({T, qs});
    for (int64_t l = 0; l < layers_; ++l) {
      const torch::Tensor* w = w_.data() + 9 * l;
      const int64_t* qt = qt_.data() + 7 * l;
      auto& kc = kv[parts * l];
      auto& vc = kv[parts * l + 1];
      TORCH_CHECK((kc.scalar_type() == torch::kFloat32 || kc.scalar_type() == torch::kHalf || kc.scalar_type() == torch::kChar) &&
                      vc.scalar_type() == kc.scalar_type() && (parts == 4) == (kc.scalar_type() == torch::kChar) && kc.is_contiguous() &&
                      vc.is_contiguous() && kc.size(2) == hkv_ && kc.size(3) == d_,
                  "DecoderStack: contiguous float32, float16 or int8 (with scales) [blocks, block_size, n_kv, d] caches");
      c10::optional<torch::Tensor> kscl, vscl;
      if (parts == 4) {
        kscl = kv[parts * l + 2];
        vscl = kv[parts * l + 3];
        TORCH_CHECK(kscl->scalar_type() == torch::kFloat32 && vscl->scalar_type() == torch::kFloat32 && kscl->is_contiguous() &&
                        vscl->is_contiguous() && kscl->numel() == kc.size(0) * kc.size(1) * hkv_ && vscl->numel() == kscl->numel(),
                    "DecoderStack: contiguous float32 [blocks, block_size, n_kv] scales");
      }
      rms_norm_into(x, w[0], eps_, &h);
      qmatmul_multi_into(h, {w[1], w[2], w[3]}, {qt[0], qt[1], qt[2]}, {b_[3 * l], b_[3 * l + 1], b_[3 * l + 2]}, false, &qkv);
      rope_(q, k, cos, sin, positions);
      write_kv_slots(k, v, kc, vc, slots, kscl ? &*kscl : nullptr, vscl ? &*vscl : nullptr);
      paged_attention_into(q, kc, vc, block_tables, mask, query_index, scale, kscl, vscl, &att);
      qmatmul_multi_into(att_rows, {w[4]}, {qt[3]}, {c10::nullopt}, false, &proj);
      add_(x, proj);
      rms_norm_into(x, w[5], eps_, &h);
      qmatmul_multi_into(h, {w[6], w[7]}, {qt[4], qt[5]}, {c10::nullopt, c10::nullopt}, true, &act);
      qmatmul_multi_into(act, {w[8]}, {qt[6]}, {c10::nullopt}, false, &proj);
      add_(x, proj);
      if (captured != nullptr && std::binary_search(capture.begin(), capture.end(), l + 1)) captured->push_back(x.clone());
    }
    return x;
  }

  std::vector<torch::Tensor> w_;
  std::vector<int64_t> qt_;
  std::vector<c10::optional<torch::Tensor>> b_;
  int64_t layers_ = 0, hq_, hkv_, d_;
  double eps_;
};

// u8 x s8 multiply-adds per second of all threads through the kernels' widest int8 instruction
// (AVX2 vpmaddubsw, or vpdpbusd with VNNI: 32 per 256-bit instruction, 64 per 512-bit one where
// the multi-row passes use AVX-512), 12 independent chains so latency never limits it: the compute
// roof under the verify-cost curve (bench/roofline.py). The chains live in registers through each
// burst: kept in an array, GCC stored each one to the stack after every instruction, and the loop
// measured the store port instead, under half the multiply rate of a Zen 3 (82 against 183 GMAC/s a core).
#if SPECSERVE_AVX2
template <typename V, typename Op>
__attribute__((noinline)) void int8_burst(V* acc, V b, Op op) {
  V r0 = acc[0], r1 = acc[1], r2 = acc[2], r3 = acc[3], r4 = acc[4], r5 = acc[5];
  V r6 = acc[6], r7 = acc[7], r8 = acc[8], r9 = acc[9], r10 = acc[10], r11 = acc[11];
  for (int it = 0; it < 4096; ++it) {
    r0 = op(r0, b), r1 = op(r1, b), r2 = op(r2, b), r3 = op(r3, b), r4 = op(r4, b), r5 = op(r5, b);
    r6 = op(r6, b), r7 = op(r7, b), r8 = op(r8, b), r9 = op(r9, b), r10 = op(r10, b), r11 = op(r11, b);
    // Even so GCC 12 stored half the chains every iteration; this empty asm pins them in registers.
    asm volatile("" : "+v"(r0), "+v"(r1), "+v"(r2), "+v"(r3), "+v"(r4), "+v"(r5));
    asm volatile("" : "+v"(r6), "+v"(r7), "+v"(r8), "+v"(r9), "+v"(r10), "+v"(r11));
  }
  acc[0] = r0, acc[1] = r1, acc[2] = r2, acc[3] = r3, acc[4] = r4, acc[5] = r5;
  acc[6] = r6, acc[7] = r7, acc[8] = r8, acc[9] = r9, acc[10] = r10, acc[11] = r11;
}
#endif

double int8_peak(double seconds) {
#if SPECSERVE_AVX2
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::atomic<int64_t> instructions{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#if SPECSERVE_AVX512
    __m512i acc[12];
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_epi8(static_cast<char>(j + 1));
    const __m512i b = _mm512_set1_epi8(3);
    const auto op = [](__m512i a, __m512i c) { return _mm512_dpbusd_epi32(a, a, c); };
#else
    __m256i acc[12];
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_epi8(static_cast<char>(j + 1));
    const __m256i b = _mm256_set1_epi8(3);
#if SPECSERVE_VNNI
    const auto op = [](__m256i a, __m256i c) { return _mm256_dpbusd_epi32(a, a, c); };
#else
    const auto op = [](__m256i a, __m256i c) { return _mm256_maddubs_epi16(a, c); };
#endif
#endif
    int64_t n = 0;
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
      int8_burst(acc, b, op);
      n += 4096 * 12;
    }
#if SPECSERVE_AVX512
    __m512i sink = acc[0];
    for (int j = 1; j < 12; ++j) sink = _mm512_xor_si512(sink, acc[j]);
    const int lane0 = _mm_extract_epi8(_mm512_castsi512_si128(sink), 0);
#else
    __m256i sink = acc[0];
    for (int j = 1; j < 12; ++j) sink = _mm256_xor_si256(sink, acc[j]);
    const int lane0 = _mm256_extract_epi8(sink, 0);
#endif
    instructions += n + (lane0 == 0x7f ? 1 : 0);  // keep the chains alive
  });
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(instructions.load()) * (SPECSERVE_AVX512 ? 64.0 : 32.0) / elapsed;
#else
  (void)seconds;
  return 0.0;
#endif
}

bool has_avx2() { return SPECSERVE_AVX2 != 0; }
bool has_avx512() { return SPECSERVE_AVX512 != 0; }

// Activation rows from which the multi-row passes take two 8-row groups per 512-bit pass (0 where
// the build has no AVX-512 path); set_wide_min_rows returns the previous value.
int64_t wide_min_rows() {
#if SPECSERVE_AVX512
  return g_wide_min_rows.load();
#else
  return 0;
#endif
}

int64_t set_wide_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "wide passes start at one activation row or more, got ", rows);
#if SPECSERVE_AVX512
  return g_wide_min_rows.exchange(static_cast<int>(std::min<int64_t>(rows, kPassRows + 1)));
#else
  return 0;
#endif
}
bool has_vnni() { return SPECSERVE_VNNI != 0; }

// Activation rows from which an AVX2 build without VNNI takes two Q4_K groups per pass (0: never,
// and always 0 where the build has VNNI); set_pair_min_rows returns the previous value.
int64_t pair_min_rows() {
#if SPECSERVE_AVX2
  return g_pair_min_rows.load();
#else
  return 0;
#endif
}

int64_t set_pair_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "paired passes start at zero (never) or more activation rows, got ", rows);
#if SPECSERVE_AVX2 && !SPECSERVE_VNNI
  return g_pair_min_rows.exchange(static_cast<int>(std::min<int64_t>(rows, kPassRows + 1)));
#else
  return 0;
#endif
}

// Whether passes can take the AMX tiles (compiled in and granted by the kernel), and the
// activation rows from which they do (0: never); set_amx_min_rows returns the previous value.
bool has_amx() {
#if SPECSERVE_AMX
  return amx_ready();
#else
  return false;
#endif
}

int64_t amx_min_rows() {
#if SPECSERVE_AMX
  return amx_ready() ? g_amx_min_rows.load() : 0;
#else
  return 0;
#endif
}

int64_t set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "AMX passes start at 0 (never) or a positive number of activation rows, got ", rows);
#if SPECSERVE_AMX
  return g_amx_min_rows.exchange(static_cast<int>(std::min<int64_t>(rows, kPassRows + 1)));
#else
  return 0;
#endif
}

// Prefetch distance in bytes (0 turns software prefetch off) of one-row passes, or of passes over
// several activation rows; returns the previous one.
int64_t set_prefetch_distance(int64_t bytes, bool multi_row) {
#if SPECSERVE_AVX2
  TORCH_CHECK(bytes >= 0 && bytes <= (1 << 20), "prefetch distance must be in [0, 1 MiB], got ", bytes);
  return (multi_row ? g_prefetch_ahead_rows : g_prefetch_ahead).exchange(bytes);
#else
  return 0;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "y = x @ W^T + bias, W in a GGUF block format", py::arg("x"), py::arg("w"), py::arg("qtype"),
        py::arg("bias") = py::none());
  m.def("qmatmul_multi", &qmatmul_multi, "several products of one input, concatenated (or silu(first) * second)",
        py::arg("x"), py::arg("ws"), py::arg("qtypes"), py::arg("biases"), py::arg("silu_mul") = false);
  m.def("argmax_rows", &argmax_rows, "each row's argmax (first of equal values; NaN counts as the largest)", py::arg("x"));
  m.def("truncate_rows", &truncate_rows, "sampling's temperature, min-p, top-k and top-p per row (-inf where dropped; with probs, "
        "the softmax of that), and whether every row was answered", py::arg("x"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("probs") = false);
  m.def("sample_rows", &sample_rows, "per row, truncate_rows' probabilities then inverse_cdf_rows' draw with u, in a scratch row: "
        "(tokens, ok)", py::arg("x"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::arg("greedy_eps"));
  m.def("inverse_cdf_rows", &inverse_cdf_rows, "per row, the first index whose float64 running sum reaches u times the row's sum, "
        "and whether every row was answered", py::arg("p"), py::arg("u"));
  m.def("topk_rows", &topk_rows, "each row's k largest values (descending, the first of equal ones first), their indices, "
        "the row's logsumexp, and whether every row was answered (no NaN or +inf, k values above -inf)", py::arg("x"), py::arg("k"));
  m.def("rms_norm", &rms_norm, "RMSNorm of each row", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rope_", &rope_, "rotate-half RoPE in place", py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("positions"));
  m.def("paged_attention", &paged_attention, "attention of a few tokens per request over the paged KV cache", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("mask"), py::arg("query_index"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("interleave_rows", &interleave_rows, "Q4_K/Q6_K/Q8_0/Q5_0/Q4_0/Q4_1 rows -> the 8-row interleaved layout (paired: two groups "
        "per row, blocks alternating)", py::arg("w"), py::arg("qtype"), py::arg("paired") = false);
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGUF block matrix as float32 (bit-identical to decoding it whole)",
        py::arg("w"), py::arg("qtype"), py::arg("ids"), py::arg("cols"));
  m.def("has_avx2", &has_avx2, "whether the AVX2 kernels were compiled in");
  m.def("int8_peak", &int8_peak, "u8 x s8 multiply-adds per second of all threads (widest int8 instruction)",
        py::arg("seconds") = 0.5, py::call_guard<py::gil_scoped_release>());
  m.def("has_vnni", &has_vnni, "whether the interleaved kernels use AVX512-VNNI");
  m.def("has_amx", &has_amx, "whether wide passes over Q4_K can use the AMX tiles (compiled in and granted)");
  m.def("amx_min_rows", &amx_min_rows, "activation rows from which passes take the AMX tiles (0: never)");
  m.def("set_amx_min_rows", &set_amx_min_rows, "activation rows from which passes take the AMX tiles (0: never); returns the old value",
        py::arg("rows"));
  m.def("has_avx512", &has_avx512, "whether multi-row passes take two 8-row groups in 512-bit registers");
  m.def("wide_min_rows", &wide_min_rows, "activation rows from which passes go 512 bits wide (0: no AVX-512 path)");
  m.def("set_wide_min_rows", &set_wide_min_rows, "activation rows from which passes go 512 bits wide; returns the old value",
        py::arg("rows"));
  m.def("pair_min_rows", &pair_min_rows, "activation rows from which AVX2 passes take two Q4_K groups at once (0: never)");
  m.def("set_pair_min_rows", &set_pair_min_rows,
        "activation rows from which AVX2 passes take two Q4_K groups at once (0: never); returns the old value", py::arg("rows"));
  m.def("set_prefetch_distance", &set_prefetch_distance,
        "software prefetch distance in bytes (0: off) of one-row passes, or of multi-row ones; returns the old one",
        py::arg("bytes"), py::arg("multi_row") = false);
  py::class_<DecoderStack>(m, "DecoderStack", "a whole decoder stack with block-quantized projections, one call per step")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<c10::optional<torch::Tensor>>, int64_t, int64_t, int64_t,
                    double>(),
           py::arg("weights"), py::arg("qtypes"), py::arg("biases"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("eps"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, "hidden states after the last layer (before the final norm)", py::arg("x"),
           py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("mask"), py::arg("query_index"), py::arg("scale"), py::call_guard<py::gil_scoped_release>())
      .def("forward_capturing", &DecoderStack::forward_capturing,
           "forward, with the residual stream after each of the `capture` layer counts: [streams..., hidden states]", py::arg("x"),
           py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("mask"), py::arg("query_index"), py::arg("scale"), py::arg("capture"), py::call_guard<py::gil_scoped_release>());
}
