"""A CPU worker that computes on the model file's own blocks (--weights gguf, the default) never
imports torch: a quarter of a GB resident and about a second of start-up it has no use for.
Workers holding float copies (--weights f32) do import it: the positive control."""
from __future__ import annotations

import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from tests.fixtures import procs


def _maps_torch(pid: int) -> bool:
    return "libtorch" in procs.maps(pid)


@pytest.mark.parametrize("weights,fast,imports", [("gguf", False, False), ("gguf", True, False), ("f32", False, True)])
def test_cpu_worker_imports_torch_only_for_float_copies(tiny_model_factory, weights, fast, imports, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=7)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, weights=weights, fast=fast)) as eng:
        workers = [w for w in eng.pool.workers if w.role == "cpu"]
        assert workers
        # a prompt (the prefill path) and decoded tokens (the per-token kernels) first
        out = list(eng.generate(list(range(5, 45)), 4, stop_at_eos=False))
        assert len(out) == 4
        for w in workers:
            assert _maps_torch(w.pid) is imports, f"cpu worker {w.pid}: torch mapped = {not imports}"
