"""The engine's per-step host costs, counted (not timed): on a GPU every device->host read
stalls the host until the GPU drains and every blocking host->device copy syncs the stream, so
a decode step must read back once (its tokens and log-probs) and copy nothing up, whatever the
batch holds (padding, token masks, temperatures, shared-base LoRA rows, finishing rows)."""

import torch

from flexmarl.bench.engine_overhead import count_host_costs
from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import HFEngine
from flexmarl.types import GenerationRequest


def test_counter_sees_reads_and_ops():
    t = torch.arange(6.0)
    with count_host_costs() as c:
        (t + 1).cpu().tolist()  # one read: the list comes from the host copy
        float(t.sum())
        t[t > 2]  # boolean indexing: a nonzero inside
    assert c.syncs == 3
    assert c.by_sync[".cpu()"] == 1 and c.by_sync["aten._local_scalar_dense"] == 1
    assert c.ops >= 4  # add, sum, gt, index


def _engine(adapters=None, model=None):
    model = model or build_model("a", ModelConfig(init_std=0.1), 48, 96, 0)
    return HFEngine(model, 8, adapters=adapters)


def _mixed(n, agents=("a",), long=40):
    return [GenerationRequest(f"m{i}_0_0", agents[i % len(agents)], 0, [1] + [5 + i] * (1 + i),
                              long if i % 2 else 3, None if i % 3 else list(range(10, 40)),
                              [], 0.8 + 0.1 * (i % 3), 3) for i in range(n)]


def test_a_decode_step_reads_back_once_and_copies_nothing_up():
    engine = _engine()
    engine.admit(_mixed(6))  # each row's first token
    with count_host_costs() as c:
        done = engine.step()  # the second: nobody finishes
    assert not done
    assert (c.syncs, c.h2d) == (1, 0), c.by_sync
    with count_host_costs() as c:
        done = engine.step()  # the 3-token rows finish and leave the batch
    assert len(done) == 3 and engine.active == 3
    assert c.syncs == 1, c.by_sync  # trimming the padding reads nothing from the device
    assert c.h2d == 1  # the kept rows' indices


def test_admission_copies_up_once_per_batch():
    engine = _engine()
    with count_host_costs() as c:
        engine.admit(_mixed(5))
    assert c.syncs == 1  # the first tokens
    assert c.h2d == 2  # ids + state + temperatures packed; the token masks


def test_shared_base_step_copies_no_adapter_rows():
    from flexmarl.config.schema import config_from_dict
    from flexmarl.policy import adapters
    from tests.rollout.test_engine_adapters import AGENTS, RAW  # the shared-base setup

    model, names, _ = adapters.build_replica_model(config_from_dict(RAW), AGENTS, 48, 96, "cpu",
                                                   torch.float32)
    engine = _engine(names, model)
    engine.admit(_mixed(6, AGENTS))
    with count_host_costs() as c:
        engine.step()
    assert (c.syncs, c.h2d) == (1, 0), c.by_sync


def test_a_static_decode_step_reads_back_once_and_copies_nothing_up():
    """The bucketed step (what a CUDA graph replays): one read, no copy up, also when rows
    leave and the batch drops to a smaller bucket."""
    engine = HFEngine(build_model("a", ModelConfig(init_std=0.1), 48, 96, 0), 8, decode="static")
    engine.admit([GenerationRequest(f"s{i}_0_0", "a", 0, [1] + [5 + i] * (1 + i),
                                    40 if i % 2 else 3, None, [], 0.8 + 0.1 * (i % 3), 3)
                  for i in range(6)])
    with count_host_costs() as c:
        assert not engine.step()
    assert (c.syncs, c.h2d) == (1, 0), c.by_sync
    with count_host_costs() as c:
        assert len(engine.step()) == 3  # 6 rows (bucket 8) -> 3 rows (bucket 4)
    with count_host_costs() as c:
        engine.step()
    assert (c.syncs, c.h2d) == (1, 0), c.by_sync


def test_a_nucleus_decode_step_copies_nothing_up():
    """Rows sampling from a nucleus (top-p): their top-p values stay on the device with the
    batch, so a step still copies nothing up."""
    engine = _engine()
    engine.admit([GenerationRequest(f"p{i}_0_0", "a", 0, [1] + [5 + i] * (1 + i), 40, None, [],
                                    1.0, 3, top_p=0.9 if i % 2 else 1.0) for i in range(4)])
    with count_host_costs() as c:
        assert not engine.step()
    assert (c.syncs, c.h2d) == (1, 0), c.by_sync
