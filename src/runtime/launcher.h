// `keel launch`: runs a keel subcommand on N MPI ranks through OpenMPI's mpirun, sets what a
// container needs (root, oversubscription, one OpenMP thread pool per rank), passes rank 0's
// progress through, and turns mpirun's account of a failure into one line naming the rank and
// the signal or exit code.
#pragma once

#include <string>
#include <vector>

namespace keel {

struct LaunchOptions {
  int ranks = 0;
  std::string hostfile;                                     // "" = all ranks on this machine
  std::vector<std::pair<std::string, std::string>> mca;    // --mca key value
  std::vector<std::string> command;                         // keel subcommand and its arguments
  std::string keel_binary;                                  // path of the keel executable to run
};

// Parses `launch` arguments: -n N [--hostfile F] [--mca K V]... -- SUBCOMMAND ARGS...
// Throws keel::Error on a bad count, a missing hostfile or a missing subcommand.
LaunchOptions parse_launch_args(const std::vector<std::string>& args);

// The mpirun command line and the environment additions for these options.
std::vector<std::string> mpirun_argv(const LaunchOptions& options);

// Runs the job; returns the exit code to exit with (0 when every rank succeeded).
int launch(const LaunchOptions& options);

}  // namespace keel
