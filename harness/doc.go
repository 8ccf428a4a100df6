// Package harness runs many isolated agent jobs from one process: each job
// gets its own Executor (a DeltaBox sandbox, or a directory on the host for
// development) and its own workspace, and search strategies (Best-of-N, MCTS)
// branch and roll back a job's sandbox through checkpoints.
//
// # Words
//
// A job is one unit of agent work. Its Executor runs its commands and
// touches its files; nothing is shared between jobs, and there is no
// process-global executor. The workspace is the directory a job works in
// (Executor.Workspace): relative paths resolve against it, and the agent
// tools refuse paths outside it.
//
// # Lifecycle
//
// A Backend makes one Executor per job (Backend.NewExecutor) and the job
// owns it until Executor.Close, which removes the workspace (the sandbox, or
// the directory). Gather does this for a batch of jobs, with bounded
// parallelism, per-job timeouts and failures kept to their job.
//
// # Search
//
// BestOfN and MCTS need a Brancher (the DeltaBox executor is one): an
// Executor whose whole state can be checkpointed, restored in place and
// forked. A Policy proposes Actions for a state, an Evaluator scores a
// state; the search records what state management cost (SearchStats).
//
// An Executor serialises its own calls; different executors run in
// parallel.
package harness
