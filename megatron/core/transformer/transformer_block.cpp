#include "megatron/core/transformer/transformer_block.h"

#include <fmt/format.h>

namespace megatron {

namespace {
// Segments over the local layers (Megatron applies the recompute settings per pipeline stage).
std::vector<TransformerBlock::Segment> plan_segments(const TransformerConfig& c, int n) {
  std::vector<TransformerBlock::Segment> segs;
  const bool full = c.recompute_granularity == "full";
  if (full && c.recompute_method == "uniform") {
    for (int i = 0; i < n; i += c.recompute_num_layers) {
      segs.push_back({i, std::min(i + c.recompute_num_layers, n), true});
    }
    return segs;
  }
  for (int i = 0; i < n; ++i) segs.push_back({i, i + 1, full && i < c.recompute_num_layers});
  return segs;
}

LayerRange resolve(const TransformerConfig& c, LayerRange r) { return r.count > 0 ? r : LayerRange{0, c.num_layers}; }

// Builds the layers before the final norm so parameters register in Megatron's order.
std::vector<std::unique_ptr<TransformerLayer>> build_layers(const TransformerConfig& c,
                                                            const TransformerBlockSpec& spec,
                                                            ParamAndGradBuffer& params, const std::string& prefix,
                                                            const ProcessGroupCollection& pg, LayerRange r) {
  MG_CHECK(int64_t(spec.layers.size()) == c.num_layers, "the block spec has {} layer specs for {} layers",
           spec.layers.size(), c.num_layers);
  std::vector<std::unique_ptr<TransformerLayer>> layers;
  for (int i = r.first; i < r.first + r.count; ++i) {
    layers.push_back(std::make_unique<TransformerLayer>(c, spec.layers[size_t(i)], params,
                                                        fmt::format("{}.layers.{}", prefix, i), pg, i));
  }
  return layers;
}
}  // namespace

TransformerBlock::TransformerBlock(const TransformerConfig& config, const TransformerBlockSpec& spec,
                                   ParamAndGradBuffer& params, const std::string& prefix,
                                   const ProcessGroupCollection& pg, LayerRange range, bool final_norm)
    : selective_(config.recompute_granularity == "selective"),
      segments_(plan_segments(config, resolve(config, range).count)),
      first_layer_(resolve(config, range).first),
      layers_(build_layers(config, spec, params, prefix, pg, resolve(config, range))) {
  if (final_norm) {
    final_layernorm_ = std::make_unique<Norm>(config, spec.final_layernorm, params, prefix + ".final_layernorm", pg);
  }
}

Tensor TransformerBlock::run_segment(Context& ctx, const Segment& seg, const Tensor& x, const AttentionInputs& in,
                                     Saved& saved, bool keep, bool report_aux_losses) const {
  Tensor h = x;
  for (int i = seg.begin; i < seg.end; ++i) {
    TransformerLayer::Saved layer_saved;
    uint64_t base = saved.rng_base + uint64_t(first_layer_ + i) * TransformerLayer::kRandomStreams;
    h = layers_[size_t(i)]->forward(ctx, h, in, base, /*keep_core_attention=*/!selective_, layer_saved,
                                    aux_losses_, report_aux_losses);
    if (keep) saved.layers[size_t(i)] = std::move(layer_saved);
  }
  return h;
}

Tensor TransformerBlock::forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t rng_base,
                                 Saved& saved) const {
  saved.rng_base = rng_base;
  saved.layers.assign(layers_.size(), TransformerLayer::Saved{});
  saved.segment_inputs.clear();
  Tensor h = x;
  for (const Segment& seg : segments_) {
    saved.segment_inputs.push_back(seg.recompute ? h : Tensor());
    h = run_segment(ctx, seg, h, in, saved, /*keep=*/!seg.recompute, /*report_aux_losses=*/true);
  }
  if (!final_layernorm_) return h;
  const int64_t s = h.size(0), b = h.size(1), hid = h.size(2);
  return final_layernorm_->forward(ctx, h.view({s * b, hid}), saved.final_norm).view({s, b, hid});
}

Tensor TransformerBlock::backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const {
  const int64_t s = grad_out.size(0), b = grad_out.size(1), hid = grad_out.size(2);
  Tensor g = final_layernorm_
                 ? final_layernorm_->backward(ctx, grad_out.view({s * b, hid}), saved.final_norm).view({s, b, hid})
                 : grad_out;
  saved.final_norm = Norm::Saved{};
  for (size_t k = segments_.size(); k-- > 0;) {
    const Segment& seg = segments_[k];
    if (seg.recompute) {  // the losses were reported by the first pass
      run_segment(ctx, seg, saved.segment_inputs[k], in, saved, /*keep=*/true, /*report_aux_losses=*/false);
    }
    for (int i = seg.end; i-- > seg.begin;) {
      g = layers_[size_t(i)]->backward(ctx, g, in, saved.layers[size_t(i)]);
      saved.layers[size_t(i)] = TransformerLayer::Saved{};  // free as we go
    }
    saved.segment_inputs[k] = Tensor();
  }
  return g;
}

// ---- inference ---------------------------------------------------------------------------------

Tensor TransformerBlock::forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                                           std::vector<Tensor>& keys, std::vector<Tensor>& values) const {
  MG_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "the KV cache has {} layers, the model {}",
           keys.size(), layers_.size());
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    h = layers_[i]->forward_inference(ctx, h, freqs, rows, keys[i], values[i]);
  }
  const int64_t s = h.size(0), b = h.size(1), hid = h.size(2);
  Norm::Saved final_norm;
  MG_ASSERT(final_layernorm_, "inference needs the whole decoder");
  return final_layernorm_->forward(ctx, h.view({s * b, hid}), final_norm).view({s, b, hid});
}

}  // namespace megatron
