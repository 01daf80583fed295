#include "megatron/training/signal_handler.h"

#include <atomic>
#include <csignal>

namespace megatron {

namespace {
std::atomic<bool> g_received{false};  // a signal handler can only reach a global
struct sigaction g_old_term, g_old_int;
extern "C" void on_signal(int) { g_received.store(true); }
}  // namespace

SignalHandler::SignalHandler() {
  g_received.store(false);
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGINT, &sa, &g_old_int);
}

SignalHandler::~SignalHandler() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

bool SignalHandler::signal_received() const { return g_received.load(); }

}  // namespace megatron
