// Decode attention over the KV cache on CPU: one query token per sequence, reading the cache in its own dtype.
//
// torch.ops.alchemist.decode_attention(q, k, v, k_cache, v_cache, slots, positions, scale) -> out
//   q:        (N, H, D)             one query row per decoding sequence, RoPE applied (fp32 or bf16)
//   k, v:     (N, Hkv, D)           the rows' new key (RoPE applied) and value, written into the cache first
//   k_cache:  (S, Hkv, Lmax, D)     one layer of the per-slot cache (alchemist.model.attention.KVCache), q's dtype
//   v_cache:  (S, Hkv, Lmax, D)
//   slots:    (N,) int64            each row's slot (distinct)
//   positions:(N,) int64            each row's position: it attends to cached keys 0 .. position
//   out:      (N, H, D)             q's dtype
//
// Work is split by (row, kv head): each task writes its row's new key and value, then the G = H / Hkv query heads that share a kv head read its keys and values once,
// converted to fp32 as they are read (no copy of the cache), with fp32 products, sums and softmax, as ATen's fp32
// kernel computes them on an fp32 copy. Three passes over one row's data: scores (q . k for every cached key),
// softmax, and the weighted sum of the values. Why a kernel of our own: docs/architecture.md, "Decode attention".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* dst, float x) { *dst = x; }

inline void store(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }  // round to nearest even

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift left
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0 (softmax arguments): 2^n * p(f), n = round(x log2 e), |f| <= ln2 / 2, p of degree 6 (Cephes'
// coefficients: relative error under 2e-7, as good as the fp32 rounding of the argument).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below this e^x is 0 in fp32 (and -inf stays finite)
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: three rounds of shuffles and adds instead of 16
// horizontal reductions. The rounds leave sum(v[4j + k]) in lane 4k + j, so the caller passes the vectors in that
// (transposed, self-inverse) order: v[s] holds key 4 * (s % 4) + s / 4.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes [x0+x2, x1+x3, y0+y2, y1+y3]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane k: 4 partial sums of vector 4i + k
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
}

// The dot product of one query row with one key row (C chunks of 16), as 16 partial sums.
template <int C>
inline __m512 dot16(const c10::BFloat16* q, const float* qf, const c10::BFloat16* k) {
#if defined(__AVX512BF16__)
  if constexpr (C % 2 == 0) {  // bf16 pairs straight into fp32 sums (bf16 products are exact in fp32)
    __m512 s = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < C; c += 2) {
      const __m512i qv = _mm512_loadu_si512(q + 16 * c), kv = _mm512_loadu_si512(k + 16 * c);
      s = _mm512_dpbf16_ps(s, reinterpret_cast<const __m512bh&>(qv), reinterpret_cast<const __m512bh&>(kv));
    }
    return s;
  }
#endif
  __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qf), load16(k));
#pragma GCC unroll 16
  for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 16 * c), load16(k + 16 * c), s);
  return s;
}

template <int C>
inline __m512 dot16(const float*, const float* qf, const float* k) {
  __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qf), _mm512_loadu_ps(k));
#pragma GCC unroll 16
  for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 16 * c), _mm512_loadu_ps(k + 16 * c), s);
  return s;
}

// scores[g * L + l] = scale * (q_g . k_l) for l < L, 16 keys at a time. q_raw: the query rows in the cache's dtype;
// qf: in fp32. (Loops of compile-time length, so that the accumulators live in registers.)
template <typename T, int C>
void scores_pass(const T* q_raw, const float* qf, const T* k, int64_t L, int64_t group, float scale,
                 float* scores) {
  constexpr int64_t D = 16 * C;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q_raw + g * D;
    const float* qfg = qf + g * D;
    int64_t l0 = 0;
    for (; l0 + 16 <= L; l0 += 16) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int s = 0; s < 16; ++s) acc[s] = dot16<C>(qg, qfg, k + (l0 + 4 * (s % 4) + s / 4) * D);
      _mm512_storeu_ps(scores + g * L + l0, _mm512_mul_ps(transpose_sum16(acc), sv));
    }
    if (l0 < L) {
      const int64_t n = L - l0;
      __m512 acc[16];
      for (int s = 0; s < 16; ++s) {
        const int64_t key = 4 * (s % 4) + s / 4;
        acc[s] = key < n ? dot16<C>(qg, qfg, k + (l0 + key) * D) : _mm512_setzero_ps();
      }
      const __m512 r = _mm512_mul_ps(transpose_sum16(acc), sv);
      _mm512_mask_storeu_ps(scores + g * L + l0, static_cast<__mmask16>((1u << n) - 1), r);
    }
  }
}

// acc[g] = sum_l p[g, l] v_l, the G x C accumulators in registers.
template <typename T, int G, int C>
void values_pass(const float* p, const T* v, int64_t L, float* acc) {
  constexpr int64_t D = 16 * C;
  __m512 a[G][C];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    __m512 vl[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vl[c] = load16(v + l * D + 16 * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * L + l]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vl[c], a[g][c]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

template <typename T, int C>
void values_pass_for(int64_t group, const float* p, const T* v, int64_t L, float* acc) {
  switch (group) {
    case 1: return values_pass<T, 1, C>(p, v, L, acc);
    case 2: return values_pass<T, 2, C>(p, v, L, acc);
    case 3: return values_pass<T, 3, C>(p, v, L, acc);
    case 4: return values_pass<T, 4, C>(p, v, L, acc);
    case 5: return values_pass<T, 5, C>(p, v, L, acc);
    case 6: return values_pass<T, 6, C>(p, v, L, acc);
    case 7: return values_pass<T, 7, C>(p, v, L, acc);
    default: return values_pass<T, 8, C>(p, v, L, acc);  // the op checks group <= 8
  }
}

template <typename T, int C>
void softmax_pass(float* scores, int64_t L, int64_t group);

// The vectorized path for head dims of C chunks of 16 (C = 1, 2, 4, 8: head dims 16 .. 128).
template <typename T, int C>
void attend_vec(const T* q_raw, const float* qf, const T* k, const T* v, int64_t L, int64_t group, float scale,
                float* scores, float* acc) {
  scores_pass<T, C>(q_raw, qf, k, L, group, scale, scores);
  softmax_pass<T, C>(scores, L, group);
  values_pass_for<T, C>(group, scores, v, L, acc);
}
#endif

inline float exp_scalar(float x) { return std::exp(x); }

// One (row, kv head) task: the `group` query heads qf (group x D, fp32, scaled) over L cached keys and values.
#if defined(__AVX512F__)
// Softmax numerators over each query head's L scores, in place; their sums go to scores[group * L + g].
template <typename T, int C>
void softmax_pass(float* scores, int64_t L, int64_t group) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < L; ++l) m = std::max(m, sg[l]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    int64_t l = 0;
    for (; l + 16 <= L; l += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mv));
      _mm512_storeu_ps(sg + l, e);
      total = _mm512_add_ps(total, e);
    }
    if (l < L) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (L - l)) - 1);
      __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + l), mv)));
      _mm512_mask_storeu_ps(sg + l, mask, e);
      total = _mm512_add_ps(total, e);
    }
    scores[group * L + g] = _mm512_reduce_add_ps(total);
  }
}
#endif

// One (row, kv head) task: the `group` query heads (q_raw in the cache's dtype, qf in fp32) over L cached keys and
// values; leaves the unnormalized output rows in acc (group x D) and their softmax sums in scores[group * L + g].
template <typename T>
void attend_one(const T* q_raw, const float* qf, const T* k, const T* v, int64_t L, int64_t group, int64_t D,
                float scale, float* scores, float* acc) {
#if defined(__AVX512F__)
  switch (D) {
    case 16: return attend_vec<T, 1>(q_raw, qf, k, v, L, group, scale, scores, acc);
    case 32: return attend_vec<T, 2>(q_raw, qf, k, v, L, group, scale, scores, acc);
    case 64: return attend_vec<T, 4>(q_raw, qf, k, v, L, group, scale, scores, acc);
    case 128: return attend_vec<T, 8>(q_raw, qf, k, v, L, group, scale, scores, acc);
    default: break;  // other head dims: the scalar loops below
  }
#endif
  for (int64_t l = 0; l < L; ++l)
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_float(k[l * D + d]);
      scores[g * L + l] = s * scale;
    }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < L; ++l) m = std::max(m, sg[l]);
    float total = 0.f;
    for (int64_t l = 0; l < L; ++l) total += (sg[l] = exp_scalar(sg[l] - m));
    scores[group * L + g] = total;
  }
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += scores[g * L + l] * to_float(v[l * D + d]);
}

template <typename T>
void decode_attention_kernel(const T* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache,
                             const int64_t* slots, const int64_t* positions, T* out, int64_t num_rows,
                             int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t max_len, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * max_len * head_dim;
  const int64_t head_stride = max_len * head_dim;
  const int64_t D = head_dim;
  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t L = positions[n] + 1;
      const int64_t base = slots[n] * slot_stride + h * head_stride;
      std::memcpy(k_cache + base + positions[n] * D, k_new + (n * num_kv_heads + h) * D, D * sizeof(T));
      std::memcpy(v_cache + base + positions[n] * D, v_new + (n * num_kv_heads + h) * D, D * sizeof(T));
      const T* qn = q + (n * num_heads + h * group) * D;
      scores.resize(group * (L + 1));  // group rows of L scores, then the group's softmax sums
      for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(qn[i]);
      attend_one(qn, qf.data(), k_cache + base, v_cache + base, L, group, D, scale, scores.data(), acc.data());
      T* on = out + (n * num_heads + h * group) * D;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / scores[group * L + g];
        for (int64_t d = 0; d < D; ++d) store(on + g * D + d, acc[g * D + d] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "decode_attention: q, k, v and the cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: the cache must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decode_attention: int64 slots and positions");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), max_len = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= 8, "decode_attention: head counts");
  TORCH_CHECK(k.dim() == 3 && k.size(0) == N && k.size(1) == Hkv && k.size(2) == D && v.sizes() == k.sizes(),
              "decode_attention: k and v must be (N, kv heads, head dim)");
  TORCH_CHECK(slots.numel() == N && positions.numel() == N, "decode_attention: one slot and position per row");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto sc = slots.contiguous(), pc = positions.contiguous();
  auto out = at::empty_like(qc);
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(pp[n] >= 0 && pp[n] < max_len, "decode_attention: position out of range");
    TORCH_CHECK(sp[n] >= 0 && sp[n] < S, "decode_attention: slot out of range");
  }
  const float s = static_cast<float>(scale);
  if (dtype == at::kBFloat16) {
    using B = c10::BFloat16;
    decode_attention_kernel(qc.data_ptr<B>(), kc.data_ptr<B>(), vc.data_ptr<B>(), k_cache.data_ptr<B>(),
                            v_cache.data_ptr<B>(), sp, pp, out.data_ptr<B>(), N, H, Hkv, D, max_len, s);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "decode_attention: float32 or bfloat16");
    decode_attention_kernel(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                            k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, pp, out.data_ptr<float>(), N, H,
                            Hkv, D, max_len, s);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(alchemist, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(alchemist, CPU, m) { m.impl("decode_attention", &decode_attention); }
