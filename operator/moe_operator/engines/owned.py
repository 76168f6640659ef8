"""What each owned engine flag is set by instead (the spec field or the operator), shared by the engines'
args.py lists (engine_args.py explains the owned flags)."""

MODEL = "spec.model.uri"
SERVER = "the operator (the container port is fixed; spec.service.port is the Service's port)"
SERVED = "spec.model.servedName"
TP, EP, DP = "spec.parallelism.tp", "spec.parallelism.ep", "spec.parallelism.dp"
NODES = "spec.nodesPerReplica"
PLANNER = "the planner (per GPU class and engine release; status.plan.args shows its choice)"
PP = "spec.parallelism (the GPUs of a replica are tp x dp; no pipeline or context parallel groups)"
CONFIG = "spec.engine.args itself (a config file would bypass the owned flags)"
