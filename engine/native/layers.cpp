// Decoder layers for one sequence's chain of rows, as one call from Python: an fp32 or int4 target's layers, and
// the EAGLE head's draft step (its fc, its one layer, its norm).
//
// Every operation is the call that the Python forward makes (engine/fused_llama.py: decoder_layer,
// Int4Weights.linear, BlockedWeights.linear, PagedCache.layer_update, attention and rows_apart, _rms_norm and
// _gated; engine/drafters/eagle.py: EagleHead.step), with the same arguments in the same order, so the results are
// the Python forward's bit for bit; only the cost of calling some 40 small operations a layer from Python is gone.
// Where the arithmetic is ATen's, some steps are written out here with the same products and sums: the rotary
// turn (pointwise.cpp's `rotated`) and the cache write (`stored`).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

// coded.cpp: products from a GGUF file's Q4_1 / Q8_0 codes
bool coded_supported();
at::Tensor coded_product(const at::Tensor& x, const at::Tensor& blocks, int64_t n, bool q4);
bool integer_supported();
// attention.cpp: attention row by row, each row over a prefix of the keys
bool rows_supported();
at::Tensor rows_attention(const at::Tensor& qs, const at::Tensor& keys, const at::Tensor& values,
                          const std::vector<int64_t>& counts, double scaling);
at::Tensor q4_packed(const at::Tensor& blocks, int64_t n);
at::Tensor q8_packed(const at::Tensor& blocks, int64_t n);
at::Tensor integer_product(const at::Tensor& x, const at::Tensor& packed, int64_t n);
// pointwise.cpp: the norm, the gate and the rotary turn, a row at a time
bool pointwise_supported();
at::Tensor rms_rows(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor gated_rows(const at::Tensor& gate_up, int64_t inter);
at::Tensor rotated(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                   int64_t kv_heads, int64_t head_dim);
// nucleus.cpp: top-p's processed distribution, and inverse-CDF samples, a row at a time; a chain's verdict
std::tuple<at::Tensor, at::Tensor> nucleus_rows(const at::Tensor& logits, double t, double top_p);
std::tuple<at::Tensor, at::Tensor> sampled_rows(const at::Tensor& probs, const at::Tensor& uniforms);
std::tuple<at::Tensor, at::Tensor> chain_verdict(const at::Tensor& q, const at::Tensor& p, const at::Tensor& ids,
                                                 const at::Tensor& uniforms);

namespace {

struct Geometry {
  int64_t heads, kv_heads, head_dim, inter;
  double scaling, eps;
};

// Where a sequence's K/V lives: the pool's [kv_heads, slots, head_dim] tensors of one layer, the slots this
// forward writes, and the sequence's slots (a view of [span_start, span_end) when span_end >= 0).
struct Cache {
  at::Tensor keys, values, write, slots;
  int64_t span_start, span_end;
};

// Which keys each query row attends to when attention runs row by row (fused_llama._rows_seen): row r the first
// counts[r] keys, or (counts[r] < 0) the keys at indices[r]. Empty: a chain, whose row r sees the first past + r + 1.
struct RowKeys {
  const std::vector<int64_t>& counts;
  const std::vector<at::Tensor>& indices;
};

at::Tensor int4_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t rows) {
  auto out = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, x.size(-1)}).to(at::kBFloat16), packed, 32, pairs)
                 .to(at::kFloat);
  auto shape = x.sizes().vec();
  shape.back() = rows;
  return out.view(shape);
}

// BlockedWeights.linear: oneDNN's product with a blocked copy (bf16: the input rounded to bf16, fp32 out).
at::Tensor blocked_product(const at::Tensor& x, const at::Tensor& blocked, const std::optional<at::Tensor>& bias,
                           bool bf16) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(bf16 ? x.to(at::kBFloat16) : x);
  stack.emplace_back(blocked);
  stack.emplace_back(bf16 || !bias ? c10::IValue() : c10::IValue(*bias));
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  auto out = stack[0].toTensor();
  if (!bf16) return out;
  out = out.to(at::kFloat);
  return bias ? out + *bias : out;
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// pool.index_copy_(1, write, rows.to(pool's dtype)) for one layer's pool [kv_heads, slots, head_dim] and rows
// [kv_heads, q, head_dim]: where both are float32 with rows of head_dim in a line, row by row with memcpy (the
// same bytes, without the call's cost).
void stored(const at::Tensor& pool, const at::Tensor& write, const at::Tensor& rows) {
  const int64_t kv = pool.size(0), slots = pool.size(1), d = pool.size(2), q = write.numel();
  if (pool.scalar_type() != at::kFloat || rows.scalar_type() != at::kFloat || write.scalar_type() != at::kLong ||
      !write.is_contiguous() || pool.stride(2) != 1 || rows.stride(2) != 1 || rows.size(0) != kv ||
      rows.size(1) != q || rows.size(2) != d) {
    pool.index_copy_(1, write, rows.to(pool.scalar_type()));
    return;
  }
  const int64_t* at = write.data_ptr<int64_t>();
  for (int64_t r = 0; r < q; ++r) TORCH_CHECK(at[r] >= 0 && at[r] < slots, "a cache slot out of range: ", at[r]);
  float* out = pool.data_ptr<float>();
  const float* in = rows.data_ptr<float>();
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t r = 0; r < q; ++r)
      std::memcpy(out + h * pool.stride(0) + at[r] * pool.stride(1), in + h * rows.stride(0) + r * rows.stride(1),
                  d * sizeof(float));
}

// decoder_layer for x [1, q, d]; product(input, i) multiplies by the layer's QKV (0), O (1), gate/up (2) or
// down (3) matrix. With rows_apart, attention runs one query row at a time over the keys it sees (rows_apart in
// Python); otherwise one SDPA call under `mask` (None: every key), as `attention` without `exact`.
template <class Product>
at::Tensor layer(at::Tensor x, Product&& product, const at::Tensor& norm_in, const at::Tensor& norm_post,
                 const Cache& cache, const at::Tensor& cos, const at::Tensor& sin, const Geometry& g,
                 const std::optional<at::Tensor>& mask, bool rows_apart, const RowKeys& seen) {
  const int64_t d = x.size(-1), q = x.size(1);
  const bool gqa = g.kv_heads != g.heads;
  // float32 rows: pointwise.cpp's norm and gate, as fused_llama's _rms_norm and _gated pick them
  const bool pointwise = pointwise_supported() && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                         cos.numel() == q * g.head_dim;
  auto normed = [&](const at::Tensor& in, const at::Tensor& w) {
    return pointwise ? rms_rows(in, w, g.eps) : at::rms_norm(in, {d}, w, g.eps);
  };
  auto qkv = product(normed(x, norm_in), 0);
  auto parts = qkv.split_with_sizes({(g.heads + g.kv_heads) * g.head_dim, g.kv_heads * g.head_dim}, -1);
  at::Tensor qk;
  if (pointwise) {
    qk = rotated(qkv, cos, sin, g.heads, g.kv_heads, g.head_dim);
  } else {
    qk = parts[0].view({1, q, g.heads + g.kv_heads, g.head_dim}).transpose(1, 2);
    qk = qk * cos + rotate_half(qk) * sin;
  }
  auto split = qk.split_with_sizes({g.heads, g.kv_heads}, 1);
  auto qs = split[0];
  auto vs = parts[1].view({1, q, g.kv_heads, g.head_dim}).transpose(1, 2);
  // PagedCache.layer_update: write this step's K/V, gather the sequence's
  stored(cache.keys, cache.write, split[1][0]);
  stored(cache.values, cache.write, vs[0]);
  const bool view = cache.span_end >= 0;
  auto k = (view ? cache.keys.slice(1, cache.span_start, cache.span_end) : cache.keys.index_select(1, cache.slots))
               .unsqueeze(0).to(split[1].scalar_type());
  auto v = (view ? cache.values.slice(1, cache.span_start, cache.span_end)
                 : cache.values.index_select(1, cache.slots))
               .unsqueeze(0).to(vs.scalar_type());
  at::Tensor attn;
  const bool tree = !seen.counts.empty();
  if (rows_apart && rows_supported()) {   // fused_llama.rows_apart: attention.cpp's rows, each over its keys
    const int64_t past = k.size(2) - q;
    if (!tree) {
      std::vector<int64_t> counts(q);
      for (int64_t r = 0; r < q; ++r) counts[r] = past + r + 1;
      attn = rows_attention(qs, k, v, counts, g.scaling);
    } else {
      attn = at::empty_like(qs);
      for (int64_t r = 0; r < q; ++r) {
        auto row = qs.slice(2, r, r + 1);
        attn.slice(2, r, r + 1).copy_(seen.counts[r] >= 0
            ? rows_attention(row, k, v, {seen.counts[r]}, g.scaling)
            : rows_attention(row, k.index_select(2, seen.indices[r]), v.index_select(2, seen.indices[r]),
                             {seen.indices[r].size(0)}, g.scaling));
      }
    }
  } else if (!rows_apart || (q == 1 && !tree)) {   // rows_apart's one row alone, without a mask, is this same call
    attn = at::scaled_dot_product_attention(qs, k, v, rows_apart ? std::nullopt : mask, 0.0, false, g.scaling, gqa);
  } else {
    attn = at::empty_like(qs);
    const int64_t past = k.size(2) - q;
    for (int64_t r = 0; r < q; ++r) {
      auto kr = k.slice(0, 0, 1), vr = v.slice(0, 0, 1);
      if (!tree || seen.counts[r] >= 0) {   // a prefix of the keys
        const int64_t n = tree ? seen.counts[r] : past + r + 1;
        kr = kr.slice(2, 0, n);
        vr = vr.slice(2, 0, n);
      } else {                              // a tree node's path
        kr = kr.index_select(2, seen.indices[r]);
        vr = vr.index_select(2, seen.indices[r]);
      }
      attn.slice(0, 0, 1).slice(2, r, r + 1).copy_(at::scaled_dot_product_attention(
          qs.slice(0, 0, 1).slice(2, r, r + 1), kr, vr, std::nullopt, 0.0, false, g.scaling, gqa));
    }
  }
  x = x + product(attn.transpose(1, 2).reshape({1, q, g.heads * g.head_dim}), 1);
  auto gate_up = product(normed(x, norm_post), 2);
  if (pointwise) return x + product(gated_rows(gate_up, g.inter), 3);
  auto halves = gate_up.split(g.inter, -1);
  return x + product(at::silu(halves[0]) * halves[1], 3);
}

// Every layer in turn: products_of(i) gives layer i's product(input, matrix); norms[2i], norms[2i + 1] its norms,
// keys[i] / values[i] its pool tensors. Returns {x after the last layer, then x entering each layer listed in
// `taps` (ascending), as [q, d]}.
template <class ProductsOf>
std::vector<at::Tensor> every_layer(at::Tensor x, const std::vector<at::Tensor>& norms,
                                    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                    const at::Tensor& write, const at::Tensor& slots, int64_t span_start,
                                    int64_t span_end, const at::Tensor& cos, const at::Tensor& sin, const Geometry& g,
                                    const std::optional<at::Tensor>& mask, bool rows_apart, const RowKeys& seen,
                                    const std::vector<int64_t>& taps, ProductsOf&& products_of) {
  std::vector<at::Tensor> tapped;
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int64_t t : taps)
      if (t == static_cast<int64_t>(i)) tapped.push_back(x[0]);
    const Cache cache{keys[i], values[i], write, slots, span_start, span_end};
    x = layer(x, products_of(i), norms[2 * i], norms[2 * i + 1], cache, cos, sin, g, mask, rows_apart, seen);
  }
  tapped.insert(tapped.begin(), x);
  return tapped;
}

}  // namespace

// The int4 target's layers. x [1, q, d]; per layer i: packed[4i..4i+3] and pairs[...] for QKV, O, gate/up and
// down (rows[...] their output sizes; `integer`: packed[...] are q4_packed blocks, multiplied by integer_product,
// and pairs[...] are unused), norms[2i] and norms[2i+1]; keys[i] / values[i] its pool tensors; a tree's
// rows' keys in row_counts / row_indices (RowKeys; empty for a chain). Returns as every_layer does.
std::vector<at::Tensor> int4_layers(at::Tensor x, const std::vector<at::Tensor>& packed,
                                    const std::vector<at::Tensor>& pairs, const std::vector<int64_t>& rows,
                                    const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& keys,
                                    const std::vector<at::Tensor>& values, const at::Tensor& write,
                                    const at::Tensor& slots, int64_t span_start, int64_t span_end,
                                    const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, int64_t inter, double scaling, double eps,
                                    const std::vector<int64_t>& taps, const std::vector<int64_t>& row_counts,
                                    const std::vector<at::Tensor>& row_indices, bool integer) {
  const Geometry g{heads, kv_heads, head_dim, inter, scaling, eps};
  const RowKeys seen{row_counts, row_indices};
  return every_layer(x, norms, keys, values, write, slots, span_start, span_end, cos, sin, g, std::nullopt, true,
                     seen, taps, [&](size_t i) {
                       return [&, i](const at::Tensor& in, int64_t m) {
                         if (integer) return integer_product(in, packed[4 * i + m], rows[4 * i + m]);
                         return int4_product(in, packed[4 * i + m], pairs[4 * i + m], rows[4 * i + m]);
                       };
                     });
}

// How an fp32 layer matrix is multiplied: as it is (torch's default linear), as oneDNN's blocked copy, from a
// GGUF file's Q4_1 codes (CodedWeights; coded.cpp), or (a drafter's, DraftCodes) from Q8_0 codes packed by
// q8_packed, with 8-bit inputs.
enum Fp32Product : int64_t { DENSE = 0, BLOCKED = 1, CODED = 2, INTEGER = 3 };

// The fp32 target's layers: weights[4i..4i+3] are layer i's QKV, O, gate/up and down matrices, each multiplied as
// kinds[...] says (Fp32Product; CODED: weights[...] are the blocks, rows[...] the output size); attention is one
// SDPA call under `mask` (None for one row), or with `rows_apart` row by row as int4_layers attends (a tree's rows'
// keys in row_counts / row_indices). Returns as int4_layers does.
std::vector<at::Tensor> fp32_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                                    const std::vector<int64_t>& kinds, const std::vector<int64_t>& rows,
                                    const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& keys,
                                    const std::vector<at::Tensor>& values, const at::Tensor& write,
                                    const at::Tensor& slots, int64_t span_start, int64_t span_end,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    const std::optional<at::Tensor>& mask, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, int64_t inter, double scaling, double eps,
                                    const std::vector<int64_t>& taps, bool rows_apart,
                                    const std::vector<int64_t>& row_counts,
                                    const std::vector<at::Tensor>& row_indices) {
  const Geometry g{heads, kv_heads, head_dim, inter, scaling, eps};
  return every_layer(x, norms, keys, values, write, slots, span_start, span_end, cos, sin, g, mask, rows_apart,
                     RowKeys{row_counts, row_indices}, taps, [&](size_t i) {
                       return [&, i](const at::Tensor& in, int64_t m) {
                         const auto& w = weights[4 * i + m];
                         switch (kinds[4 * i + m]) {
                           case BLOCKED: return blocked_product(in, w, std::nullopt, false);
                           case CODED: return coded_product(in, w, rows[4 * i + m], true);
                           default: return at::linear(in, w);
                         }
                       };
                     });
}

// EagleHead.step with the head's copies' products: fc over [emb, feats] (weights[0], with fc_bias), the layer
// (weights[1..4]), then the output norm; each multiplied as kinds[...] says (BLOCKED: oneDNN's blocked copy, bf16
// or fp32; CODED: Q8_0 blocks of rows[...] outputs, DraftCodes; INTEGER: those blocks packed, with 8-bit
// inputs). emb and feats [1, q, d]; norms: in, post, out.
at::Tensor eagle_step(const at::Tensor& emb, const at::Tensor& feats, const std::vector<at::Tensor>& weights,
                      const std::vector<int64_t>& kinds, const std::vector<int64_t>& rows,
                      const std::optional<at::Tensor>& fc_bias, bool bf16, const std::vector<at::Tensor>& norms,
                      const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write,
                      const at::Tensor& slots, int64_t span_start, int64_t span_end, const at::Tensor& cos,
                      const at::Tensor& sin, const std::optional<at::Tensor>& mask, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t inter, double scaling, double eps) {
  const Geometry g{heads, kv_heads, head_dim, inter, scaling, eps};
  auto multiply = [&](const at::Tensor& in, size_t i, const std::optional<at::Tensor>& bias) {
    if (kinds[i] != CODED && kinds[i] != INTEGER) return blocked_product(in, weights[i], bias, bf16);
    auto out = kinds[i] == INTEGER ? integer_product(in, weights[i], rows[i])
                                   : coded_product(in, weights[i], rows[i], false);
    return bias ? out + *bias : out;
  };
  auto x = multiply(at::cat({emb, feats}, -1), 0, fc_bias);
  auto product = [&](const at::Tensor& in, int64_t m) { return multiply(in, 1 + m, std::nullopt); };
  const Cache cache{keys, values, write, slots, span_start, span_end};
  const std::vector<int64_t> no_counts;
  const std::vector<at::Tensor> no_indices;
  x = layer(x, product, norms[0], norms[1], cache, cos, sin, g, mask, false, RowKeys{no_counts, no_indices});
  return pointwise_supported() && x.scalar_type() == at::kFloat ? rms_rows(x, norms[2], eps)
                                                                 : at::rms_norm(x, {x.size(-1)}, norms[2], eps);
}

// Each call lets go of Python's lock while it computes, as each ATen call from Python does: the server's other
// threads (its event loop, other sessions) keep running through a forward.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("int4_layers", &int4_layers, "the int4 target's decoder layers over one sequence's chain of rows", release());
  m.def("fp32_layers", &fp32_layers, "the fp32 target's decoder layers over one sequence's chain of rows", release());
  m.def("coded_product", &coded_product, "x times a matrix kept as Q4_1 or Q8_0 codes, in fp32", release());
  m.def("coded_supported", &coded_supported, "whether this CPU multiplies from codes (AVX2 and FMA)");
  m.def("rows_supported", &rows_supported, "whether this CPU runs rows_attention (AVX2 and FMA)");
  m.def("rows_attention", &rows_attention, "attention one query row at a time, each over a prefix of the keys",
        release());
  m.def("pointwise_supported", &pointwise_supported, "whether this CPU runs rms_rows and gated_rows (AVX2 and FMA)");
  m.def("rms_rows", &rms_rows, "LlamaRMSNorm over float32 rows, a row at a time", release());
  m.def("gated_rows", &gated_rows, "silu(gate) * up over float32 rows of [gate, up]", release());
  m.def("integer_supported", &integer_supported, "whether this CPU takes the integer products (AVX2, FMA, F16C)");
  m.def("q4_packed", &q4_packed, "a matrix's Q4_1 blocks repacked four output rows together", release());
  m.def("q8_packed", &q8_packed, "a matrix's Q8_0 blocks repacked four output rows together", release());
  m.def("integer_product", &integer_product,
        "x rounded to 8 bits times a packed Q4_1 or Q8_0 matrix, as llama.cpp does", release());
  m.def("nucleus_rows", &nucleus_rows, "top-p's distribution over float32 logits at temperature t, and which rows it "
        "decided", release());
  m.def("sampled_rows", &sampled_rows, "inverse-CDF samples of probability rows, as engine.sampling.sample_many",
        release());
  m.def("chain_verdict", &chain_verdict, "one round's accept tests and final row on a chain, as engine.verify.verify",
        release());
  m.def("eagle_step", &eagle_step, "an EAGLE head's draft step over one sequence's rows, with its copies' products",
        release());
}
