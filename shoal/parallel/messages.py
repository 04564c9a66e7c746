"""What travels on the pipes between the front (`Fleet`) and its rank processes.

Plain frozen records (pickled by multiprocessing; trusted, in-job traffic only).

    front -> rank   Add, Cancel, AskStats, AskCheck, Shutdown
    rank -> front   Ready, Results, Stats, Checked, Fatal, Failed, Stopped
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.build import EngineInfo
from shoal.request import NewRequest, StepResult


@dataclass(frozen=True)
class Add:
    requests: list[NewRequest]  # added together: admitted at one step


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class AskStats:
    pass


@dataclass(frozen=True)
class AskCheck:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    info: EngineInfo


@dataclass(frozen=True)
class Results:
    rank: int
    result: StepResult  # new tokens and finished requests of one step


@dataclass(frozen=True)
class Stats:
    rank: int
    stats: dict


@dataclass(frozen=True)
class Checked:
    rank: int
    error: str | None  # None: the rank's block accounting holds


@dataclass(frozen=True)
class Fatal:
    rank: int
    message: str  # a connector failure the ranks agreed on: the fleet must restart


@dataclass(frozen=True)
class Failed:
    rank: int
    detail: str  # anything else that ended the rank


@dataclass(frozen=True)
class Stopped:
    rank: int


ToRank = Add | Cancel | AskStats | AskCheck | Shutdown
ToFront = Ready | Results | Stats | Checked | Fatal | Failed | Stopped
