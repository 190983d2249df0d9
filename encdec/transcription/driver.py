"""The driver core every way of running transcription jobs shares: request ids,
which job and ticket each request in flight belongs to, routing a finished
output back to its job, and the requests a job gave up.

A driver loops::

    batch = router.take(jobs)            # [(request id, job, JobRequest)], registered
    submit every request of batch        # all validated before any is queued
    ... a request finishes with output `out`:
    job = router.route(out)              # job.add_output(out, ticket); None if not ours
    abort router.abandoned([job])        # requests the job no longer needs
    batch = router.take([job])           # what it asks for next
    ... leaving early: abort router.open_ids()

``encdec.transcribe.run_jobs`` runs it on an ``LLMEngine`` it steps itself; the
server's ``run_job`` and the realtime sessions on ``AsyncLLMEngine`` (submit is
``add_requests``, abort is cancelling a request's stream).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from encdec.outputs import RequestOutput
from encdec.transcription.job import JobRequest


class JobRouter:
    def __init__(self, prefix: str) -> None:
        self._ids = (f"{prefix}{n}" for n in itertools.count())
        self._owner: dict[str, tuple[Any, int]] = {}  # request id -> (job, ticket), while in flight

    def take(self, jobs: Iterable[Any]) -> list[tuple[str, Any, JobRequest]]:
        """The requests ``jobs`` ask for now, each with a new request id, registered as in flight."""
        batch = []
        for job in jobs:
            for req in job.next_requests():
                rid = next(self._ids)
                self._owner[rid] = (job, req.ticket)
                batch.append((rid, job, req))
        return batch

    def route(self, output: RequestOutput) -> Any | None:
        """Give a finished output to the job that asked for it; returns that job,
        or None for a request not (or no longer) in flight here."""
        entry = self._owner.pop(output.request_id, None)
        if entry is None:
            return None
        job, ticket = entry
        job.add_output(output, ticket)
        return job

    def abandoned(self, jobs: Iterable[Any]) -> list[str]:
        """Request ids of what ``jobs`` gave up (``abandoned_tickets``), no longer in
        flight here: the driver aborts them."""
        dropped = {(id(job), t) for job in jobs for t in job.abandoned_tickets()}
        rids = [rid for rid, (job, t) in self._owner.items() if (id(job), t) in dropped]
        for rid in rids:
            del self._owner[rid]
        return rids

    def forget(self, request_ids: Iterable[str]) -> None:
        """Stop routing these requests (the driver aborted them)."""
        for rid in request_ids:
            self._owner.pop(rid, None)

    def open_ids(self) -> list[str]:
        return list(self._owner)

    def __len__(self) -> int:
        return len(self._owner)
