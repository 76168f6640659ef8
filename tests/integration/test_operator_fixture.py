"""The fixture's own judgement of the operator log: an RBAC refusal fails a module, a write into a
namespace the test is deleting does not (CI failed once on the second wording)."""

from .operator_fixture import forbidden_lines


def test_rbac_refusal_is_reported():
    log = ('level=ERROR msg=Handler failed: configmaps "x" is forbidden: User "system:serviceaccount:'
           'moe:moe-operator" cannot create resource "configmaps" in API group "" in the namespace "a"')
    assert forbidden_lines(log) == [log]


def test_terminating_namespace_refusals_are_not_rbac():
    worded = ('level=ERROR msg=apply ConfigMap/p: configmaps "p" is forbidden: unable to create new '
              'content in namespace it-1 because it is being terminated')
    by_reason = 'level=ERROR msg=HTTP 403 Forbidden\n  "reason": "NamespaceTerminating"'
    assert forbidden_lines(worded) == []
    assert forbidden_lines(by_reason) == []
