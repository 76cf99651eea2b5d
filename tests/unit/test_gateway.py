"""Which failures of a model's router the gateway sends a request again for: only a replica that died after
accepting it (Serve resends what a dying replica never accepted). One that may still answer, or a router that
raised, is not resent: the request would run twice."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments.gateway import _replica_gone


def test_only_a_router_replica_that_died_is_sent_the_request_again():
    assert _replica_gone(ActorDiedError())
    assert not _replica_gone(ActorUnavailableError("unreachable for now", None))  # it may still answer
    raised = RayTaskError("respond", "Traceback ...", ActorDiedError()).as_instanceof_cause()
    assert isinstance(raised, ActorDiedError) and not _replica_gone(raised)  # the router raised what it called
    assert not _replica_gone(ValueError("a bad request"))
