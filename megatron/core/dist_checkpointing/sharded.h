// Sharded checkpoints (Megatron's dist_checkpointing, our format): every rank writes the tensors it
// owns as they sit in its memory, and a reader of any other parallel layout assembles the pieces
// its own layout needs.
//
// Note [Sharded safetensors]
// A rank's file is "<stem>_rank<NNNNN>.safetensors" (NNNNN the world rank). It holds each local
// tensor under the global tensor's name, and its "__metadata__" carries, under "shards", a JSON map
//   {name: {"global_shape": [..], "boxes": [{"global_offset": [..], "local_offset": [..],
//                                            "shape": [..]}, ..]}}
// — the rectangles of the global tensor the local tensor holds (parameter.h's ShardBox: one box, or
// one per chunk for SwiGLU's [gate; up]). A tensor without an entry is whole (a file written before
// this format, or by another writer): one box covering its own shape.
//
// ShardIndex opens every "<stem>_rank*.safetensors" of a checkpoint directory (memory-mapped,
// headers validated by safetensors::File), checks that the pieces of each global tensor agree on
// its shape and dtype and cover it completely (overlaps are allowed: duplicated pieces hold the same
// values), and load_into() fills a local tensor of any layout: for each of its boxes and each
// stored box it intersects, the intersection is copied as flat runs (parameter.h's flat_runs),
// converting the dtype when the checkpoint's differs from the local tensor's (bf16 model weights
// into fp32, or back).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/parameter.h"
#include "megatron/runtime/tensor.h"

namespace megatron::dist_checkpointing {

/// A local tensor and where it sits in the global one. An empty spec.global_shape means whole.
struct ShardedTensor {
  std::string name;
  Tensor local;  // any device; shape local_shape(spec)
  ShardSpec spec;
};

/// "<stem>_rank00003.safetensors".
std::string shard_file_name(const std::string& stem, int rank);

/// A file save_shards wrote: its name in the directory, size and XXH3-64 checksum.
struct SavedShardFile {
  std::string file;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

/// A tensor of a shard file as declared before its data exists (a streaming writer's layout).
struct ShardDecl {
  std::string name;
  Shape local_shape;
  ShardSpec spec;  // empty global_shape: whole
};

/// `metadata` with the shard table of Note [Sharded safetensors] for `tensors`: what save_shards
/// writes, for a safetensors::Writer that writes the file tensor by tensor.
safetensors::Metadata shard_metadata(const std::vector<ShardDecl>& tensors, const safetensors::Metadata& metadata = {});

/// Writes `tensors` (names unique) as `dir`/shard_file_name(stem, rank), atomically (safetensors::write:
/// temporary file, fsync, rename), with the shard metadata of Note [Sharded safetensors] and
/// `metadata`.
SavedShardFile save_shards(const std::string& dir, const std::string& stem, int rank,
                           const std::vector<ShardedTensor>& tensors, const safetensors::Metadata& metadata = {});

/// The shard files of one stem in a checkpoint directory, validated as one set of global tensors.
class ShardIndex {
 public:
  /// One stored piece of a global tensor: a box of the tensor stored in files()[file].
  struct Piece {
    size_t file = 0;
    ShardBox box;
  };
  struct Global {
    Shape shape;
    DType dtype = DType::Float32;
    std::vector<Piece> pieces;
  };

  /// Opens every `stem`_rank*.safetensors file in `dir` (throws megatron::Error with one line naming
  /// the file and tensor on anything inconsistent, and when there is no such file).
  ShardIndex(const std::string& dir, const std::string& stem);

  const std::string& dir() const { return dir_; }
  /// The open files, by ascending rank.
  const std::vector<safetensors::File>& files() const { return files_; }
  /// The sum of the files' sizes.
  uint64_t total_bytes() const { return total_bytes_; }

  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  /// Global tensor names in ascending order.
  std::vector<std::string> names() const;
  /// The global tensor `name` (a megatron::Error naming the directory when there is none).
  const Global& tensor(std::string_view name) const;

  /// Fills `local` (any dtype, any device) with the part of global tensor `name` that `spec`
  /// describes (empty spec.global_shape: the whole tensor). The spec's global shape must equal the
  /// checkpoint's. Returns the bytes written into `local`.
  uint64_t load_into(const std::string& name, const ShardSpec& spec, Tensor& local) const;

  /// The expected XXH3-64 checksum of each file by its name in the directory: load_into() verifies a
  /// file the first time it reads from it (so a rank checks only the files it reads) and throws
  /// megatron::Error naming the file when it does not match. Every file of the index must be listed.
  void expect_checksums(const std::map<std::string, uint64_t>& by_file);
  /// Verifies (expect_checksums) every file that load_into(name, spec, a tensor of `local_shape`)
  /// would read, without copying: lets a rank find a corrupt file before a collective.
  void verify_files_for(const std::string& name, const ShardSpec& spec, const Shape& local_shape) const;
  /// Seconds spent verifying checksums so far.
  double verify_seconds() const { return verify_seconds_; }

 private:
  std::string dir_;
  std::string stem_;
  std::vector<safetensors::File> files_;
  std::map<std::string, Global, std::less<>> tensors_;
  uint64_t total_bytes_ = 0;
  void verify(size_t file) const;
  std::vector<std::optional<uint64_t>> expected_checksums_;  // by file index
  mutable std::vector<bool> verified_;
  mutable double verify_seconds_ = 0;
};

}  // namespace megatron::dist_checkpointing
