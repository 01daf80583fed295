// --exit-signal-handler: SIGTERM (and SIGINT) set a flag the training loop polls after each
// iteration; it then saves a checkpoint and exits (Megatron's DistributedSignalHandler).
#pragma once

namespace megatron {

class SignalHandler {
 public:
  SignalHandler();   // installs the handlers
  ~SignalHandler();  // restores the previous ones
  bool signal_received() const;
};

}  // namespace megatron
