// SIGTERM and SIGINT as a request to stop training cleanly (Slurm and cloud preemption send
// SIGTERM some time before they kill): the run finishes the step it is in, every rank writes a
// checkpoint, a line names it, and the process exits with the conventional status (128 + the
// signal). A second signal aborts at once with that status. SIGUSR1 and SIGUSR2 stand for SIGTERM
// and SIGINT: `keel launch` passes a stop on that way, since mpirun forwards them to every rank
// untouched (a SIGTERM it would follow with SIGKILL a second later).
#pragma once

#include "comm/communicator.h"

namespace keel {

class StopSignals {
 public:
  // Installs the handlers for the life of the object (the previous ones are restored after).
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal received by any rank of `world` so far (0 = none). A collective: every rank calls
  // it at the same point (after a step), so every rank stops after the same step.
  int requested(Communicator& world) const;
  // The signal this process has received so far (0 = none); no collective. The trainer folds it
  // into a reduction it makes anyway at the end of each step.
  int received() const;
};

}  // namespace keel
