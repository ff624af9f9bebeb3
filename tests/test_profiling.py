"""coordinator.tools.profile: activation frequencies from the dense engine, the .npz and .png files,
PowerInfer's activation_N.pt directories, and a budget plan built from a real profile."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import gpuidx_path, load_profile, plot_path, profile_path, save_profile
from coordinator.runtime.sampling import SamplingParams
from coordinator.tools import corpus, observe
from coordinator.tools.profile import collect, load_powerinfer_activations, plot_profile, profile_from_powerinfer
from tests.conftest import REPO
from tests.fixtures.reference_llama import ReferenceLlama


def _chunks(eng, n=4, length=48):
    ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:12000])
    return corpus.token_chunks(ids, length, n)


@pytest.fixture(scope="module")
def tiny_profile(tiny_model_factory):
    path = tiny_model_factory(tensor_type="F32", seed=11)
    with Engine(path, EngineOptions(cpu_workers=1, threads=2)) as eng:
        chunks = _chunks(eng)
        prof = collect(eng, chunks, sparsity=0.3)  # no calibrated thresholds: quantiles on the fly
        again = collect(eng, chunks, sparsity=0.3, thresholds=prof.meta["thresholds"])
    return path, prof, again


def test_frequencies_match_target_sparsity(tiny_profile):
    path, prof, again = tiny_profile
    assert prof.n_layers == 2 and all(f.shape == (160,) and f.dtype == np.float32 for f in prof.freqs)
    for f in prof.freqs:
        assert f.min() >= 0.0 and f.max() <= 1.0
        assert float(f.mean()) == pytest.approx(1 - 0.3, abs=0.01)
    assert prof.meta["tokens"] == 4 * 48 and prof.meta["sparsity"] == 0.3
    assert "quantile" in prof.meta["rule"]
    # Given the same thresholds explicitly (as calibrated ones are), the counts are the same.
    for a, b in zip(prof.freqs, again.freqs):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert "calibrated" in again.meta["rule"]


def test_relu_model_counts_positive_gate(tiny_model_factory):
    path = tiny_model_factory(tensor_type="F32", seed=2, activation="relu")
    with Engine(path, EngineOptions(cpu_workers=1, threads=2)) as eng:
        xs = {}
        prof = collect(eng, _chunks(eng, 2, 32), sparsity=0.9)  # sparsity does not matter for ReLU
        observe.dense_run(eng, _chunks(eng, 2, 32), lambda layer, x, *rest: xs.setdefault(layer, []).append(x.copy()))
        gate = observe.GateActivity(eng).gate(0).numpy()
    want = (np.concatenate(xs[0]) @ gate.T > 0).mean(axis=0)
    np.testing.assert_allclose(prof.freqs[0], want, atol=1e-6)
    assert prof.meta["rule"] == "relu(gate x) > 0" and prof.meta["thresholds"] == [0.0, 0.0]


def test_npz_round_trip_without_pickle_and_png(tiny_profile, tmp_path):
    _, prof, _ = tiny_profile
    npz = save_profile(prof, tmp_path / "m.gguf.profile.npz")
    with np.load(npz, allow_pickle=False) as z:
        assert sorted(z.files) == ["layer_0", "layer_1", "metadata"]
        assert z["layer_0"].dtype == np.float32
        assert json.loads(str(z["metadata"][0]))["format"] == "sparseinfer-profile/1"
    back = load_profile(npz)
    assert back.meta == json.loads(json.dumps(prof.meta))
    assert all(np.array_equal(a, b) for a, b in zip(back.freqs, prof.freqs))
    assert back.digest() == prof.digest()
    png = plot_profile(prof, plot_path(npz))
    assert png.name == "m.gguf.profile.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 200


def test_load_profile_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, layer_0=np.zeros(3), metadata=np.array([json.dumps({"format": "other"})]))
    with pytest.raises(ValueError, match="format"):
        load_profile(bad)
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ValueError):
        load_profile(tmp_path / "junk.npz")


def test_powerinfer_activation_dir_is_ordered_by_number(tmp_path):
    d = tmp_path / "activation"
    d.mkdir()
    for i in range(12):  # lexicographic order would be 0, 1, 10, 11, 2, ...
        torch.save(torch.full((8,), float(i)) + torch.arange(8.0), d / f"activation_{i}.pt")
    (d / "notes.txt").write_text("ignored")
    freqs = load_powerinfer_activations(d)
    assert len(freqs) == 12
    assert [float(f[0]) for f in freqs] == [float(i) for i in range(12)]
    prof = profile_from_powerinfer(d)
    assert prof.n_layers == 12 and max(float(f.max()) for f in prof.freqs) == 1.0
    assert prof.meta["scale"] == 18.0
    np.testing.assert_allclose(prof.freqs[3], (3 + np.arange(8)) / 18.0, rtol=1e-6)


def test_powerinfer_activation_dir_errors(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    with pytest.raises(ValueError, match="no activation_N.pt"):
        load_powerinfer_activations(d)
    torch.save(torch.ones(4), d / "activation_0.pt")
    torch.save(torch.ones(4), d / "activation_2.pt")
    with pytest.raises(ValueError, match="missing"):
        load_powerinfer_activations(d)
    torch.save({"not": torch.ones(4)}, d / "activation_1.pt")
    with pytest.raises(ValueError, match="1-D tensor"):
        load_powerinfer_activations(d)


def test_budget_engine_from_profile_matches_reference(tiny_profile, tmp_path):
    """A budget plan puts the most frequent neurons on the GPU worker; the output is unchanged."""
    path, prof, _ = tiny_profile
    save_profile(prof, profile_path(path))
    cache = gpuidx_path(path)
    cache.unlink(missing_ok=True)
    try:
        budget_gb = 100 * 3 * 64 * 4 / (1 << 30)  # 100 of the 320 neurons
        # float32 rows on the (CPU) GPU worker: the budget is counted in them
        with Engine(path, EngineOptions(cpu_workers=2, threads=2, vram_budget_gb=budget_gb, weights="f32")) as eng:
            ids = eng.tokenizer.encode("the quick brown fox")
            got = list(eng.generate(ids, 6, SamplingParams(0.0), stop_at_eos=False))
            gpu = eng.plan.shards[0].neurons
        assert sum(len(g) for g in gpu) == 100 and cache.exists()
        flat = np.concatenate(prof.freqs)
        chosen = np.concatenate([prof.freqs[l][g] for l, g in enumerate(gpu)])
        assert chosen.min() >= np.sort(flat)[::-1][99] - 1e-7
        assert got == ReferenceLlama(path).greedy(ids, 6)
    finally:
        cache.unlink(missing_ok=True)
        profile_path(path).unlink(missing_ok=True)


def test_cli_profile_then_info(tiny_model_factory, tmp_path):
    path = tiny_model_factory(tensor_type="F32", seed=12)
    r = subprocess.run([sys.executable, "-m", "coordinator", "profile", "-m", str(path), "--chunks", "2",
                        "--chunk-len", "32", "--sparsity", "0.5", "--cpu-workers", "1", "-t", "2"],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "sparseinfer calibrate" in r.stderr  # no thresholds: says how to calibrate, goes on
    npz = profile_path(path)
    try:
        assert npz.exists() and plot_path(npz).exists()
        assert float(np.mean(np.concatenate(load_profile(npz).freqs))) == pytest.approx(0.5, abs=0.02)
        r = subprocess.run([sys.executable, "-m", "coordinator", "info", "-m", str(path), "--vram-budget", "0.0001",
                            "--cpu-workers", "2", "--json", "--weights", "f32"],  # float32 rows: 12 B a value
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr
        plan = json.loads(r.stdout)["plan"]
        nb = 3 * 64 * 4
        assert plan["neuron_bytes"] == nb
        assert plan["workers"][0]["neurons"] == int(0.0001 * (1 << 30)) // nb
        assert [w["role"] for w in plan["workers"]] == ["gpu", "cpu", "cpu"]
        assert 0 < plan["coverage"] < 1 and len(plan["layers"]) == 2
        assert not gpuidx_path(path).exists()  # info does not write the cache
    finally:
        npz.unlink(missing_ok=True)
        plot_path(npz).unlink(missing_ok=True)


def test_info_without_profile_says_what_to_run(tiny_model):
    r = subprocess.run([sys.executable, "-m", "coordinator", "info", "-m", str(tiny_model), "--vram-budget", "1"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and "sparseinfer profile -m" in r.stderr and "Traceback" not in r.stderr
