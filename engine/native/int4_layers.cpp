// The int4 target's decoder layers for one sequence's chain of q new rows, as one call from Python.
//
// Every operation is the ATen call that engine/fused_llama.py's Python loop makes (decoder_layer,
// Int4Weights.linear, PagedCache.layer_update, rows_apart), with the same arguments in the same order, so
// the results are that loop's bit for bit; only the cost of calling ~40 small operations a layer from Python
// is gone. Attention runs one query row at a time over the keys its row sees, as rows_apart does.
#include <torch/extension.h>

#include <vector>

namespace {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t rows) {
  auto in = x.reshape({-1, x.size(-1)}).to(at::kBFloat16);
  auto out = at::_weight_int4pack_mm_for_cpu(in, packed, 32, pairs).to(at::kFloat);
  auto shape = x.sizes().vec();
  shape.back() = rows;
  return out.view(shape);
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

// x [1, q, d]; per layer i: packed[4i..4i+3] and pairs[...] for QKV, O, gate/up and down (rows[...] their
// output sizes), norms[2i], norms[2i+1]; keys[i] / values[i] the pool's [kv_heads, slots, head_dim]; write the q
// new rows at `write` slots, then attend to the sequence's slots: pool[:, span_start:span_end] when span_end >= 0,
// else index_select of `slots`. Returns {x after the last layer, then x entering each layer in `taps`, as [q, d]}.
std::vector<at::Tensor> int4_layers(at::Tensor x, const std::vector<at::Tensor>& packed,
                                    const std::vector<at::Tensor>& pairs, const std::vector<int64_t>& rows,
                                    const std::vector<at::Tensor>& norms, double eps,
                                    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                    const at::Tensor& write, const at::Tensor& slots, int64_t span_start,
                                    int64_t span_end, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, int64_t inter, double scaling,
                                    const std::vector<int64_t>& taps) {
  const int64_t d = x.size(-1), q = x.size(1);
  const int64_t layers = static_cast<int64_t>(keys.size());
  const bool gqa = kv_heads != heads;
  std::vector<at::Tensor> tapped;
  for (int64_t i = 0; i < layers; ++i) {
    for (int64_t t : taps)
      if (t == i) tapped.push_back(x[0]);
    auto qkv = int4_linear(at::rms_norm(x, {d}, norms[2 * i], eps), packed[4 * i], pairs[4 * i], rows[4 * i]);
    auto parts = qkv.split_with_sizes({(heads + kv_heads) * head_dim, kv_heads * head_dim}, -1);
    auto qk = parts[0].view({1, q, heads + kv_heads, head_dim}).transpose(1, 2);
    qk = qk * cos + rotate_half(qk) * sin;
    auto split = qk.split_with_sizes({heads, kv_heads}, 1);
    auto qs = split[0];
    auto vs = parts[1].view({1, q, kv_heads, head_dim}).transpose(1, 2);
    // PagedCache.layer_update: write this step's K/V, gather the sequence's
    keys[i].index_copy_(1, write, split[1][0].to(keys[i].scalar_type()));
    values[i].index_copy_(1, write, vs[0].to(values[i].scalar_type()));
    auto k = (span_end >= 0 ? keys[i].slice(1, span_start, span_end) : keys[i].index_select(1, slots))
                 .unsqueeze(0).to(split[1].scalar_type());
    auto v = (span_end >= 0 ? values[i].slice(1, span_start, span_end) : values[i].index_select(1, slots))
                 .unsqueeze(0).to(vs.scalar_type());
    // rows_apart: one row alone over the whole cache; a chain's row r over the first past + r + 1 keys
    at::Tensor attn;
    if (q == 1) {
      attn = at::scaled_dot_product_attention(qs, k, v, {}, 0.0, false, scaling, gqa);
    } else {
      attn = at::empty_like(qs);
      const int64_t past = k.size(2) - q;
      for (int64_t r = 0; r < q; ++r) {
        auto kr = k.slice(0, 0, 1).slice(2, 0, past + r + 1);
        auto vr = v.slice(0, 0, 1).slice(2, 0, past + r + 1);
        attn.slice(0, 0, 1).slice(2, r, r + 1).copy_(at::scaled_dot_product_attention(
            qs.slice(0, 0, 1).slice(2, r, r + 1), kr, vr, {}, 0.0, false, scaling, gqa));
      }
    }
    x = x + int4_linear(attn.transpose(1, 2).reshape({1, q, heads * head_dim}), packed[4 * i + 1],
                        pairs[4 * i + 1], rows[4 * i + 1]);
    auto gate_up = int4_linear(at::rms_norm(x, {d}, norms[2 * i + 1], eps), packed[4 * i + 2], pairs[4 * i + 2],
                               rows[4 * i + 2]).split(inter, -1);
    x = x + int4_linear(at::silu(gate_up[0]) * gate_up[1], packed[4 * i + 3], pairs[4 * i + 3], rows[4 * i + 3]);
  }
  tapped.insert(tapped.begin(), x);
  return tapped;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_layers", &int4_layers, "the int4 target's decoder layers over one sequence's chain of rows");
}
