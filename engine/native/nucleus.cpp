// Top-p's processed distribution (engine.sampling.logits_to_probs at T > 0 with top-p alone), a row at a time in
// three short passes: the row's largest scaled logit, then the row's total mass and the candidates within CUT of
// the largest, then the candidates alone, sorted. From ATen this was some fifteen calls over the whole vocabulary
// (a top-k, a softmax, the masks, sorts, sums): 0.7 ms a row of SmolLM2's 49,152 logits, and a decoding step spends
// one row a token, a verify K + 1.
//
// The rule is the one sampling.py states: logits divided by the temperature, tokens in stable order (larger first,
// ties to the lower id), a token kept when the mass before it is below top_p, the kept ones renormalised. Tokens
// outside the candidates are below every candidate, so the candidates are the order's first tokens; their masses
// decide the set when they reach top_p, which holds unless nearly all of a row's mass lies more than CUT below its
// largest logit. A row where they do not reach it, or that holds a NaN, +inf or only -inf, is left to the caller
// (`found` false), which takes sampling.py's own path: its sort, and its errors.
//
// Two more serve the rows that come out: inverse-CDF sampling (`sampled_rows`), and a chain's verdict
// (`chain_verdict`, engine.verify's accept tests and final draw), each computing as the ATen path does.
#include <ATen/ATen.h>   // not torch/extension.h: a third of the compile time

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "lanes.h"
#define SPECPLAY_NUCLEUS 1
#endif

bool coded_supported();   // coded.cpp: x86-64 with AVX2 and FMA, what this file needs too

namespace {

#ifdef SPECPLAY_NUCLEUS
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_OR_PLAIN AVX2
#else
#define AVX2_OR_PLAIN
#endif

#ifdef SPECPLAY_NUCLEUS
constexpr float CUT = 16.0f;   // candidates: scaled logits within 16 of the largest (e^-16: 1.1e-7 of its mass)
using Candidate = std::pair<float, int64_t>;

// The largest of x / t over a row of v, or NaN when the row holds a NaN or +inf, or is all -inf.
AVX2 float largest(const float* x, int64_t v, float t) {
  const __m256 lanes_t = _mm256_set1_ps(t), inf = _mm256_set1_ps(INFINITY);
  __m256 best = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= v; c += 8) {
    const __m256 a = _mm256_div_ps(_mm256_loadu_ps(x + c), lanes_t);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(a, inf, _CMP_EQ_OQ)));
    best = _mm256_max_ps(best, a);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float m = *std::max_element(lanes, lanes + 8);
  bool ok = _mm256_movemask_ps(bad) == 0;
  for (; c < v; ++c) {
    const float a = x[c] / t;
    ok = ok && !std::isnan(a) && a != INFINITY;
    m = std::max(m, a);
  }
  return ok && m != -INFINITY ? m : NAN;
}

// The row's total of exp(x / t - m) (float32 terms summed in float64) and its candidates, in id order.
AVX2 double total_and_candidates(const float* x, int64_t v, float t, float m, std::vector<Candidate>& out) {
  const __m256 lanes_t = _mm256_set1_ps(t), top = _mm256_set1_ps(m), edge = _mm256_set1_ps(m - CUT);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t c = 0;
  for (; c + 8 <= v; c += 8) {
    const __m256 a = _mm256_div_ps(_mm256_loadu_ps(x + c), lanes_t);
    const __m256 e = exp_negative(_mm256_sub_ps(a, top));
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    for (int near = _mm256_movemask_ps(_mm256_cmp_ps(a, edge, _CMP_GE_OQ)); near; near &= near - 1) {
      const int j = __builtin_ctz(near);
      out.emplace_back(x[c + j] / t, c + j);
    }
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, _mm256_add_pd(low, high));
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; c < v; ++c) {
    const float a = x[c] / t;
    total += std::exp(static_cast<double>(a - m));
    if (a >= m - CUT) out.emplace_back(a, c);
  }
  return total;
}

// One row: its processed distribution into out (zeroed by the caller); false when the candidates cannot decide it.
AVX2 bool nucleus_row(const float* x, int64_t v, float t, double top_p, float* out, std::vector<Candidate>& cand) {
  const float m = largest(x, v, t);
  if (std::isnan(m)) return false;
  cand.clear();
  const double total = total_and_candidates(x, v, t, m, cand);
  std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double before = 0.0, kept_mass = 0.0;
  size_t kept = 0;
  std::vector<double> mass(cand.size());
  while (kept < cand.size() && before < top_p) {
    mass[kept] = std::exp(static_cast<double>(cand[kept].first - m));
    before += mass[kept] / total;
    kept_mass += mass[kept];
    ++kept;
  }
  if (before < top_p) return false;   // the nucleus reaches past the candidates
  for (size_t i = 0; i < kept; ++i) out[cand[i].second] = static_cast<float>(mass[i] / kept_mass);
  return true;
}
#endif

}  // namespace

// logits [n, v] float32 -> (probs [n, v] float32, found [n] bool): each found row's top-p distribution at temperature
// t; rows not found are left zero for the caller to fill.
std::tuple<at::Tensor, at::Tensor> nucleus_rows(const at::Tensor& logits, double t, double top_p) {
  TORCH_CHECK(coded_supported(), "nucleus_rows needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "nucleus_rows takes float32 rows [n, v]");
  TORCH_CHECK(t > 0 && top_p > 0 && top_p < 1, "nucleus_rows needs t > 0 and 0 < top_p < 1");
  const auto rows = logits.contiguous();
  const int64_t n = rows.size(0), v = rows.size(1);
  auto probs = at::zeros({n, v}, rows.options());
  auto found = at::zeros({n}, rows.options().dtype(at::kBool));
#ifdef SPECPLAY_NUCLEUS
  std::vector<Candidate> cand;
  for (int64_t r = 0; r < n; ++r)
    found.data_ptr<bool>()[r] = nucleus_row(rows.data_ptr<float>() + r * v, v, static_cast<float>(t), top_p,
                                            probs.data_ptr<float>() + r * v, cand);
#endif
  return {probs, found};
}

// Inverse-CDF sampling (engine.sampling.sample_many) over rows of probabilities [n, v] (float32 or float64, any
// positive total) with uniforms [n, t] float64: per uniform, the first token whose running sum exceeds u times
// the row's total, or the row's last positive token where none does. The running sums are torch.cumsum's in
// float64, added in id order one token at a time; adding a zero changes no sum, so only the positive tokens are
// visited: a top-p row of a few kept tokens costs one pass to find them, not 49,152 dependent additions. Returns
// (ids [n, t] int64, the rows whose total is positive [n] bool).
namespace {

#ifdef SPECPLAY_NUCLEUS
AVX2 inline int nonzero_lanes(const float* p) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_NEQ_UQ));
}

AVX2 inline int nonzero_lanes(const double* p) {
  return _mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(p), _mm256_setzero_pd(), _CMP_NEQ_UQ));
}
#endif

// The ids of a row's tokens that are not zero (a NaN counts), in order, into kept: eight floats or four doubles
// compared at a time, since a processed row is nearly all zeros.
template <typename T>
AVX2_OR_PLAIN void nonzero_ids(const T* p, int64_t v, std::vector<int64_t>& kept) {
  int64_t i = 0;
#ifdef SPECPLAY_NUCLEUS
  constexpr int64_t lanes = 32 / sizeof(T);
  for (; i + lanes <= v; i += lanes)
    for (int set = nonzero_lanes(p + i); set; set &= set - 1) kept.push_back(i + __builtin_ctz(set));
#endif
  for (; i < v; ++i)
    if (p[i] != 0) kept.push_back(i);
}

template <typename T>
void sampled_row(const T* p, int64_t v, const double* u, int64_t t, int64_t* out, bool* positive,
                 std::vector<int64_t>& kept) {
  kept.clear();
  nonzero_ids(p, v, kept);
  double total = 0.0;
  for (const int64_t i : kept) total += static_cast<double>(p[i]);
  *positive = total > 0;
  int64_t last = v - 1;                            // the last positive token (v - 1 when there is none)
  for (auto it = kept.rbegin(); it != kept.rend(); ++it)
    if (p[*it] > 0) {
      last = *it;
      break;
    }
  for (int64_t j = 0; j < t; ++j) {
    const double target = u[j] * total;
    double sum = 0.0;
    int64_t id = v;                                  // searchsorted(right=True): the first running sum above target
    for (const int64_t i : kept) {
      sum += static_cast<double>(p[i]);
      if (sum > target) {
        id = i;
        break;
      }
    }
    out[j] = std::min(id, last);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sampled_rows(const at::Tensor& probs, const at::Tensor& uniforms) {
  TORCH_CHECK(probs.dim() == 2 && (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble),
              "sampled_rows takes float32 or float64 rows [n, v]");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == probs.size(0),
              "sampled_rows takes float64 uniforms [n, t]");
  const auto rows = probs.contiguous();
  const auto us = uniforms.contiguous();
  const int64_t n = rows.size(0), v = rows.size(1), t = us.size(1);
  auto ids = at::empty({n, t}, rows.options().dtype(at::kLong));
  auto positive = at::empty({n}, rows.options().dtype(at::kBool));
  std::vector<int64_t> kept;
  for (int64_t r = 0; r < n; ++r) {
    if (rows.scalar_type() == at::kFloat)
      sampled_row(rows.data_ptr<float>() + r * v, v, us.data_ptr<double>() + r * t, t, ids.data_ptr<int64_t>() + r * t,
                  positive.data_ptr<bool>() + r, kept);
    else
      sampled_row(rows.data_ptr<double>() + r * v, v, us.data_ptr<double>() + r * t, t,
                  ids.data_ptr<int64_t>() + r * t, positive.data_ptr<bool>() + r, kept);
  }
  return {ids, positive};
}

// One round's verdict on a chain (engine.verify.verify): q [k, v] the drafts' float32 rows, p [k + 1, v] the target's,
// the k drafted ids, and k + 1 float64 uniforms (the k tests', then the final draw's). In float64, as verify.py
// computes it: each draft's alpha = min(1, p / q) (where q = 0: 1 if p > 0, else 0), accepted while u < alpha; then
// the final row, max(0, p - q) at the first rejection or the target's row k after k acceptances, drawn from as
// sampled_rows draws, and its mass (ATen's sum, verify.py's). Returns (the scalars as verify.py lays them out:
// ids, p, q, alpha and u (k each), the final u, the accepted count, the final id, the mass; the final row [v]).
// ATen's way was some twenty calls, four of them over a whole float64 row.
std::tuple<at::Tensor, at::Tensor> chain_verdict(const at::Tensor& q, const at::Tensor& p, const at::Tensor& ids,
                                                 const at::Tensor& uniforms) {
  TORCH_CHECK(q.dim() == 2 && p.dim() == 2 && q.scalar_type() == at::kFloat && p.scalar_type() == at::kFloat &&
                  p.size(0) == q.size(0) + 1 && p.size(1) == q.size(1) && q.size(0) >= 1,
              "chain_verdict takes float32 rows q [k, v] and p [k + 1, v]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.size(0) == q.size(0) &&
                  uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == q.size(0) + 1,
              "chain_verdict takes k int64 ids and k + 1 float64 uniforms");
  const auto qs = q.contiguous(), ps = p.contiguous(), us = uniforms.contiguous(), tokens = ids.contiguous();
  const int64_t k = qs.size(0), v = qs.size(1);
  const float *qd = qs.data_ptr<float>(), *pd = ps.data_ptr<float>();
  const double* u = us.data_ptr<double>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  auto scalars = at::empty({5 * k + 4}, us.options());
  double* out = scalars.data_ptr<double>();
  int64_t accepted = 0;
  bool rejected = false;
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(t[i] >= 0 && t[i] < v, "chain_verdict: draft id ", t[i], " is outside the vocabulary of ", v);
    const double pt = pd[i * v + t[i]], qt = qd[i * v + t[i]];
    const double ratio = qt > 0 ? pt / qt : (pt > 0 ? 1.0 : 0.0);
    const double alpha = ratio > 1.0 ? 1.0 : ratio;   // as clamp(max=1): a NaN stays NaN
    out[i] = static_cast<double>(t[i]);
    out[k + i] = pt;
    out[2 * k + i] = qt;
    out[3 * k + i] = alpha;
    out[4 * k + i] = u[i];
    if (!rejected && u[i] < alpha) ++accepted;
    else rejected = true;
  }
  auto row = at::empty({v}, us.options());
  double* d = row.data_ptr<double>();
  const float* pr = pd + accepted * v;
  const float* qr = accepted < k ? qd + accepted * v : nullptr;   // none after k acceptances: the bonus row
  for (int64_t j = 0; j < v; ++j) {
    const double x = static_cast<double>(pr[j]) - (qr ? static_cast<double>(qr[j]) : 0.0);
    d[j] = x < 0.0 ? 0.0 : x;
  }
  int64_t final_id = 0;
  bool positive = false;
  std::vector<int64_t> kept;
  sampled_row(d, v, u + k, 1, &final_id, &positive, kept);
  out[5 * k] = u[k];
  out[5 * k + 1] = static_cast<double>(accepted);
  out[5 * k + 2] = static_cast<double>(final_id);
  out[5 * k + 3] = row.sum().item<double>();
  return {scalars, row};
}
