"""Deterministic synthetic batches and the Fashion-MNIST / CIFAR-10 file loaders."""

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from parity.data import (
    BatchStream,
    load_cifar10,
    load_fashion_mnist,
    read_idx,
    synthetic_images,
    synthetic_tokens,
)


def _streams():
    return {
        "images": lambda seed: synthetic_images(seed, 8, (12, 12, 3), 5),
        "lm": lambda seed: synthetic_tokens(seed, 8, 16, 64, task="lm"),
        "classification": lambda seed: synthetic_tokens(seed, 8, 16, 64, task="classification"),
    }


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["images", "lm", "classification"])
def test_batches_are_a_pure_function_of_seed_and_step(kind):
    make = _streams()[kind]
    first, second = make(3), make(3)
    later = first.batch(7)
    for step in range(5):  # asking for other steps first changes nothing
        first.batch(step)
    assert _equal(first.batch(7), later)
    assert _equal(second.batch(7), later)
    assert not _equal(first.batch(6), later)
    assert not _equal(make(4).batch(7), later)
    evals = first.eval_batches()
    assert len(evals) == 4
    assert all(_equal(a, b) for a, b in zip(evals, second.eval_batches(), strict=True))
    assert not any(_equal(evals[0], first.batch(step)) for step in range(4))


def test_shapes_and_dtypes():
    images, labels = synthetic_images(0, 6, (10, 9, 2), 4).batch(0)
    assert images.shape == (6, 10, 9, 2) and images.dtype == np.float32
    assert labels.shape == (6,) and labels.dtype == np.int32
    assert labels.min() >= 0 and labels.max() < 4

    stream = synthetic_tokens(0, 5, 12, 50, task="lm")
    inputs, targets = stream.batch(0)
    assert inputs.shape == targets.shape == (5, 12)
    assert inputs.dtype == targets.dtype == np.int32
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])  # next-token targets, aligned
    assert inputs.max() < 50 and inputs.min() >= 0
    assert stream.task == "lm" and stream.num_classes == 50 and stream.input_shape == (12,)

    tokens, labels = synthetic_tokens(0, 5, 12, 50, task="classification", num_classes=3).batch(0)
    assert tokens.shape == (5, 12) and labels.shape == (5,)
    assert tokens.dtype == labels.dtype == np.int32
    assert labels.max() < 3 and tokens.max() < 50
    assert "batch_size=5" in repr(synthetic_tokens(0, 5, 12, 50))


def test_images_have_learnable_class_structure():
    """A nearest-class-mean classifier fitted on training batches beats chance by far."""
    stream = synthetic_images(0, 256, (16, 16, 3), 10)
    images, labels = stream.batch(0)
    means = np.stack([images[labels == c].mean(axis=0) for c in range(10)])
    test_images, test_labels = stream.eval_batches()[0]
    flat = test_images.reshape(len(test_images), -1)
    scores = flat @ means.reshape(10, -1).T - 0.5 * (means.reshape(10, -1) ** 2).sum(axis=1)
    accuracy = np.mean(scores.argmax(axis=1) == test_labels)
    assert accuracy > 0.6  # chance is 0.1


def test_lm_tokens_follow_a_grammar():
    """Bigram entropy of the stream is far below uniform: next tokens are predictable."""
    vocab = 64
    stream = synthetic_tokens(0, 256, 32, vocab, task="lm")
    inputs, targets = stream.batch(0)
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (inputs.ravel(), targets.ravel()), 1)
    probs = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    eval_inputs, eval_targets = stream.eval_batches()[0]
    nll = -np.mean(np.log(probs[eval_inputs.ravel(), eval_targets.ravel()] + 1e-3))
    assert nll < 0.5 * np.log(vocab)


def test_classification_tokens_carry_the_label():
    """Counting each class's cue words predicts the label (a sentiment-style task)."""
    vocab, classes = 64, 2
    tokens, labels = synthetic_tokens(0, 512, 32, vocab, task="classification").batch(0)
    cue_size = vocab // (4 * classes)
    text_size = vocab - classes * cue_size
    cue_class = np.where(tokens >= text_size, (tokens - text_size) // cue_size, -1)
    votes = np.stack([(cue_class == c).sum(axis=1) for c in range(classes)], axis=1)
    assert np.mean(votes.argmax(axis=1) == labels) > 0.8
    assert 0.3 < labels.mean() < 0.7  # both classes present


def test_classification_task_statistics_as_documented():
    """The ``lstm`` defaults: ~15% cue words, 87.5% of them for the label, a cue majority vote
    right ~96% of the time (learnable, not trivial); the text itself says nothing of the label."""
    vocab, classes, length = 256, 2, 32
    tokens, labels = synthetic_tokens(3, 4096, length, vocab, task="classification").batch(0)
    cue_size = vocab // (4 * classes)
    text_size = vocab - classes * cue_size
    is_cue = tokens >= text_size
    assert abs(is_cue.mean() - 0.15) < 0.01
    cue_class = np.where(is_cue, (tokens - text_size) // cue_size, -1)
    own = (cue_class == labels[:, None]).sum() / is_cue.sum()
    assert abs(own - 0.875) < 0.01
    votes = np.stack([(cue_class == c).sum(axis=1) for c in range(classes)], axis=1)
    majority = np.where(votes[:, 0] == votes[:, 1], 0.5, votes.argmax(axis=1) == labels)
    assert 0.94 < majority.mean() < 0.98
    text_mean = [np.mean(np.where(is_cue, 0, tokens)[labels == c]) for c in range(classes)]
    assert abs(text_mean[0] - text_mean[1]) < 2.0


def test_structure_is_shared_across_seeds():
    """Different seeds sample the same task: the class means agree."""
    a_images, a_labels = synthetic_images(0, 512, (8, 8, 1), 2).batch(0)
    b_images, b_labels = synthetic_images(1, 512, (8, 8, 1), 2).batch(0)
    a_mean = a_images[a_labels == 0].mean(axis=0)
    b_mean = b_images[b_labels == 0].mean(axis=0)
    assert np.corrcoef(a_mean.ravel(), b_mean.ravel())[0, 1] > 0.9


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: synthetic_images(-1, 4), "`seed`"),
        (lambda: synthetic_images(0, 0), "`batch_size`"),
        (lambda: synthetic_images(0, 4, (32, 32)), "`image_shape`"),
        (lambda: synthetic_images(0, 4, num_classes=1), "`num_classes`"),
        (lambda: synthetic_images(0, 4, noise=-1.0), "`noise`"),
        (lambda: synthetic_tokens(0, 4, 8, 64, task="mlm"), "`task` must be 'lm' or"),
        (lambda: synthetic_tokens(0, 4, 1, 64), "`seq_len`"),
        (
            lambda: synthetic_tokens(0, 4, 8, 6, task="classification"),
            "`vocab_size` must be >= 4 \\* num_classes = 8",
        ),
        (lambda: synthetic_images(0, 4).batch(-1), "`step`"),
        (lambda: synthetic_images(0, 4).batch(1.5), "`step`"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- Fashion-MNIST (IDX) -----------------------------------------------------------------------


def _idx_bytes(array):
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    return header + array.tobytes()


def _write_fashion_mnist(folder, compress, n_train=20, n_test=6):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, array in arrays.items():
        data = _idx_bytes(array)
        if compress:
            (folder / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
def test_load_fashion_mnist(tmp_path, compress):
    arrays = _write_fashion_mnist(tmp_path, compress)
    dataset = load_fashion_mnist(tmp_path)
    assert dataset.train_images.shape == (20, 28, 28, 1)
    assert dataset.train_images.dtype == np.float32
    assert dataset.test_images.shape == (6, 28, 28, 1)
    assert np.array_equal(dataset.train_labels, arrays["train-labels-idx1-ubyte"])
    assert dataset.train_labels.dtype == np.int32
    # standardised with the training statistics, pixel order kept
    raw = arrays["train-images-idx3-ubyte"].astype(np.float64) / 255
    expected = (raw - raw.mean()) / raw.std()
    np.testing.assert_allclose(dataset.train_images[..., 0], expected, atol=1e-5)
    assert abs(float(dataset.train_images.mean())) < 1e-5


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x08\x03\x00\x00garbage")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(_idx_bytes(np.zeros((3, 4)))[:-2])
    with pytest.raises(ValueError, match="header says shape"):
        read_idx(short)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_fashion_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="`folder`"):
        load_fashion_mnist(tmp_path / "missing")


def test_array_stream_epochs_and_eval(tmp_path):
    _write_fashion_mnist(tmp_path, compress=True, n_train=20, n_test=6)
    dataset = load_fashion_mnist(tmp_path)
    stream = dataset.stream(seed=1, batch_size=8)
    assert isinstance(stream, BatchStream)
    assert stream.input_shape == (28, 28, 1) and stream.num_classes == 10
    # steps 0..4 cover 40 positions = two epochs of 20: each example exactly twice
    seen = np.concatenate([stream.batch(step)[0] for step in range(5)])
    flat_train = dataset.train_images.reshape(20, -1)
    index = [
        int(np.flatnonzero((flat_train == row).all(axis=1))[0]) for row in seen.reshape(40, -1)
    ]
    assert np.array_equal(np.bincount(index, minlength=20), np.full(20, 2))
    assert _equal(stream.batch(3), dataset.stream(seed=1, batch_size=8).batch(3))
    assert not _equal(stream.batch(0), dataset.stream(seed=2, batch_size=8).batch(0))
    images, labels = stream.batch(2)
    assert images.shape == (8, 28, 28, 1) and labels.shape == (8,)
    # test set (6) smaller than a batch: one short batch, in order
    ((eval_images, eval_labels),) = stream.eval_batches()
    assert np.array_equal(eval_labels, dataset.test_labels)
    small = dataset.stream(seed=1, batch_size=2).eval_batches()
    assert len(small) == 3 and all(len(labels) == 2 for _, labels in small)
    assert len(dataset.stream(seed=1, batch_size=2, max_eval_examples=4).eval_batches()) == 2


# --- CIFAR-10 (python pickles) -----------------------------------------------------------------


def _write_cifar(folder, n_batches=2, per_batch=5):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, n_batches + 1)] + ["test_batch"]
    for name in names:
        data = rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)],
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
        written[name] = (data, labels)
    return written


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "cifar-10-batches-py"])
def test_load_cifar10(tmp_path, nested):
    written = _write_cifar(tmp_path / "cifar-10-batches-py" if nested else tmp_path)
    dataset = load_cifar10(tmp_path)
    assert dataset.train_images.shape == (10, 32, 32, 3)
    assert dataset.test_images.shape == (5, 32, 32, 3)
    assert dataset.train_images.dtype == np.float32
    expected_labels = written["data_batch_1"][1] + written["data_batch_2"][1]
    assert dataset.train_labels.tolist() == expected_labels
    # the row layout is R plane, G plane, B plane (CHW): pixel (y=1, x=2) of channel G
    raw = written["data_batch_1"][0][0]
    green = raw[1024 + 1 * 32 + 2]
    train_raw = np.concatenate([written["data_batch_1"][0], written["data_batch_2"][0]])
    green_all = train_raw.reshape(-1, 3, 32, 32)[:, 1].astype(np.float64) / 255
    standardised = (green / 255 - green_all.mean()) / green_all.std()
    assert abs(float(dataset.train_images[0, 1, 2, 1]) - standardised) < 1e-4
    stream = dataset.stream(seed=0, batch_size=4)
    assert stream.batch(0)[0].shape == (4, 32, 32, 3)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_loader_refuses_code_in_pickles(tmp_path):
    _write_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": _Exploit(), b"labels": [0]}, handle, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        load_cifar10(tmp_path)


def test_cifar_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        load_cifar10(tmp_path)
    _write_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, handle)
    with pytest.raises(ValueError, match=r"\(N, 3072\)"):
        load_cifar10(tmp_path)


def test_cifar_loader_reads_numpy1_pickles_without_warnings(tmp_path):
    """The real files name `numpy.core.multiarray` (numpy 1.x); numpy 2 would warn on import."""
    written = _write_cifar(tmp_path)
    for name in ("data_batch_1", "data_batch_2", "test_batch"):
        path = tmp_path / name
        legacy = path.read_bytes().replace(
            b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"
        )
        assert b"cnumpy.core.multiarray\n" in legacy
        path.write_bytes(legacy)
    dataset = load_cifar10(tmp_path)  # warnings are errors in this suite
    assert dataset.test_labels.tolist() == written["test_batch"][1]


# --- offline real data: digits, text, --data specs --------------------------------------------


def test_digits_are_bundled_and_split_deterministically():
    pytest.importorskip("sklearn")
    from parity.data import load_digits

    data = load_digits()
    assert data.train_images.shape == (1438, 8, 8, 1) and data.test_images.shape == (359, 8, 8, 1)
    assert data.train_images.dtype == np.float32 and data.train_labels.dtype == np.int32
    assert set(np.unique(data.train_labels)) == set(range(10))
    np.testing.assert_allclose(data.train_images.mean(), 0.0, atol=1e-5)
    again = load_digits()
    np.testing.assert_array_equal(data.test_labels, again.test_labels)
    stream = data.stream(seed=3, batch_size=16)
    first, second = stream.batch(5), stream.batch(5)
    np.testing.assert_array_equal(first[0], second[0])
    assert len(stream.eval_batches()) == 359 // 16


def test_text_corpus_defaults_to_the_standard_library(tmp_path):
    from parity.data import default_text_path, load_text

    corpus = load_text(max_bytes=1 << 16)
    first_file = sorted(default_text_path().glob("*.py"))[0].read_bytes()
    assert corpus.dtype == np.uint8 and corpus.size == 1 << 16
    assert bytes(corpus[:64]) == first_file[:64]
    (tmp_path / "b.txt").write_bytes(b"b" * 600)
    (tmp_path / "a.md").write_bytes(b"a" * 600)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 5000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_bytes(b"c" * 600)
    text = bytes(load_text(tmp_path))
    assert text == b"a" * 600 + b"\n" + b"b" * 600 + b"\n" + b"c" * 600 + b"\n"
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        load_text(tmp_path / "missing")
    with pytest.raises(ValueError, match="at least 1 KiB"):
        load_text(tmp_path / "sub" / "c.py")


def test_a_text_corpus_that_is_mostly_not_text_is_warned_about(tmp_path):
    """Random bytes given as a text corpus train and can PASS; the load warns naming the share
    of text bytes. Text in any script (and the standard library's sources) loads silently."""
    import warnings

    from parity.data import load_text, text_fraction

    noise = tmp_path / "noise.txt"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 8192, np.uint8).tobytes())
    with pytest.warns(UserWarning, match=r"only 4\d% of the bytes of .*noise.txt' are text"):
        load_text(noise)
    prose = tmp_path / "prose.txt"
    prose.write_bytes(("Grüße, 日本語のテキスト\tand ASCII.\n" * 100).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_text(prose)
        load_text(max_bytes=1 << 16)
    assert text_fraction(prose.read_bytes()) == 1.0
    assert text_fraction(b"\x00" * 10 + b"a" * 90) == pytest.approx(0.9)


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_text_stream_windows(task):
    from parity.data import text_stream

    corpus = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    stream = text_stream(corpus, seed=0, batch_size=8, seq_len=12, task=task)
    inputs, targets = stream.batch(0)
    assert inputs.shape == (8, 12) and inputs.dtype == np.int32
    steps = np.diff(inputs.astype(np.int64), axis=1) % 256
    if task == "lm":
        np.testing.assert_array_equal(targets, (inputs + 1) % 256)  # the next byte
        assert np.all(steps == 1)
    else:
        # label 1: the window runs backwards; label 0: forwards
        forwards = np.all(steps == 1, axis=1)
        np.testing.assert_array_equal(forwards, targets == 0)


def test_text_stream_holds_out_the_last_tenth():
    from parity.data import text_stream

    corpus = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint8)
    stream = text_stream(corpus, seed=0, batch_size=8, seq_len=12)
    cut = int(corpus.size * 0.9)
    head, tail = bytes(corpus[:cut]), bytes(corpus[cut:])
    for inputs, _ in stream.eval_batches():
        assert all(bytes(row.astype(np.uint8)) in tail for row in inputs)
    for step in range(3):
        inputs, _ = stream.batch(step)
        assert all(bytes(row.astype(np.uint8)) in head for row in inputs)


def test_data_specs_and_their_errors():
    from parity.data import DataSpec

    assert str(DataSpec.parse("text")) == "text"
    assert DataSpec.parse("fashion-mnist:/data/fm").path == "/data/fm"
    for bad, fragment in [
        ("digit", "did you mean 'digits'"),
        ("cifar10", "cifar10:DIR"),
        ("digits:/x", "takes no path"),
        ("", "string such as"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            DataSpec.parse(bad)


def test_pairs_take_their_shapes_from_the_data():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from parity.core.config import RunConfig
    from parity.models import get_model_pair

    pair = get_model_pair("cnn_bn", data="digits")
    assert pair.config["image_shape"] == (8, 8, 1) and pair.config["num_classes"] == 10
    inputs, labels = pair.make_data(0, 4).batch(0)
    assert inputs.shape == (4, 8, 8, 1) and labels.max() < 10
    lstm = get_model_pair("lstm", data="text")
    assert lstm.config["vocab_size"] == 256 and lstm.config["num_classes"] == 2
    with pytest.raises(ValueError, match="Image models: mlp"):
        get_model_pair("lstm", data="digits")
    with pytest.raises(ValueError, match="Text models: transformer"):
        get_model_pair("mlp", data="text")
    with pytest.raises(ValueError, match="contradicts --data digits"):
        get_model_pair("cnn", data="digits", image_shape=(16, 16, 3))
    assert RunConfig(data="digits").to_dict()["data"] == "digits"
    assert RunConfig.from_dict(RunConfig(data="text").to_dict()).data == "text"
    with pytest.raises(ValueError, match="did you mean 'digits'"):
        RunConfig(data="digit")


def test_image_label_noise_sets_a_loss_floor():
    """10% of the labels are random: even the true prototype class is right only ~91% of the time."""
    clean = synthetic_images(0, 2048, (8, 8, 1), 10, label_noise=0.0).batch(0)[1]
    noisy = synthetic_images(0, 2048, (8, 8, 1), 10).batch(0)[1]
    agreement = np.mean(clean == noisy)
    assert 0.87 < agreement < 0.95  # expected 1 - 0.1 * 0.9 = 0.91
    with pytest.raises(ValueError, match="label_noise"):
        synthetic_images(0, 4, label_noise=1.5)


def test_real_data_resolves_per_model():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from parity.data import DataSpec
    from parity.models import get_model_pair

    assert DataSpec.parse("real").resolve(image_model=True) == DataSpec("digits")
    assert DataSpec.parse("real").resolve(image_model=False) == DataSpec("text")
    assert get_model_pair("cnn", data="real").config["image_shape"] == (8, 8, 1)
    assert get_model_pair("transformer", data="real").config["vocab_size"] == 256


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # optax internals
def test_cli_runs_on_real_digits(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import json

    from parity.cli.commands import main

    code = main(
        ["run", "--model", "mlp", "--data", "digits", "--steps", "3", "--batch-size", "8",
         "--framework", "both", "--out", str(tmp_path), "--no-plots"]
    )  # fmt: skip
    assert code == 0
    assert "Not drawn (`--no-plots`)" in (tmp_path / "report.md").read_text()  # the data is checked
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {run["config"]["data"] for run in runs} == {"digits"}
    assert all(run["model_config"]["image_shape"] == [8, 8, 1] for run in runs)
    losses = [[step["loss"] for step in run["steps"]] for run in runs]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
