// `keel launch`: runs a keel subcommand on N MPI ranks through OpenMPI's mpirun, sets what a
// container needs (root, oversubscription, one OpenMP thread pool per rank), passes rank 0's
// progress through, turns mpirun's account of a failure into one line naming the rank and the
// signal or exit code, and on request restarts a failed job from its newest checkpoint.
#pragma once

#include <string>
#include <vector>

namespace keel {

struct Config;

// Exit codes of `keel` that a supervisor must not answer with a restart: the input was refused
// before training started, the run ended without its final checkpoint (a restart would
// recompute from the last one and, until the cause such as a full disk is fixed, fail alike), or
// it stopped at a non-finite step (training is deterministic: a restart would meet it again).
inline constexpr int kRefusedInputExit = 2;
inline constexpr int kFinalCheckpointNotWritten = 3;
inline constexpr int kNonFiniteStepExit = 4;  // a NaN/inf step: a restart would replay into it

struct LaunchOptions {
  int ranks = 0;
  std::string hostfile;                                     // "" = all ranks on this machine
  std::vector<std::pair<std::string, std::string>> mca;    // --mca key value
  int max_restarts = 0;                                     // --max-restarts R; 0 = never restart
  std::vector<std::string> command;                         // keel subcommand and its arguments
  std::string keel_binary;                                  // path of the keel executable to run
};

// Parses `launch` arguments:
//   -n N [--hostfile F] [--mca K V]... [--max-restarts R] -- SUBCOMMAND ARGS...
// Throws keel::Error on a bad count, a missing hostfile, a bad restart count (R must be a whole
// number >= 0) or a missing subcommand.
LaunchOptions parse_launch_args(const std::vector<std::string>& args);

// Whether this host has an RDMA device (/sys/class/infiniband lists one: InfiniBand, RoCE, EFA).
// Without one, mpirun_argv selects OpenMPI's ob1 messaging layer (unless the caller's --mca pml).
bool rdma_devices_present();

// The mpirun command line for attempt `restart` of these options (0 = the first run). A restart
// (restart >= 1) also exports KEEL_RESTART, KEEL_FAILURE_NOTICED_NS and KEEL_FAILURE to every
// rank (launch() sets their values); a restarted `keel train` sees KEEL_RESTART and continues
// from the newest usable checkpoint in its run_dir, or from its own train.resume when there is
// none yet.
std::vector<std::string> mpirun_argv(const LaunchOptions& options, int restart = 0);

// Runs the job and returns the exit code to exit with: 0 when every rank succeeded, else
// mpirun's exit code (2 when a rank refused its input: keel exits 2 for a keel::Error raised
// before training starts).
//
// When the job fails and fewer than max_restarts restarts were made, it is run again with
// mpirun_argv(options, K) for restart K = 1, 2, ..., and the ranks find in their environment
//   KEEL_RESTART             K
//   KEEL_FAILURE_NOTICED_NS  std::chrono::system_clock time in ns at which mpirun's exit was reaped
//   KEEL_FAILURE             the one-line description of the failure
// (on the first run these are removed from the environment). A failure is not restarted when
// the launcher was stopped by SIGINT or SIGTERM (forwarded to mpirun), when the job exited 2
// with no rank killed by a signal (bad input fails the same way again), or when mpirun could not
// be run. Each decision is one line on stderr beginning "keel: launch: ".
int launch(const LaunchOptions& options);

// --- Slurm -------------------------------------------------------------------------------------
// Under `srun --mpi=pmix` every task of the job step is one rank: Slurm's PMIx plugin makes the
// step's task id (SLURM_PROCID) the MPI rank and its task count (SLURM_STEP_NUM_TASKS) the world
// size, so Keel's rank r is Slurm's task r, and with Slurm's default block distribution ranks
// r, r+1, ... fill one node before the next (the innermost group of the mesh shares a host).
// A process started by mpirun (`keel launch`, also inside an allocation) is OpenMPI's rank and
// takes nothing from Slurm's variables, which it inherits from the batch script unchanged.

// What Slurm says about the process it started, from its environment.
struct SlurmTask {
  int step_tasks = 0;       // SLURM_STEP_NUM_TASKS: tasks of the srun job step; 0 = not in a step
  int task = 0;             // SLURM_PROCID: this task's number in the step (the batch script: 0)
  int job_tasks = 0;        // SLURM_NTASKS: tasks of the job's allocation; 0 = not in a Slurm job
  std::string job_id;       // SLURM_JOB_ID
  std::string mpi;          // SLURM_MPI_TYPE: srun --mpi (pmix, pmi2, none)
  bool pmix = false;        // PMIX_RANK is set: the step offers PMIx, which OpenMPI joins
  bool under_mpirun = false;  // OMPI_COMM_WORLD_SIZE is set: started by mpirun, not by srun
};
SlurmTask slurm_task();

// For `keel train` in a Slurm job, before MPI is joined: refuses (keel::Error, one line) a start
// that would fail inside MPI_Init or silently train the wrong job:
//   - an srun step of several tasks without PMIx (srun --mpi=none or pmi2: OpenMPI 4 as Debian
//     builds it, and OpenMPI 5 always, join a Slurm step through PMIx only; without it each task
//     would train alone);
//   - `keel train` run outside a job step (the batch script itself, an salloc shell) in an
//     allocation of several tasks (one process, where srun would start them all);
//   - a step whose task count does not fit the configured layout (parallel.data x
//     parallel.pipeline), named with the srun option that fixes it;
//   - whatever else resolve_job_config refuses for a world of the step's tasks.
// Also sets what `keel launch` passes to its ranks where the caller has not (PMIX_MCA_gds=hash;
// OpenMPI's ob1 messaging without an RDMA device). Does nothing outside Slurm or under mpirun.
void check_slurm_train_start(const SlurmTask& slurm, const Config& config);

// matmul_efficiency's reference: this process's SGEMM rate, measured now. A rank of a restarted
// job (KEEL_RESTART), whose start-up is the job's down time, takes instead the rate a start
// measured on this host with the same CPU, OpenBLAS kernels and thread count (kept in
// /dev/shm/keel-sgemm.json, or the file KEEL_SGEMM_CACHE names); missing or unreadable, it is measured.
// `cached` (optional) says which of the two it was.
double sgemm_reference_gflops(bool* cached = nullptr);

}  // namespace keel
