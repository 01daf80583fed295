// PackedSeqParams (Megatron-Core's packed_seq_params.py): the documents packed into the sequences
// of one microbatch, and AttentionInputs, what every attention layer of a microbatch shares
// (Megatron hands rotary_pos_emb and packed_seq_params down the decoder).
//
// Note [Packed sequences]: with --reset-attention-mask a sequence of the data holds several
// documents, each ending with an EOD token (the EOD belongs to the document it ends, as in
// Megatron's get_ltor_masks_and_position_ids), and attention stays inside each document. The data
// loader gives the EOD count before each position (GPTSample::attention_segments); the documents
// of batch row i are the runs of equal counts, written as cumulative lengths cu_seqlens
// [b, n + 1] (rows with fewer documents repeat s at their end: empty documents), which the
// attention ops take as their Documents mask (Note [Attention masks] in kernels/op_list.inc; on the
// GPU cuDNN's ragged layout, Megatron's THD format with PackedSeqParams). RoPE needs no reset: it
// rotates by position, and a score depends only on the difference of two positions, so a document
// sees the same attention wherever it sits (--reset-position-ids resets the learned position
// embeddings' ids, as in Megatron). Under context parallelism the documents stay global: each
// rank cuts its blocks from the host copy (Note [Context-parallel attention]).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

struct PackedSeqParams {
  /// int32 [b, n + 1] on the model's device: the attention ops' Documents mask.
  Tensor cu_seqlens;
  /// The same on the host, row-major [b][n + 1], in positions of the whole sequence.
  std::vector<int32_t> cu_seqlens_host;
  int64_t batch = 0, max_documents = 0;  // b and n
  int64_t seq_length = 0;                // s: the whole (not context-parallel) sequence
  /// Context parallelism (micro-batch 1): the documents inside each of the 2N chunks, chunk g as
  /// int32 [n_g + 1] on the device in rows of the chunk (Note [Context-parallel attention]).
  std::vector<Tensor> chunk_cu_seqlens;

  AttnMask mask() const { return AttnMask::documents(cu_seqlens); }
  /// Document boundaries of batch row i: cu[0] = 0 <= cu[1] <= ... <= cu[n] = s.
  const int32_t* row(int64_t i) const { return cu_seqlens_host.data() + i * (max_documents + 1); }
};

/// cu_seqlens int32 [b, n + 1] (host) from the EOD counts per position, segments int32 [b, s]
/// (host): a new document starts where the count changes (Note [Packed sequences]).
Tensor cu_seqlens_from_segments(const Tensor& segments);

/// PackedSeqParams from host cu_seqlens int32 [b, n + 1], checked (0 first, non-decreasing, s
/// last), with its device copy on `device`.
PackedSeqParams make_packed_seq_params(const Tensor& cu_seqlens, Device device);

/// Fills p.chunk_cu_seqlens for 2·cp_size chunks of the sequence (p.batch must be 1).
void add_context_parallel_chunks(PackedSeqParams& p, int cp_size, Device device);

/// What the attention layers of one microbatch share.
struct AttentionInputs {
  Tensor freqs;                             // rotary angles of this rank's positions [s, r/2]; undefined: no RoPE
  std::shared_ptr<const PackedSeqParams> packed;  // documents (Note [Packed sequences]); null: causal
};

}  // namespace megatron
