#include "megatron/core/transformer/context_parallel.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "megatron/core/process_groups_config.h"
#include "megatron/kernels/ops.h"

namespace megatron {

CpCommType cp_comm_type_from_string(const std::string& s) {
  if (s == "p2p") return CpCommType::P2P;
  if (s == "all_gather") return CpCommType::AllGather;
  if (s == "a2a") return CpCommType::A2A;
  if (s == "a2a+p2p") return CpCommType::A2AP2P;
  MG_CHECK(false, "--cp-comm-type {}: expected p2p, all_gather, a2a or a2a+p2p", s);
  return CpCommType::P2P;
}

std::string to_string(CpCommType t) {
  switch (t) {
    case CpCommType::P2P: return "p2p";
    case CpCommType::AllGather: return "all_gather";
    case CpCommType::A2A: return "a2a";
    case CpCommType::A2AP2P: return "a2a+p2p";
  }
  return "?";
}

namespace {
// The global chunks of CP rank r of n (Note [Load-balanced chunks]).
std::vector<int64_t> rank_chunks(int64_t r, int64_t n) { return {r, 2 * n - 1 - r}; }
}  // namespace

std::vector<int64_t> cp_positions(int r, int n, int64_t s_global) {
  MG_CHECK(s_global % (2 * n) == 0, "sequence length {} is not divisible by 2 x --context-parallel-size ({})",
           s_global, 2 * n);
  const int64_t c = s_global / (2 * n);
  std::vector<int64_t> pos;
  pos.reserve(size_t(2 * c));
  for (int64_t chunk : rank_chunks(r, n))
    for (int64_t i = 0; i < c; ++i) pos.push_back(chunk * c + i);
  return pos;
}

Tensor cp_split_rows(const Tensor& t, int r, int n) {
  if (!t.defined() || n == 1) return t;
  MG_ASSERT(t.device().is_host() && t.dim() >= 2, "cp_split_rows needs a host [b, s, ...] tensor, got {}", t.str());
  const int64_t b = t.size(0), s = t.size(1);
  MG_CHECK(s % (2 * n) == 0, "sequence length {} is not divisible by 2 x --context-parallel-size ({})", s, 2 * n);
  const int64_t c = s / (2 * n);
  const size_t row = b * s == 0 ? 0 : t.nbytes() / size_t(b * s);
  Shape shape = t.shape();
  shape[1] = s / n;
  Tensor out = Tensor::empty(shape, t.dtype());
  const char* src = static_cast<const char*>(t.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const std::vector<int64_t> chunks = rank_chunks(r, n);
  for (int64_t bi = 0; bi < b; ++bi)
    for (size_t j = 0; j < chunks.size(); ++j)
      std::memcpy(dst + size_t(bi * 2 * c + int64_t(j) * c) * row, src + size_t(bi * s + chunks[j] * c) * row,
                  size_t(c) * row);
  return out;
}

Tensor gather_rows(Context& ctx, const Tensor& x, const std::vector<int64_t>& positions) {
  Shape shape = x.shape();
  shape[0] = int64_t(positions.size());
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  for (size_t i = 0; i < positions.size();) {
    size_t j = i + 1;
    while (j < positions.size() && positions[j] == positions[j - 1] + 1) ++j;
    ops::copy_rows(ctx, x, positions[i], out, int64_t(i), int64_t(j - i));
    i = j;
  }
  return out;
}

namespace {

// The attention options every block shares.
struct Params {
  float scale = 1.0f, dropout_p = 0.0f;
  uint64_t seed = 0, offset = 0;
  int64_t c = 0;  // chunk rows
  const PackedSeqParams* packed = nullptr;
  int64_t window = -1;  // Note [Sliding-window attention]: -1 none
};

// Each block draws its dropout mask from a seed of its chunk pair (replayable, not the
// single-process mask: Note [Context-parallel attention]).
uint64_t block_seed(uint64_t seed, int64_t gq, int64_t gk) {
  return seed ^ (0x9E3779B97F4A7C15ull * uint64_t(gq * 65536 + gk + 1));
}

// Every key visible: j + 0 <= i + sk for all j < sk.
AttnMask full_mask(int64_t sk) { return AttnMask::causal_with_offset(sk, 0); }

// Query chunk gq against key chunk gk (Note [Context-parallel attention]): the rows of each that
// meet, and the mask between them.
struct Block {
  bool visible = false;
  int64_t q0 = 0, q1 = 0, k0 = 0, k1 = 0;  // rows within the two chunks
  AttnMask mask;
};

Block block_of(int64_t gq, int64_t gk, const Params& p) {
  const int64_t c = p.c;
  Block bl;
  if (gk > gq) return bl;
  bl.visible = true;
  bl.q1 = bl.k1 = c;
  // A sliding window counts global positions: query row i of chunk gq is at gq·c + i, key row j of
  // chunk gk at gk·c + j (+ k0 below); a block whose rows all fall outside gives rows without keys.
  if (!p.packed) {
    if (gk == gq) {
      bl.mask = AttnMask::causal().with_window(p.window);
    } else {
      bl.mask = p.window >= 0 ? AttnMask::causal_with_offset(gq * c, gk * c).with_window(p.window) : full_mask(c);
    }
    return bl;
  }
  if (gk == gq) {
    bl.mask = AttnMask::documents(p.packed->chunk_cu_seqlens[size_t(gq)]).with_window(p.window);
    return bl;
  }
  // The one document that may run from chunk gk into chunk gq: the one holding gk's last key.
  const int32_t* cu = p.packed->row(0);
  const int32_t* end = cu + p.packed->max_documents + 1;
  const int64_t last_key = gk * c + c - 1;
  const int64_t t = int64_t(std::upper_bound(cu, end, int32_t(last_key)) - cu) - 1;
  const int64_t doc_begin = cu[t], doc_end = cu[t + 1];
  if (doc_end <= gq * c) {
    bl.visible = false;
    return bl;
  }
  bl.k0 = std::max(doc_begin, gk * c) - gk * c;
  bl.q1 = std::min(doc_end, gq * c + c) - gq * c;
  bl.mask = p.window >= 0 ? AttnMask::causal_with_offset(gq * c, gk * c + bl.k0).with_window(p.window)
                          : full_mask(bl.k1 - bl.k0);
  return bl;
}

// Note [Keys and values of two widths]: keys [R, b, ng, dk] and values [R, b, ng, dv] travel as two
// tensors of the same rows (MLA's keys are qk + pe wide, its values dv), every exchange moving both:
// the ring sends each to the same peer in the same order (so the receives match them under MPI's
// ordering), all_gather and reduce_scatter run once per tensor. Row i of one is row i of the other.
struct Kv {
  Tensor k, v;
};

// One key/value chunk of a buffer: its global chunk index and its first row in k and v.
struct KvChunk {
  int64_t id, row;
};

// The chunks of a buffer whose rows hold `ids`, from row `base`.
std::vector<KvChunk> kv_chunks(const std::vector<int64_t>& ids, int64_t c, int64_t base = 0) {
  std::vector<KvChunk> out;
  for (size_t j = 0; j < ids.size(); ++j) out.push_back({ids[j], base + int64_t(j) * c});
  return out;
}

Kv empty_like(const Kv& x) {
  return {Tensor::empty(x.k.shape(), x.k.dtype(), x.k.device()), Tensor::empty(x.v.shape(), x.v.dtype(), x.v.device())};
}
Kv zeros_like(const Kv& x) {
  return {Tensor::zeros(x.k.shape(), x.k.dtype(), x.k.device()), Tensor::zeros(x.v.shape(), x.v.dtype(), x.v.device())};
}

// Sends `out` to rank `to` while receiving `in` from rank `from` (Note [Keys and values of two widths]).
std::unique_ptr<CommWork> exchange(Context& ctx, Communicator* g, const Kv& out, int to, Kv& in, int from) {
  return g->batch_isend_irecv(
      ctx, {{P2POp::Send, out.k, to}, {P2POp::Send, out.v, to}, {P2POp::Recv, in.k, from}, {P2POp::Recv, in.v, from}});
}

Tensor empty_like_rows(const Tensor& x, int64_t rows) {
  Shape shape = x.shape();
  shape[0] = rows;
  return Tensor::empty(shape, x.dtype(), x.device());
}

// dst = src (same shape and dtype), ordered on the context's stream.
void copy_into(Context& ctx, const Tensor& src, Tensor& dst) { ops::copy_rows(ctx, src, 0, dst, 0, src.size(0)); }

// ---- one block, forward and backward ----

// Query chunk `a` (rows a·c.. of q) against the key chunk `kc` of kv: writes the block's rows of
// out/lse directly (`first`: the chunk's diagonal, which covers every row of it), or merges them in.
void block_forward(Context& ctx, const Tensor& q, int64_t a, int64_t gq, const Kv& kv, const KvChunk& kc,
                   const Block& bl, const Params& p, bool first, Tensor& out, Tensor& lse) {
  const int64_t row0 = a * p.c + bl.q0, rows = bl.q1 - bl.q0;
  Tensor qb = q.slice(row0, row0 + rows);
  Tensor kb = kv.k.slice(kc.row + bl.k0, kc.row + bl.k1), vb = kv.v.slice(kc.row + bl.k0, kc.row + bl.k1);
  Tensor lse_b = Tensor::empty({q.size(1), q.size(2), rows}, DType::Float32, q.device());
  const uint64_t seed = block_seed(p.seed, gq, kc.id);
  if (first) {
    Tensor ob = out.slice(row0, row0 + rows);
    ops::attention_forward(ctx, qb, kb, vb, bl.mask, p.scale, p.dropout_p, seed, p.offset, ob, lse_b);
    ops::lse_copy_rows(ctx, lse_b, 0, lse, row0, rows);
  } else {
    Tensor ob = empty_like_rows(out, rows);
    ops::attention_forward(ctx, qb, kb, vb, bl.mask, p.scale, p.dropout_p, seed, p.offset, ob, lse_b);
    ops::attention_merge(ctx, ob, lse_b, row0, out, lse);
  }
}

// The block's share of the gradients with the merged out/lse, added into dq (rows of q) and dkv
// (the rows of kv).
void block_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& out, const Tensor& lse,
                    int64_t a, int64_t qid, const Kv& kv, const KvChunk& kc, const Block& bl, const Params& p,
                    Tensor& dq, Kv& dkv) {
  const int64_t row0 = a * p.c + bl.q0, rows = bl.q1 - bl.q0, k0 = kc.row + bl.k0, k1 = kc.row + bl.k1;
  Tensor qb = q.slice(row0, row0 + rows), ob = out.slice(row0, row0 + rows), gob = grad_out.slice(row0, row0 + rows);
  Tensor kb = kv.k.slice(k0, k1), vb = kv.v.slice(k0, k1);
  Tensor lse_b = Tensor::empty({q.size(1), q.size(2), rows}, DType::Float32, q.device());
  ops::lse_copy_rows(ctx, lse, row0, lse_b, 0, rows);
  Tensor gq = empty_like_rows(q, rows), gk = empty_like_rows(kb, k1 - k0), gv = empty_like_rows(vb, k1 - k0);
  ops::attention_backward(ctx, gob, qb, kb, vb, ob, lse_b, bl.mask, p.scale, p.dropout_p,
                          block_seed(p.seed, qid, kc.id), p.offset, gq, gk, gv);
  Tensor dqs = dq.slice(row0, row0 + rows);
  ops::add(ctx, dqs, gq, dqs);
  Tensor dks = dkv.k.slice(k0, k1), dvs = dkv.v.slice(k0, k1);
  ops::add(ctx, dks, gk, dks);
  ops::add(ctx, dvs, gv, dvs);
}

// All blocks of the query chunks `mine` (rows of q, in order) against the key chunks `chunks` of
// kv. diagonals_first: the diagonal of each query chunk is among `chunks` and written first.
void blocks_forward(Context& ctx, const Tensor& q, const std::vector<int64_t>& mine, const Kv& kv,
                    const std::vector<KvChunk>& chunks, const Params& p, bool diagonals_first, Tensor& out,
                    Tensor& lse) {
  if (diagonals_first) {
    for (size_t a = 0; a < mine.size(); ++a) {
      auto it = std::find_if(chunks.begin(), chunks.end(), [&](const KvChunk& k) { return k.id == mine[a]; });
      MG_ASSERT(it != chunks.end(), "query chunk {} has no diagonal block here", mine[a]);
      block_forward(ctx, q, int64_t(a), mine[a], kv, *it, block_of(mine[a], mine[a], p), p, true, out, lse);
    }
  }
  for (size_t a = 0; a < mine.size(); ++a)
    for (const KvChunk& k : chunks) {
      if (diagonals_first && k.id == mine[a]) continue;
      const Block bl = block_of(mine[a], k.id, p);
      if (bl.visible) block_forward(ctx, q, int64_t(a), mine[a], kv, k, bl, p, false, out, lse);
    }
}

void blocks_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& out, const Tensor& lse,
                     const std::vector<int64_t>& mine, const Kv& kv, const std::vector<KvChunk>& chunks,
                     const Params& p, Tensor& dq, Kv& dkv) {
  for (size_t a = 0; a < mine.size(); ++a)
    for (const KvChunk& k : chunks) {
      const Block bl = block_of(mine[a], k.id, p);
      if (bl.visible) block_backward(ctx, grad_out, q, out, lse, int64_t(a), mine[a], kv, k, bl, p, dq, dkv);
    }
}

// ---- the ring (p2p) ----

using ChunksOf = std::function<std::vector<int64_t>(int)>;

void ring_forward(Context& ctx, Communicator* ring, const ChunksOf& chunks_of, const Tensor& q, const Tensor& k,
                  const Tensor& v, const Params& p, Tensor& out, Tensor& lse) {
  const int P = group_size(ring), me = group_rank(ring);
  const std::vector<int64_t> mine = chunks_of(me);
  Kv cur{k, v};  // only read: the sends and the blocks share it
  for (int t = 0; t < P; ++t) {
    std::unique_ptr<CommWork> work;
    Kv next;
    if (t + 1 < P) {  // the next step's keys/values travel while this step computes
      next = empty_like(cur);
      work = exchange(ctx, ring, cur, (me + 1) % P, next, (me + P - 1) % P);
    }
    const int owner = (me - t + P) % P;
    blocks_forward(ctx, q, mine, cur, kv_chunks(chunks_of(owner), p.c), p, /*diagonals_first=*/t == 0, out, lse);
    if (work) {
      work->wait();
      cur = next;
    }
  }
}

// dq, dk, dv (shapes of q, k, v) are overwritten.
void ring_backward(Context& ctx, Communicator* ring, const ChunksOf& chunks_of, const Tensor& grad_out,
                   const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                   const Params& p, Tensor& dq, Tensor& dk, Tensor& dv) {
  const int P = group_size(ring), me = group_rank(ring);
  const int next_rank = (me + 1) % P, prev_rank = (me + P - 1) % P;
  const std::vector<int64_t> mine = chunks_of(me);
  Tensor dq_acc = Tensor::zeros(q.shape(), q.dtype(), q.device());
  Kv cur{k, v};
  Kv dkv = zeros_like(cur);  // the gradient of `cur`'s owner
  std::unique_ptr<CommWork> dkv_work;
  Kv dkv_in;  // arriving: the accumulated gradient of the next step's owner
  for (int t = 0; t < P; ++t) {
    std::unique_ptr<CommWork> kv_work;
    Kv next;
    if (t + 1 < P) {
      next = empty_like(cur);
      kv_work = exchange(ctx, ring, cur, next_rank, next, prev_rank);
    }
    const int owner = (me - t + P) % P;
    // This step's share, computed while the owner's gradient so far is still arriving.
    Kv local = t == 0 ? dkv : zeros_like(cur);
    blocks_backward(ctx, grad_out, q, out, lse, mine, cur, kv_chunks(chunks_of(owner), p.c), p, dq_acc, local);
    if (t > 0) {
      dkv_work->wait();
      ops::add(ctx, dkv_in.k, local.k, dkv_in.k);
      ops::add(ctx, dkv_in.v, local.v, dkv_in.v);
      dkv = dkv_in;
    }
    if (P > 1) {  // on to the next rank; after the last step each gradient arrives at its owner
      dkv_in = empty_like(cur);
      dkv_work = exchange(ctx, ring, dkv, next_rank, dkv_in, prev_rank);
    }
    if (kv_work) {
      kv_work->wait();
      cur = next;
    }
  }
  if (P > 1) {
    dkv_work->wait();
    dkv = dkv_in;
  }
  copy_into(ctx, dq_acc, dq);
  copy_into(ctx, dkv.k, dk);
  copy_into(ctx, dkv.v, dv);
}

// ---- Ulysses all-to-all over heads ----

// x [R, b, H, d] (this rank's rows, all heads) -> [A·R, b, H/A, d]: every rank's rows (rank-major)
// for this rank's H/A heads.
Tensor heads_to_sequence(Context& ctx, Communicator& g, const Tensor& x) {
  const int64_t A = g.size(), R = x.size(0), b = x.size(1), H = x.size(2), d = x.size(3);
  MG_CHECK(H % A == 0, "{} attention heads (or key/value groups) on this rank are not divisible by the {} ranks of {}",
           H, A, g.name());
  Tensor t = Tensor::empty({A, R * b, (H / A) * d}, x.dtype(), x.device());
  ops::transpose_01(ctx, x.view({R * b, A, (H / A) * d}), t);
  Tensor out = Tensor::empty({A * R, b, H / A, d}, x.dtype(), x.device());
  g.all_to_all(ctx, t, out)->wait();
  return out;
}

// The reverse: y [A·R, b, H/A, d] -> [R, b, H, d].
Tensor sequence_to_heads(Context& ctx, Communicator& g, const Tensor& y) {
  const int64_t A = g.size(), R = y.size(0) / A, b = y.size(1), Hl = y.size(2), d = y.size(3);
  Tensor t = Tensor::empty({A, R * b, Hl * d}, y.dtype(), y.device());
  g.all_to_all(ctx, y, t)->wait();
  Tensor out = Tensor::empty({R * b, A, Hl * d}, y.dtype(), y.device());
  ops::transpose_01(ctx, t, out);
  return out.view({R, b, A * Hl, d});
}

// Rank-major chunk rows (rank i's chunks i, 2N-1-i) <-> the global order, for x [2N·c, ...].
Tensor to_global_order(Context& ctx, const Tensor& x, int64_t n, int64_t c) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t> ch = rank_chunks(i, n);
    for (size_t j = 0; j < 2; ++j) ops::copy_rows(ctx, x, (2 * i + int64_t(j)) * c, out, ch[j] * c, c);
  }
  return out;
}
Tensor to_rank_order(Context& ctx, const Tensor& x, int64_t n, int64_t c) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t> ch = rank_chunks(i, n);
    for (size_t j = 0; j < 2; ++j) ops::copy_rows(ctx, x, ch[j] * c, out, (2 * i + int64_t(j)) * c, c);
  }
  return out;
}

// The rows of t [H, ...] for the heads this rank of g attends after heads_to_sequence (rank i takes
// the i-th of g.size() blocks); undefined stays undefined.
Tensor head_block(const Tensor& t, const Communicator& g) {
  if (!t.defined()) return t;
  const int64_t n = t.size(0) / g.size();
  return t.slice(g.rank() * n, (g.rank() + 1) * n);
}

// Rank-major gathered rows of every rank's two chunks (rank i's at i·2c) as KvChunks.
std::vector<KvChunk> gathered_chunks(int64_t n, int64_t c) {
  std::vector<KvChunk> chunks;
  for (int64_t i = 0; i < n; ++i)
    for (const KvChunk& kc : kv_chunks(rank_chunks(i, n), c, i * 2 * c)) chunks.push_back(kc);
  return chunks;
}

// Ring member j of a2a+p2p holds the chunks of level-0 group j: CP ranks j·A .. j·A + A - 1.
ChunksOf level0_chunks(int64_t A, int64_t n) {
  return [A, n](int j) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < A; ++i)
      for (int64_t c : rank_chunks(int64_t(j) * A + i, n)) ids.push_back(c);
    return ids;
  };
}

// [rows, b, heads of q, width of v]: the attention output of q's rows and heads.
Tensor empty_out(const Tensor& q, const Tensor& v) {
  return Tensor::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.dtype(), q.device());
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(Communicator* cp, CpCommType type, Communicator* a2a,
                                                   Communicator* ring, int64_t window_left)
    : cp_(cp), type_(type), n_(group_size(cp)), r_(group_rank(cp)), window_left_(window_left) {
  MG_ASSERT(cp && n_ > 1, "context-parallel attention without a context-parallel group");
  switch (type_) {
    case CpCommType::P2P: ring_ = cp; break;
    case CpCommType::A2A: a2a_ = cp; break;
    case CpCommType::AllGather: break;
    case CpCommType::A2AP2P:
      MG_CHECK(a2a && ring, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with two levels");
      MG_ASSERT(a2a->size() * ring->size() == n_, "hierarchical groups {} x {} for context-parallel size {}",
                a2a->size(), ring->size(), n_);
      a2a_ = a2a, ring_ = ring;
      break;
  }
}

// Note [Context-parallel attention sinks]: the sinks fold into whole attention rows (Note [Attention
// sinks]), so each comm type applies them where it holds rows merged over every key: p2p and
// all_gather to this rank's merged rows (all heads); a2a and a2a+p2p to the head-split rows before
// the output's all-to-all, with the sinks of the heads this rank attends (head_block). The backward
// takes the sinks' gradient in the same place, before the blocks' backward; each (row, head) is
// counted on one CP rank, and the data × context gradient reduction sums them.
void ContextParallelAttention::forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const PackedSeqParams* packed, float softmax_scale, float dropout_p,
                                       uint64_t seed, uint64_t offset, const Tensor& sinks, Tensor& out,
                                       Saved& saved) const {
  const int64_t R = q.size(0), b = q.size(1), nq = q.size(2);
  MG_ASSERT(R % 2 == 0, "a context-parallel rank holds two chunks, got {} rows", R);
  MG_ASSERT(k.size(0) == R && v.size(0) == R && k.size(3) == q.size(3) && out.size(3) == v.size(3),
            "context-parallel attention of q {}, k {}, v {} into out {}", q.str(), k.str(), v.str(), out.str());
  MG_CHECK(!packed || b == 1, "packed sequences (--reset-attention-mask) with context parallelism need "
                              "--micro-batch-size 1 (Megatron's THD format), got {}", b);
  Params p{softmax_scale, dropout_p, seed, offset, R / 2, packed, window_left_};
  saved = Saved{};
  switch (type_) {
    case CpCommType::P2P: {
      saved.lse = Tensor::empty({b, nq, R}, DType::Float32, q.device());
      const int64_t n = n_;
      ring_forward(ctx, ring_, [n](int r) { return rank_chunks(r, n); }, q, k, v, p, out, saved.lse);
      break;
    }
    case CpCommType::AllGather: {
      saved.lse = Tensor::empty({b, nq, R}, DType::Float32, q.device());
      Kv all{empty_like_rows(k, n_ * R), empty_like_rows(v, n_ * R)};
      cp_->all_gather(ctx, k, all.k)->wait();
      cp_->all_gather(ctx, v, all.v)->wait();
      const std::vector<int64_t> mine = rank_chunks(r_, n_);
      if (packed) {  // block by block (Note [Context-parallel attention])
        blocks_forward(ctx, q, mine, all, gathered_chunks(n_, p.c), p, true, out, saved.lse);
        saved.k_all = all.k, saved.v_all = all.v;
        break;
      }
      // The keys/values in the global order; each query chunk attends to the prefix it sees.
      saved.k_all = to_global_order(ctx, all.k, n_, p.c);
      saved.v_all = to_global_order(ctx, all.v, n_, p.c);
      for (size_t a = 0; a < 2; ++a) {
        const int64_t g = mine[a], keys = (g + 1) * p.c;
        Tensor qa = q.slice(int64_t(a) * p.c, int64_t(a + 1) * p.c), oa = out.slice(int64_t(a) * p.c, int64_t(a + 1) * p.c);
        Tensor lse_a = Tensor::empty({b, nq, p.c}, DType::Float32, q.device());
        ops::attention_forward(ctx, qa, saved.k_all.slice(0, keys), saved.v_all.slice(0, keys),
                               AttnMask::causal_with_offset(g * p.c, 0).with_window(p.window), softmax_scale,
                               dropout_p, block_seed(seed, g, -1), offset, oa, lse_a);
        ops::lse_copy_rows(ctx, lse_a, 0, saved.lse, int64_t(a) * p.c, p.c);
      }
      break;
    }
    case CpCommType::A2A: {
      saved.q = to_global_order(ctx, heads_to_sequence(ctx, *a2a_, q), n_, p.c);
      saved.k = to_global_order(ctx, heads_to_sequence(ctx, *a2a_, k), n_, p.c);
      saved.v = to_global_order(ctx, heads_to_sequence(ctx, *a2a_, v), n_, p.c);
      saved.out = empty_out(saved.q, saved.v);
      saved.lse = Tensor::empty({b, saved.q.size(2), saved.q.size(0)}, DType::Float32, q.device());
      ops::attention_forward(ctx, saved.q, saved.k, saved.v,
                             (packed ? packed->mask() : AttnMask::causal()).with_window(p.window), softmax_scale,
                             dropout_p, block_seed(seed, a2a_->rank(), -1), offset, saved.out, saved.lse);
      if (sinks.defined())  // Note [Context-parallel attention sinks]
        ops::attention_sink_forward(ctx, saved.out, saved.lse, head_block(sinks, *a2a_), saved.out, saved.lse);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, to_rank_order(ctx, saved.out, n_, p.c)), out);
      return;
    }
    case CpCommType::A2AP2P: {
      saved.q = heads_to_sequence(ctx, *a2a_, q);
      saved.k = heads_to_sequence(ctx, *a2a_, k);
      saved.v = heads_to_sequence(ctx, *a2a_, v);
      saved.out = empty_out(saved.q, saved.v);
      saved.lse = Tensor::empty({b, saved.q.size(2), saved.q.size(0)}, DType::Float32, q.device());
      ring_forward(ctx, ring_, level0_chunks(a2a_->size(), n_), saved.q, saved.k, saved.v, p, saved.out, saved.lse);
      if (sinks.defined())
        ops::attention_sink_forward(ctx, saved.out, saved.lse, head_block(sinks, *a2a_), saved.out, saved.lse);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, saved.out), out);
      return;
    }
  }
  // p2p, all_gather: this rank's rows, merged over every key.
  if (sinks.defined()) ops::attention_sink_forward(ctx, out, saved.lse, sinks, out, saved.lse);
}

void ContextParallelAttention::backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& out, const PackedSeqParams* packed,
                                        float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset,
                                        const Tensor& sinks, Tensor& sinks_grad, Saved& saved, Tensor& grad_q,
                                        Tensor& grad_k, Tensor& grad_v) const {
  const int64_t R = q.size(0), b = q.size(1), nq = q.size(2);
  Params p{softmax_scale, dropout_p, seed, offset, R / 2, packed, window_left_};
  if (sinks.defined() && (type_ == CpCommType::P2P || type_ == CpCommType::AllGather))
    ops::attention_sink_backward(ctx, grad_out, out, saved.lse, sinks, sinks_grad);
  switch (type_) {
    case CpCommType::P2P: {
      const int64_t n = n_;
      ring_backward(ctx, ring_, [n](int r) { return rank_chunks(r, n); }, grad_out, q, k, v, out, saved.lse, p, grad_q,
                    grad_k, grad_v);
      return;
    }
    case CpCommType::AllGather: {
      const std::vector<int64_t> mine = rank_chunks(r_, n_);
      Kv dkv_all;  // the gathered layout (rank-major)
      if (packed) {
        const Kv all{saved.k_all, saved.v_all};
        Tensor dq = Tensor::zeros(q.shape(), q.dtype(), q.device());
        dkv_all = zeros_like(all);
        blocks_backward(ctx, grad_out, q, out, saved.lse, mine, all, gathered_chunks(n_, p.c), p, dq, dkv_all);
        copy_into(ctx, dq, grad_q);
      } else {
        Tensor dk_all = Tensor::zeros(saved.k_all.shape(), k.dtype(), k.device());
        Tensor dv_all = Tensor::zeros(saved.v_all.shape(), v.dtype(), v.device());
        for (size_t a = 0; a < 2; ++a) {
          const int64_t g = mine[a], keys = (g + 1) * p.c, r0 = int64_t(a) * p.c;
          Tensor lse_a = Tensor::empty({b, nq, p.c}, DType::Float32, q.device());
          ops::lse_copy_rows(ctx, saved.lse, r0, lse_a, 0, p.c);
          Tensor gq = grad_q.slice(r0, r0 + p.c);  // one block per query chunk: written directly
          Tensor gk = empty_like_rows(k, keys), gv = empty_like_rows(v, keys);
          ops::attention_backward(ctx, grad_out.slice(r0, r0 + p.c), q.slice(r0, r0 + p.c), saved.k_all.slice(0, keys),
                                  saved.v_all.slice(0, keys), out.slice(r0, r0 + p.c), lse_a,
                                  AttnMask::causal_with_offset(g * p.c, 0).with_window(p.window), softmax_scale,
                                  dropout_p, block_seed(seed, g, -1), offset, gq, gk, gv);
          Tensor dks = dk_all.slice(0, keys), dvs = dv_all.slice(0, keys);
          ops::add(ctx, dks, gk, dks);
          ops::add(ctx, dvs, gv, dvs);
        }
        dkv_all = {to_rank_order(ctx, dk_all, n_, p.c), to_rank_order(ctx, dv_all, n_, p.c)};
      }
      cp_->reduce_scatter(ctx, dkv_all.k, grad_k)->wait();
      cp_->reduce_scatter(ctx, dkv_all.v, grad_v)->wait();
      return;
    }
    case CpCommType::A2A: {
      Tensor go = to_global_order(ctx, heads_to_sequence(ctx, *a2a_, grad_out), n_, p.c);
      if (sinks.defined()) {  // Note [Context-parallel attention sinks]
        Tensor g = head_block(sinks_grad, *a2a_);
        ops::attention_sink_backward(ctx, go, saved.out, saved.lse, head_block(sinks, *a2a_), g);
      }
      Tensor gq = empty_like_rows(saved.q, saved.q.size(0)), gk = empty_like_rows(saved.k, saved.k.size(0)),
             gv = empty_like_rows(saved.v, saved.v.size(0));
      ops::attention_backward(ctx, go, saved.q, saved.k, saved.v, saved.out, saved.lse,
                              (packed ? packed->mask() : AttnMask::causal()).with_window(p.window), softmax_scale,
                              dropout_p, block_seed(seed, a2a_->rank(), -1), offset, gq, gk, gv);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, to_rank_order(ctx, gq, n_, p.c)), grad_q);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, to_rank_order(ctx, gk, n_, p.c)), grad_k);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, to_rank_order(ctx, gv, n_, p.c)), grad_v);
      return;
    }
    case CpCommType::A2AP2P: {
      Tensor go = heads_to_sequence(ctx, *a2a_, grad_out);
      if (sinks.defined()) {
        Tensor g = head_block(sinks_grad, *a2a_);
        ops::attention_sink_backward(ctx, go, saved.out, saved.lse, head_block(sinks, *a2a_), g);
      }
      Tensor dq = empty_like_rows(saved.q, saved.q.size(0)), dk = empty_like_rows(saved.k, saved.k.size(0)),
             dv = empty_like_rows(saved.v, saved.v.size(0));
      ring_backward(ctx, ring_, level0_chunks(a2a_->size(), n_), go, saved.q, saved.k, saved.v, saved.out, saved.lse,
                    p, dq, dk, dv);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, dq), grad_q);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, dk), grad_k);
      copy_into(ctx, sequence_to_heads(ctx, *a2a_, dv), grad_v);
      return;
    }
  }
}

}  // namespace megatron
