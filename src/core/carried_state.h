// The seam between a step engine and checkpoints for state the engine carries from one step into
// the next and the chunk store does not hold (a pipeline's gradient prediction: the gradients of
// W's deferred into the next step and the predictor's history, pipeline/gradient_prediction.h).
// Every checkpoint saves each rank's as one record of floats with a description; a resume hands
// it back to the rank that saved it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace keel {

class CarriedState {
 public:
  virtual ~CarriedState() = default;
  // At a checkpoint after `steps_done` steps: brings the state to a form the checkpoint can hold
  // without changing what training computes from here on (the same bytes as not saving), and
  // returns its description, JSON text whose "what" says in words the layout the state belongs
  // to (for messages); its floats are appended to `floats`.
  virtual std::string save(int64_t steps_done, std::vector<float>& floats) = 0;
  // On resume: "" when this run can continue from the state described by `layout` with `floats`
  // floats (as save() returned them; "" = the checkpoint holds none), else why not, in one line
  // naming the config keys that differ.
  virtual std::string check_resume(const std::string& layout, size_t floats) const = 0;
  // After every rank accepted the checkpoint (check_resume said ""): restores what save()
  // returned (none: the engine starts afresh, as at a run's first step).
  virtual void restore(const std::string& layout, const std::vector<float>& floats) = 0;
  // True when every rank carries the same state (a rank the writer did not have then reads rank
  // 0's record, and a checkpoint resumes on any number of ranks); false: each rank its own.
  virtual bool replicated() const { return false; }
};

}  // namespace keel
