// The seam between a component and the training loop's step boundaries: a component that must
// act around every optimizer step (mark a step for a schedule it learns, take the step's
// counters) implements this, and the trainer calls every hook in the order they were added.
#pragma once

#include <cstdint>

namespace keel {

class StepHook {
 public:
  virtual ~StepHook() = default;
  // Before step `step` (0-based: the steps done so far) begins.
  virtual void before_step(int64_t step) {}
  // After step `step`'s compute (the step engine's run), before its checkpoint, after_step and
  // any evaluation that follows it.
  virtual void step_computed(int64_t step) {}
  // After the step (and its checkpoint, if any) is done; `step` is now the steps done.
  virtual void after_step(int64_t step) {}
};

}  // namespace keel
