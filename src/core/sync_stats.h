// What one step's data-parallel gradient sync did on a rank (comm/grad_sync.h measures it): a value
// the step engines report (core/step_engine.h) and the metrics record, kept below all of them.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"

namespace keel {

// One layer's share of a step's sync (compressed sync only).
struct LayerSyncStats {
  int layer = 0;
  CodecKind codec = CodecKind::none;  // the codec of most of its elements this step (none during warm-up)
  double raw_bytes = 0;     // float32 bytes of its gradient
  double wire_bytes = 0;    // bytes this rank sent for it
};

struct SyncStats {
  double payload_bytes = 0;     // gradient bytes all-reduced by this rank this step (float32, or bf16's 2 bytes)
  // Bytes this rank puts on the wire: what the compressed collectives sent, plus for plain
  // buckets the ring all-reduce's 2 (N-1)/N of the payload (reduce-scatter: (N-1)/N).
  double sent_bytes = 0;
  double uncompressed_bytes = 0;  // what a plain ring all-reduce of the payload would have sent
  double encode_ms = 0, decode_ms = 0;  // codec time on this rank (on the training thread)
  bool compressed = false;      // some bucket went through a codec this step
  std::vector<LayerSyncStats> layers;  // per layer, when compression is configured
  double exposed_ms = 0;        // time finish() waited on this rank
  // Over all ranks (set by the trainer): the least wait is communication that backward did not
  // hide (the last rank to finish backward waits only for the transfer); the spread between the
  // most and least wait is time ranks spent waiting for a slower peer.
  double exposed_min_ms = 0;
  double imbalance_ms = 0;
  double latency_ms = 0;        // first bucket started -> last bucket completed
  int buckets = 0;
};

}  // namespace keel
