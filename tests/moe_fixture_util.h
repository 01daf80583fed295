// The routing fixtures of ../shared/fixtures/moe (router_<config>.safetensors, made with Megatron's
// own routing functions; README there): their names and the RouterConfig their metadata describes.
// Shared by the CPU routing tests, the op tests and the GPU op tests.
#pragma once

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/transformer/moe/moe_utils.h"
#include "tests/test_util.h"

namespace megatron::testing {

/// Every router_*.safetensors in moe_fixtures_dir(), sorted.
inline std::vector<std::string> router_fixtures() {
  std::vector<std::string> out;
  const std::string dir = moe_fixtures_dir();
  if (!std::filesystem::is_directory(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("router_", 0) == 0 && f.size() > 12 && f.substr(f.size() - 12) == ".safetensors") out.push_back(f);
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// The fixture's options (its metadata's "options" JSON) as a RouterConfig; an option not
/// understood is a test failure (a fixture made with more options must not pass by ignoring them).
inline moe::RouterConfig router_fixture_config(const safetensors::File& f) {
  const auto& m = f.metadata();
  moe::RouterConfig c;
  c.num_experts = std::stoi(m.at("experts"));
  c.topk = std::stoi(m.at("topk"));
  const nlohmann::json o = nlohmann::json::parse(m.at("options"));
  for (const auto& [key, value] : o.items()) {
    if (key == "aux") c.aux_loss_coeff = value.get<float>();
    else if (key == "seq_aux") c.seq_aux_loss_coeff = value.get<float>();
    else if (key == "z") c.z_loss_coeff = value.get<float>();
    else if (key == "pre_softmax") c.pre_softmax = value.get<bool>();
    else if (key == "score") c.score_function = value.get<std::string>();
    else if (key == "groups") c.num_groups = value.get<int>();
    else if (key == "group_topk") c.group_topk = value.get<int>();
    else if (key == "scale") c.topk_scaling_factor = value.get<float>();
    else if (key == "bias") c.expert_bias = value.get<bool>();
    else if (key == "capacity") c.capacity_factor = value.get<float>();
    else if (key == "pad") c.pad_to_capacity = value.get<bool>();
    else if (key == "drop_policy") c.drop_policy = value.get<std::string>();
    else ADD_FAILURE() << "option '" << key << "' is not understood: extend router_fixture_config";
  }
  return c;
}

}  // namespace megatron::testing
