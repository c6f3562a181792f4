// `keel report RUN_DIR`: one self-contained HTML file of a run (finished or still going): its
// summary, SVG plots drawn here (losses, throughput, MFU, tier hit rates, bubble, sync latency and
// jitter with their thresholds, energy per million tokens; a mixture of experts' routing and, in
// the memory tiers, each expert's hit rate, stall, bytes read and home over the steps) with
// checkpoints, recoveries and alerts on the step axis, the pipeline's Gantt chart from
// pipeline_trace.json, and the alerts. Nothing is fetched from anywhere: no script, no
// stylesheet, no font.
#pragma once

#include <string>
#include <vector>

namespace keel {

// The report's HTML for run directory `run_dir`. Throws keel::Error when it is not a run
// directory (no metrics.jsonl) or its metrics cannot be read. A metrics line that is not JSON (but
// the last, which a run may still be writing), or a value not of its field's type, is left out of
// the report and noted in `skipped` ("RUN/metrics.jsonl line 7: field 'loss': expected a number,
// found string ..."); the report says how many.
std::string render_report(const std::string& run_dir, std::vector<std::string>* skipped = nullptr);

}  // namespace keel
