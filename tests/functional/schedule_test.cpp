// pretrain_gpt with the flags of Megatron-LM's own runs prints the learning rates Megatron printed
// (fixtures/megatron_schedules.json: five schedules, every iteration), with the same consumed
// samples and global batch size.
#include <nlohmann/json.hpp>

#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

TEST(Schedules, PretrainGptPrintsMegatronsLearningRates) {
  const fs::path path = fs::absolute(fixtures_dir()) / "megatron_schedules.json";
  nlohmann::json fixture = nlohmann::json::parse(read_file(path));
  const std::string about = fixture.at("about");
  const std::string common = about.substr(about.find("Common flags: ") + 14);
  ScratchDir dir("schedules");
  int configs = 0;
  for (const auto& [name, cfg] : fixture.at("configs").items()) {
    std::vector<std::string> argv = {bin("pretrain_gpt")};
    for (const std::string& w : split_words(common)) argv.push_back(w);
    for (const std::string& w : split_words(cfg.at("flags"))) argv.push_back(w);
    argv.insert(argv.end(), {"--device", "cpu"});
    RunResult r = run(argv, dir.path);
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.output;
    std::vector<std::string> lrs = field_values(r.output, "learning rate");
    std::vector<std::string> consumed = field_values(r.output, "consumed samples");
    std::vector<std::string> gbs = field_values(r.output, "global batch size");
    const auto& rows = cfg.at("rows");
    ASSERT_EQ(lrs.size(), rows.size()) << name;
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(lrs[i], rows[i][2].get<std::string>()) << name << " iteration " << rows[i][0];
      EXPECT_EQ(consumed[i], std::to_string(rows[i][1].get<int64_t>())) << name << " iteration " << rows[i][0];
      EXPECT_EQ(gbs[i], std::to_string(rows[i][3].get<int64_t>())) << name << " iteration " << rows[i][0];
    }
    ++configs;
  }
  EXPECT_EQ(configs, 5);
}

}  // namespace
}  // namespace megatron::testing
