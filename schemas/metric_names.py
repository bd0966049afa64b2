"""Metric names written to ``<run>.metrics``: public API shared by the stages that
write them and ``relax monitor`` / the dashboard that read them. The unit is the
suffix (``_s`` seconds, ``_bytes``, ``_tokens``, ``_per_s``); counts have none.

Every row carries the ``policy_version`` it refers to (the trainer's version
after the step for trainer metrics; the rollout's policy_version_start for
sample metrics).
"""

# every stage (its own component): the stage timeline of the dashboard
BUSY_FRAC = "busy_frac"                # fraction of the window since the stage's previous row
# spent working: a stage loop's turns that did work, every BUSY_WINDOW_S; the trainer's
# step minus its data wait, every step

PEAK_RSS_MB = "peak_rss_mb"            # the process's peak resident set so far (MB, 10^6
# bytes; getrusage's ru_maxrss, VmHWM), with each busy_frac row (every stage) and each step
# (trainer); relax monitor lists it under the stage (a run's summary.json has every process's)
GPU_PEAK_MB = "gpu_peak_mb"            # the process's peak CUDA memory allocated by torch
# (MB), where it has initialised CUDA; written with peak_rss_mb

LOST_TO_RETENTION = "lost_to_retention"  # records of an input partition deleted by retention
# (or DeleteRecords) before the stage's consumer read them: one row per loss found, the
# count of that loss (streams/retention.py); the run's total is the sum of the rows

# trainer (component "trainer"), one row each per optimizer step
STEP_S = "step_s"                      # wall time of one optimizer step incl. waiting for data
TRAIN_S = "train_s"                    # forward/backward/optimizer time of the step
DATA_WAIT_S = "data_wait_s"            # time the trainer waited for train samples
PUBLISH_S = "publish_s"                # time the step was blocked publishing (copy to send buffer)
WEIGHTS_SEND_S = "weights_send_s"      # the previous version's send (background)
WEIGHTS_LOCAL = "weights_local_subscribers"  # of them, subscribers that read the same-host file
WEIGHTS_BROADCAST = "weights_broadcast_subscribers"  # ... that got the broadcast
CHECKPOINT_S = "checkpoint_s"          # time the step spent writing its checkpoint
TRAIN_CPU_USER_S = "train_cpu_user_s"  # trainer process CPU seconds in user mode during train_step
TRAIN_CPU_SYS_S = "train_cpu_sys_s"    # ... in the kernel (page faults show here)
TRAIN_PAGE_FAULTS = "train_page_faults"  # trainer process minor page faults during train_step
LOSS = "loss"
GRAD_NORM = "grad_norm"
REWARD_MEAN = "reward_mean"            # mean final reward of the samples decided this step
ACCURACY = "accuracy"                  # fraction of them judged correct
REWARD_MEAN_TRAINED = "reward_mean_trained"  # mean final reward of the trained samples only
TEACHER_KL = "teacher_kl"              # on-policy distillation: mean logprobs - teacher_logprobs
# over the trained loss tokens (nats/token; only when a teacher is on)
ADVANTAGE_MEAN = "advantage_mean"      # mean advantage over the trained rows (one per row)
ADVANTAGE_STD = "advantage_std"        # its sample std (1 for REINFORCE++ unless rewards are equal)
# PPO's critic (advantage.estimator: gae; relax.trainer.critic), trainer component
VALUE_LOSS = "value_loss"              # clipped value loss, token-mean, before the critic's update
VF_CLIP_FRAC = "vf_clip_frac"          # share of loss tokens where the value clip set the loss
VALUE_MEAN = "value_mean"              # mean critic value over the loss tokens
RETURN_MEAN = "return_mean"            # mean GAE return (value target) over the loss tokens
CRITIC_GRAD_NORM = "critic_grad_norm"  # the critic's gradient norm (first update of the step)
CRITIC_LR = "critic_lr"
CRITIC_S = "critic_s"                  # seconds of the critic's forward, GAE and update
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"
SAMPLES_TRAINED = "samples_trained"
SAMPLES_DROPPED_STALE = "samples_dropped_stale"
SAMPLES_DROPPED_FILTERED = "samples_dropped_filtered"
SAMPLES_ERROR = "samples_error"
TOKENS_TRAINED = "tokens_trained"
SAMPLES_PER_S = "samples_per_s"
STALENESS_HIST_PREFIX = "staleness_hist."  # + str(k): samples with staleness k seen this step

# rollout (component "rollout-<i>")
GEN_TOKENS_PER_S = "gen_tokens_per_s"
GROUPS_IN_FLIGHT = "groups_in_flight"
BUDGET_WAIT_S = "budget_wait_s"        # time the rollout stage waited for the staleness budget
WEIGHT_WAIT_S = "weight_wait_s"        # cumulative seconds it waited for announced weights
GROUPS_SAMPLED = "groups_sampled"

# reward (component "reward.<name>")
REWARD_ERRORS = "reward_errors"
REWARD_TIMEOUTS = "reward_timeouts"
REWARD_ROWS_PER_S = "reward_rows_per_s"
# counts per poll; reward_timeouts / _exceptions / _memory_errors count failed calls (a
# failed batch call and the one-row retries after it count separately); reward_errors
# counts rows
REWARD_ROWS = "reward_rows"
REWARD_ABSTAINS = "reward_abstains"
REWARD_EXCEPTIONS = "reward_exceptions"
REWARD_MEMORY_ERRORS = "reward_memory_errors"
REWARD_WORKER_RESTARTS = "reward_worker_restarts"
REWARD_VALUE_MEAN = "reward_value_mean"            # mean of the non-null values of the poll
REWARD_SCORE_S = "reward_score_s"                  # seconds scoring the poll

# aggregator (component "aggregate-<i>"), on every delivery and at least every HEARTBEAT_S
GROUPS_EMITTED = "groups_emitted"
PARTIAL_GROUPS = "partial_groups"        # groups waiting for rollouts / rewards / ref log-probs
OLDEST_PARTIAL_S = "oldest_partial_s"    # age of the oldest of them (0 when none)
REWARD_WEIGHT_PREFIX = "reward_weight."  # + reward name: weight from the row's policy_version
# on, written when a live reward change (relax reward attach --weight / detach) is applied

# evaluation (component "eval"): eval.before writes policy_version 0 (the driver), eval.every
# each evaluated policy_version (the eval stage, infra/control/eval_stage.py); one row each per eval
EVAL_COMPONENT = "eval"                 # the component of these rows
EVAL_ACCURACY = "eval_accuracy"        # greedy held-out accuracy at policy_version, in [0, 1]
EVAL_N = "eval_n"                      # held-out prompts evaluated (eval.size)
EVAL_CORRECT = "eval_correct"          # of them, judged correct
EVAL_REWARD_ERRORS = "eval_reward_errors"  # of them, rows whose reward failed (counted wrong)
EVAL_S = "eval_s"                      # wall time of the generation and scoring


def staleness_hist_name(k: int) -> str:
    """Metric name holding the count of samples with staleness ``k``."""
    return f"{STALENESS_HIST_PREFIX}{k}"

# trainer progress (a copy for people; the rollout stage's credit reads <run>.progress,
# streams/progress.py):
# groups the trainer has decided (trained in a finished step, or dropped), and groups it still
# needs to finish the run. started - consumed <= min(budget, needed) keeps the rollout stage
# from sampling groups that the run will never train.
GROUPS_CONSUMED = "groups_consumed"
GROUPS_NEEDED = "groups_needed"
