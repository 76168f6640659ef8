"""The chart's optional PodMonitor (issue 22): inference pods' /metrics scraped by prometheus-operator."""

from test_chart import helm, of_kind, one, render  # noqa: F401 - helm is a fixture


def test_pod_monitor_is_off_by_default(helm):
    assert not of_kind(render(helm), "PodMonitor")


def test_pod_monitor_scrapes_the_serving_pods_of_the_watched_namespaces(helm):
    pm = one(render(helm, "podMonitor.enabled=true", "podMonitor.labels.release=kube-prometheus"), "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    sel = pm["spec"]["selector"]
    # the labels render.py puts on every inference pod
    assert sel["matchLabels"] == {"app.kubernetes.io/name": "moe-inference", "app.kubernetes.io/managed-by": "moe-operator"}
    assert sel["matchExpressions"] == [{"key": "moe.serving.dev/role", "operator": "NotIn", "values": ["worker"]}]
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    scoped = one(render(helm, "podMonitor.enabled=true", "watchNamespaces={a,b}"), "PodMonitor")
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
