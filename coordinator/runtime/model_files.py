"""Files written beside a model, `<model>.<kind>`: their names, readers and writers, in one place.

| file | written by | read by |
|---|---|---|
| `<model>.thresholds.json` | `sparseinfer calibrate` (coordinator.tools.calibrate) | the engine (`--sparsity`) |
| `<model>.profile.npz` (+ `.png`) | `sparseinfer profile` (coordinator.tools.profile) | placement (`--vram-budget`) |
| `<model>.predictor.gguf` | `sparseinfer train-predictor` | the engine (`--predictor`), coordinator.model.predictor |
| `<model>.generated.gpuidx` | placement, a cache of a budget plan's GPU share | placement |

Every writer writes a temporary file in the same directory and renames it over the target, so a
crash or Ctrl-C never leaves a half-written file under the real name.

Thresholds: `{"format", "model", "model_bytes", "activation", "tokens", "seconds", "levels",
"sites", "input_levels", "head_levels", "quality"}`: levels maps "0.50" to CATS's threshold per
layer; input_levels to input sparsity's, per layer one per site (`sites`, protocol.shm_layout.
INPUT_SITES); head_levels to the lm_head input's; quality holds the held-out perplexity of dense
and of each input level (coordinator/tools/calibrate.py), which the default level is chosen from.
A routed (mixture-of-experts) model's file adds `expert_levels`: per level, per layer, CATS's
threshold of each expert (its quantile over the tokens routed to it; the layer's where too few
were), and its quality is CATS's (method "cats"); a dense model's file has no such key.

Profile: one float32 array `layer_N` of activation frequencies in [0, 1] per layer, and
`metadata`, a JSON document stored as a one-element string array, so that the file loads with
`allow_pickle=False`.

Predictor: a standard GGUF, `blk.N.fc1.weight` (rank, hidden), `blk.N.fc2.weight` (n_ff, rank),
`powerinfer.sparse_threshold` and `sparseinfer.predictor.*` keys.

GPU index: PowerInfer's layout (architecture "generic.gpu_index"; per layer `blk.N.gpu_idx`,
int32 per neuron, 1 on the GPU else 0, and `blk.N.gpu_bucket`, the sorted indices of the GPU
neurons; `split.vram_capacity`, the bytes the GPU neurons need), plus `sparseinfer.*` keys that
say which model, profile, budget and neuron size it was made for, so a stale file is rebuilt.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from protocol.shm_layout import INPUT_SITES

THRESHOLDS_FORMAT = "sparseinfer-thresholds/1"
PROFILE_FORMAT = "sparseinfer-profile/1"
PREDICTOR_FORMAT = "sparseinfer-predictor/1"
GPUIDX_ARCH = "generic.gpu_index"  # PowerInfer's export_split writes this architecture
GPUIDX_FORMAT = "sparseinfer-gpuidx/1"


# ---- names -----------------------------------------------------------------------------------

def thresholds_path(model: Path) -> Path:
    return Path(str(model) + ".thresholds.json")


def profile_path(model: Path, out_dir: Path | None = None) -> Path:
    model = Path(model)
    return (Path(out_dir) if out_dir else model.parent) / (model.name + ".profile.npz")


def plot_path(npz: Path) -> Path:
    return Path(str(npz)[: -len(".npz")] + ".png" if str(npz).endswith(".npz") else str(npz) + ".png")


def predictor_path(model: Path) -> Path:
    return Path(str(model) + ".predictor.gguf")


def gpuidx_path(model: Path) -> Path:
    return Path(str(model) + ".generated.gpuidx")


# ---- writing without half files ----------------------------------------------------------------

@contextlib.contextmanager
def _replaced_atomically(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yields a temporary name beside `path` (ending in `suffix`) to write; renames it over `path`
    when the block completes, removes it when the block raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}{suffix}")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_gguf(path: Path, arch: str, fill: Callable) -> Path:
    """A GGUF file: `fill(writer)` adds the keys and tensors to a gguf.GGUFWriter."""
    from gguf import GGUFWriter

    with _replaced_atomically(path) as tmp:
        w = GGUFWriter(tmp, arch)
        try:
            fill(w)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return Path(path)


# ---- thresholds (<model>.thresholds.json) -------------------------------------------------------

def level_key(sparsity: float) -> str:
    return f"{sparsity:.2f}"


def _read_thresholds(model: Path, path: Path, sparsity: float) -> dict:
    if not path.exists():
        raise ValueError(f"{path}: no calibrated thresholds; run `sparseinfer calibrate -m {model} "
                         f"--sparsity {sparsity}` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != THRESHOLDS_FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {THRESHOLDS_FORMAT!r}")
    return data


def load_thresholds(model: Path, sparsity: float, path: Path | None = None) -> list[float]:
    """CATS's per-layer thresholds at `sparsity`."""
    path = path or thresholds_path(model)
    data = _read_thresholds(model, path, sparsity)
    levels = data.get("levels", {})
    key = level_key(sparsity)
    if key not in levels:
        raise ValueError(f"{path}: no thresholds for sparsity {key} (calibrated: {', '.join(sorted(levels))}); "
                         f"run `sparseinfer calibrate --sparsity {sparsity}`")
    return [float(t) for t in levels[key]]


def load_expert_thresholds(model: Path, sparsity: float, path: Path | None = None) -> list[list[float]] | None:
    """A routed model's CATS thresholds at `sparsity` per layer and expert (the file's
    expert_levels), or None where its calibration has none (a dense model's file, or one from
    before experts were calibrated: every expert then takes its layer's threshold)."""
    path = path or thresholds_path(model)
    levels = _read_thresholds(model, path, sparsity).get("expert_levels") or {}
    got = levels.get(level_key(sparsity))
    return None if got is None else [[float(t) for t in layer] for layer in got]


def load_input_level(model: Path, sparsity: float, path: Path | None = None) -> tuple[list[list[float]], float]:
    """Input sparsity's thresholds at `sparsity`, from one read of the file: per layer, one per
    protocol.shm_layout.INPUT_SITES; and the lm_head input's (sparsecore/lm_head.py:
    HeadCandidates), -1 (dense) where the calibration has none."""
    path = path or thresholds_path(model)
    data = _read_thresholds(model, path, sparsity)
    levels = data.get("input_levels")
    if not levels:
        raise ValueError(f"{path}: no input-sparsity thresholds (calibrated by an older version); run "
                         f"`sparseinfer calibrate -m {model}` again")
    key = level_key(sparsity)
    if key not in levels:
        raise ValueError(f"{path}: no thresholds for sparsity {key} (calibrated: {', '.join(sorted(levels))}); "
                         f"run `sparseinfer calibrate --sparsity {sparsity}`")
    if data.get("sites") != list(INPUT_SITES):
        raise ValueError(f"{path}: input sites {data.get('sites')}, expected {list(INPUT_SITES)}; calibrate again")
    head = data.get("head_levels", {}).get(key)
    return [[float(t) for t in layer] for layer in levels[key]], -1.0 if head is None else float(head)


def load_input_thresholds(model: Path, sparsity: float, path: Path | None = None) -> list[list[float]]:
    """The per-layer part of load_input_level."""
    return load_input_level(model, sparsity, path)[0]


def calibration(model: Path, path: Path | None = None) -> dict:
    """What a calibration stored, for choosing a default level (coordinator/runtime/sparsity_level.py) and
    timing the levels (the speed check): the whole table, or {} where there is no readable
    thresholds file of this format (the choice then falls back to dense)."""
    path = path or thresholds_path(model)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == THRESHOLDS_FORMAT else {}


def level_keys(table: dict, method: str) -> list[str]:
    """The levels a calibration table holds for `method` ("input" or "cats"), lowest first."""
    return sorted(table.get("input_levels" if method == "input" else "levels", {}), key=float)


def save_speed(model: Path, speed: dict, path: Path | None = None) -> None:
    """Stores the decode speed check (coordinator/tools/speed_check.py) in the thresholds file."""
    path = path or thresholds_path(model)
    table = json.loads(path.read_text())
    table["speed"] = speed
    with _replaced_atomically(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))


def save_thresholds(model: Path, table: dict, path: Path | None = None) -> Path:
    """Writes `table` (coordinator.tools.calibrate.calibrate's result), keeping the levels an
    earlier calibration of the same model file stored."""
    path = path or thresholds_path(model)
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("format") == THRESHOLDS_FORMAT and old.get("model_bytes") == table["model_bytes"]:
        old["levels"].update(table["levels"])  # keep levels calibrated earlier
        table = {**table, "levels": old["levels"]}
        if old.get("input_levels") and old.get("sites") == table.get("sites") and "input_levels" in table:
            table["input_levels"] = {**old["input_levels"], **table["input_levels"]}
            table["head_levels"] = {**old.get("head_levels", {}), **table.get("head_levels", {})}
        if old.get("expert_levels") and "expert_levels" in table:
            table["expert_levels"] = {**old["expert_levels"], **table["expert_levels"]}
    with _replaced_atomically(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return path


# ---- activation profiles (<model>.profile.npz) --------------------------------------------------

@dataclass
class Profile:
    freqs: list[np.ndarray]  # per layer, float32 (n_ff,)
    meta: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.freqs)

    def digest(self) -> str:
        """Identifies these frequencies (the GPU index cache records which profile it came from)."""
        h = hashlib.sha256()
        for f in self.freqs:
            h.update(np.ascontiguousarray(f, dtype=np.float32).tobytes())
        return h.hexdigest()[:16]


def save_profile(profile: Profile, path: Path) -> Path:
    arrays = {f"layer_{i}": np.asarray(f, dtype=np.float32) for i, f in enumerate(profile.freqs)}
    arrays["metadata"] = np.array([json.dumps(profile.meta)])  # a unicode array: no pickle needed
    with _replaced_atomically(path, ".npz") as tmp:  # np.savez appends .npz to any other name
        np.savez(tmp, **arrays)
    return Path(path)


def load_profile(path: Path) -> Profile:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["metadata"][0])) if "metadata" in z.files else {}
            layers = sorted((int(m.group(1)), k) for k in z.files if (m := re.fullmatch(r"layer_(\d+)", k)))
            freqs = [np.asarray(z[k], dtype=np.float32) for _, k in layers]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a readable activation profile ({e})") from None
    if meta.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {PROFILE_FORMAT!r}")
    if [i for i, _ in layers] != list(range(len(layers))) or not layers:
        raise ValueError(f"{path}: layers {[i for i, _ in layers]} are not 0..N-1")
    return Profile(freqs, meta)


# ---- trained predictors (<model>.predictor.gguf) ------------------------------------------------

def save_predictor(path: Path, p, *, arch: str = "llama", model: Path | None = None) -> Path:
    """`p`: a coordinator.tools.train_predictor.TrainedPredictors."""
    np_dtype = np.float16 if p.dtype == "F16" else np.float32

    def fill(w) -> None:
        w.add_name("sparseinfer activation predictor")
        w.add_string("sparseinfer.predictor.format", PREDICTOR_FORMAT)
        w.add_float32("powerinfer.sparse_threshold", float(p.sparse_threshold))
        w.add_uint32("sparseinfer.predictor.rank", int(p.rank))
        w.add_float32("sparseinfer.predictor.target_sparsity",
                      float(p.target_sparsity) if p.target_sparsity is not None else 0.0)
        w.add_string("sparseinfer.predictor.target_rule", "relu>0" if p.target_sparsity is None else "cats")
        w.add_float32("sparseinfer.predictor.target_recall", float(p.target_recall))
        w.add_bool("sparseinfer.predictor.per_layer", bool(p.per_layer))
        w.add_array("sparseinfer.predictor.thresholds", [float(t) for t in p.thresholds])
        w.add_uint32("sparseinfer.predictor.n_layers", len(p.fc1))
        if model is not None:
            w.add_string("sparseinfer.predictor.model", Path(model).name)
            w.add_uint64("sparseinfer.predictor.model_bytes", Path(model).stat().st_size)
        for i, (a, b) in enumerate(zip(p.fc1, p.fc2)):
            w.add_tensor(f"blk.{i}.fc1.weight", np.ascontiguousarray(a, dtype=np_dtype))
            w.add_tensor(f"blk.{i}.fc2.weight", np.ascontiguousarray(b, dtype=np_dtype))

    return write_gguf(path, arch, fill)


def load_predictor(path: Path) -> tuple[list[np.ndarray], list[np.ndarray], list[float], dict]:
    """(fc1s, fc2s, per-layer thresholds, metadata) from a file `save_predictor` wrote (for tests
    and tools; the engine reads predictors with coordinator.model.predictor)."""
    from gguf import GGUFReader

    from sparsecore.gguf_file import field_value

    r = GGUFReader(path)
    by = {t.name: t for t in r.tensors}
    n = int(field_value(r, "sparseinfer.predictor.n_layers"))
    fc1 = [np.asarray(by[f"blk.{i}.fc1.weight"].data, dtype=np.float32) for i in range(n)]
    fc2 = [np.asarray(by[f"blk.{i}.fc2.weight"].data, dtype=np.float32) for i in range(n)]
    meta = {k: field_value(r, k) for k in r.fields if k.startswith(("powerinfer.", "sparseinfer."))}
    thr = [float(v) for v in meta["sparseinfer.predictor.thresholds"]]
    return fc1, fc2, thr, meta


# ---- the GPU index cache (<model>.generated.gpuidx) --------------------------------------------

def write_gpuidx(path: Path, hot: list[np.ndarray], meta: dict) -> Path:
    """Write the GPU masks in PowerInfer's layout (standard GGUF magic; our reader also takes
    PowerInfer's PWRI one). `meta` values (ints or strings) go in as `sparseinfer.<key>`."""
    def fill(w) -> None:
        w.add_block_count(len(hot))
        n_gpu = int(sum(int(np.count_nonzero(h)) for h in hot))
        w.add_uint64("split.vram_capacity", n_gpu * int(meta.get("neuron_bytes", 0)))
        w.add_string("sparseinfer.format", GPUIDX_FORMAT)
        for k, v in meta.items():
            if isinstance(v, str):
                w.add_string(f"sparseinfer.{k}", v)
            else:
                w.add_uint64(f"sparseinfer.{k}", int(v))
        for i, h in enumerate(hot):
            w.add_tensor(f"blk.{i}.gpu_idx", np.asarray(h, dtype=np.int32))
            w.add_tensor(f"blk.{i}.gpu_bucket", np.flatnonzero(h).astype(np.int32))

    return write_gguf(path, GPUIDX_ARCH, fill)


def read_gpuidx(path: Path) -> tuple[list[np.ndarray], dict]:
    """(per-layer bool GPU masks, metadata) from a gpuidx file, ours or PowerInfer's."""
    from sparsecore.gguf_file import field_value, open_gguf

    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture")
    if arch != GPUIDX_ARCH:
        raise ValueError(f"{path}: architecture {arch!r}, expected {GPUIDX_ARCH!r}")
    n_layers = int(field_value(reader, f"{GPUIDX_ARCH}.block_count", -1))
    by_name = {t.name: t for t in reader.tensors}
    hot = []
    for i in range(n_layers):
        t = by_name.get(f"blk.{i}.gpu_idx")
        if t is None:
            raise ValueError(f"{path}: tensor blk.{i}.gpu_idx is missing")
        idx = np.asarray(t.data).reshape(-1)
        bucket = by_name.get(f"blk.{i}.gpu_bucket")
        if bucket is not None and not np.array_equal(np.asarray(bucket.data).reshape(-1), np.flatnonzero(idx)):
            raise ValueError(f"{path}: blk.{i}.gpu_bucket disagrees with blk.{i}.gpu_idx")
        hot.append(idx != 0)
    meta = {k[len("sparseinfer."):]: field_value(reader, k) for k in reader.fields if k.startswith("sparseinfer.")}
    meta["vram_capacity"] = field_value(reader, "split.vram_capacity")
    return hot, meta
