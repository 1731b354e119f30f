"""Bad model paths, generated: missing paths, files, directories that are not models, damaged configs,
weights and tokenizers, and tokenizers that do not fit the model end in FileNotFoundError or ModelLoadError
naming the path (or in a loaded model), never in a traceback from transformers, safetensors or tokenizers.

No example is a hub id, so nothing here reaches for the network.
"""

import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.config import ModelConfig
from tether.models import build_tiny, load_model, load_tokenizer, save_tiny
from tether.models.loading import ModelLoadError, resolve_model

EXAMPLES = int(os.environ.get("TETHER_FUZZ_EXAMPLES", "60")) // 3  # each example writes a model directory
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json"]


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny(path)
    return path


damage = st.fixed_dictionaries({
    "file": st.sampled_from(FILES),
    "how": st.sampled_from(["delete", "empty", "truncate", "garbage", "json", "flip"]),
    "data": st.one_of(st.binary(max_size=64), st.sampled_from([b"{", b"[]", b"null", b'{"model_type": "nope"}',
                                                                b'{"vocab_size": -1}'])),
    "at": st.floats(0, 1),
})


def apply(path, change):
    target = path / change["file"]
    if not target.exists():
        return
    data = target.read_bytes()
    how = change["how"]
    if how == "delete":
        target.unlink()
    elif how == "empty":
        target.write_bytes(b"")
    elif how == "truncate":
        target.write_bytes(data[: int(len(data) * change["at"])])
    elif how == "garbage":
        target.write_bytes(change["data"])
    elif how == "json":
        target.write_bytes(b'{"unexpected": ' + (change["data"].hex().encode() or b"0") + b"}")
    elif data:
        i = min(int(len(data) * change["at"]), len(data) - 1)
        target.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])


@FUZZ
@given(changes=st.lists(damage, min_size=1, max_size=3))
def test_a_damaged_model_directory_fails_with_its_path(tmp_path_factory, good_model, changes):
    path = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(good_model, path)
    for change in changes:
        apply(path, change)
    try:
        model, tokenizer = load_model(str(path))
    except (FileNotFoundError, ModelLoadError) as err:
        assert str(path) in str(err), err
        return
    # loaded despite the damage (e.g. a flipped byte inside a weight, or a file it does not need): usable
    ids = tokenizer("1+1=", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] >= len(tokenizer)


@FUZZ
@given(kind=st.sampled_from(["missing", "file", "empty_dir", "stage_dir", "nested"]),
       name=st.text(alphabet="abc-_. ", min_size=1, max_size=8))
def test_a_path_that_holds_no_model_fails_before_transformers(tmp_path_factory, kind, name):
    root = tmp_path_factory.mktemp("paths")
    path = root / name.strip(" ./") if name.strip(" ./") else root / "x"
    if kind == "file":
        path.write_text("not a model")
    elif kind == "empty_dir":
        path.mkdir(exist_ok=True)
    elif kind == "stage_dir":
        (path / "checkpoints" / "step-000002").mkdir(parents=True, exist_ok=True)
    elif kind == "nested":
        path = path / "deeper" / "still"
    with pytest.raises((FileNotFoundError, ModelLoadError)) as info:
        load_model(str(path))
    assert str(path) in str(info.value)
    if kind == "stage_dir":
        assert "has not finished" in str(info.value)
    with pytest.raises((FileNotFoundError, ModelLoadError)):
        load_tokenizer(str(path))


def test_a_tokenizer_larger_than_the_model_is_refused_for_a_loaded_model():
    model, tokenizer = build_tiny()
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    with pytest.raises(ModelLoadError, match=r"the tokenizer has \d+ tokens but the model's embedding table has"):
        resolve_model(model, tokenizer, ModelConfig())


def test_a_tokenizer_that_adds_tokens_is_fitted_when_loading_from_a_path(good_model):
    """The documented recovery: loading a model directory with a bigger tokenizer resizes the embeddings."""
    _, tokenizer = build_tiny()
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    model, tokenizer = load_model(str(good_model), tokenizer=tokenizer)
    assert model.get_input_embeddings().num_embeddings >= len(tokenizer)
