"""One transport for every coordination of the checkpoint backend: its rounds, and how a failure
on some ranks reaches all of them as one typed dmuon error.

A save, a load, the tiers and the managers coordinate through a :class:`Transport`: a few
primitives (an all-reduce of numbers, a gather to the coordinator and a scatter from it, an
all-gather and a broadcast of objects, a barrier) that an implementation provides
(``group_transport.py`` over a torch process group or a single process; the scale simulator's
over N ranks in one process), and the rounds built on them here, which every caller uses:

* :meth:`Transport.reduce`: every rank offers a few typed fields (a dataclass: :func:`same`,
  :func:`lowest`, else the maximum) and whether its step failed, in one all-reduce;
* :meth:`Transport.settle`: the same with no fields: did any rank fail;
* :meth:`Transport.gather_scatter`: every rank's object to the coordinator, which answers each
  rank (a plan for each);
* :meth:`Transport.decided`: one rank does the work, every rank gets its result;
* :meth:`Transport.share` / :meth:`broadcast` / :meth:`barrier`: data, no verdict.

Failing is part of each round, never a path of its own: a rank's step runs in an
:class:`Attempt`, which keeps its exception instead of raising it; the next round carries the
failure with the rank's fields, and if any rank failed, every rank learns every failed rank's
problem (gathered on that path only) and raises one error of one type: the caller's ``error``
when given, else the first failed rank's type where that is a dmuon error (a committed
checkpoint stays a :class:`CheckpointExistsError` on every rank, a corrupt file a
:class:`CheckpointCorruptError`), else :class:`CheckpointError`. The error names the failed
ranks (``error.ranks``) and the round (``error.phase``). Inside :meth:`Transport.operation` (a
save or a load), messages start with the operation's title, and a collective broken by a rank
that stopped raises :class:`~.rank_failure.RankStoppedError` naming it (``group_transport.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .errors import CheckpointError
from .rank_failure import Phases

__all__ = ["Attempt", "Transport", "lowest", "same"]

T = TypeVar("T")
F = TypeVar("F")

_HOW = "dmuon.reduce"
_SAME, _LOWEST = "same", "lowest"

#: what a failed rank reports: its exception type (None: a plain message), and the message
Problem = tuple[type | None, str]


def same(default: int = -1) -> Any:
    """A field of a reduced dataclass whose result is the value every rank offered, or None
    where ranks offered different values (two numbers on the wire: the maximum and minimum)."""
    return dataclasses.field(default=default, metadata={_HOW: _SAME})


def lowest(default: float = 0.0) -> Any:
    """A field of a reduced dataclass whose result is the smallest value offered."""
    return dataclasses.field(default=default, metadata={_HOW: _LOWEST})


def _encode(fields: Any) -> tuple[list[float], bool]:
    """The numbers ``fields`` puts on the wire, and whether they are floating point (a field
    whose default is a float makes the whole round float64; the defaults are alike on every
    rank, so the ranks agree on the width and type without asking)."""
    values: list[float] = []
    floating = False
    for spec in dataclasses.fields(fields):
        value = getattr(fields, spec.name)
        floating |= isinstance(spec.default, float)
        how = spec.metadata.get(_HOW)
        if how == _SAME:
            values += [value, -value]
        elif how == _LOWEST:
            values.append(-value)
        else:
            values.append(value)
    return values, floating


def _decode(template: Any, values: list[float]) -> Any:
    out: dict[str, Any] = {}
    position = 0
    for spec in dataclasses.fields(template):
        how = spec.metadata.get(_HOW)
        kind: Any = type(spec.default)
        if how == _SAME:
            top, neg_bottom = values[position], values[position + 1]
            out[spec.name] = kind(top) if top == -neg_bottom else None
            position += 2
            continue
        value = -values[position] if how == _LOWEST else values[position]
        out[spec.name] = kind(value)
        position += 1
    return dataclasses.replace(template, **out)


class Attempt:
    """A rank's part of a round whose failure is reported to every rank at the round's
    collective, not raised here: ``with Attempt() as step: ...`` keeps an ``Exception`` in
    ``step.error``. What goes through: an error a round raised on every rank already (a nested
    round's, a rank that stopped), and what is no ``Exception`` (an interrupt)."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: Any, value: BaseException | None, traceback: Any) -> bool:
        if isinstance(value, CheckpointError) and value.everywhere:
            return False  # every rank raises it already: reporting it again would only repeat it
        if isinstance(value, Exception):
            self.error = value
            return True
        return False


Failure = BaseException | Attempt | str | None


def _problem(failure: Failure) -> Problem | None:
    if isinstance(failure, Attempt):
        failure = failure.error
    if failure is None:
        return None
    if isinstance(failure, BaseException):
        text = str(failure) if isinstance(failure, CheckpointError) else f"{type(failure).__name__}: {failure}"
        return type(failure), text
    return None, failure


def _own(failure: Failure) -> BaseException | None:
    if isinstance(failure, Attempt):
        return failure.error
    return failure if isinstance(failure, BaseException) else None


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _detail(failed: dict[int, Problem]) -> str:
    """Every failed rank's problem, ranks with the same message named together."""
    by_message: dict[str, list[int]] = {}
    for rank in sorted(failed):
        by_message.setdefault(failed[rank][1], []).append(rank)
    return "; ".join(f"{_ranks_text(ranks)}: {message}" for message, ranks in by_message.items())


def _typed(kind: type | None, error: type[Exception] | None, text: str) -> Exception:
    if error is not None:
        return error(text)
    if isinstance(kind, type) and issubclass(kind, CheckpointError):
        try:
            return kind(text)
        except TypeError:  # a constructor that wants more than a message
            pass
    return CheckpointError(text)


class Transport:
    """The coordination of one group of ranks (module docstring). Subclasses provide the
    primitives; every rank calls every round, in the same order."""

    rank: int = 0
    world: int = 1
    #: the process group the rounds run over (for point-to-point transfers); None: none
    group: Any = None
    #: do this transport's ranks make up the whole operation? A round over part of it (a
    #: cooperative load's replicas) raises errors that the operation's own round must still
    #: carry to the other ranks (``Attempt`` keeps them instead of letting them through)
    spans_operation: bool = True

    def __init__(self) -> None:
        self.title = ""  # the operation in progress (a save, a load), named in errors
        self.phases: Phases | None = None
        self.consequence = ""

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # -- primitives (subclasses) -----------------------------------------------------------------
    def _max(self, values: list[float], floating: bool) -> list[float]:
        """Element-wise maximum over the ranks (one all-reduce)."""
        raise NotImplementedError

    def _gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere)."""
        raise NotImplementedError

    def _scatter(self, objs: list[Any] | None) -> Any:
        """Rank ``r`` gets the coordinator's ``objs[r]``."""
        raise NotImplementedError

    def _all_gather(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def _broadcast(self, obj: Any, src: int) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def job_rank(self, rank: int) -> int:
        """This transport's ``rank`` as the job numbers it (a replica group's member: its rank
        in the job; a transport over the whole operation: itself)."""
        return self._job_rank(rank)

    def _job_rank(self, rank: int) -> int:
        """How errors name this transport's ``rank``: as the job does, where the transport
        is part of an operation (``spans_operation`` False), else as the transport does."""
        return rank

    def _watching(self) -> contextlib.AbstractContextManager[None]:
        """What an operation runs under to name a rank that stops (``group_transport.py``)."""
        return contextlib.nullcontext()

    # -- an operation ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def operation(self, title: str, phases: Phases, consequence: str) -> Iterator[None]:
        """A save or a load: errors of its rounds start with ``title`` (``"save to <url>"``);
        a rank that stops is named with the phase this rank was in and ``consequence``."""
        self.title, self.phases, self.consequence = title, phases, consequence
        try:
            with self._watching():
                yield
        finally:
            self.title, self.phases, self.consequence = "", None, ""

    # -- rounds ----------------------------------------------------------------------------------
    def reduce(self, fields: F, failure: Failure, what: str, error: type[Exception] | None = None) -> F:
        """Collective: ``fields`` (a dataclass of numbers) reduced over the ranks, in one
        all-reduce with whether this rank's step failed; if any rank's did, every rank raises
        (module docstring), ``what`` naming the round."""
        values, floating = _encode(fields)
        reduced = self._max([float(_problem(failure) is not None), *values], floating)
        if reduced[0]:
            self._raise_everyones(failure, what, error)
        return _decode(fields, reduced[1:])

    def settle(self, failure: Failure, what: str, error: type[Exception] | None = None) -> None:
        """Collective: return on every rank if no rank failed (one all-reduce of one number);
        else raise every rank's failure on every rank."""
        if self._max([float(_problem(failure) is not None)], False)[0]:
            self._raise_everyones(failure, what, error)

    def gather_scatter(
        self, mine: T, decide: Callable[[list[T]], list[Any]], what: str, error: type[Exception] | None = None
    ) -> Any:
        """Collective: every rank's ``mine`` to the coordinator, which runs ``decide`` on them
        (in rank order) for one answer per rank; returns this rank's answer. A failure of
        ``decide`` is raised on every rank."""
        everyone = self._gather(mine)
        outgoing: list[Any] | None = None
        own: BaseException | None = None
        if self.coordinator:
            assert everyone is not None
            try:
                outgoing = [(None, answer) for answer in decide(everyone)]
            except Exception as exc:  # sent to every rank in place of its answer
                outgoing = [(_problem(exc), None)] * self.world
                own = exc
        problem, answer = self._scatter(outgoing)
        if problem is not None:
            raise self._error({0: problem}, what, error) from own
        return answer

    def gather(self, mine: Any) -> list[Any] | None:
        """Collective: every rank's ``mine`` on the coordinator (None elsewhere), for a step
        only the coordinator takes; its outcome reaches the ranks by :meth:`settle`."""
        return self._gather(mine)

    def decided(self, work: Callable[[], T], on: int, what: str, error: type[Exception] | None = None) -> T:
        """Collective: rank ``on`` runs ``work``; every rank returns its result (picklable), or
        every rank raises its failure, ``"<what>: <problem>"``."""
        outcome: tuple[bool, Any] | None = None
        failure: Exception | None = None
        if self.rank == on:
            with Attempt() as step:
                outcome = (True, work())
            if step.error is not None:
                failure = step.error
                outcome = (False, _problem(failure))
        done, value = self._broadcast(outcome, on)
        if done:
            return value
        raise self._error({on: value}, what, error, plain=True) from failure

    def all_marked(self, marks: list[bool]) -> list[bool]:
        """Collective: for each position, whether every rank marked it (one all-reduce of
        ``len(marks)`` numbers, as many on every rank)."""
        return [value == -1 for value in self._max([-int(mark) for mark in marks], False)]

    def replicas(self, layout: Any) -> Transport:
        """A transport over this rank's replica group: the ranks along ``layout.dim`` of
        ``layout.mesh`` (a cooperative load's ``ReplicaLayout``), whose errors the operation's
        next round still carries to the other ranks (``spans_operation`` False)."""
        raise NotImplementedError

    def share(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj``, in rank order, on every rank."""
        return self._all_gather(obj)

    def broadcast(self, obj: Any, src: int) -> Any:
        """Collective: rank ``src``'s ``obj`` on every rank."""
        return self._broadcast(obj, src)

    # -- failures --------------------------------------------------------------------------------
    def _raise_everyones(self, failure: Failure, what: str, error: type[Exception] | None) -> None:
        everyone = self._all_gather(_problem(failure))
        failed = {self._job_rank(rank): problem for rank, problem in enumerate(everyone) if problem is not None}
        raise self._error(failed, what, error) from _own(failure)

    def _error(
        self, failed: dict[int, Problem], what: str, error: type[Exception] | None, plain: bool = False
    ) -> Exception:
        """One error for every rank's problem: ``"<title> failed on rank 1 while <what>: ..."``
        inside an operation, else ``"<what>: rank 1: ..."`` (``plain``: the one problem alone)."""
        ranks = sorted(failed)
        if self.title:
            single = len({message for _, message in failed.values()}) == 1
            detail = failed[ranks[0]][1] if single else _detail(failed)
            text = f"{self.title} failed on {_ranks_text(ranks)} while {what}: {detail}"
        else:
            text = f"{what}: {failed[ranks[0]][1] if plain else _detail(failed)}"
        raised = _typed(failed[ranks[0]][0], error, text)
        if isinstance(raised, CheckpointError):
            raised.ranks, raised.phase, raised.everywhere = tuple(ranks), what, self.spans_operation
        return raised
