"""data.mix: the apportionment by weight, the per-source streams, the epoch mixture, loading and the errors."""

import json
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from tether.config.base import describe_validation_error
from tether.config.data import DataConfig, PairDataConfig
from tether.config.sft import SFTConfig
from tether.data import DataError, TokenizedExample, make_batches
from tether.data.mixing import Mixture, mixture_counts, stream_indices
from tether.data.sources import mix_records, training_records

# ---------------------------------------------------------------- counts


@pytest.mark.parametrize(("weights", "size", "expected"), [
    ([3, 1], 4000, [3000, 1000]),
    # quotas 3.33 each: floors 3 + 3 + 3 = 9, the one left goes to the first of the tied remainders
    ([1, 1, 1], 10, [4, 3, 3]),
    # quotas 3.5, 2.1, 1.4: floors 3 + 2 + 1 = 6, the one left to the largest remainder (0.5)
    ([0.5, 0.3, 0.2], 7, [4, 2, 1]),
    # quotas 0.3, 0.7 (x 1): the one example goes to the larger remainder
    ([3, 7], 1, [0, 1]),
    ([2.0], 5, [5]),
])
def test_mixture_counts_by_hand(weights, size, expected):
    assert mixture_counts(weights, size) == expected


def hamilton_naive(weights, size):
    """A second implementation: hand out the examples one by one, each to the source furthest below its quota
    after rounding every quota down, i.e. the largest remainder among those not yet rounded up."""
    quotas = [size * w / sum(weights) for w in weights]
    counts = [int(q) for q in quotas]
    up = set()
    while sum(counts) < size:
        best = max((i for i in range(len(weights)) if i not in up), key=lambda i: (quotas[i] - int(quotas[i]), -i))
        counts[best] += 1
        up.add(best)
    return counts


def test_mixture_counts_match_a_naive_apportionment_and_stay_within_one_of_the_quota():
    rng = random.Random(0)
    for _ in range(300):
        weights = [rng.choice([rng.uniform(0.01, 10), rng.randint(1, 5)]) for _ in range(rng.randint(1, 5))]
        size = rng.randint(0, 500)
        counts = mixture_counts(weights, size)
        assert counts == hamilton_naive(weights, size)
        assert sum(counts) == size
        assert all(abs(c - size * w / sum(weights)) < 1 for c, w in zip(counts, weights, strict=True))


# ---------------------------------------------------------------- streams


def test_stream_is_whole_shuffled_passes_and_contiguous():
    first = stream_indices(10, 0, 35, seed=1)
    for p in range(3):  # every full pass is a permutation
        assert sorted(first[10 * p:10 * p + 10]) == list(range(10))
    assert sorted(first[30:]) == sorted(set(first[30:]))  # the partial pass repeats nothing
    assert first[:10] != first[10:20]  # each pass shuffled anew
    # any split of the positions reads the same stream: an epoch is a pure function of its start
    assert stream_indices(10, 0, 13, seed=1) + stream_indices(10, 13, 22, seed=1) == first
    assert stream_indices(10, 0, 35, seed=1) == first and stream_indices(10, 0, 35, seed=2) != first


# ---------------------------------------------------------------- the epoch mixture


def sources(n_a=300, n_b=40):
    return ["a", "b"], [[f"a{i}" for i in range(n_a)], [f"b{i}" for i in range(n_b)]]


def test_weights_3_to_1_over_4000_draws_give_exact_counts_each_epoch():
    names, items = sources()
    mixture = Mixture.build(names, items, [3, 1], size=4000, seed=0)
    assert mixture.counts == [3000, 1000] and mixture.size == 4000
    for epoch in range(3):
        examples, source_of = mixture.epoch(epoch)
        assert Counter(source_of) == {0: 3000, 1: 1000}
        assert Counter(e[0] for e in examples) == {"a": 3000, "b": 1000}
        # b (40 examples) is up-weighted to 1000 an epoch: 25 whole passes, every example 25 times
        assert set(Counter(e for e in examples if e[0] == "b").values()) == {25}


def test_the_shuffled_training_stream_follows_the_weights():
    """The epoch's examples shuffled into micro-batches (as the SFT trainer does): any stretch of the stream
    holds each source at about its share (binomial: 400 draws at p = 0.75 have sd 0.022)."""
    examples = [TokenizedExample([1] * (2 + i % 5), [1] * (2 + i % 5)) for i in range(340)]
    mixture = Mixture.build(["a", "b"], [examples[:300], examples[300:]], [3, 1], size=4000, seed=0)
    epoch, source_of = mixture.epoch(0)
    batches = make_batches(epoch, batch_size=8, seed=0, epoch=0, indices=True, drop_last=True)
    assert len(batches) == 500
    for start in range(0, 500, 50):
        picked = [source_of[i] for b in batches[start:start + 50] for i in b["indices"]]
        share = picked.count(0) / len(picked)
        assert abs(share - 0.75) < 0.07, (start, share)
    assert sorted(i for b in batches for i in b["indices"]) == list(range(4000))


def test_the_mixture_is_deterministic_and_resumable():
    names, items = sources()
    a = Mixture.build(names, items, [1, 2], size=90, seed=3)
    b = Mixture.build(names, items, [1, 2], size=90, seed=3)
    assert [a.epoch(e) for e in range(4)] == [b.epoch(e) for e in range(4)]
    fresh = Mixture.build(names, items, [1, 2], size=90, seed=3)  # a resumed run jumps straight to epoch 3
    assert fresh.epoch(3) == a.epoch(3)
    assert Mixture.build(names, items, [1, 2], size=90, seed=4).epoch(0) != a.epoch(0)


def test_a_down_weighted_source_is_walked_through_before_it_repeats():
    names, items = sources(n_a=100, n_b=40)
    mixture = Mixture.build(names, items, [1, 1], size=60, seed=0)  # a: 30 of its 100 an epoch
    seen = [e for epoch in range(4) for e in mixture.epoch(epoch)[0] if e[0] == "a"]
    assert len(set(seen[:100])) == 100  # epochs 0-3 hold every example of a once before any repeats


def test_default_size_is_the_sources_total():
    names, items = sources(n_a=30, n_b=10)
    assert Mixture.build(names, items, [1, 1]).counts == [20, 20]


def test_mixture_errors():
    with pytest.raises(DataError, match="source 'b' has no examples"):
        Mixture.build(["a", "b"], [["x"], []], [1, 1])
    with pytest.raises(DataError, match=r"source .b. gets none of the 10 examples an epoch at weight 0\.01"):
        Mixture.build(["a", "b"], [["x"], ["y"]], [1, 0.01], size=10)
    with pytest.raises(ValueError, match="weights must be finite numbers > 0"):
        mixture_counts([1, 0], 10)


# ---------------------------------------------------------------- config


def config_error(**data):
    with pytest.raises(ValidationError) as err:
        DataConfig(**data)
    message = describe_validation_error(err.value)
    assert "\n" not in message
    return message


def test_config_errors_are_one_line():
    assert "weight must be a finite number > 0, got 0" in config_error(mix=[{"path": "a.jsonl", "weight": 0}])
    assert "got -1" in config_error(mix=[{"path": "a.jsonl", "weight": -1}])
    assert "data.mix is empty" in config_error(mix=[])
    assert "unknown key(s) 'weigth' in MixSource" in config_error(mix=[{"path": "a.jsonl", "weigth": 2}])
    assert "exactly one of 'path' or 'task'" in config_error(mix=[{"weight": 2}])
    assert "replaces data.path" in config_error(path="x.jsonl", mix=[{"path": "a.jsonl"}])
    assert "several sources named 'a'" in config_error(mix=[{"path": "a.jsonl"}, {"path": "sub/a.jsonl"}])
    assert "mix_size applies to data.mix only" in config_error(path="x.jsonl", mix_size=10)
    with pytest.raises(ValidationError, match=r"data\.mix is for SFT and pretraining"):
        PairDataConfig(mix=[{"path": "a.jsonl"}])


def test_mix_sources_take_the_stage_task_and_default_names():
    cfg = SFTConfig(task={"name": "secret"}, data={"mix": [{"task": {"n": 4}}, {"path": "d/extra.jsonl"}]})
    assert cfg.data.mix[0].task.name == "secret" and cfg.data.mix[0].label == "secret"
    assert cfg.data.mix[1].label == "extra"


# ---------------------------------------------------------------- loading


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mix_records_load_each_source_as_a_single_source(tmp_path):
    good = write(tmp_path / "good.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    data = DataConfig(mix=[{"task": {"name": "arithmetic", "n": 5}, "weight": 3}, {"path": good}])
    (arith, records, skipped), (file, rows, _) = mix_records(data, "sft")
    assert arith.label == "arithmetic" and len(records) == 5 and skipped == {} and "completion" in records[0]
    assert file.label == "good" and rows == [{"prompt": "a", "completion": "b"}] * 3
    assert "text" in mix_records(data.model_copy(update={"mix": data.mix[:1]}), "text")[0][1][0]
    with pytest.raises(ValueError, match="mix_records"):
        training_records(data, "sft")


def test_mix_records_errors_name_the_source(tmp_path):
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    mix = [{"task": {"name": "arithmetic", "n": 2}}]
    with pytest.raises(DataError, match=r"data.mix source 'bad': .*bad\.jsonl, line 2, field 'completion'"):
        mix_records(DataConfig(mix=[*mix, {"path": bad, "format": "prompt_completion"}]), "sft")
    with pytest.raises(DataError, match=r"data.mix source 'bad': .*bad\.jsonl, line 2"):  # data's format
        mix_records(DataConfig(format="prompt_completion", mix=[*mix, {"path": bad}]), "sft")
    # on_error per source (or data's): the bad row is skipped and counted
    _, (_, rows, skipped) = mix_records(DataConfig(mix=[*mix, {"path": bad, "on_error": "skip"}]), "sft")
    assert len(rows) == 1 and sum(skipped.values()) == 1
    assert sum(mix_records(DataConfig(on_error="skip", mix=[*mix, {"path": bad}]), "sft")[1][2].values()) == 1
    with pytest.raises(FileNotFoundError, match=r"data\.mix source .gone.: data file not found"):
        mix_records(DataConfig(mix=[*mix, {"path": str(tmp_path / "gone.jsonl")}]), "sft")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"data\.mix source .empty.: .*no records"):
        mix_records(DataConfig(mix=[*mix, {"path": str(tmp_path / "empty.jsonl")}]), "sft")
    allbad = write(tmp_path / "allbad.jsonl", [{"prompt": "c"}])
    with pytest.raises(DataError, match=r"data.mix source .allbad.: .*allbad\.jsonl, line 1"):
        mix_records(DataConfig(mix=[*mix, {"path": allbad, "on_error": "skip", "format": "prompt_completion"}]),
                    "sft")
