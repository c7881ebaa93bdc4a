"""Scheduler subclass: forward each row's aux ids from the runner to the request's output.

vLLM's scheduler already slices `ModelRunnerOutput.sampling_masks` per request into
`EngineCoreOutput.new_sampling_mask` when `return_sampling_mask` is on, and the output path
concatenates those per token -- also when it merges deltas for a consumer that lags. We turn the
slicing on here only, in the engine core; the front-end's model config keeps it off, so its
request validation for sampling-mask replay does not apply to our requests.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class OpusScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.return_sampling_mask = True
