"""Scheduler without a model: token budget, batch cap, chunked prefill, preemption."""

from __future__ import annotations

from shoal.kv.kv_cache_manager import KVCacheManager
from shoal.request import Request, RequestStatus
from shoal.sampling import SamplingParams
from shoal.engine.scheduler import Scheduler


def make(num_blocks=64, max_num_tokens=32, max_batch_size=8):
    kv = KVCacheManager(num_blocks, 4, b"ns" * 16)
    return Scheduler(kv, max_num_tokens, max_batch_size, max_model_len=1000)


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), frozenset())


def fake_step(sched, batch):
    """Pretend the model ran: every sampling chunk gets token 7."""
    return sched.update(batch, [7] * sum(c.is_sampling for c in batch.chunks), defer_free=False)


def test_chunked_prefill_respects_token_budget():
    sched = make(max_num_tokens=10)
    sched.add(req("a", 25))
    sizes = []
    while sched.has_work:
        batch = sched.schedule()
        assert batch.num_tokens <= 10
        sizes.append([(c.start, c.num_tokens, c.is_sampling) for c in batch.chunks])
        fake_step(sched, batch)
        sched.check_integrity()
    assert sizes[:3] == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]
    assert sizes[3:] == [[(25, 1, True)], [(26, 1, True)], [(27, 1, True)]]


def test_batch_cap_limits_running_requests():
    sched = make(max_batch_size=2)
    for i in range(4):
        sched.add(req(f"r{i}", 3))
    batch = sched.schedule()
    assert [c.request.request_id for c in batch.chunks] == ["r0", "r1"]
    assert len(sched.waiting) == 2


def test_decodes_go_first_then_new_prefills_share_the_budget():
    sched = make(max_num_tokens=8)
    sched.add(req("a", 3, max_tokens=10))
    fake_step(sched, sched.schedule())
    sched.add(req("b", 20))
    batch = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in batch.chunks] == [("a", 1), ("b", 7)]


def test_preemption_frees_blocks_and_requeues_at_the_front():
    sched = make(num_blocks=4, max_num_tokens=64)
    sched.add(req("old", 7, max_tokens=20))
    sched.add(req("new", 7, max_tokens=20))
    fake_step(sched, sched.schedule())  # both admitted: 2 blocks each
    sched.check_integrity()
    while sched.num_preemptions == 0:
        fake_step(sched, sched.schedule())
        sched.check_integrity()
    victim = sched.waiting[0]
    assert victim.request_id == "new" and victim.status == RequestStatus.WAITING
    assert victim.block_ids == [] and victim.num_computed_tokens == 0
    assert len(victim.output_token_ids) > 0  # kept: recompute covers prompt + outputs
    while sched.has_work:
        fake_step(sched, sched.schedule())
        sched.check_integrity()
    assert sched.kv.pool.num_free_blocks == 4
