"""ADP's step sync: the one fixed-size control all-gather of every step.

Every owner joins every forward (the MLP is sharded across them), so after scheduling each
owner tells the others how many tokens it computes, whether it has work or pending
transfers, whether it was asked to stop, and whether its connector failed. A failure
anywhere is raised on every owner alike (a second round carries the message).
"""

from __future__ import annotations

from shoal.connectors.base import ConnectorError
from shoal.engine.peers import PeerState, StepVote
from shoal.parallel.comm import Comm


def agree_on_failure(comm: Comm, votes: list[int], failure: str | None) -> None:
    """After a control all-gather: if any rank voted a failure, a second round carries the
    messages and every rank raises the same ConnectorError (the lowest failed rank's)."""
    if any(votes):
        messages = comm.all_gather_object(failure)
        raise ConnectorError(next(m for m in messages if m))


class AdpSync:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.want_shutdown = 0  # this owner was asked to stop (set by its rank loop)
        self.state = PeerState([], any_work=True, stop=False)  # what the last step said

    def exchange(self, vote: StepVote) -> PeerState:
        rows = self.comm.all_gather_ints([vote.num_tokens, int(vote.has_work), self.want_shutdown,
                                          int(vote.failure is not None)])
        agree_on_failure(self.comm, [r[3] for r in rows], vote.failure)
        # pending transfers count as work
        self.state = PeerState([r[0] for r in rows], any(r[1] for r in rows), any(r[2] for r in rows))
        return self.state
