// Parsing a command line in the training tests: the flags after "pretrain_gpt", parsed as the binary does.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "megatron/training/arguments.h"

namespace megatron::testing {

inline Arguments parse(const std::vector<std::string>& flags) {
  std::vector<const char*> argv = {"pretrain_gpt"};
  for (const std::string& f : flags) argv.push_back(f.c_str());
  auto a = parse_args(int(argv.size()), argv.data(), "test");
  EXPECT_TRUE(a.has_value());
  return *a;
}

}  // namespace megatron::testing
