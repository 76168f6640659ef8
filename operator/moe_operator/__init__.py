"""moe-operator control plane: API models, checkpoint inspection, GPU classes, the planner,
rendering and the kopf handlers. Must import without torch."""

__version__ = "0.1.0"

API_GROUP = "moe.serving.dev"
API_VERSION = "v1alpha1"
KIND = "MoEDeployment"
PLURAL = "moedeployments"
