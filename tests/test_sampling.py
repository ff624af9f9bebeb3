"""coordinator/runtime/sampling.py: greedy and temperature sampling with top-k, top-p and min-p, seeds,
the penalties, the chat defaults a GGUF recommends, and the token step generate and the server share."""
import numpy as np
import pytest

from coordinator.runtime.sampling import Sampler, SamplingParams

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)


def test_greedy_is_argmax_and_ignores_seed():
    for seed in (None, 1, 2):
        assert Sampler(SamplingParams(0.0, seed=seed))(LOGITS) == 0
    assert Sampler(SamplingParams(0.0))(np.array([0.0, 5.0, 5.0])) == 1  # first of equal maxima


def test_temperature_one_follows_softmax():
    s = Sampler(SamplingParams(1.0, seed=0))
    draws = np.bincount([s(LOGITS) for _ in range(20000)], minlength=len(LOGITS)) / 20000
    want = np.exp(LOGITS - LOGITS.max())
    want /= want.sum()
    np.testing.assert_allclose(draws, want, atol=0.015)


def test_low_temperature_sharpens():
    p_hot = Sampler(SamplingParams(2.0)).probabilities(LOGITS)
    p_cold = Sampler(SamplingParams(0.2)).probabilities(LOGITS)
    assert p_cold[0] > 0.99 and p_hot[0] < 0.5


def test_top_k_keeps_only_k_best():
    p = Sampler(SamplingParams(1.0, top_k=2)).probabilities(LOGITS)
    assert np.count_nonzero(p) == 2 and p[0] > p[1] > 0
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_p():
    full = Sampler(SamplingParams(1.0)).probabilities(LOGITS)
    p = Sampler(SamplingParams(1.0, top_p=0.8)).probabilities(LOGITS)
    k = int(np.searchsorted(np.cumsum(np.sort(full)[::-1]), 0.8)) + 1
    assert np.count_nonzero(p) == k
    assert full[np.argsort(-full)[: k - 1]].sum() < 0.8 <= full[np.argsort(-full)[:k]].sum()
    np.testing.assert_allclose(p[p > 0], full[p > 0] / full[p > 0].sum())


def test_seed_reproducible():
    s1, s2 = Sampler(SamplingParams(1.0, seed=7)), Sampler(SamplingParams(1.0, seed=7))
    assert [s1(LOGITS) for _ in range(50)] == [s2(LOGITS) for _ in range(50)]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_values_rejected(bad):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    p = Sampler(SamplingParams(1.0, min_p=0.3)).probabilities(LOGITS)
    soft = np.exp(LOGITS - LOGITS.max())
    assert np.all((p > 0) == (soft >= 0.3 * soft.max()))
    assert p.sum() == pytest.approx(1.0)


def test_penalties_follow_llama_cpp():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(0.0, repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s.penalize(logits, [0, 1, 1, 3, 3, 3])
    # positive logits are divided, negative multiplied, then presence once and frequency per use
    np.testing.assert_allclose(out, [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.5, 0.5, 3.0 / 2 - 0.5 - 0.75])
    assert s(logits, [3, 3, 3, 3]) == 0  # greedy picks another token once the favourite is penalized
    assert Sampler(SamplingParams(0.0, repeat_penalty=2.0, repeat_last_n=1)).penalize(logits, [3, 0])[3] == 3.0


@pytest.mark.parametrize("kw", [dict(min_p=1.5), dict(repeat_penalty=0.0), dict(presence_penalty=3.0),
                                dict(frequency_penalty=-2.5), dict(temperature=float("nan"))])
def test_bad_new_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).validate()


def test_chat_samples_as_the_model_recommends_else_as_llama_cpp_does():
    """chat_defaults: llama.cpp's defaults, with the GGUF's general.sampling.* over them; values
    of the wrong kind in the file are ignored."""
    import gguf

    from coordinator.runtime.sampling import CHAT_DEFAULTS, chat_defaults

    def reader(tmp, **kv):
        w = gguf.GGUFWriter(tmp, "llama")
        for k, v in kv.items():
            (w.add_float32 if isinstance(v, float) else w.add_uint32 if isinstance(v, int) else w.add_string)(k, v)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
        w.close()
        return gguf.GGUFReader(tmp)

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        assert chat_defaults(reader(f"{d}/a.gguf")) == CHAT_DEFAULTS == dict(temperature=0.8, top_k=40, top_p=0.95,
                                                                              min_p=0.05)
        got = chat_defaults(reader(f"{d}/b.gguf", **{"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                                     "general.sampling.penalty_repeat": 1.1,
                                                     "general.sampling.top_p": "lots"}))
    assert got["temperature"] == pytest.approx(0.6) and got["top_k"] == 20 and isinstance(got["top_k"], int)
    assert got["repeat_penalty"] == pytest.approx(1.1) and got["top_p"] == 0.95 and got["min_p"] == 0.05
    SamplingParams(**got).validate()


def test_pick_next_samples_appends_to_history_and_says_when_the_sequence_ends():
    """The token step Engine.generate and the scheduler share: the history (the penalties'
    window) gains the token; an end-of-sequence token ends the sequence unless told otherwise."""
    from coordinator.runtime.sampling import pick_next

    logits = np.array([0.0, 3.0, 1.0, 2.0], np.float32)
    history = [0]
    pick = pick_next(logits, Sampler(SamplingParams(0.0)), history, eos_ids={1})
    assert (pick.token, pick.end, history) == (1, "eos", [0, 1])
    pick = pick_next(logits, Sampler(SamplingParams(0.0)), history, eos_ids={1}, stop_at_eos=False)
    assert (pick.token, pick.end) == (1, None)
    # a penalty over the history moves the choice off the token already said twice
    pick = pick_next(logits, Sampler(SamplingParams(0.0, repeat_penalty=10.0)), history, eos_ids=set())
    assert pick.token == 3 and history[-1] == 3
