# SPDX-License-Identifier: Apache-2.0
"""The per-request acceptance guard in vLLM: a ``--scheduler-cls`` subclass of vLLM's ``Scheduler``.

``--scheduler-cls vllm_dspark.runtime.guard.GuardedScheduler`` turns it on; its parameters come
from ``--additional-config '{"dspark_guard": {...}}'`` (:class:`~vllm_dspark.acceptance_guard.GuardConfig`).
The state machine is :mod:`vllm_dspark.acceptance_guard`; this class only feeds it and applies
it. A guarded request's drafts are dropped after vLLM hands them to the scheduler, so the next step
schedules none: the target verifies nothing of it and emits its own token (greedy output is the
target's by construction), while the dspark speculator still stores the context KV of its tokens.
When no request of a step will verify, the step drafts 0 tokens (0.33+ then skips the query pass).
Needs synchronous scheduling (vLLM hands drafts to the scheduler only there).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_dspark.acceptance_guard import AcceptanceGuard, GuardConfig

logger = init_logger("vllm.vllm_dspark.guard")
CONFIG_KEY = "dspark_guard"  # its entry in --additional-config


def guard_config(vllm_config: Any) -> GuardConfig:
    """The guard's parameters from ``additional_config["dspark_guard"]`` (defaults where absent)."""
    extra = vllm_config.additional_config or {}
    return GuardConfig.from_dict(extra.get(CONFIG_KEY) if isinstance(extra, dict) else None)


def checked_guard_config(vllm_config: Any) -> GuardConfig:
    """:func:`guard_config`, once what the guard cannot run with is refused (one line each)."""
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "the dspark acceptance guard needs synchronous scheduling (vLLM gives an async "
            "scheduler no drafts to withhold): add --no-async-scheduling"
        )
    if vllm_config.speculative_config is None:
        raise ValueError(
            "the dspark acceptance guard needs speculative decoding: give --speculative-config"
        )
    return guard_config(vllm_config)


class GuardedScheduler(Scheduler):
    """vLLM's scheduler with the acceptance guard: guarded requests' drafts are not verified."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        config = checked_guard_config(vllm_config)  # before vLLM's scheduler builds anything
        super().__init__(vllm_config, *args, **kwargs)
        self.guard = AcceptanceGuard(config, self.num_spec_tokens)
        logger.info("dspark acceptance guard on: %s", self.guard.config)

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if output.num_spec_tokens_to_schedule and output.num_scheduled_tokens:
            wanted = any(
                self.guard.wants_drafts_after_step(rid, self.requests[rid].num_prompt_tokens)
                for rid in output.num_scheduled_tokens
            )
            if not wanted:
                output.num_spec_tokens_to_schedule = 0
                self.guard.undrafted_steps += 1
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            i = index.get(rid)
            if request is None or request.is_finished() or i is None or not sampled:
                continue
            generated = sampled[i]
            if not generated:  # a prefill chunk before the last
                continue
            spec = scheduler_output.scheduled_spec_decode_tokens.get(rid) or ()
            invalid = (scheduler_output.num_invalid_spec_tokens or {}).get(rid, 0)
            accepted = max(len(generated) - self.num_sampled_tokens_per_step, 0) if spec else 0
            event = self.guard.observe(
                rid, request.num_prompt_tokens, len(spec) - invalid, accepted, request.num_tokens
            )
            if event is not None:
                g = self.guard.requests[rid]
                logger.info(
                    "dspark guard: request %s %s at step %d, context %d, window rate %.3f",
                    rid,
                    event,
                    g.steps,
                    request.num_tokens,
                    g.rate(),
                )
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid, c in self.guard.retain(self.requests):
            if c["trips"]:
                logger.info(
                    "dspark guard: request %s done: %d of %d drafted accepted, %d guarded steps, "
                    "%d probes, %d resumes",
                    rid,
                    c["accepted"],
                    c["drafted"],
                    c["guarded_steps"],
                    c["probes"],
                    c["resumes"],
                )
        return outputs

    def update_draft_token_ids(self, draft_token_ids) -> None:
        super().update_draft_token_ids(draft_token_ids)
        for rid in draft_token_ids.req_ids:
            request = self.requests.get(rid)
            if request is not None and request.spec_token_ids and not self.guard.verifies(rid):
                request.spec_token_ids = []

    def guard_stats(self) -> dict[str, Any]:
        """The guard's counters: per request (live and recently finished) and totals."""
        return self.guard.stats()
