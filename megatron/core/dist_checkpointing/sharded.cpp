// Sharded safetensors checkpoints (Note [Sharded safetensors] in sharded.h): the writer adds each
// tensor's boxes to the file's metadata; the index validates a directory's files as one set of
// global tensors and copies any layout's local tensor out of them by box intersection.
#include "megatron/core/dist_checkpointing/sharded.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

namespace megatron::dist_checkpointing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kShardsKey = "shards";

ShardSpec normalized(const ShardSpec& spec, const Shape& local) {
  return spec.global_shape.empty() ? unsharded(local) : spec;
}

std::string dims_str(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

/// The rank of "<stem>_rank<digits>.safetensors", or -1 for any other name.
int64_t rank_of_file(const std::string& file, const std::string& stem) {
  const std::string prefix = stem + "_rank", suffix = ".safetensors";
  if (file.size() <= prefix.size() + suffix.size() || file.rfind(prefix, 0) != 0 ||
      file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string digits = file.substr(prefix.size(), file.size() - prefix.size() - suffix.size());
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

std::vector<int64_t> int_list(const json& j, const std::string& file, const std::string& name, const char* what,
                              size_t dims) {
  MG_CHECK(j.is_array() && j.size() == dims &&
               std::all_of(j.begin(), j.end(), [](const json& d) { return d.is_number_unsigned(); }),
           "shard file '{}': tensor '{}' has {} {} in its shard metadata, expected {} non-negative integers; the file "
           "is corrupt",
           file, name, what, j.dump(), dims);
  return j.get<std::vector<int64_t>>();
}

/// The pieces one file holds of each of its tensors (Note [Sharded safetensors]), checked against the
/// stored tensors' shapes.
std::vector<std::pair<std::string, ShardIndex::Global>> pieces_of_file(const safetensors::File& f, size_t file_index) {
  json shards = json::object();
  if (auto it = f.metadata().find(kShardsKey); it != f.metadata().end()) {
    try {
      shards = json::parse(it->second);
    } catch (const json::exception& e) {
      MG_CHECK(false, "shard file '{}' has shard metadata that is not valid JSON ({}); the file is corrupt", f.path(),
               e.what());
    }
    MG_CHECK(shards.is_object(), "shard file '{}' has shard metadata {}, not a map; the file is corrupt", f.path(),
             shards.dump().substr(0, 200));
  }
  for (const auto& [name, entry] : shards.items()) {
    MG_CHECK(f.contains(name), "shard file '{}' describes tensor '{}' in its shard metadata but does not hold it; the "
             "file is corrupt",
             f.path(), name);
  }
  std::vector<std::pair<std::string, ShardIndex::Global>> out;
  for (const std::string& name : f.names()) {
    const safetensors::Entry& e = f.entry(name);
    ShardIndex::Global g;
    g.dtype = e.dtype;
    auto it = shards.find(name);
    if (it == shards.end()) {  // a whole tensor
      g.shape = e.shape;
      std::vector<int64_t> zeros(e.shape.size(), 0);
      g.pieces.push_back({file_index, ShardBox{zeros, zeros, std::vector<int64_t>(e.shape.begin(), e.shape.end())}});
      out.emplace_back(name, std::move(g));
      continue;
    }
    const size_t nd = e.shape.size();
    MG_CHECK(it->is_object() && it->contains("global_shape") && it->contains("boxes") && it->at("boxes").is_array(),
             "shard file '{}': tensor '{}' has shard metadata {}, expected global_shape and boxes; the file is corrupt",
             f.path(), name, it->dump().substr(0, 200));
    std::vector<int64_t> global = int_list(it->at("global_shape"), f.path(), name, "global_shape", nd);
    g.shape = Shape(global.begin(), global.end());
    for (const json& b : it->at("boxes")) {
      MG_CHECK(b.is_object() && b.contains("global_offset") && b.contains("local_offset") && b.contains("shape"),
               "shard file '{}': tensor '{}' has a box {} without global_offset, local_offset and shape; the file is "
               "corrupt",
               f.path(), name, b.dump());
      ShardBox box{int_list(b.at("global_offset"), f.path(), name, "global_offset", nd),
                   int_list(b.at("local_offset"), f.path(), name, "local_offset", nd),
                   int_list(b.at("shape"), f.path(), name, "box shape", nd)};
      for (size_t d = 0; d < nd; ++d) {
        MG_CHECK(box.global_offset[d] + box.shape[d] <= g.shape[d] && box.local_offset[d] + box.shape[d] <= e.shape[d],
                 "shard file '{}': tensor '{}' has a box at global offset {} / local offset {} of shape {} that does "
                 "not fit its global shape {} or its stored shape {}; the file is corrupt",
                 f.path(), name, dims_str(box.global_offset), dims_str(box.local_offset), dims_str(box.shape),
                 shape_str(g.shape), shape_str(e.shape));
      }
      g.pieces.push_back({file_index, std::move(box)});
    }
    out.emplace_back(name, std::move(g));
  }
  return out;
}

/// A block of `shape` that no piece covers, or nullopt. The pieces' boundaries cut every dimension
/// into intervals; each cell of that grid is either inside a piece or not.
std::optional<ShardBox> uncovered_block(const Shape& shape, const std::vector<ShardIndex::Piece>& pieces) {
  const size_t nd = shape.size();
  if (nd == 0) return pieces.empty() ? std::optional<ShardBox>(ShardBox{}) : std::nullopt;
  if (shape_numel(shape) == 0) return std::nullopt;
  std::vector<std::vector<int64_t>> cuts(nd);
  for (size_t d = 0; d < nd; ++d) {
    std::set<int64_t> c{0, shape[d]};
    for (const auto& p : pieces) {
      c.insert(p.box.global_offset[d]);
      c.insert(p.box.global_offset[d] + p.box.shape[d]);
    }
    cuts[d].assign(c.begin(), c.end());
  }
  std::vector<size_t> cell(nd, 0);
  while (true) {
    bool covered = false;
    for (const auto& p : pieces) {
      bool inside = true;
      for (size_t d = 0; d < nd && inside; ++d)
        inside = p.box.global_offset[d] <= cuts[d][cell[d]] &&
                 cuts[d][cell[d] + 1] <= p.box.global_offset[d] + p.box.shape[d];
      if (inside) {
        covered = true;
        break;
      }
    }
    if (!covered) {
      ShardBox b{std::vector<int64_t>(nd), std::vector<int64_t>(nd, 0), std::vector<int64_t>(nd)};
      for (size_t d = 0; d < nd; ++d) {
        b.global_offset[d] = cuts[d][cell[d]];
        b.shape[d] = cuts[d][cell[d] + 1] - cuts[d][cell[d]];
      }
      return b;
    }
    size_t d = nd;
    while (d > 0 && ++cell[d - 1] + 1 == cuts[d - 1].size()) cell[--d] = 0;
    if (d == 0) return std::nullopt;
  }
}

}  // namespace

std::string shard_file_name(const std::string& stem, int rank) { return fmt::format("{}_rank{:05d}.safetensors", stem, rank); }

safetensors::Metadata shard_metadata(const std::vector<ShardDecl>& tensors, const safetensors::Metadata& metadata) {
  json shards = json::object();
  for (const ShardDecl& t : tensors) {
    const ShardSpec spec = normalized(t.spec, t.local_shape);
    MG_CHECK(local_shape(spec) == t.local_shape,
             "cannot save '{}': its local shape {} is not the shard of global shape {} split on dimension {} into {}",
             t.name, shape_str(t.local_shape), shape_str(spec.global_shape), spec.partition_dim, spec.size);
    json boxes = json::array();
    for (const ShardBox& b : shard_boxes(spec))
      boxes.push_back({{"global_offset", b.global_offset}, {"local_offset", b.local_offset}, {"shape", b.shape}});
    shards[t.name] = {{"global_shape", spec.global_shape}, {"boxes", std::move(boxes)}};
  }
  safetensors::Metadata meta = metadata;
  meta[kShardsKey] = shards.dump();
  return meta;
}

SavedShardFile save_shards(const std::string& dir, const std::string& stem, int rank,
                           const std::vector<ShardedTensor>& tensors, const safetensors::Metadata& metadata) {
  std::vector<std::pair<std::string, Tensor>> items;
  std::vector<ShardDecl> decls;
  for (const ShardedTensor& t : tensors) {
    decls.push_back({t.name, t.local.shape(), t.spec});
    items.emplace_back(t.name, t.local);
  }
  const fs::path path = fs::path(dir) / shard_file_name(stem, rank);
  const uint64_t checksum = safetensors::write(path.string(), items, shard_metadata(decls, metadata));
  return {shard_file_name(stem, rank), fs::file_size(path), checksum};
}

void ShardIndex::expect_checksums(const std::map<std::string, uint64_t>& by_file) {
  expected_checksums_.assign(files_.size(), std::nullopt);
  verified_.assign(files_.size(), false);
  for (size_t i = 0; i < files_.size(); ++i) {
    const std::string name = fs::path(files_[i].path()).filename().string();
    auto it = by_file.find(name);
    MG_CHECK(it != by_file.end(),
             "checkpoint {}: {} has no checksum in metadata.json, so it is not a file this checkpoint was written "
             "with; remove it",
             dir_, name);
    expected_checksums_[i] = it->second;
  }
}

void ShardIndex::verify_files_for(const std::string& name, const ShardSpec& spec_in, const Shape& local_shape) const {
  const Global& g = tensor(name);
  const ShardSpec spec = normalized(spec_in, local_shape);
  for (const ShardBox& want : shard_boxes(spec)) {
    for (const Piece& p : g.pieces) {
      bool overlap = want.shape.size() == p.box.shape.size();
      for (size_t d = 0; overlap && d < want.shape.size(); ++d) {
        overlap = std::max(want.global_offset[d], p.box.global_offset[d]) <
                  std::min(want.global_offset[d] + want.shape[d], p.box.global_offset[d] + p.box.shape[d]);
      }
      if (overlap) verify(p.file);
    }
  }
}

// Note [Checkpoint checksums] (training/checkpointing.h): the whole file, header included.
void ShardIndex::verify(size_t file) const {
  if (file >= expected_checksums_.size() || !expected_checksums_[file] || verified_[file]) return;
  const auto start = std::chrono::steady_clock::now();
  const uint64_t got = files_[file].checksum();
  verify_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MG_CHECK(got == *expected_checksums_[file],
           "checkpoint file {} does not match its checksum in metadata.json (xxh3-64 {:016x}, recorded {:016x}): the "
           "file is corrupt; restore it or load another checkpoint",
           files_[file].path(), got, *expected_checksums_[file]);
  verified_[file] = true;
}

ShardIndex::ShardIndex(const std::string& dir, const std::string& stem) : dir_(dir), stem_(stem) {
  MG_CHECK(fs::is_directory(dir), "checkpoint directory {} does not exist", dir);
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    const int64_t rank = rank_of_file(file, stem);
    if (rank >= 0) found.emplace_back(rank, file);
  }
  MG_CHECK(!found.empty(), "checkpoint {} has no {}_rank*.safetensors files: it is incomplete or not a checkpoint",
           dir, stem);
  std::sort(found.begin(), found.end());
  for (size_t i = 1; i < found.size(); ++i) {
    MG_CHECK(found[i].first != found[i - 1].first, "checkpoint {} has two files for rank {} ({} and {}); remove one",
             dir, found[i].first, found[i - 1].second, found[i].second);
  }
  for (const auto& [rank, file] : found) {
    files_.emplace_back((fs::path(dir) / file).string());
    total_bytes_ += fs::file_size(fs::path(dir) / file);
  }

  for (size_t i = 0; i < files_.size(); ++i) {
    for (auto& [name, g] : pieces_of_file(files_[i], i)) {
      auto it = tensors_.find(name);
      if (it == tensors_.end()) {
        tensors_.emplace(name, std::move(g));
        continue;
      }
      Global& have = it->second;
      const std::string& first = files_[have.pieces.front().file].path();
      MG_CHECK(have.shape == g.shape,
               "checkpoint {}: tensor '{}' has global shape {} in {} but {} in {}; the files are from different "
               "checkpoints",
               dir, name, shape_str(have.shape), first, shape_str(g.shape), files_[i].path());
      MG_CHECK(have.dtype == g.dtype,
               "checkpoint {}: tensor '{}' is {} in {} but {} in {}; the files are from different checkpoints", dir,
               name, to_string(have.dtype), first, to_string(g.dtype), files_[i].path());
      for (Piece& p : g.pieces) have.pieces.push_back(std::move(p));
    }
  }
  for (const auto& [name, g] : tensors_) {
    if (auto hole = uncovered_block(g.shape, g.pieces)) {
      MG_CHECK(false,
               "checkpoint {}: tensor '{}' {} is not fully covered by {}_rank*.safetensors (no file holds the block "
               "at offset {} of shape {}); a rank's file is missing",
               dir, name, shape_str(g.shape), stem, dims_str(hole->global_offset), dims_str(hole->shape));
    }
  }
}

std::vector<std::string> ShardIndex::names() const {
  std::vector<std::string> out;
  for (const auto& [name, g] : tensors_) out.push_back(name);
  return out;
}

const ShardIndex::Global& ShardIndex::tensor(std::string_view name) const {
  auto it = tensors_.find(name);
  MG_CHECK(it != tensors_.end(), "checkpoint {} has no tensor '{}' in its {}_rank*.safetensors files", dir_, name,
           stem_);
  return it->second;
}

uint64_t ShardIndex::load_into(const std::string& name, const ShardSpec& spec_in, Tensor& local) const {
  const Global& g = tensor(name);
  const ShardSpec spec = normalized(spec_in, local.shape());
  MG_CHECK(spec.global_shape == g.shape, "checkpoint {}: tensor '{}' has shape {} there, {} here", dir_, name,
           shape_str(g.shape), shape_str(spec.global_shape));
  const Shape lshape = local_shape(spec);
  MG_CHECK(shape_numel(lshape) == local.numel(), "loading '{}': the local tensor {} is not a shard of shape {}", name,
           local.str(), shape_str(lshape));

  Tensor dst = local.device().is_host() ? local : Tensor::empty(local.shape(), local.dtype());
  auto* out = static_cast<std::byte*>(dst.raw_data());
  const size_t out_size = size_of(dst.dtype());
  const size_t nd = g.shape.size();
  for (const ShardBox& want : shard_boxes(spec)) {
    for (const Piece& p : g.pieces) {
      ShardBox copy{std::vector<int64_t>(nd), std::vector<int64_t>(nd), std::vector<int64_t>(nd)};
      bool empty = false;
      for (size_t d = 0; d < nd; ++d) {
        const int64_t lo = std::max(want.global_offset[d], p.box.global_offset[d]);
        const int64_t hi = std::min(want.global_offset[d] + want.shape[d], p.box.global_offset[d] + p.box.shape[d]);
        if (lo >= hi) {
          empty = true;
          break;
        }
        copy.global_offset[d] = p.box.local_offset[d] + lo - p.box.global_offset[d];  // in the stored tensor
        copy.local_offset[d] = want.local_offset[d] + lo - want.global_offset[d];
        copy.shape[d] = hi - lo;
      }
      if (empty) continue;
      verify(p.file);
      const safetensors::File& f = files_[p.file];
      const safetensors::Entry& e = f.entry(name);
      // Files from this writer are aligned and read in place; others' are read into a copy.
      Tensor copied;
      const std::byte* src = nullptr;
      safetensors::MappedTensor mapped;
      try {
        mapped = f.view(name);
        src = static_cast<const std::byte*>(mapped.data());
      } catch (const Error&) {
        copied = f.read(name);
        src = static_cast<const std::byte*>(copied.raw_data());
      }
      const size_t in_size = size_of(e.dtype);
      // Note [Bounded reads] (safetensors.h): long runs go a chunk at a time, their mapped pages dropped.
      const size_t step = std::max<size_t>(1, (size_t(16) << 20) / in_size);
      for (const FlatRun& r : flat_runs(copy, e.shape, lshape)) {
        for (size_t i = 0; i < size_t(r.count); i += step) {
          const size_t n = std::min(step, size_t(r.count) - i), at = size_t(r.global_start) + i;
          convert_elements(src + at * in_size, e.dtype, out + (size_t(r.local_start) + i) * out_size, dst.dtype(), n);
          if (!copied.defined()) f.release(e.begin + at * in_size, e.begin + (at + n) * in_size);
        }
      }
    }
  }
  if (!local.device().is_host()) local.copy_from(dst);
  return local.nbytes();
}

}  // namespace megatron::dist_checkpointing
