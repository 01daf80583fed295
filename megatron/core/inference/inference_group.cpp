#include "megatron/core/inference/inference_group.h"

#include <array>
#include <map>
#include <memory>

#include "megatron/runtime/check.h"

namespace megatron {

void InferenceGroup::announce(Context& ctx, const std::array<int64_t, kHeaderSize - 1>& fields,
                              const std::vector<int64_t>& payload) {
  MG_ASSERT(leader(), "only rank 0 of the inference group announces work");
  std::vector<int64_t> header(fields.begin(), fields.end());
  header.resize(kHeaderSize, int64_t(payload.size()));
  Tensor h = Tensor::from_ints(header, {kHeaderSize}, DType::Int64, ctx.device());
  group_.broadcast(ctx, h, 0)->wait();
  if (payload.empty()) return;
  Tensor p = Tensor::from_ints(payload, {int64_t(payload.size())}, DType::Int64, ctx.device());
  group_.broadcast(ctx, p, 0)->wait();
}

void InferenceGroup::announce_forward(Context& ctx, int64_t cache_id, const KVCache& cache, const Tensor& tokens,
                                      const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& output_rows) {
  const int64_t b = tokens.size(0), s = tokens.size(1);
  std::vector<int64_t> payload = tokens.to_ints();
  payload.insert(payload.end(), slots.begin(), slots.end());
  payload.insert(payload.end(), starts.begin(), starts.end());
  payload.insert(payload.end(), output_rows.begin(), output_rows.end());
  announce(ctx, {kForward, cache_id, cache.num_slots(), cache.max_length(), b, s}, payload);
}

void InferenceGroup::announce_copy_slots(Context& ctx, int64_t cache_id, const KVCache& cache,
                                         const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  std::vector<int64_t> payload;
  for (const auto& [from, to] : pairs) payload.insert(payload.end(), {from, to});
  announce(ctx, {kCopySlots, cache_id, cache.num_slots(), cache.max_length(), 0, 0}, payload);
}

void InferenceGroup::heartbeat(Context& ctx) { announce(ctx, {kHeartbeat, 0, 0, 0, 0, 0}, {}); }

void InferenceGroup::stop(Context& ctx) { announce(ctx, {kStop, 0, 0, 0, 0, 0}, {}); }

void InferenceGroup::follow(const GPTModel& model, Context& ctx) {
  MG_ASSERT(!leader(), "rank 0 of the inference group leads; it does not follow");
  std::map<int64_t, std::unique_ptr<KVCache>> caches;
  // The cache `id` of the leader's dimensions (Note [Tensor-parallel inference]).
  auto cache_of = [&](int64_t id, int64_t slots, int64_t length) -> KVCache& {
    std::unique_ptr<KVCache>& c = caches[id];
    if (!c || c->num_slots() != slots || c->max_length() != length) {
      c.reset();  // freed before the new one is made
      c = std::make_unique<KVCache>(model.config(), slots, length, ctx.device());
    }
    return *c;
  };
  while (true) {
    Tensor h = Tensor::empty({kHeaderSize}, DType::Int64, ctx.device());
    group_.broadcast(ctx, h, 0)->wait();
    const std::vector<int64_t> header = h.to_ints();
    const int64_t command = header[0], cache_id = header[1], cache_slots = header[2], cache_length = header[3];
    const int64_t b = header[4], s = header[5], n = header[6];
    std::vector<int64_t> payload;
    if (n > 0) {
      Tensor p = Tensor::empty({n}, DType::Int64, ctx.device());
      group_.broadcast(ctx, p, 0)->wait();
      payload = p.to_ints();
    }
    switch (command) {
      case kHeartbeat:
        break;
      case kStop:
        return;
      case kForward: {
        MG_ASSERT(n >= b * s + 2 * b, "a forward announcement of {} values for {} x {} tokens", n, b, s);
        auto at = payload.begin();
        Tensor tokens = Tensor::from_ints(std::vector<int64_t>(at, at + b * s), {b, s}, DType::Int64, ctx.device());
        at += b * s;
        const std::vector<int64_t> slots(at, at + b), starts(at + b, at + 2 * b), rows(at + 2 * b, payload.end());
        model.forward_inference(ctx, tokens, slots, starts, cache_of(cache_id, cache_slots, cache_length), rows);
        break;
      }
      case kCopySlots: {
        std::vector<std::pair<int64_t, int64_t>> pairs;
        for (int64_t i = 0; i + 1 < n; i += 2) pairs.emplace_back(payload[size_t(i)], payload[size_t(i + 1)]);
        cache_of(cache_id, cache_slots, cache_length).copy_slots(pairs);
        break;
      }
      default:
        MG_ASSERT(false, "unknown inference command {} from the leader", command);
    }
  }
}

}  // namespace megatron
