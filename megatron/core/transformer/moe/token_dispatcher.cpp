#include "megatron/core/transformer/moe/token_dispatcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

MoETokenDispatcher::MoETokenDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg)
    : config_(config), ep_(multi_rank(pg.ep)), etp_(multi_rank(pg.expt_tp)), tp_ep_(multi_rank(pg.tp_ep)) {
  const int ep = group_size(ep_), etp = group_size(etp_);
  MG_CHECK(config.num_experts > 0 && config.num_experts % ep == 0,
           "--num-experts ({}) must be divisible by --expert-model-parallel-size ({})", config.num_experts, ep);
  MG_CHECK(config.capacity >= 0, "expert capacity {} must be >= 0 (0: no padding)", config.capacity);
  MG_CHECK(!config.pad_capacity_factor || config.topk > 0, "a padded dispatch needs the router's top-k");
  num_local_experts_ = config.num_experts / ep;
  first_local_expert_ = group_rank(ep_) * num_local_experts_;
  // With one of EP and expert-TP a single rank, tp_ep is the other group.
  if (!tp_ep_ && !(ep_ && etp_)) tp_ep_ = ep_ ? ep_ : etp_;
  MG_CHECK(!(ep_ && etp_) || tp_ep_,
           "the token dispatcher over {} expert-parallel x {} expert-tensor-parallel ranks needs their combined group "
           "(ProcessGroupCollection::tp_ep; ProcessGroupCollection::from(ParallelState) sets it)",
           ep, etp);
  MG_CHECK(group_size(tp_ep_) == ep * etp && group_rank(tp_ep_) == group_rank(etp_) + etp * group_rank(ep_),
           "the expert tensor-and-model group (rank {} of {}) is not expert-TP x EP (rank {} of {} x rank {} of {}) "
           "with the expert-TP rank fastest",
           group_rank(tp_ep_), group_size(tp_ep_), group_rank(etp_), etp, group_rank(ep_), ep);
}

// The router padded every expert to exactly this capacity (moe_utils' routing, when it fits the
// tokens; otherwise it routed dropless and so does the dispatch).
int64_t MoETokenDispatcher::capacity(int64_t tokens) const {
  if (!config_.pad_capacity_factor) return config_.capacity;
  const int64_t c = expert_capacity(tokens * config_.topk, config_.num_experts, *config_.pad_capacity_factor);
  return c <= tokens ? c : 0;
}

namespace {

// ---- building blocks: row gathers and variable-size collectives, each with its adjoint -----------
// Every row movement is an ops::moe_permute_* over a MoePermutation on the context's device: the
// routing map's permutation (ops::moe_permutation), or a row gather built here from host indices
// (the host counts that size the all-to-all splits give them).

// A row gather as a MoePermutation on `dev`: moe_permute_forward gives out[r] = in[index[r]] and
// moe_permute_backward, its adjoint, sums each out row back into its source row in row order (the
// "experts" of the permutation are the copies of a source row: token_rows lists them).
MoePermutation row_gather(const std::vector<int64_t>& index, int64_t num_rows, Device dev) {
  std::vector<int64_t> copies(static_cast<size_t>(num_rows), 0);
  for (int64_t i : index) ++copies[size_t(i)];
  int64_t width = 1;
  for (int64_t c : copies) width = std::max(width, c);
  std::vector<int64_t> token_rows(size_t(num_rows * width), -1), filled(size_t(num_rows), 0);
  for (size_t r = 0; r < index.size(); ++r) {
    const int64_t i = index[r];
    token_rows[size_t(i * width + filled[size_t(i)]++)] = int64_t(r);
  }
  const int64_t n = int64_t(index.size());
  MoePermutation p;
  p.sorted_indices = Tensor::from_ints(index, {n}, DType::Int32, dev);
  p.row_expert = Tensor::zeros({n}, DType::Int32, dev);
  p.token_rows = Tensor::from_ints(token_rows, {num_rows, width}, DType::Int32, dev);
  p.rows_per_expert = {n};
  p.num_tokens = num_rows;
  p.num_experts = width;
  return p;
}

// x [T, h] -> [N, h] and its adjoint; probs [T, E] -> [N] and its adjoint; the unweighted unpermute.
Tensor permute_rows(Context& ctx, const Tensor& x, const MoePermutation& perm) {
  Tensor out = Tensor::empty({perm.rows(), x.size(1)}, x.dtype(), ctx.device());
  ops::moe_permute_forward(ctx, x, perm, out);
  return out;
}
Tensor permute_rows_backward(Context& ctx, const Tensor& grad, const MoePermutation& perm) {
  Tensor out = Tensor::empty({perm.num_tokens, grad.size(1)}, grad.dtype(), ctx.device());
  ops::moe_permute_backward(ctx, grad, perm, out);
  return out;
}
Tensor unpermute_rows(Context& ctx, const Tensor& rows, const MoePermutation& perm) {
  Tensor out = Tensor::empty({perm.num_tokens, rows.size(1)}, rows.dtype(), ctx.device());
  ops::moe_unpermute_forward(ctx, rows, Tensor(), perm, out);
  return out;
}
Tensor permute_probs(Context& ctx, const Tensor& probs, const MoePermutation& perm) {
  Tensor out = Tensor::empty({perm.rows()}, DType::Float32, ctx.device());
  ops::moe_permute_probs_forward(ctx, probs, perm, out);
  return out;
}
Tensor permute_probs_backward(Context& ctx, const Tensor& grad, const MoePermutation& perm) {
  Tensor out = Tensor::empty({perm.num_tokens, perm.num_experts}, DType::Float32, ctx.device());
  ops::moe_permute_probs_backward(ctx, grad, perm, out);
  return out;
}

// [N] -> [N, 1], so a vector of probabilities travels through the row operations; and back.
Tensor as_rows(const Tensor& v) { return v.view({v.numel(), 1}); }
Tensor as_vector(const Tensor& rows) { return rows.view({rows.numel()}); }

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); }

Tensor all_to_all_v(Context& ctx, Communicator& group, const Tensor& x, const std::vector<int64_t>& input_splits,
                    const std::vector<int64_t>& output_splits) {
  Shape shape = x.shape();
  shape[0] = sum(output_splits);
  Tensor out = Tensor::empty(shape, x.dtype(), ctx.device());
  group.all_to_all_v(ctx, x, input_splits, out, output_splits)->wait();
  return out;
}

// Rows [0, rows) once per rank of a group of n: the gather of a block sent to every rank.
MoePermutation copies_per_rank(int n, int64_t rows, Device dev) {
  std::vector<int64_t> index;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < rows; ++i) index.push_back(i);
  return row_gather(index, rows, dev);
}

// Variable-size all-gather of [rows, c] tensors: rank r holds rows[r] rows; every rank gets them
// all in rank order. Through all_to_all_v: this rank's block sent to every rank.
Tensor all_gather_v(Context& ctx, Communicator& group, const Tensor& x, const std::vector<int64_t>& rows) {
  const int n = group.size();
  const int64_t mine = rows[size_t(group.rank())];
  MG_ASSERT(x.size(0) == mine, "all_gather_v of {} rows, {} expected", x.size(0), mine);
  const Tensor replicated = permute_rows(ctx, x, copies_per_rank(n, mine, ctx.device()));
  return all_to_all_v(ctx, group, replicated, std::vector<int64_t>(size_t(n), mine), rows);
}

// The adjoint of all_gather_v: x holds sum(rows) rows, block r going to rank r; each rank gets the
// sum over the ranks of its block (rows[rank] rows).
Tensor reduce_scatter_v(Context& ctx, Communicator& group, const Tensor& x, const std::vector<int64_t>& rows) {
  const int n = group.size();
  const int64_t mine = rows[size_t(group.rank())];
  const Tensor blocks = all_to_all_v(ctx, group, x, rows, std::vector<int64_t>(size_t(n), mine));
  return permute_rows_backward(ctx, blocks, copies_per_rank(n, mine, ctx.device()));
}

// Equal-size all-gather / reduce-scatter along dim 0 (Megatron's gather_from_sequence_parallel_region
// and reduce_scatter_to_sequence_parallel_region).
Tensor all_gather_rows(Context& ctx, Communicator& group, const Tensor& x) {
  Shape shape = x.shape();
  shape[0] *= group.size();
  Tensor out = Tensor::empty(shape, x.dtype(), ctx.device());
  group.all_gather(ctx, x, out)->wait();
  return out;
}
Tensor reduce_scatter_rows(Context& ctx, Communicator& group, const Tensor& x) {
  MG_ASSERT(x.size(0) % group.size() == 0, "reduce-scatter of {} rows over {} ranks", x.size(0), group.size());
  Shape shape = x.shape();
  shape[0] /= group.size();
  Tensor out = Tensor::empty(shape, x.dtype(), ctx.device());
  group.reduce_scatter(ctx, x, out)->wait();
  return out;
}

// Chunk c of `sizes` (in order) starts at offsets[c].
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> at(sizes.size() + 1, 0);
  for (size_t c = 0; c < sizes.size(); ++c) at[c + 1] = at[c] + sizes[c];
  return at;
}

// Megatron's sort_chunks_by_idxs as a row gather: rows arrive as chunks [source s][local expert l]
// of counts[s·L + l] rows; the result holds them as [l][s] (every local expert's rows together).
MoePermutation sort_by_local_expert(const std::vector<int64_t>& counts, int sources, int local,
                                    std::vector<int64_t>& tokens_per_expert, Device dev) {
  const std::vector<int64_t> at = offsets_of(counts);
  std::vector<int64_t> index;
  index.reserve(size_t(at.back()));
  tokens_per_expert.assign(size_t(local), 0);
  for (int l = 0; l < local; ++l) {
    for (int s = 0; s < sources; ++s) {
      const size_t c = size_t(s * local + l);
      for (int64_t r = at[c]; r < at[c + 1]; ++r) index.push_back(r);
      tokens_per_expert[size_t(l)] += counts[c];
    }
  }
  return row_gather(index, at.back(), dev);
}

// Rows of the permutation per expert, `local` experts from `first`: [counts of first .. first+local).
std::vector<int64_t> counts_of(const MoePermutation& perm, int first, int local) {
  return {perm.rows_per_expert.begin() + first, perm.rows_per_expert.begin() + first + local};
}

// The counts of the other ranks' rows: each source sends block d of `sent` (its rows per local expert of
// destination d) to d, through `group`; returns [source][local expert], sources in group order.
std::vector<int64_t> exchange_counts(Context& ctx, Communicator& group, const std::vector<int64_t>& sent, int local) {
  const Tensor mine = Tensor::from_ints(sent, {int64_t(sent.size())}, DType::Int64).to(ctx.device());
  Tensor got = Tensor::empty({int64_t(group.size()) * local}, DType::Int64, ctx.device());
  group.all_to_all(ctx, mine, got)->wait();
  return got.to_ints();
}

// ---- alltoall, flex and one rank: a local permutation, then an exchange of its rows ---------------

// After the local permutation by expert (over all E experts), `forward` brings the permuted rows of
// this rank's tokens to the ranks of their experts, sorted by local expert (Note [Dispatch layout]);
// `backward` is its adjoint. Both work on [rows, c] tensors of any float dtype.
struct Exchange {
  virtual ~Exchange() = default;
  virtual Tensor forward(Context& ctx, const Tensor& rows) const = 0;
  virtual Tensor backward(Context& ctx, const Tensor& rows) const = 0;
  std::vector<int64_t> tokens_per_expert;  // [local experts] rows after forward
};

// One rank in every group: the permuted rows are the experts' rows.
struct NoExchange final : Exchange {
  explicit NoExchange(const MoePermutation& perm) { tokens_per_expert = perm.rows_per_expert; }
  Tensor forward(Context&, const Tensor& rows) const override { return rows; }
  Tensor backward(Context&, const Tensor& rows) const override { return rows; }
};

// alltoall: all-to-all-v over EP, all-gather-v over expert-TP, sort by local expert.
struct AllToAllExchange final : Exchange {
  Communicator* ep;
  Communicator* etp;
  std::vector<int64_t> input_splits, output_splits;  // [EP] rows to / from each EP rank
  std::vector<int64_t> etp_rows;                     // [ETP] rows of each expert-TP rank after the all-to-all
  MoePermutation sort;                               // chunks [etp][ep][local expert] -> [local expert][etp][ep]

  AllToAllExchange(Context& ctx, Communicator* ep_group, Communicator* etp_group, const MoePermutation& perm, int local,
                   int64_t capacity)
      : ep(ep_group), etp(etp_group) {
    const int n_ep = group_size(ep), n_etp = group_size(etp);
    for (int i = 0; i < n_ep; ++i) input_splits.push_back(sum(counts_of(perm, i * local, local)));
    // counts[(j·EP + i)·L + l]: rows of expert-TP rank j's EP peer i for local expert l.
    std::vector<int64_t> counts;
    if (capacity > 0) {
      counts.assign(size_t(n_etp * n_ep * local), capacity);
    } else {
      std::vector<int64_t> from_ep =
          ep ? exchange_counts(ctx, *ep, counts_of(perm, 0, n_ep * local), local) : counts_of(perm, 0, local);
      if (etp) {
        const Tensor mine = Tensor::from_ints(from_ep, {int64_t(from_ep.size())}, DType::Int64).to(ctx.device());
        from_ep = all_gather_rows(ctx, *etp, mine).to_ints();
      }
      counts = std::move(from_ep);
    }
    const int me = group_rank(etp);
    for (int i = 0; i < n_ep; ++i)
      output_splits.push_back(std::accumulate(counts.begin() + (me * n_ep + i) * local,
                                              counts.begin() + (me * n_ep + i + 1) * local, int64_t(0)));
    for (int j = 0; j < n_etp; ++j)
      etp_rows.push_back(
          std::accumulate(counts.begin() + j * n_ep * local, counts.begin() + (j + 1) * n_ep * local, int64_t(0)));
    sort = sort_by_local_expert(counts, n_etp * n_ep, local, tokens_per_expert, ctx.device());
  }
  Tensor forward(Context& ctx, const Tensor& rows) const override {
    Tensor t = ep ? all_to_all_v(ctx, *ep, rows, input_splits, output_splits) : rows;
    if (etp) t = all_gather_v(ctx, *etp, t, etp_rows);
    return permute_rows(ctx, t, sort);
  }
  Tensor backward(Context& ctx, const Tensor& rows) const override {
    Tensor t = permute_rows_backward(ctx, rows, sort);  // a bijection: the inverse gather
    if (etp) t = reduce_scatter_v(ctx, *etp, t, etp_rows);
    return ep ? all_to_all_v(ctx, *ep, t, output_splits, input_splits) : t;
  }
};

// flex: every token to each expert-TP rank of its experts' EP rank by one all-to-all-v over tp_ep,
// then sorted by local expert.
struct FlexExchange final : Exchange {
  Communicator* group;
  MoePermutation copies;                             // EP rank i's rows once per expert-TP rank of i
  std::vector<int64_t> input_splits, output_splits;  // [EP·ETP]
  MoePermutation sort;                               // chunks [source][local expert] -> [local expert][source]

  FlexExchange(Context& ctx, Communicator* tp_ep, int n_ep, const MoePermutation& perm, int local, int64_t capacity)
      : group(tp_ep) {
    const int n = group_size(group), n_etp = n / n_ep;
    const int64_t rows = perm.rows();
    std::vector<int64_t> index, sent;
    int64_t at = 0;
    for (int i = 0; i < n_ep; ++i) {
      const std::vector<int64_t> c = counts_of(perm, i * local, local);
      const int64_t chunk = sum(c);
      for (int j = 0; j < n_etp; ++j) {
        for (int64_t r = at; r < at + chunk; ++r) index.push_back(r);
        input_splits.push_back(chunk);
        sent.insert(sent.end(), c.begin(), c.end());
      }
      at += chunk;
    }
    copies = row_gather(index, rows, ctx.device());
    const std::vector<int64_t> counts =
        capacity > 0 ? std::vector<int64_t>(size_t(n * local), capacity) : exchange_counts(ctx, *group, sent, local);
    for (int s = 0; s < n; ++s)
      output_splits.push_back(
          std::accumulate(counts.begin() + s * local, counts.begin() + (s + 1) * local, int64_t(0)));
    sort = sort_by_local_expert(counts, n, local, tokens_per_expert, ctx.device());
  }
  Tensor forward(Context& ctx, const Tensor& rows) const override {
    const Tensor sent = permute_rows(ctx, rows, copies);
    return permute_rows(ctx, all_to_all_v(ctx, *group, sent, input_splits, output_splits), sort);
  }
  Tensor backward(Context& ctx, const Tensor& rows) const override {
    const Tensor back = all_to_all_v(ctx, *group, permute_rows_backward(ctx, rows, sort), output_splits, input_splits);
    return permute_rows_backward(ctx, back, copies);  // the copies' partial results summed
  }
};

class PermutedDispatcher final : public MoETokenDispatcher {
 public:
  PermutedDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg)
      : MoETokenDispatcher(config, pg) {}

  struct State : Saved {
    MoePermutation perm;  // this rank's tokens over all experts (Note [Permuted order]), on the device
    std::unique_ptr<Exchange> exchange;
    int64_t num_experts = 0;
  };

  Dispatched dispatch(Context& ctx, const Tensor& x, const Tensor& probs, const Tensor& routing_map,
                      std::unique_ptr<Saved>& saved) override {
    MG_CHECK(routing_map.dim() == 2 && routing_map.size(1) == config_.num_experts, "routing map {} for {} experts",
             shape_str(routing_map.shape()), config_.num_experts);
    auto state = std::make_unique<State>();
    const int64_t cap = capacity(routing_map.size(0));
    ops::moe_permutation(ctx, routing_map, cap, state->perm);  // dropless: one device->host copy of the counts
    state->num_experts = routing_map.size(1);
    const int local = num_local_experts_;
    if (!ep_ && !etp_) {
      state->exchange = std::make_unique<NoExchange>(state->perm);
    } else if (config_.type == "flex") {
      state->exchange = std::make_unique<FlexExchange>(ctx, tp_ep_, group_size(ep_), state->perm, local, cap);
    } else {
      state->exchange = std::make_unique<AllToAllExchange>(ctx, ep_, etp_, state->perm, local, cap);
    }
    const Exchange& ex = *state->exchange;
    Dispatched d;
    d.tokens = ex.forward(ctx, permute_rows(ctx, x, state->perm));
    d.probs = as_vector(ex.forward(ctx, as_rows(permute_probs(ctx, probs, state->perm))));
    d.tokens_per_expert = ex.tokens_per_expert;
    saved = std::move(state);
    return d;
  }
  Tensor combine(Context& ctx, const Tensor& expert_out, Saved& saved) override {
    State& s = state(saved);
    return unpermute_rows(ctx, s.exchange->backward(ctx, expert_out), s.perm);
  }
  Tensor combine_backward(Context& ctx, const Tensor& grad_out, Saved& saved) override {
    State& s = state(saved);
    return s.exchange->forward(ctx, permute_rows(ctx, grad_out, s.perm));  // the gradient of an unweighted unpermute
  }
  void dispatch_backward(Context& ctx, const Tensor& grad_tokens, const Tensor& grad_probs, Saved& saved,
                         Tensor& grad_x, Tensor& grad_probs_full) override {
    State& s = state(saved);
    grad_x = permute_rows_backward(ctx, s.exchange->backward(ctx, grad_tokens), s.perm);
    grad_probs_full = permute_probs_backward(ctx, as_vector(s.exchange->backward(ctx, as_rows(grad_probs))), s.perm);
    s.perm = MoePermutation{};
    s.exchange.reset();
  }

 private:
  static State& state(Saved& saved) {
    auto* s = dynamic_cast<State*>(&saved);
    MG_ASSERT(s && s->exchange, "token dispatcher state of another kind, or already released");
    return *s;
  }
};

// ---- allgather: gather every token of tp_ep, permute the local experts' rows ----------------------

class AllGatherDispatcher final : public MoETokenDispatcher {
 public:
  AllGatherDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg)
      : MoETokenDispatcher(config, pg) {}

  struct State : Saved {
    // The gathered tokens' rows for the local experts: row_expert is the global expert, so
    // permute_probs reads the gathered probs [T·n, E] directly.
    MoePermutation perm;
    int64_t num_experts = 0;
  };

  Dispatched dispatch(Context& ctx, const Tensor& x, const Tensor& probs, const Tensor& routing_map,
                      std::unique_ptr<Saved>& saved) override {
    MG_CHECK(routing_map.dim() == 2 && routing_map.size(1) == config_.num_experts, "routing map {} for {} experts",
             shape_str(routing_map.shape()), config_.num_experts);
    Communicator& group = *tp_ep_;
    const Tensor map = all_gather_rows(ctx, group, routing_map);
    const Tensor all_probs = all_gather_rows(ctx, group, probs);
    const Tensor all_x = all_gather_rows(ctx, group, x);
    auto state = std::make_unique<State>();
    state->num_experts = routing_map.size(1);
    state->perm = local_permutation(map, routing_map.size(0), group.size(), ctx.device());
    Dispatched d;
    d.tokens = permute_rows(ctx, all_x, state->perm);
    d.probs = permute_probs(ctx, all_probs, state->perm);
    d.tokens_per_expert = counts_of(state->perm, first_local_expert_, num_local_experts_);
    saved = std::move(state);
    return d;
  }
  Tensor combine(Context& ctx, const Tensor& expert_out, Saved& saved) override {
    return reduce_scatter_rows(ctx, *tp_ep_, unpermute_rows(ctx, expert_out, state(saved).perm));
  }
  Tensor combine_backward(Context& ctx, const Tensor& grad_out, Saved& saved) override {
    return permute_rows(ctx, all_gather_rows(ctx, *tp_ep_, grad_out), state(saved).perm);
  }
  void dispatch_backward(Context& ctx, const Tensor& grad_tokens, const Tensor& grad_probs, Saved& saved,
                         Tensor& grad_x, Tensor& grad_probs_full) override {
    State& s = state(saved);
    grad_x = reduce_scatter_rows(ctx, *tp_ep_, permute_rows_backward(ctx, grad_tokens, s.perm));
    grad_probs_full = reduce_scatter_rows(ctx, *tp_ep_, permute_probs_backward(ctx, grad_probs, s.perm));
    s.perm = MoePermutation{};
  }

 private:
  // Each source rank's block of `tokens` gathered tokens permuted on its own (so drop-and-pad gives
  // `capacity` rows per expert and source), then for each local expert the blocks in rank order. The
  // order comes from the CPU permutation op over a host copy of the gathered map (one device->host
  // copy per layer, as the counts of the alltoall path); the result moves to `dev`.
  MoePermutation local_permutation(const Tensor& map_in, int64_t tokens, int sources, Device dev) const {
    Context host;
    const Tensor map = map_in.device().is_host() ? map_in : map_in.to(Device::cpu());
    const int64_t e = map.size(1);
    std::vector<MoePermutation> blocks(static_cast<size_t>(sources));
    std::vector<std::vector<int64_t>> sorted(static_cast<size_t>(sources));
    for (int s = 0; s < sources; ++s) {
      ops::moe_permutation(host, map.slice(s * tokens, (s + 1) * tokens), capacity(tokens), blocks[size_t(s)]);
      sorted[size_t(s)] = blocks[size_t(s)].sorted_indices.to_ints();
    }
    std::vector<int64_t> index, expert, token_rows(size_t(tokens * sources * e), -1), rows(size_t(e), 0);
    for (int l = 0; l < num_local_experts_; ++l) {
      const int x = first_local_expert_ + l;
      for (int s = 0; s < sources; ++s) {
        const std::vector<int64_t>& counts = blocks[size_t(s)].rows_per_expert;
        const int64_t at = std::accumulate(counts.begin(), counts.begin() + x, int64_t(0));
        for (int64_t r = at; r < at + counts[size_t(x)]; ++r) {
          const int64_t t = s * tokens + sorted[size_t(s)][size_t(r)];
          token_rows[size_t(t * e + x)] = int64_t(index.size());
          index.push_back(t);
          expert.push_back(x);
        }
        rows[size_t(x)] += counts[size_t(x)];
      }
    }
    const int64_t n = int64_t(index.size());
    MoePermutation p;
    p.sorted_indices = Tensor::from_ints(index, {n}, DType::Int32, dev);
    p.row_expert = Tensor::from_ints(expert, {n}, DType::Int32, dev);
    p.token_rows = Tensor::from_ints(token_rows, {tokens * sources, e}, DType::Int32, dev);
    p.rows_per_expert = std::move(rows);
    p.num_tokens = tokens * sources;
    p.num_experts = e;
    return p;
  }
  static State& state(Saved& saved) {
    auto* s = dynamic_cast<State*>(&saved);
    MG_ASSERT(s, "token dispatcher state of another kind");
    return *s;
  }
};

}  // namespace

std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(const DispatcherConfig& config,
                                                          const ProcessGroupCollection& pg) {
  MG_CHECK(config.type == "allgather" || config.type == "alltoall" || config.type == "flex",
           "unknown --moe-token-dispatcher-type {}: use allgather, alltoall or flex", config.type);
  if (config.type == "allgather" && (multi_rank(pg.ep) || multi_rank(pg.expt_tp)))
    return std::make_unique<AllGatherDispatcher>(config, pg);
  return std::make_unique<PermutedDispatcher>(config, pg);  // one rank: the local permutation for every kind
}

}  // namespace megatron::moe
