"""How an engine works with other ranks: its place as values (`Topology`), and two injected
strategies: `StepSync` (once per step: what every owner computes, and whether any failed)
and `Agreement` (TP: how the connector's answers and transfer polls are agreed). The engine
never imports `shoal.parallel`, which builds a `Peers` for each rank process (one rank: the
defaults below). See docs/design.md, "Layers" and "A step"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from shoal.connectors.base import ConnectorError
from shoal.model.shard import Shard


@dataclass(frozen=True)
class Topology:
    """This engine's place among its peers."""

    rank: int = 0  # this process's rank in the group
    world_size: int = 1
    owner_rank: int = 0  # ADP: the owner whose requests this engine serves (0 without ADP)
    num_owners: int = 1  # ADP owners, each with its own requests and KV cache
    shard_rank: int = 0  # TP: which shard of the attention heads (and of each block) it holds
    num_shards: int = 1  # TP: ranks sharing every request's attention heads


@dataclass(frozen=True)
class StepVote:
    """What an engine tells its peers after scheduling a step."""

    num_tokens: int  # tokens it computes this step (0: nothing, or padding if a peer computes)
    has_work: bool  # it holds requests or pending transfers
    failure: str | None  # its connector's fatal failure, if any


@dataclass(frozen=True)
class PeerState:
    """What the step's sync said about every owner."""

    token_counts: list[int]  # every owner's num_tokens this step, in rank order
    any_work: bool  # some owner holds requests or pending transfers
    stop: bool  # some owner was asked to stop: every owner drains after this step

    @property
    def any_tokens(self) -> bool:
        """Some owner computes: every owner joins the forward (with padding if it has none)."""
        return any(self.token_counts)


class StepSync(Protocol):
    def exchange(self, vote: StepVote) -> PeerState:
        """Every owner's vote; raises ConnectorError on every owner if any voted a failure."""


class LocalSync:
    """No peers: a recorded failure is raised here, at the next step."""

    def exchange(self, vote: StepVote) -> PeerState:
        if vote.failure is not None:
            raise ConnectorError(vote.failure)
        return PeerState([vote.num_tokens], vote.has_work, stop=False)


class Agreement(Protocol):
    is_lead: bool  # this rank runs the connector's scheduler side

    def share(self, answer: Any) -> Any:
        """The lead's `answer` on every rank (the others pass None)."""

    def agree_min(self, flags: list[int]) -> list[int]:
        """Element-wise minimum of every rank's `flags` (the same length on every rank)."""


class LocalAgreement:
    """No peers: this rank leads and its word is final."""

    is_lead = True

    def share(self, answer: Any) -> Any:
        return answer

    def agree_min(self, flags: list[int]) -> list[int]:
        return flags


@dataclass(frozen=True)
class Peers:
    """Everything an engine needs to know about other ranks (one rank: the defaults)."""

    topology: Topology = field(default_factory=Topology)
    shard: Shard = field(default_factory=Shard)  # the model's slice and its collectives
    sync: StepSync = field(default_factory=LocalSync)
    agreement: Agreement = field(default_factory=LocalAgreement)
    # control-collective counters for stats() (control_collectives, control_seconds)
    counters: Callable[[], dict[str, float]] = dict  # (one rank: none)
