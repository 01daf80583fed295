// text_generation_server: serves a checkpoint over HTTP (cpp-httplib) with the inference engine.
//
//   build/bin/text_generation_server --load ckpt --tokenizer-type GPT2BPETokenizer --vocab-file v.json \
//       --merge-file m.txt --host 0.0.0.0 --port 5000 --max-batch-size 8
//
//   mpirun -np 2 build/bin/text_generation_server --tensor-model-parallel-size 2 --load ckpt ...
//       tensor-parallel: the ranks launched as for training (mpirun, torchrun's environment or
//       --nproc-per-node 2), rank 0 serving HTTP (Note [Server ranks])
//
//   PUT  /api                   Megatron's text generation API (megatron/core/inference/text_generation_api.h)
//   POST /v1/completions        OpenAI completions; "stream": true sends server-sent events
//   POST /v1/chat/completions   OpenAI chat, formatted with the tokenizer's chat template (HuggingFace
//                               tokenizer_config.json "chat_template"); streams as completions do
//   GET  /v1/models             the one model served (its id: --load)
//   GET  /health                liveness: {"status": "ok", "prompts_in_flight": n, "connections": m}
//
// The HTTP side is megatron/core/inference/http_server.h: requests are read whole by a reactor
// thread (bounded by --max-request-bytes and --http-timeout) before a thread answers them, and
// /health runs on a thread of its own, so slow or many clients cannot lock the server out.
// Handlers validate a request (400 on any problem, Note [Error shapes]; at most
// --max-prompts-per-request prompts on any endpoint) and queue one job per prompt, the
// request's prompts sharing one engine group; a single engine thread owns the model and the
// InferenceEngine, moves queued jobs into it and steps it (continuous batching, slots handed out
// round-robin between requests: Note [Fair admission]). Tokens flow back through each request's
// mutex and condition variable. A client that goes away cancels its request's jobs: a streaming
// one at the next failed write, a waiting one through HttpServer::client_gone (Note [Hang-up
// probe]); cancelled jobs leave the engine at its next step, queued or running.
// An /api request with beam_width is one BeamJob, searched whole on the engine thread between
// steps (InferenceEngine::beam_search, a cache of its own), as Megatron's server holds its lock.
// SIGINT/SIGTERM stop the listener, then the engine thread (remaining jobs end with an error).
//
// Note [Server ranks]: under mpirun (or torchrun's environment) the server runs on
// --tensor-model-parallel-size ranks, as Megatron's run_text_generation_server.py does. Every rank
// parses the same flags and loads its shard of the checkpoint (any saved layout); rank 0 binds the
// port, serves HTTP and owns the engine, announcing each model forward to the other ranks, which
// run it in lockstep and do nothing else (Note [Tensor-parallel inference] in
// megatron/core/inference/inference_group.h). The other ranks ignore SIGINT/SIGTERM (mpirun
// forwards them to every rank): they leave when rank 0, stopping, tells them to. A failed step
// under tensor parallelism ends the job, since the ranks could no longer run in lockstep.
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/inference/chat_template.h"
#include "megatron/core/inference/http_server.h"
#include "megatron/core/inference/inference_group.h"
#include "megatron/core/inference/text_generation_api.h"
#include "megatron/training/checkpointing.h"
#include "megatron/training/inference_model.h"
#include "megatron/training/training.h"

using namespace megatron;
using nlohmann::json;

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

// Responses carry detokenized text, which may hold invalid UTF-8 (a byte-level token cut in two):
// it is replaced (U+FFFD), never thrown.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// One HTTP request's prompts ("choices"), shared by its handler and the engine thread.
struct Pending {
  struct Choice {
    GenerationRequest request;
    std::optional<CompletionText> text;  // /v1/completions
    GenerationResult result;
    bool done = false;
  };
  struct Piece {
    size_t index;
    std::string text;
    std::optional<std::pair<int64_t, double>> token;
    TopLogprobs top;
  };
  std::mutex m;
  std::condition_variable cv;
  std::vector<Choice> choices;
  std::deque<Piece> pieces;  // streamed output not yet written
  bool stream = false;
  size_t remaining = 0;
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);

  bool all_done() const { return remaining == 0; }
};

// One /api beam search, run whole on the engine thread.
struct BeamJob {
  BeamSearchRequest request;
  std::vector<BeamHypothesis> beams;
  std::optional<std::string> error;
  bool done = false;
  std::mutex m;
  std::condition_variable cv;
};

class Server {
 public:
  Server(InferenceEngine& engine, const Tokenizer& tokenizer, const ChatTemplate* chat_template,
         std::string model_name, size_t max_prompts, bool log_requests, SamplingDefaults sampling, Context& ctx,
         InferenceGroup* group)
      : engine_(engine),
        tokenizer_(tokenizer),
        chat_template_(chat_template),
        model_name_(std::move(model_name)),
        max_prompts_(max_prompts),
        log_requests_(log_requests),
        sampling_(sampling),
        ctx_(ctx),
        group_(group) {}

  void run_engine() {
    while (true) {
      std::vector<std::pair<std::shared_ptr<Pending>, size_t>> incoming;
      std::vector<std::shared_ptr<BeamJob>> beams;
      {
        std::unique_lock lock(queue_m_);
        auto work = [&] { return stopping_ || !queue_.empty() || !beam_queue_.empty() || !engine_.idle(); };
        if (!group_) {
          queue_cv_.wait(lock, work);
        } else if (!queue_cv_.wait_for(lock, group_->heartbeat_interval(), work)) {
          lock.unlock();
          group_->heartbeat(ctx_);  // the other ranks wait for the next forward within their timeout
          continue;
        }
        if (stopping_) break;
        incoming.swap(queue_);
        beams.swap(beam_queue_);
      }
      for (auto& [p, i] : incoming) submit(p, i);
      for (const auto& job : beams) run_beam_search(*job);
      try {
        engine_.step();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "engine step failed: %s\n", e.what());
        if (group_) {  // Note [Server ranks]
          std::fprintf(stderr, "error: the tensor-parallel ranks cannot continue in lockstep; ending the job\n");
          std::fflush(stderr);
          abort_job(1);
          std::_Exit(1);
        }
        engine_.abort_all(e.what());
      }
    }
    for (auto& [p, i] : queue_) submit(p, i);
    engine_.abort_all("the server is shutting down");
    for (const auto& job : beam_queue_) finish_beam(*job, {}, "the server is shutting down");
  }

  void stop_engine() {
    std::lock_guard lock(queue_m_);
    stopping_ = true;
    queue_cv_.notify_all();
  }

  void routes(HttpServer& http) {
    http.route(
        "GET", "/health",
        [this, &http](const httplib::Request&, httplib::Response& res) {
          json health = {{"status", "ok"},
                         {"prompts_in_flight", in_flight_.load()},
                         {"connections", http.open_connections()}};
          res.set_content(health.dump(), "application/json");
        },
        /*blocking=*/false);
    http.route(
        "GET", "/v1/models",
        [this](const httplib::Request&, httplib::Response& res) {
          json model = {{"id", model_name_}, {"object", "model"}, {"created", started_}, {"owned_by", "megatron.cpp"}};
          res.set_content(dump(json{{"object", "list"}, {"data", json::array({model})}}), "application/json");
        },
        /*blocking=*/false);
    http.route(
        "PUT", "/api",
        [this](const httplib::Request& req, httplib::Response& res) {
          guarded(res, megatron_error, [&] { handle_api(req, res); });
        },
        /*blocking=*/true);
    http.route(
        "POST", "/v1/completions",
        [this](const httplib::Request& req, httplib::Response& res) {
          guarded(res, openai_error, [&] { handle_completions(req, res, /*chat=*/false); });
        },
        /*blocking=*/true);
    http.route(
        "POST", "/v1/chat/completions",
        [this](const httplib::Request& req, httplib::Response& res) {
          guarded(res, openai_error, [&] { handle_completions(req, res, /*chat=*/true); });
        },
        /*blocking=*/true);
  }

 private:
  // Note [Error shapes]: /v1/* answers OpenAI's {"error": {"message", "type", "code"}}, which the
  // openai client reads. /api answers as Megatron's Flask server: its message strings, status 400,
  // in the {"message": ...} object that Flask-RESTful gives its errors and that Megatron's
  // tools/text_generation_cli.py reads (response.json()['message']). The HTTP layer's own errors
  // (404, 405, 408, 413) stay {"error": "<line>"}.
  using ErrorWriter = void (*)(httplib::Response&, int, const std::string&);
  static void openai_error(httplib::Response& res, int status, const std::string& message) {
    res.status = status;
    const char* type = status == 400 ? "invalid_request_error" : status == 499 ? "client_gone" : "server_error";
    res.set_content(dump(json{{"error", {{"message", message}, {"type", type}, {"code", nullptr}}}}),
                    "application/json");
  }
  static void megatron_error(httplib::Response& res, int status, const std::string& message) {
    res.status = status;
    res.set_content(dump(json{{"message", message}}), "application/json");
  }

  // Every problem with the request is a 400; anything else a 500. Nothing escapes to httplib.
  template <typename F>
  static void guarded(httplib::Response& res, ErrorWriter error, F&& f) {
    try {
      f();
    } catch (const json::exception& e) {
      error(res, 400, fmt::format("malformed JSON: {}", e.what()));
    } catch (const ApiError& e) {
      error(res, 400, e.what());
    } catch (const Error& e) {
      error(res, 400, e.what());
    } catch (const std::exception& e) {
      error(res, 500, e.what());
    }
  }

  static json parse_body(const httplib::Request& req) { return json::parse(req.body); }

  // On the engine thread.
  void run_beam_search(BeamJob& job) {
    try {
      finish_beam(job, engine_.beam_search(job.request), std::nullopt);
    } catch (const std::exception& e) {
      finish_beam(job, {}, e.what());
    }
  }

  static void finish_beam(BeamJob& job, std::vector<BeamHypothesis> beams, std::optional<std::string> error) {
    std::lock_guard lock(job.m);
    job.beams = std::move(beams);
    job.error = std::move(error);
    job.done = true;
    job.cv.notify_all();
  }

  void handle_beam_search(const httplib::Request& req, httplib::Response& res, BeamSearchRequest request) {
    MG_CHECK(int64_t(request.prompt.size()) + request.max_new_tokens <= engine_.max_sequence_length(),
             "too many tokens: a prompt of {} tokens plus {} to generate exceeds the maximum sequence length {}",
             request.prompt.size(), request.max_new_tokens, engine_.max_sequence_length());
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    request.cancelled = cancelled;
    auto job = std::make_shared<BeamJob>();
    job->request = std::move(request);
    {
      std::lock_guard lock(queue_m_);
      if (stopping_) throw std::runtime_error("the server is shutting down");
      beam_queue_.push_back(job);
      queue_cv_.notify_all();
    }
    std::unique_lock lock(job->m);
    while (!job->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return job->done; })) {
      if (HttpServer::client_gone(req)) {
        *cancelled = true;
        return;
      }
    }
    if (job->error) return megatron_error(res, 500, *job->error);
    res.set_content(dump(megatron_beam_response(job->beams, tokenizer_)), "application/json");
  }

  // Validates every request, then queues them all for the engine thread.
  std::shared_ptr<Pending> enqueue(std::vector<GenerationRequest> requests, const CompletionRequest* completion) {
    for (const GenerationRequest& r : requests) engine_.validate(r);
    auto p = std::make_shared<Pending>();
    const uint64_t group = next_group_++;
    for (GenerationRequest& r : requests) {
      r.group = group;
      r.cancelled = p->cancelled;
      Pending::Choice c{std::move(r), std::nullopt, {}, false};
      if (completion) c.text.emplace(tokenizer_, c.request.stop_tokens, completion->stop);
      p->choices.push_back(std::move(c));
    }
    p->stream = completion && completion->stream;
    p->remaining = p->choices.size();
    std::lock_guard lock(queue_m_);
    if (stopping_) throw std::runtime_error("the server is shutting down");
    in_flight_ += int64_t(p->remaining);
    for (size_t i = 0; i < p->choices.size(); ++i) queue_.emplace_back(p, i);
    queue_cv_.notify_all();
    return p;
  }

  // On the engine thread.
  void submit(const std::shared_ptr<Pending>& p, size_t i) {
    auto on_token = [p, i](int64_t token, double logprob, const TopLogprobs& top) {
      std::lock_guard lock(p->m);
      Pending::Choice& c = p->choices[i];
      if (c.text) {
        std::string piece = c.text->add(token);
        if (p->stream) p->pieces.push_back({i, std::move(piece), std::make_pair(token, logprob), top});
      }
      p->cv.notify_all();
      return !*p->cancelled && !(c.text && c.text->stopped());
    };
    auto on_done = [this, p, i](const GenerationResult& result) {
      std::lock_guard lock(p->m);
      Pending::Choice& c = p->choices[i];
      c.result = result;
      c.done = true;
      if (c.text) {
        std::string rest = c.text->finish();
        if (p->stream && !rest.empty()) p->pieces.push_back({i, std::move(rest), std::nullopt, {}});
      }
      --p->remaining;
      --in_flight_;
      p->cv.notify_all();
    };
    engine_.submit(p->choices[i].request, on_token, on_done);
  }

  // Waits for every choice. False if the client hung up first: its jobs are cancelled (the engine
  // drops them at its next step) and nobody is left to answer.
  static bool wait_all(Pending& p, const httplib::Request& req) {
    std::unique_lock lock(p.m);
    while (!p.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return p.all_done(); })) {
      if (HttpServer::client_gone(req)) {
        *p.cancelled = true;
        return false;
      }
    }
    return true;
  }

  static std::optional<std::string> failure(const Pending& p) {
    for (const auto& c : p.choices)
      if (c.result.finish_reason.rfind("error", 0) == 0) return c.result.finish_reason;
    return std::nullopt;
  }

  void handle_api(const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    MegatronApiRequest api = parse_megatron_api_request(body, tokenizer_, max_prompts_, sampling_);
    if (log_requests_ && !api.no_log) {  // Megatron's --inference-flask-server-logging lines
      const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
      char stamp[32];
      std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
      std::printf("request IP: %s\n%s\nstart time: %s\n", req.remote_addr.c_str(), dump(body).c_str(), stamp);
      std::fflush(stdout);
    }
    if (api.beam) return handle_beam_search(req, res, std::move(*api.beam));
    auto p = enqueue(api.requests, nullptr);
    if (!wait_all(*p, req)) return megatron_error(res, 499, "the client went away");
    if (auto f = failure(*p)) return megatron_error(res, 500, *f);
    std::vector<GenerationResult> results;
    for (const auto& c : p->choices) results.push_back(c.result);
    res.set_content(dump(megatron_api_response(api, results, tokenizer_)), "application/json");
  }

  // The kept tokens' total logprob: best_of's ranking.
  static double score(const Pending::Choice& c) {
    double sum = 0;
    for (size_t t = 0; t < c.text->tokens().size(); ++t) sum += c.result.logprobs[t];
    return sum;
  }

  void handle_completions(const httplib::Request& req, httplib::Response& res, bool chat) {
    const json body = parse_body(req);
    auto completion = std::make_shared<CompletionRequest>(
        chat ? parse_chat_request(body, tokenizer_, chat_template_, max_prompts_, sampling_)
             : parse_completion_request(body, tokenizer_, max_prompts_, sampling_));
    if (completion->model.empty()) completion->model = model_name_;
    auto p = enqueue(completion->requests, completion.get());
    const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id_++);
    if (completion->stream) return stream_completion(res, p, completion, id);
    if (!wait_all(*p, req)) return openai_error(res, 499, "the client went away");
    if (auto f = failure(*p)) return openai_error(res, 500, *f);
    json choices = json::array();
    int64_t prompt_tokens = 0, completion_tokens = 0;
    const size_t best_of = completion->best_of, n = completion->n;
    for (size_t i = 0; i < completion->prompt_texts.size(); ++i) {
      std::vector<size_t> order(best_of);
      for (size_t j = 0; j < best_of; ++j) order[j] = i * best_of + j;
      if (best_of > n)
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return score(p->choices[a]) > score(p->choices[b]); });
      for (size_t k = 0; k < n; ++k) {
        const Pending::Choice& c = p->choices[order[k]];
        const size_t index = i * n + k;
        const std::string finish = completion_finish_reason(c.result, c.text->stopped());
        const bool with_lp = completion->logprobs;
        if (chat) {
          json lp = with_lp ? chat_logprobs(choice_logprobs(c.request, c.result, c.text->tokens().size(), false),
                                            tokenizer_)
                            : json(nullptr);
          choices.push_back(chat_choice(index, c.text->text(), finish, lp));
        } else {
          const std::string echo = completion->echo ? completion->prompt_texts[i] : "";
          json lp = with_lp ? completion_logprobs(
                                  choice_logprobs(c.request, c.result, c.text->tokens().size(), completion->echo),
                                  tokenizer_)
                            : json(nullptr);
          choices.push_back(completion_choice(index, echo + c.text->text(), finish, lp));
        }
      }
      prompt_tokens += int64_t(p->choices[i * best_of].request.prompt.size());
      for (size_t j = 0; j < best_of; ++j) completion_tokens += int64_t(p->choices[i * best_of + j].result.tokens.size());
    }
    json usage = {{"prompt_tokens", prompt_tokens},
                  {"completion_tokens", completion_tokens},
                  {"total_tokens", prompt_tokens + completion_tokens}};
    res.set_content(dump(completion_object(id, chat ? "chat.completion" : "text_completion", completion->model,
                                           choices, usage)),
                    "application/json");
  }

  // Server-sent events: a chunk per released piece of text (chat: a first chunk per choice with the
  // assistant role), a final chunk per choice with its finish_reason, with stream_options.include_usage
  // a chunk with the usage and no choices, then [DONE]. Streaming needs best_of == n, so request
  // position q is choice index q. A failed write cancels the request (the client went away).
  void stream_completion(httplib::Response& res, std::shared_ptr<Pending> p,
                         std::shared_ptr<CompletionRequest> completion, std::string id) {
    auto finished = std::make_shared<std::vector<bool>>(p->choices.size(), false);
    auto opened = std::make_shared<bool>(false);
    const bool chat = completion->chat;
    const std::string object = chat ? "chat.completion.chunk" : "text_completion";
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, p, completion, id, finished, opened, chat, object](size_t, httplib::DataSink& sink) {
          auto write = [&](const json& chunk) {
            std::string event = "data: " + dump(chunk) + "\n\n";
            if (!sink.write(event.data(), event.size())) {
              *p->cancelled = true;
              return false;
            }
            return true;
          };
          auto send = [&](const json& choice) {
            json chunk = completion_object(id, object, completion->model, json::array({choice}));
            if (completion->include_usage) chunk["usage"] = nullptr;
            return write(chunk);
          };
          if (!*opened) {
            *opened = true;
            for (size_t i = 0; i < p->choices.size(); ++i) {
              const size_t prompt = i / completion->best_of;
              if (chat && !send(chat_delta_choice(i, "assistant", "", std::nullopt, nullptr))) return false;
              if (!chat && completion->echo &&
                  !send(completion_choice(i, completion->prompt_texts[prompt], std::nullopt, nullptr)))
                return false;
            }
          }
          std::unique_lock lock(p->m);
          p->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return !p->pieces.empty() || p->all_done(); });
          std::deque<Pending::Piece> pieces;
          pieces.swap(p->pieces);
          std::vector<json> ends;
          for (size_t i = 0; i < p->choices.size(); ++i) {
            const Pending::Choice& c = p->choices[i];
            if (c.done && !(*finished)[i]) {
              (*finished)[i] = true;
              const std::string reason = completion_finish_reason(c.result, c.text->stopped());
              ends.push_back(chat ? chat_delta_choice(i, std::nullopt, std::nullopt, reason, nullptr)
                                  : completion_choice(i, "", reason, nullptr));
            }
          }
          const bool done = p->all_done();
          const std::optional<std::string> failed = done ? failure(*p) : std::nullopt;
          json usage;
          if (done && completion->include_usage) {
            int64_t prompt_tokens = 0, completion_tokens = 0;
            for (size_t i = 0; i < p->choices.size(); ++i) {
              if (i % completion->best_of == 0) prompt_tokens += int64_t(p->choices[i].request.prompt.size());
              completion_tokens += int64_t(p->choices[i].result.tokens.size());
            }
            usage = {{"prompt_tokens", prompt_tokens},
                     {"completion_tokens", completion_tokens},
                     {"total_tokens", prompt_tokens + completion_tokens}};
          }
          lock.unlock();
          for (const Pending::Piece& piece : pieces) {
            if (piece.text.empty()) continue;
            json lp = nullptr;
            if (completion->logprobs && piece.token) {
              TokenLogprobs one{{piece.token->first}, {piece.token->second}, {}};
              if (completion->top_logprobs > 0) one.top.push_back(piece.top);
              lp = chat ? chat_logprobs(one, tokenizer_) : completion_logprobs(one, tokenizer_);
            }
            json choice = chat ? chat_delta_choice(piece.index, std::nullopt, piece.text, std::nullopt, lp)
                               : completion_choice(piece.index, piece.text, std::nullopt, lp);
            if (!send(choice)) return false;
          }
          if (failed) {
            openai_stream_error(sink, *failed);
          } else {
            for (const json& choice : ends)
              if (!send(choice)) return false;
            if (!usage.is_null() && !write(completion_object(id, object, completion->model, json::array(), usage)))
              return false;
          }
          if (done) {
            static const std::string kDone = "data: [DONE]\n\n";
            sink.write(kDone.data(), kDone.size());
            sink.done();
          }
          return true;
        },
        [p](bool success) {
          if (!success) *p->cancelled = true;
        });
  }

  static void openai_stream_error(httplib::DataSink& sink, const std::string& message) {
    std::string event =
        "data: " + dump(json{{"error", {{"message", message}, {"type", "server_error"}, {"code", nullptr}}}}) + "\n\n";
    sink.write(event.data(), event.size());
  }

  InferenceEngine& engine_;
  const Tokenizer& tokenizer_;
  const ChatTemplate* chat_template_;  // null: the tokenizer has none
  std::string model_name_;
  size_t max_prompts_;
  bool log_requests_;
  SamplingDefaults sampling_;
  Context& ctx_;
  InferenceGroup* group_;  // null: one process
  int64_t started_ = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  std::atomic<int64_t> next_id_{0};
  std::atomic<uint64_t> next_group_{1};
  std::atomic<int64_t> in_flight_{0};  // prompts queued or generating
  std::mutex queue_m_;
  std::condition_variable queue_cv_;
  std::vector<std::pair<std::shared_ptr<Pending>, size_t>> queue_;
  std::vector<std::shared_ptr<BeamJob>> beam_queue_;
  bool stopping_ = false;
};

}  // namespace

// Note [Server arguments]: as Megatron's tools/run_text_generation_server.py, the server takes
// pretrain_gpt's arguments (model flags, --load, tokenizer flags, --micro-batch-size, ...; parsed by
// megatron/training/arguments.h, so a misspelt flag is named) plus its own: the HTTP options here
// and Megatron's text generation flags --temperature, --top_k, --top_p as request defaults. The
// model comes from the checkpoint: a model flag given with another value than the checkpoint's is
// one line and exit 1; flags without a meaning for inference (learning rate, data, batch sizes)
// are accepted. --tensor-model-parallel-size N runs on N ranks (Note [Server ranks]); pipeline,
// context and expert parallel sizes above 1 are refused.
int main(int argc, char** argv) {
  const LaunchInfo launch = detect_launch();
  try {
    std::string host = "127.0.0.1";
    int port = 5000;
    EngineOptions options;
    HttpServerOptions http_options;
    size_t max_prompts = kDefaultMaxPrompts;
    double http_timeout = 30;
    bool log_requests = false;
    SamplingDefaults sampling;
    CLI::App app(
        "Serve a megatron.cpp checkpoint over HTTP (Megatron's /api, OpenAI's /v1/completions, /v1/chat/completions "
        "and /v1/models). Also takes pretrain_gpt's flags: --load (required), the tokenizer flags, model flags "
        "(checked against the checkpoint's), --device; see pretrain_gpt --help. Tensor-parallel: launch N ranks "
        "as for training, e.g. mpirun -np N text_generation_server --tensor-model-parallel-size N --load ckpt ...; "
        "rank 0 serves HTTP, the checkpoint may be saved with any layout.");
    app.allow_extras();
    app.add_option("--host", host, "Address to listen on")->capture_default_str();
    app.add_option("--port", port, "Port to listen on (0: any free port, printed in the serving line)")
        ->capture_default_str()
        ->check(CLI::Range(0, 65535));
    app.add_option("--max-batch-size", options.max_batch_size, "Sequences decoded together (KV-cache slots)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--max-sequence-length", options.max_sequence_length,
                   "Longest prompt + generation (0: the model's position limit)")
        ->capture_default_str();
    app.add_option("--max-prompts-per-request", max_prompts,
                   "Most prompts one request may carry, on every endpoint (Megatron's /api: 128)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--max-request-bytes", http_options.max_request_bytes,
                   "Largest request body in bytes; a larger one is refused with 413")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--http-threads", http_options.threads, "HTTP worker threads for generation requests")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--http-timeout", http_timeout,
                   "Seconds a request may take to arrive, and a write to a client that reads nothing may wait")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--http-max-connections", http_options.max_connections,
                   "Open connections at most; more are refused with 503")
        ->capture_default_str()
        ->check(CLI::Range(size_t(1), size_t(900)));
    app.add_flag("--inference-flask-server-logging", log_requests,
                 "Log every /api request (its JSON and start time) unless it sets no_log (Megatron's flag)");
    app.add_option("--temperature", sampling.temperature,
                   "Sampling temperature of requests that give none (0: greedy; Megatron's flag)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 100.0));
    app.add_option("--top_k", sampling.top_k, "Top-k of requests that give neither top_k nor top_p (0: off)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1000)));
    app.add_option("--top_p", sampling.top_p, "Top-p of requests that give neither top_k nor top_p (0: off)")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 1.0));
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    MG_CHECK(!(sampling.top_k > 0 && sampling.top_p > 0.0), "set --top_k or --top_p, not both (as Megatron)");
    // Everything CLI11 did not take is pretrain_gpt's (Note [Server arguments]).
    std::vector<std::string> rest = app.remaining();
    std::vector<const char*> megatron_argv = {argv[0]};
    for (const std::string& r : rest) megatron_argv.push_back(r.c_str());
    std::optional<Arguments> parsed =
        parse_args(int(megatron_argv.size()), megatron_argv.data(), "text_generation_server's pretrain_gpt flags");
    if (!parsed) return 0;
    Arguments args = *parsed;
    // --nproc-per-node N: this process becomes the launcher of the N ranks, as for pretrain_gpt.
    if (args.nproc_per_node > 0 && launch.kind == LaunchInfo::Single) {
      return launch_local_workers(argc, argv, args.nproc_per_node, select_device(args.device).is_host());
    }
    MG_CHECK(!args.load.empty(), "--load is required: the checkpoint directory to serve");
    MG_CHECK(!args.tokenizer_type.empty(), "--tokenizer-type is required (as for pretrain_gpt)");
    check_inference_layout(args, launch);  // before the port is taken; again with the checkpoint's arguments
    const int tp = args.tensor_model_parallel_size;
    const bool leader = launch.rank == 0;
    std::vector<std::string> given;
    for (const std::string& r : rest)
      if (r.rfind("--", 0) == 0) given.push_back(r.substr(0, r.find('=')));
    std::string checkpoint_dir;
    const json meta = read_checkpoint_metadata(args.load, &checkpoint_dir);
    check_given_model_args(meta, args, given, checkpoint_dir);
    http_options.request_timeout_s = http_options.write_timeout_s = http_timeout;
    // Bind first: a port in use is one line at once, not after loading the model.
    std::optional<HttpServer> http;
    if (leader) {
      http.emplace(http_options);
      port = http->bind(host, port);
    }

    const Arguments flags = args;
    apply_checkpoint_args(args, args.load);
    args.tokenizer_type = flags.tokenizer_type;
    args.vocab_size = flags.vocab_size > 0 ? flags.vocab_size : args.vocab_size;
    std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(tokenizer_args_from_args(args));
    InferenceModel loaded = load_inference_model(args, launch, tokenizer->vocab_size(), 1234);
    Context& ctx = *loaded.ctx;
    InferenceGroup* group = loaded.group.get();
    if (loaded.follower()) {  // Note [Server ranks]
      std::signal(SIGINT, SIG_IGN);
      std::signal(SIGTERM, SIG_IGN);
      group->follow(*loaded.model, ctx);
      return 0;
    }
    options.group = group;
    InferenceEngine engine(*loaded.model, ctx, tokenizer->vocab_size(), options);
    std::optional<ChatTemplate> chat_template;
    if (args.tokenizer_type == "HuggingFaceTokenizer") chat_template = ChatTemplate::from_tokenizer_folder(args.tokenizer_model);

    std::signal(SIGPIPE, SIG_IGN);  // a client that hangs up is a failed write, not a fatal signal
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    Server server(engine, *tokenizer, chat_template ? &*chat_template : nullptr, args.load, max_prompts, log_requests,
                  sampling, ctx, group);
    server.routes(*http);
    std::thread engine_thread([&] { server.run_engine(); });
    std::thread http_thread([&] { http->serve(); });
    std::printf("serving %s on http://%s:%d (max batch %lld, max sequence %lld, %s%s)\n", args.load.c_str(),
                host.c_str(), port, (long long)engine.max_batch_size(), (long long)engine.max_sequence_length(),
                chat_template ? "chat template" : "no chat template",
                tp > 1 ? fmt::format(", tensor-parallel size {}", tp).c_str() : "");
    std::fflush(stdout);
    while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::printf("shutting down\n");
    std::fflush(stdout);
    server.stop_engine();
    engine_thread.join();
    if (group) group->stop(ctx);
    http->shutdown();
    http_thread.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    std::fflush(stderr);
    if (launch.world_size > 1) abort_job(1);  // the other ranks would wait for this one until their timeout
    return 1;
  }
}
