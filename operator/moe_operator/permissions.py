"""Every Kubernetes permission the operator process uses, with the call that needs it.

The chart's RBAC (charts/moe-operator/templates/_helpers.tpl, rbac.yaml) must grant exactly these:
tests/unit/operator/test_chart.py and test_cache_ledger_rbac.py compare them, and the integration suite runs the operator with the
chart's ServiceAccount token (tests/integration/test_operator.py), so a call added without its
permission fails there with 403.
"""

from __future__ import annotations

# (apiGroup, resource) -> (verbs, why). Namespaced: in a ClusterRole when watching all namespaces,
# else in a Role per watched namespace.
NAMESPACED: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("moe.serving.dev", "moedeployments"): (frozenset({"get", "list", "watch", "patch"}),
                                            "kopf watches them and patches its annotations; the sweep's watch "
                                            "cache; Kube.get_moed"),
    ("moe.serving.dev", "moedeployments/status"): (frozenset({"patch"}), "Kube.patch_status"),
    ("apps", "deployments"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                              "owned workload: kopf watch, drift GET, server-side apply (create on first apply), "
                              "merge patch, delete when nodesPerReplica changes the kind"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                                                       "owned multi-node workload, as Deployments"),
    ("", "services"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                       "owned Service: the watch cache (label-selected list/watch), apply; delete: the endpoint "
                       "picker's Service when it is no longer deployed (epp.stale)"),
    ("", "configmaps"): (frozenset({"get", "list", "watch", "create", "patch"}),
                         "owned plan ConfigMap: the watch cache (label-selected list/watch), apply"),
    ("batch", "jobs"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                        "inspection Job: the watch cache, applies, deletes once read; model cache fill Job"),
    ("", "pods"): (frozenset({"get", "list", "watch"}), "kopf index of GPU requests; the inspection and cache Jobs' pod "
                   "status; get: granted to the endpoint picker's Role (epp.RULES), which needs it held"),
    ("", "pods/log"): (frozenset({"get"}), "model cache: the download Job's progress lines (Kube.job_log_tail)"),
    ("", "persistentvolumeclaims"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                                     "pvc:// models: the claim must exist before a Job runs; model caches: apply, "
                                     "user labels (merge patch), list and delete unused ones; the watch cache"),
    ("", "secrets"): (frozenset({"get"}), "model.tokenSecretRef: its label, and the token for hf:// inspection"),
    ("", "events"): (frozenset({"create", "patch"}), "Kube.post_event, and kopf's own posting of handler logs; patch: "
                     "granted to a leader-electing endpoint picker's Role (epp.LEADER_RULES)"),
    # day-2 objects (day2.py): drift GET, apply, delete when the spec stops asking for them
    ("policy", "poddisruptionbudgets"): (frozenset({"get", "create", "patch", "delete"}),
                                         "owned PodDisruptionBudget (replicas > 1)"),
    ("autoscaling", "horizontalpodautoscalers"): (frozenset({"get", "create", "patch", "delete"}),
                                                  "owned HPA (spec.autoscaling provider hpa)"),
    ("keda.sh", "scaledobjects"): (frozenset({"get", "create", "patch", "delete"}),
                                   "owned KEDA ScaledObject (spec.autoscaling provider keda)"),
    ("inference.networking.k8s.io", "inferencepools"): (frozenset({"get", "list", "watch", "create", "patch", "delete"}),
                                                        "owned InferencePool (spec.gateway.inferencePool); list/watch: "
                                                        "granted to the endpoint picker's Role"),
    # the endpoint picker the operator deploys (epp.py): its account, Role and RoleBinding; the API
    # server refuses a Role granting what its creator does not hold (RBAC escalation prevention), so
    # the operator holds what epp.RULES and epp.LEADER_RULES grant
    ("", "serviceaccounts"): (frozenset({"get", "create", "patch", "delete"}), "owned endpoint picker ServiceAccount"),
    ("rbac.authorization.k8s.io", "roles"): (frozenset({"get", "create", "patch", "delete"}),
                                             "owned endpoint picker Role"),
    ("rbac.authorization.k8s.io", "rolebindings"): (frozenset({"get", "create", "patch", "delete"}),
                                                    "owned endpoint picker RoleBinding"),
    ("inference.networking.x-k8s.io", "inferenceobjectives"): (frozenset({"get", "list", "watch"}),
                                                               "granted to the endpoint picker's Role"),
    ("coordination.k8s.io", "leases"): (frozenset({"get", "list", "watch", "create", "update", "patch", "delete"}),
                                        "granted to the Role of an endpoint picker of more than one replica "
                                        "(leader election)"),
}
CLUSTER: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("", "nodes"): (frozenset({"list", "watch"}), "kopf index of GPU nodes (GFD labels)"),
    ("apiextensions.k8s.io", "customresourcedefinitions"): (frozenset({"list", "watch"}),
                                                            "kopf resolves the resources it serves"),
    ("", "namespaces"): (frozenset({"list", "watch"}), "kopf follows the watched namespaces"),
}
# Only the chart's own configuration (resourceNames), and only without cert-manager.
WEBHOOK: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): (
        frozenset({"get", "patch"}), "Kube.patch_webhook_ca writes the operator-made CA into the chart's configuration"),
}
PEERING_VERBS = frozenset({"get", "list", "watch", "patch"})  # kopf peering objects, with leader election
# The model cache ledger (cache_ledger.py): one ConfigMap in the release namespace, whichever
# namespaces are watched, in a Role of its own (rbac.yaml's <fullname>-cache-ledger) narrowed by
# resourceNames to the ledger's name, <fullname> + LEDGER_NAME_SUFFIX (the chart hands it to the
# operator as MOE_CACHE_LEDGER_NAME). A server-side apply's create carries the name, so create can be
# narrowed too (a plain POST would not match resourceNames).
LEDGER: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("", "configmaps"): (frozenset({"get", "create", "patch"}),
                         "cache_ledger.Record.sync reads it (get); Record.save writes it by server-side apply "
                         "(create on the first save, patch after)"),
}
LEDGER_NAME_SUFFIX = "-model-caches"
