"""Which worker owns which FFN neurons of each layer.

Two planners, one Plan shape (per worker, per layer, sorted int32 index arrays):
  - static_plan: the GPU worker takes `gpu_share` of every layer's neurons, the CPU workers
    split the rest evenly (no profile needed).
  - budget_plan: from activation frequencies (coordinator/tools/profile.py) and a VRAM budget, the
    GPU worker takes the globally most frequently active neurons that fit; each layer's cold
    neurons are sharded across the CPU workers balanced by expected activations.

A budget plan's GPU share is cached beside the model as `<model>.generated.gpuidx`, a GGUF in
PowerInfer's layout (architecture "generic.gpu_index"; per layer `blk.N.gpu_idx`, int32 per
neuron, 1 on the GPU else 0, and `blk.N.gpu_bucket`, the sorted indices of the GPU neurons;
`split.vram_capacity`, the bytes the GPU neurons need), plus `sparseinfer.*` keys that say
which model, profile, budget and neuron size it was made for, so a stale file is rebuilt.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.doorbell import usable_cores

from .model_files import GPUIDX_FORMAT, gpuidx_path, read_gpuidx, write_gpuidx


@dataclass
class WorkerShard:
    role: str  # "gpu", "cpu", or "coordinator" (computed in the coordinator's process; always last)
    worker_id: int
    neurons: list[np.ndarray]  # per layer, sorted int32 neuron indices (a routed layer's: of each expert)
    # A routed model's (n_layers, experts [+ 1: the shared expert]) bool: the experts whose
    # neurons[layer] this process owns (expert_plan); None: every expert (the static split).
    experts: np.ndarray | None = None


@dataclass
class Plan:
    n_layers: int
    n_ff: int
    shards: list[WorkerShard]

    def check_partition(self) -> None:
        """Every neuron of every layer (of every expert, where shards own experts) is owned by
        exactly one worker."""
        units = max((s.experts.shape[1] for s in self.shards if s.experts is not None), default=1)
        for layer in range(self.n_layers):
            for unit in range(units):
                owned = np.concatenate([s.neurons[layer] for s in self.shards
                                        if s.experts is None or s.experts[layer, unit]])
                if len(owned) != self.n_ff or not np.array_equal(np.sort(owned), np.arange(self.n_ff)):
                    raise AssertionError(f"layer {layer}{f', expert {unit}' if units > 1 else ''}: neurons are not "
                                         f"partitioned across workers")


def static_plan(n_layers: int, n_ff: int, gpu_share: float, n_cpu_workers: int,
                coordinator_share: float = 0.0, align: int = 1) -> Plan:
    """`coordinator_share`: the fraction of the non-GPU neurons the coordinator computes itself
    while the workers compute theirs (a last shard, role "coordinator"). `align`: every cut
    between shards falls on a multiple of it (32 for the native kernels, which read the down
    matrix's columns in whole blocks of 32 neurons)."""
    if not 0.0 <= gpu_share <= 1.0:
        raise ValueError(f"gpu share must be within [0, 1], got {gpu_share}")
    if not 0.0 <= coordinator_share < 1.0:
        raise ValueError(f"coordinator share must be within [0, 1), got {coordinator_share}")
    if n_cpu_workers < 0 or (n_cpu_workers == 0 and gpu_share < 1.0):
        raise ValueError("at least one CPU worker is needed unless the GPU holds every neuron")
    snap = (lambda v: int(round(v / align)) * align) if n_ff % align == 0 else (lambda v: int(round(v)))
    n_gpu = snap(gpu_share * n_ff)
    n_coord = snap(coordinator_share * (n_ff - n_gpu))
    end = n_ff - n_coord
    cuts = [snap(c) for c in np.linspace(n_gpu, end, n_cpu_workers + 1)] if n_cpu_workers else [end]
    all_idx = np.arange(n_ff, dtype=np.int32)
    shards = [WorkerShard("gpu", 0, [all_idx[:n_gpu]] * n_layers)]
    for i in range(n_cpu_workers):
        shards.append(WorkerShard("cpu", i + 1, [all_idx[cuts[i]:cuts[i + 1]]] * n_layers))
    if n_coord:
        shards.append(WorkerShard("coordinator", n_cpu_workers + 1, [all_idx[end:]] * n_layers))
    plan = Plan(n_layers, n_ff, shards)
    plan.check_partition()
    return plan


# ---- cores, default shares and the vocabulary split ---------------------------------------------

def resolve_threads(threads: int | None, cpu_workers: int | None, cuda: bool = False) -> tuple[int, int, int]:
    """(total threads, cpu workers, threads per worker) without oversubscribing the cores.
    The coordinator keeps one core; the workers share the rest. Without CUDA the GPU worker
    holds no neuron by default (see default_gpu_share), so every other core gets a CPU worker;
    with CUDA the GPU worker's feeding thread takes a core too."""
    total = threads or usable_cores()
    default_cpu = max(1, total - 2) if cuda else max(1, total - 1)
    n_cpu = cpu_workers if cpu_workers is not None else default_cpu
    per_worker = max(1, (total - 1) // n_cpu) if total > 1 and n_cpu > 0 else 1
    return total, n_cpu, per_worker


def default_gpu_share(cuda: bool) -> float:
    """Half of each layer on a real GPU. Without one the GPU worker would be one more CPU process
    competing for the cores: it holds nothing, and the CPU workers take every neuron."""
    return 0.5 if cuda else 0.0


def default_coordinator_share(cuda: bool, n_cpu: int, per_worker: int) -> float:
    """Without CUDA the coordinator's core only waits while the workers compute a layer's FFN,
    so it takes a core's share of the neurons (SmolLM2 on 2 cores: two processes computing half
    a layer each took 470 us against 810 us for one computing all of it). With CUDA its core
    feeds the GPU worker and it takes none."""
    return 0.0 if cuda else 1.0 / (1 + n_cpu * per_worker)


def split_vocabulary(plan: Plan, n_vocab: int, slot_capacity: int,
                     shares: Plan | None = None) -> dict[int, tuple[int, int]]:
    """The lm_head's vocabulary rows per slot, [start, stop), in proportion to the FFN neurons
    each process computes (or, `shares`, is meant to: the same plan before its cuts were put on
    block edges), for plans with a coordinator shard (the last slot, which takes the last
    rows). Empty (the coordinator computes the whole head) when there is no coordinator shard,
    nobody to share with, or a worker's rows would not fit its output slot of `slot_capacity`
    floats."""
    if not plan.shards or plan.shards[-1].role != "coordinator":
        return {}
    own = len(plan.shards) - 1
    slots = [slot for slot, sh in enumerate(plan.shards[:-1]) if any(len(n) for n in sh.neurons)] + [own]
    by = shares if shares is not None and len(shares.shards) == len(plan.shards) else plan
    load = np.array([sum(len(n) for n in by.shards[slot].neurons) for slot in slots], dtype=np.float64)
    if load.sum() <= 0:
        return {}
    # cuts on multiples of 16 rows: a share then starts on a group of interleaved rows (FileMatrix.interleave)
    cuts = np.concatenate([[0], np.round(np.cumsum(load) / load.sum() * n_vocab / 16) * 16]).astype(int)
    cuts = np.minimum(cuts, n_vocab)
    cuts[-1] = n_vocab
    if len(slots) < 2 or np.diff(cuts)[:-1].max() > slot_capacity:
        return {}
    return {slot: (int(cuts[i]), int(cuts[i + 1])) for i, slot in enumerate(slots)}


# ---- placement under a VRAM budget ------------------------------------------------------------

GIB = 1 << 30


def neuron_bytes(hidden: int, weights: str = "f32", on_cpu: bool = False) -> int:
    """Bytes one FFN neuron costs on a worker as sparsecore.worker_runtime.LayerWeights
    allocates it: its gate row, its up row and its down column (held as a row), each `hidden`
    values in the workers' weight format (whatever the file's quantization). `on_cpu`: a worker
    computing on the CPU, where f16 keeps the down rows transposed too (sparsecore.ffn.HalfRows)."""
    from sparsecore.ffn import row_nbytes  # here: that module imports torch, which the engine imports after
    # starting its workers (coordinator/runtime/engine_build.py)

    extra = row_nbytes(hidden, weights) if on_cpu and weights == "f16" else 0
    return 3 * row_nbytes(hidden, weights) + extra


def choose_hot(freqs: list[np.ndarray], neuron_bytes: int, vram_budget_bytes: int) -> list[np.ndarray]:
    """Per layer, a bool mask of the neurons the GPU worker holds: the globally most frequent
    neurons, as many as fit in the budget. All neurons cost the same, so taking them in order
    of frequency maximizes the expected activations on the GPU (exchange argument). Ties are
    broken by (layer, index), so the result is deterministic."""
    if neuron_bytes <= 0:
        raise ValueError(f"bytes per neuron must be positive, got {neuron_bytes}")
    if not vram_budget_bytes >= 0:
        raise ValueError(f"VRAM budget must be >= 0 bytes, got {vram_budget_bytes}")
    flat = np.concatenate([np.asarray(f, dtype=np.float64) for f in freqs]) if freqs else np.zeros(0)
    n_hot = min(len(flat), int(vram_budget_bytes // neuron_bytes))
    order = np.argsort(-flat, kind="stable")  # stable: equal frequencies keep (layer, index) order
    mask = np.zeros(len(flat), dtype=bool)
    mask[order[:n_hot]] = True
    out, a = [], 0
    for f in freqs:
        out.append(mask[a:a + len(f)])
        a += len(f)
    return out


def balance_by_load(weights: np.ndarray, n_bins: int, first: int = 0) -> list[np.ndarray]:
    """Split item indices into `n_bins` sorted int32 arrays with nearly equal sums of weights:
    largest first, each to the bin with the least load so far (then the fewest items, then
    bin `first`, first + 1, ...). The loads end within max(weights) of each other; items of
    weight 0 even out the counts. Rotating `first` per layer spreads the rounding over workers."""
    weights = np.asarray(weights, dtype=np.float64)
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    heap = [(0.0, 0, (b - first) % n_bins, b) for b in range(n_bins)]
    heapq.heapify(heap)
    for i in np.argsort(-weights, kind="stable"):
        load, count, rank, b = heapq.heappop(heap)
        bins[b].append(int(i))
        heapq.heappush(heap, (load + float(weights[i]), count + 1, rank, b))
    return [np.array(sorted(x), dtype=np.int32) for x in bins]


def plan_from_hot(hot: list[np.ndarray], freqs: list[np.ndarray], n_cpu_workers: int) -> Plan:
    """The GPU worker gets each layer's hot neurons; the CPU workers share the cold ones,
    balanced by expected activations (sum of frequencies), not by count."""
    if n_cpu_workers < 0:
        raise ValueError("the number of CPU workers must be >= 0")
    n_layers = len(hot)
    n_ff = len(hot[0]) if n_layers else 0
    if any(len(h) != n_ff for h in hot) or any(len(f) != n_ff for f in freqs) or len(freqs) != n_layers:
        raise ValueError("every layer must have the same number of neurons in the mask and the profile")
    shards = [WorkerShard("gpu", 0, [])] + [WorkerShard("cpu", i + 1, []) for i in range(n_cpu_workers)]
    for layer, (h, f) in enumerate(zip(hot, freqs)):
        h = np.asarray(h, dtype=bool)
        shards[0].neurons.append(np.flatnonzero(h).astype(np.int32))
        cold = np.flatnonzero(~h).astype(np.int32)
        if n_cpu_workers == 0:
            if len(cold):
                raise ValueError("at least one CPU worker is needed unless the GPU holds every neuron")
            continue
        for s, part in zip(shards[1:], balance_by_load(np.asarray(f, dtype=np.float64)[cold], n_cpu_workers,
                                                        layer % n_cpu_workers)):
            s.neurons.append(cold[part])
    plan = Plan(n_layers, n_ff, shards)
    plan.check_partition()
    return plan


def budget_plan(freqs: list[np.ndarray], neuron_bytes: int, vram_budget_bytes: int, n_cpu_workers: int) -> Plan:
    """Hot neurons (global greedy by frequency) on the GPU within `vram_budget_bytes`, cold
    neurons sharded over `n_cpu_workers` by expected activations."""
    return plan_from_hot(choose_hot(freqs, neuron_bytes, vram_budget_bytes), freqs, n_cpu_workers)


def plan_summary(plan: Plan, freqs: list[np.ndarray], neuron_bytes: int, cpu_neuron_bytes: int | None = None) -> dict:
    """What a plan means: per layer the GPU's share of neurons and of expected activations,
    overall coverage, and bytes and expected activations per worker (`neuron_bytes` a neuron on
    the GPU worker, `cpu_neuron_bytes`, default the same, on a CPU worker)."""
    cpu_neuron_bytes = neuron_bytes if cpu_neuron_bytes is None else cpu_neuron_bytes
    f64 = [np.asarray(f, dtype=np.float64) for f in freqs]
    total = sum(float(f.sum()) for f in f64)
    layers = []
    for layer, f in enumerate(f64):
        g = plan.shards[0].neurons[layer]
        lt = float(f.sum())
        layers.append({"layer": layer, "gpu_neurons": int(len(g)), "hot_share": len(g) / max(1, plan.n_ff),
                       "coverage": float(f[g].sum()) / lt if lt > 0 else 0.0})
    workers = []
    for s in plan.shards:
        n = int(sum(len(x) for x in s.neurons))
        exp = float(sum(f64[l][x].sum() for l, x in enumerate(s.neurons)))
        workers.append({"role": s.role, "worker_id": s.worker_id, "neurons": n,
                        "bytes": n * (neuron_bytes if s.role == "gpu" else cpu_neuron_bytes),
                        "expected_activations_per_token": exp,
                        "activation_share": exp / total if total > 0 else 0.0})
    return {"n_layers": plan.n_layers, "n_ff": plan.n_ff, "neuron_bytes": neuron_bytes,
            "coverage": workers[0]["activation_share"] if workers else 0.0,
            "gpu_bytes": workers[0]["bytes"] if workers else 0, "layers": layers, "workers": workers}


def plan_under_budget(model: Path, n_layers: int, n_ff: int, hidden: int, vram_budget_gb: float,
                      n_cpu_workers: int, reset_gpu_index: bool = False, disable_gpu_index: bool = False,
                      write_cache: bool = True, profile_file: Path | None = None,
                      weights: str = "f32") -> tuple[Plan, list, str]:
    """The engine's plan for a VRAM budget (GiB): frequencies from `<model>.profile.npz`, the
    GPU share from `<model>.generated.gpuidx` when that file was made for the same model,
    profile, budget and neuron size (unless reset or disabled), otherwise computed and cached.
    Returns (plan, frequencies, where the GPU share came from)."""
    from .model_files import load_profile, profile_path

    if not vram_budget_gb >= 0:
        raise ValueError(f"--vram-budget must be >= 0 GiB, got {vram_budget_gb}")
    model = Path(model)
    ppath = Path(profile_file) if profile_file else profile_path(model)
    if not ppath.exists():
        raise ValueError(f"{ppath}: no activation profile for a VRAM budget; run `sparseinfer profile -m {model}` "
                         f"first (or leave out --vram-budget for the static split)")
    prof = load_profile(ppath)
    if prof.n_layers != n_layers or any(len(f) != n_ff for f in prof.freqs):
        raise ValueError(f"{ppath}: profile has {prof.n_layers} layers x {len(prof.freqs[0])} neurons, the model "
                         f"{n_layers} x {n_ff}; run `sparseinfer profile -m {model}` again")
    nb = neuron_bytes(hidden, weights)
    budget = int(vram_budget_gb * GIB)
    want = {"format": GPUIDX_FORMAT, "model_bytes": model.stat().st_size, "profile": prof.digest(),
            "vram_budget": budget, "neuron_bytes": nb}
    cache = gpuidx_path(model)
    hot = None
    source = "computed"
    if not disable_gpu_index and not reset_gpu_index and cache.exists():
        try:
            cached, meta = read_gpuidx(cache)
            if all(meta.get(k) == v for k, v in want.items()) and len(cached) == n_layers \
                    and all(len(h) == n_ff for h in cached):
                hot, source = cached, f"cached {cache}"
        except Exception:  # unreadable or foreign: rebuild it
            hot = None
    if hot is None:
        hot = choose_hot(prof.freqs, nb, budget)
        if write_cache and not disable_gpu_index:
            meta = {k: v for k, v in want.items() if k != "format"}
            meta["model"] = model.name
            write_gpuidx(cache, hot, meta)
            source = f"computed, cached in {cache}"
    return plan_from_hot(hot, prof.freqs, n_cpu_workers), prof.freqs, source


def expert_placement(freqs: list[np.ndarray], expert_bytes: int, vram_budget_bytes: int) -> dict:
    """The most-routed experts (layer, expert) that fit in the budget, whole, and the share of the
    routed work they would take: a routed model's placement by its profile (`sparseinfer profile`
    on it counts routes), the same rule as choose_hot's one level up. Returns {"experts": per
    layer the placed experts' ids, "predicted_share": of all routes, "layers": per layer (placed,
    share), "expert_bytes", "placed"}."""
    f = np.stack([np.asarray(x, np.float64) for x in freqs])
    n = min(f.size, max(0, vram_budget_bytes) // max(1, expert_bytes))
    order = np.argsort(-f, axis=None, kind="stable")[:n]
    chosen = np.zeros(f.shape, bool)
    chosen.flat[order] = True
    total = f.sum() or 1.0
    layers = [(int(c.sum()), float(r[c].sum() / (r.sum() or 1.0))) for c, r in zip(chosen, f)]
    return {"experts": [np.flatnonzero(c) for c in chosen], "predicted_share": float(f[chosen].sum() / total),
            "layers": layers, "expert_bytes": int(expert_bytes), "placed": int(n)}


def routed_share(freqs: list[np.ndarray], experts: list[np.ndarray]) -> float:
    """The share of routes (by these frequencies: another text's profile) that placed experts take."""
    f = np.stack([np.asarray(x, np.float64) for x in freqs])
    return float(sum(f[i, e].sum() for i, e in enumerate(experts)) / (f.sum() or 1.0))



# ---- a routed model's experts under a VRAM budget -----------------------------------------------

def expert_plan(n_layers: int, n_ff: int, gpu_experts: list[np.ndarray], n_experts: int, shared: bool,
                n_cpu_workers: int, coordinator_share: float = 0.0, align: int = 1) -> Plan:
    """A routed model's plan under --vram-budget: the GPU worker owns every neuron of the experts
    in gpu_experts[layer] (expert_placement's, the most-routed that fit); the CPU workers and the
    coordinator's share split the other experts' neurons as static_plan splits a layer's, the
    same range of each (and of the shared expert, where the model has one: it is every token's,
    and stays with them). A process owning no unit of a layer has no neurons there, and no step."""
    base = static_plan(n_layers, n_ff, 0.0, n_cpu_workers, coordinator_share, align)
    units = n_experts + int(shared)
    on_gpu = np.zeros((n_layers, units), bool)
    for layer, chosen in enumerate(gpu_experts):
        on_gpu[layer, np.asarray(chosen, np.int64)] = True
    none = np.zeros(0, np.int32)
    every = np.arange(n_ff, dtype=np.int32)
    shards = [WorkerShard("gpu", 0, [every if on_gpu[l].any() else none for l in range(n_layers)], on_gpu)]
    for s in base.shards[1:]:
        shards.append(WorkerShard(s.role, s.worker_id, [n if (~on_gpu[l]).any() else none
                                                        for l, n in enumerate(s.neurons)], ~on_gpu))
    plan = Plan(n_layers, n_ff, shards)
    plan.check_partition()
    return plan


def deal_experts(plan: Plan) -> dict[int, tuple[int, int]]:
    """slot -> (phase, dealers) for the CPU's processes that hold routed neurons (CPU workers and
    the coordinator, in slot order), where there are two or more: each then holds its owned
    experts whole and computes every dealers-th of a token's chosen ones (sparsecore/experts.py
    ExpertsLayer); {} where one process computes them. The GPU worker keeps its whole experts."""
    slots = [i for i, sh in enumerate(plan.shards) if sh.role != "gpu" and any(len(n) for n in sh.neurons)]
    return {slot: (phase, len(slots)) for phase, slot in enumerate(slots)} if len(slots) > 1 else {}


def routing_profile(path: Path, model: Path, n_layers: int, n_experts: int):
    """The routing profile (`sparseinfer profile` on a routed model: how often each (layer,
    expert) was chosen) at `path`; ValueError in one line when it is missing or not this model's."""
    from .model_files import load_profile

    if not path.exists():
        raise ValueError(f"{path}: no routing profile for a VRAM budget; run `sparseinfer profile -m {model}` first "
                         f"(or leave out --vram-budget)")
    prof = load_profile(path)
    if prof.meta.get("unit") != "expert" or [len(f) for f in prof.freqs] != [n_experts] * n_layers:
        raise ValueError(f"{path}: not a routing profile of this model's {n_layers} layers x {n_experts} experts; "
                         f"run `sparseinfer profile -m {model}` again")
    return prof


def gpu_expert_bytes(store, cfg, weights: str, cuda: bool) -> int:
    """What one expert takes on the GPU worker, the unit --vram-budget counts: on CUDA its gate,
    up and down as float copies (float16 for the file's blocks, else `weights`); on the CPU
    (no GPU) the file's blocks it computes on, or its converted rows with `weights` other than
    gguf."""
    if cuda or weights != "gguf":
        return neuron_bytes(cfg.hidden, weights, on_cpu=not cuda) * cfg.n_ff
    per_layer = [sum(int(store.by_name[f"blk.{i}.{n}.weight"].n_bytes) for n in
                     ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if store.has(f"blk.{i}.{n}.weight"))
                 for i in range(cfg.n_layers)]
    return max(per_layer) // cfg.n_experts


def experts_under_budget(model: Path, store, cfg, vram_budget_gb: float, weights: str, cuda: bool,
                         profile_file: Path | None = None) -> dict:
    """The most-routed experts that fit in a VRAM budget (GiB), whole, by the model's routing
    profile (expert_placement), with the share of the routed work they take: what `info
    --vram-budget` prints and what the engine places. ValueError in one line for a budget that
    is not a number >= 0, or that holds no expert."""
    from .model_files import profile_path

    if not (vram_budget_gb >= 0 and np.isfinite(vram_budget_gb)):
        raise ValueError(f"--vram-budget must be a number of GiB >= 0, got {vram_budget_gb}")
    model = Path(model)
    prof = routing_profile(Path(profile_file) if profile_file else profile_path(model), model, cfg.n_layers,
                           cfg.n_experts)
    expert_bytes = gpu_expert_bytes(store, cfg, weights, cuda)
    budget = int(vram_budget_gb * GIB)
    placed = expert_placement(prof.freqs, expert_bytes, budget)
    if not placed["placed"]:
        raise ValueError(f"--vram-budget {vram_budget_gb:g} GiB holds no expert: one takes {expert_bytes / (1 << 20):.2f} "
                         f"MiB on the GPU worker")
    return {"vram_budget_gb": vram_budget_gb, "vram_budget_bytes": budget, "unit": "expert",
            "profile_tokens": prof.meta.get("tokens"), **placed}
