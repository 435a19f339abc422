"""A serving engine that records the tokens it chooses, and a request sent to it with its events logged: engine
answers compared token by token with transformers' generate (test_serve_engine, test_vision)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gemmaforge.inference.jobs import Delta, Event, Finished, Job
from gemmaforge.inference.transformers_engine import TransformersEngine


class RecordingEngine(TransformersEngine):
    """Keeps each request's chosen token ids: bf16 answers are compared id by id with generate's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chosen: dict[int, list[int]] = defaultdict(list)  # id(job) -> tokens, the stop token included

    def _accept(self, row: Any, token: int, logprob: Any = None) -> bool:
        self.chosen[id(row.job)].append(token)
        return super()._accept(row, token, logprob)


async def ask(engine: TransformersEngine, job: Job, log: list[tuple[int, Event]], index: int) -> None:
    """Submit `job` and append each of its events, tagged with `index`, to `log`. Every job's events
    come through one event loop in the order the engine thread emitted them, so `log` is that order."""
    engine.submit(job)
    while True:
        event = await job.events.get()
        log.append((index, event))
        if not isinstance(event, Delta):
            return


async def submit_together(engine: TransformersEngine, jobs: list[Job]) -> list[Job]:
    """Submit `jobs` between two steps (the scheduler admits them in one go) and wait until each has finished."""
    with engine._wake:  # held while submitting
        for job in jobs:
            engine.submit(job)
    for job in jobs:
        while not isinstance(await job.events.get(), Finished):
            pass
    return jobs
