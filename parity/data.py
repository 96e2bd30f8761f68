"""Deterministic batches shared by both frameworks, and loaders for real datasets on disk.

Every batch is a pure function of ``(seed, step)``: ``stream.batch(i)`` returns the same numpy arrays
whatever was asked before, in any process, so the torch and the JAX trainer see identical data in the
same order without sharing an iterator. Images are NHWC float32; token ids and labels are int32.

Synthetic tasks (learnable, so loss curves are meaningful):

- ``synthetic_images``: each class has a smooth random prototype image; a sample is its class's
  prototype with a random contrast, a random brightness shift and Gaussian noise.
- ``synthetic_tokens``: a sparse random Markov chain over the vocabulary (each token has a few likely
  successors). ``task="lm"`` gives next-token prediction; ``task="classification"`` gives a
  sentiment-style task where class-specific "cue" tokens are sprinkled into the text, mostly from the
  labelled class.

The task structure (prototypes, grammar) depends only on the shapes, not on the seed: different seeds
draw different samples of the same task. Real data, nothing downloaded: ``load_digits``
(scikit-learn's bundled 8x8 digits), ``load_text`` + ``text_stream`` (a byte-level corpus from
local files, by default the standard library's sources), ``load_fashion_mnist`` (IDX files, raw or
gzip) and ``load_cifar10`` (the python-pickle batches) from a folder the user gives. `DataSpec`
parses the CLI's ``--data`` values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gzip
import io
import os
import pickle
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DATA_KINDS",
    "ArrayDataset",
    "BatchStream",
    "DataSpec",
    "load_cifar10",
    "load_digits",
    "load_fashion_mnist",
    "load_text",
    "read_idx",
    "synthetic_images",
    "synthetic_tokens",
    "text_fraction",
    "text_stream",
]

Batch = tuple[np.ndarray, np.ndarray]

_TRAIN_STREAM = 0
_EVAL_STREAM = 1
_STRUCTURE_KEY = 20240611  # fixed entropy for the task structure: independent of the sample seed


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


class BatchStream:
    """Deterministic batches: ``batch(step)`` is a pure function of ``(seed, step)``.

    Attributes:
      seed, batch_size: as given.
      task: ``"classification"`` or ``"lm"``.
      num_classes: classes (classification) or vocabulary size (lm).
      input_shape: shape of one example (``(H, W, C)`` for images, ``(T,)`` for tokens).
    """

    def __init__(
        self,
        sampler: Callable[[np.random.Generator, int], Batch],
        *,
        seed: int,
        batch_size: int,
        task: str,
        num_classes: int,
        input_shape: tuple[int, ...],
        num_eval_batches: int = 4,
    ):
        self.seed = _check_int("seed", seed, 0)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.num_eval_batches = _check_int("num_eval_batches", num_eval_batches, 1)
        self.task = task
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self._sampler = sampler

    def batch(self, step: int) -> Batch:
        """``(inputs, targets)`` for training step ``step`` (>= 0)."""
        step = _check_int("step", step, 0)
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM, step])
        return self._sampler(rng, self.batch_size)

    def eval_batches(self) -> list[Batch]:
        """A fixed held-out set (disjoint random streams from training), same every call."""
        return [
            self._sampler(np.random.default_rng([self.seed, _EVAL_STREAM, index]), self.batch_size)
            for index in range(self.num_eval_batches)
        ]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task={self.task!r}, seed={self.seed}, "
            f"batch_size={self.batch_size}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes})"
        )


# --- synthetic images -------------------------------------------------------------------------


def _image_prototypes(image_shape: tuple[int, int, int], num_classes: int) -> np.ndarray:
    """Smooth class prototypes: a few random 2-D sinusoids per class and channel, unit std."""
    height, width, channels = image_shape
    rng = np.random.default_rng([_STRUCTURE_KEY, 1, num_classes, height, width, channels])
    ys = np.arange(height, dtype=np.float64)[:, None] / height
    xs = np.arange(width, dtype=np.float64)[None, :] / width
    prototypes = np.zeros((num_classes, height, width, channels))
    for cls in range(num_classes):
        for channel in range(channels):
            for _ in range(3):
                fy, fx = rng.integers(0, 4, size=2)
                phase = rng.uniform(0, 2 * np.pi)
                amplitude = rng.normal()
                prototypes[cls, :, :, channel] += amplitude * np.sin(
                    2 * np.pi * (fy * ys + fx * xs) + phase
                )
        prototypes[cls] -= prototypes[cls].mean()
        prototypes[cls] /= prototypes[cls].std() + 1e-8
    return prototypes.astype(np.float32)


def synthetic_images(
    seed: int,
    batch_size: int,
    image_shape: tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    *,
    noise: float = 1.0,
    label_noise: float = 0.1,
    num_eval_batches: int = 4,
) -> BatchStream:
    """Images with learnable class structure: NHWC float32 inputs, int32 labels in [0, num_classes).

    A fraction `label_noise` of the labels (training and held-out alike) is replaced by a
    uniformly drawn class, so no model can drive the loss to 0: with 10 classes and the default
    0.1 the best achievable mean cross-entropy is about 0.50 (and accuracy about 0.91), and a
    loss curve keeps meaning something after the prototypes are learnt.

    Args:
      seed: sample seed (batches are a pure function of ``(seed, step)``).
      batch_size: examples per batch.
      image_shape: ``(H, W, C)``.
      num_classes: number of classes (>= 2).
      noise: standard deviation of the Gaussian pixel noise (signal std is about 1).
      label_noise: probability that a label is replaced by a uniformly drawn class.
      num_eval_batches: size of the held-out set in batches.
    """
    if (
        not isinstance(image_shape, tuple | list)
        or len(image_shape) != 3
        or not all(isinstance(d, int | np.integer) and d >= 1 for d in image_shape)
    ):
        raise ValueError(f"`image_shape` must be (H, W, C) positive ints, got {image_shape!r}.")
    num_classes = _check_int("num_classes", num_classes, 2)
    if not np.isfinite(noise) or noise < 0:
        raise ValueError(f"`noise` must be a finite float >= 0, got {noise!r}.")
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"`label_noise` must be in [0, 1], got {label_noise!r}.")
    image_shape = tuple(int(d) for d in image_shape)
    prototypes = _image_prototypes(image_shape, num_classes)

    def sample(rng: np.random.Generator, size: int) -> Batch:
        labels = rng.integers(0, num_classes, size=size)
        contrast = rng.uniform(0.5, 1.5, size=(size, 1, 1, 1))
        shift = rng.normal(0.0, 0.3, size=(size, 1, 1, 1))
        pixels = rng.normal(0.0, noise, size=(size, *image_shape))
        images = prototypes[labels] * contrast + shift + pixels
        flip = rng.random(size) < label_noise
        labels = np.where(flip, rng.integers(0, num_classes, size=size), labels)
        return images.astype(np.float32), labels.astype(np.int32)

    return BatchStream(
        sample,
        seed=seed,
        batch_size=batch_size,
        task="classification",
        num_classes=num_classes,
        input_shape=image_shape,
        num_eval_batches=num_eval_batches,
    )


# --- synthetic tokens -------------------------------------------------------------------------


def _markov_grammar(vocab_size: int, branching: int) -> tuple[np.ndarray, np.ndarray]:
    """Successor table (V, k) and cumulative probabilities (V, k) of a sparse Markov chain."""
    rng = np.random.default_rng([_STRUCTURE_KEY, 2, vocab_size, branching])
    successors = np.stack(
        [rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
    )
    probabilities = rng.dirichlet(np.ones(branching), size=vocab_size)
    return successors, np.cumsum(probabilities, axis=1)


def _markov_sequences(
    rng: np.random.Generator,
    size: int,
    length: int,
    successors: np.ndarray,
    cumulative: np.ndarray,
    vocab: np.ndarray,
    noise: float,
) -> np.ndarray:
    """``size`` sequences of ``length`` tokens from the chain, each token replaced by a uniform
    draw from ``vocab`` with probability ``noise``. Tokens index ``successors`` directly."""
    tokens = np.empty((size, length), dtype=np.int64)
    tokens[:, 0] = rng.choice(vocab, size=size)
    rows = np.arange(size)
    for position in range(1, length):
        previous = tokens[:, position - 1]
        draw = rng.random(size)
        choice = np.minimum(
            (draw[:, None] > cumulative[previous]).sum(axis=1), successors.shape[1] - 1
        )
        following = successors[previous, choice]
        replace = rng.random(size) < noise
        following = np.where(replace, rng.choice(vocab, size=size), following)
        tokens[rows, position] = following
    return tokens


def synthetic_tokens(
    seed: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    task: str = "lm",
    *,
    num_classes: int = 2,
    branching: int = 4,
    noise: float = 0.05,
    num_eval_batches: int = 4,
) -> BatchStream:
    """Token sequences with learnable structure (a sparse random Markov grammar).

    ``task="lm"``: inputs ``(B, seq_len)`` int32 tokens and targets ``(B, seq_len)`` = the inputs
    shifted by one (next-token targets, already aligned).

    ``task="classification"``: inputs ``(B, seq_len)`` int32, targets ``(B,)`` int32 labels
    (uniform over ``num_classes``). The last ``num_classes * cue_size`` token ids are "cue" words,
    ``cue_size = vocab_size // (4 * num_classes)`` per class (ids of class ``k`` follow those of
    class ``k - 1``); the text is drawn from the grammar over the other ids, then each position
    independently becomes a cue word with probability 0.15, a word of the labelled class with
    probability 0.75 and of a uniformly drawn class (possibly the labelled one) otherwise. Only the
    cues carry the label; the text is a distractor. With the ``lstm`` defaults (32 tokens, 2
    classes, 256 ids: 32 cue ids per class) a sequence holds ~4.8 cues, 87.5% of them for its
    class, and none in ~0.6% of sequences, so a majority vote over the cues is right ~96% of the
    time: learnable, not trivial (the model must discover which ids are cues and weigh conflicting
    ones).
    """
    seq_len = _check_int("seq_len", seq_len, 2)
    vocab_size = _check_int("vocab_size", vocab_size, 2)
    branching = _check_int("branching", branching, 1)
    if task not in ("lm", "classification"):
        raise ValueError(f"`task` must be 'lm' or 'classification', got {task!r}.")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"`noise` must be in [0, 1], got {noise!r}.")

    if task == "lm":
        if branching > vocab_size:
            raise ValueError(f"`branching` must be <= vocab_size={vocab_size}, got {branching}.")
        successors, cumulative = _markov_grammar(vocab_size, branching)
        vocab = np.arange(vocab_size)

        def sample_lm(rng: np.random.Generator, size: int) -> Batch:
            tokens = _markov_sequences(rng, size, seq_len + 1, successors, cumulative, vocab, noise)
            tokens = tokens.astype(np.int32)
            return tokens[:, :-1], tokens[:, 1:]

        return BatchStream(
            sample_lm,
            seed=seed,
            batch_size=batch_size,
            task="lm",
            num_classes=vocab_size,
            input_shape=(seq_len,),
            num_eval_batches=num_eval_batches,
        )

    num_classes = _check_int("num_classes", num_classes, 2)
    cue_size = vocab_size // (4 * num_classes)
    if cue_size < 1:
        raise ValueError(
            f"`vocab_size` must be >= 4 * num_classes = {4 * num_classes} for the classification "
            f"task, got {vocab_size}."
        )
    text_size = vocab_size - num_classes * cue_size
    branching = min(branching, text_size)
    successors, cumulative = _markov_grammar(text_size, branching)
    text_vocab = np.arange(text_size)

    def sample_classification(rng: np.random.Generator, size: int) -> Batch:
        labels = rng.integers(0, num_classes, size=size)
        tokens = _markov_sequences(rng, size, seq_len, successors, cumulative, text_vocab, noise)
        cue_mask = rng.random((size, seq_len)) < 0.15
        own_class = rng.random((size, seq_len)) < 0.75
        cue_class = np.where(
            own_class, labels[:, None], rng.integers(0, num_classes, size=(size, seq_len))
        )
        cues = text_size + cue_class * cue_size + rng.integers(0, cue_size, size=(size, seq_len))
        tokens = np.where(cue_mask, cues, tokens)
        return tokens.astype(np.int32), labels.astype(np.int32)

    return BatchStream(
        sample_classification,
        seed=seed,
        batch_size=batch_size,
        task="classification",
        num_classes=num_classes,
        input_shape=(seq_len,),
        num_eval_batches=num_eval_batches,
    )


# --- real datasets ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
    """An in-memory image dataset: NHWC float32 images (standardised per channel with the training
    mean/std) and int32 labels."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int

    def stream(self, seed: int, batch_size: int, *, max_eval_examples: int = 2048) -> BatchStream:
        """Training batches: a fresh seeded permutation each epoch, ``batch(step)`` takes positions
        ``[step*B, (step+1)*B)`` of the concatenated epochs. Eval: the first test examples in order,
        in full batches (at most ``max_eval_examples``; one short batch if the test set is smaller
        than a batch)."""
        return _ArrayStream(
            self, seed=seed, batch_size=batch_size, max_eval_examples=max_eval_examples
        )


class _ArrayStream(BatchStream):
    def __init__(
        self, dataset: ArrayDataset, *, seed: int, batch_size: int, max_eval_examples: int
    ):
        super().__init__(
            self._unused,
            seed=seed,
            batch_size=batch_size,
            task="classification",
            num_classes=dataset.num_classes,
            input_shape=dataset.train_images.shape[1:],
        )
        self.dataset = dataset
        self.max_eval_examples = _check_int("max_eval_examples", max_eval_examples, 1)

    @staticmethod
    def _unused(rng: np.random.Generator, size: int) -> Batch:  # pragma: no cover
        raise NotImplementedError

    def batch(self, step: int) -> Batch:
        step = _check_int("step", step, 0)
        count = len(self.dataset.train_labels)
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, offsets = np.divmod(positions, count)
        indices = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            permutation = np.random.default_rng([self.seed, _TRAIN_STREAM, int(epoch)]).permutation(
                count
            )
            selected = epochs == epoch
            indices[selected] = permutation[offsets[selected]]
        return self.dataset.train_images[indices], self.dataset.train_labels[indices]

    def eval_batches(self) -> list[Batch]:
        images, labels = self.dataset.test_images, self.dataset.test_labels
        limit = min(len(labels), self.max_eval_examples)
        if limit < self.batch_size:
            return [(images[:limit], labels[:limit])]
        return [
            (images[start : start + self.batch_size], labels[start : start + self.batch_size])
            for start in range(0, limit - self.batch_size + 1, self.batch_size)
        ]


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC -> float32 standardised per channel with the training statistics."""
    train = train.astype(np.float32) / 255.0
    test = test.astype(np.float32) / 255.0
    mean = train.mean(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
    std = train.std(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
    std = np.where(std > 0, std, np.float32(1.0)).astype(np.float32)
    return (train - mean) / std, (test - mean) / std


_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST/Fashion-MNIST format), raw or gzip-compressed (by content)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4]!r}).")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header says shape {shape} ({expected} bytes) but the file holds "
            f"{len(raw) - header} bytes of data."
        )
    return (
        np.frombuffer(raw, dtype=dtype, offset=header)
        .reshape(shape)
        .astype(dtype.newbyteorder("="))
    )


def _find(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: missing {stem!r} or {stem + '.gz'!r}.")


def load_fashion_mnist(folder: str | os.PathLike) -> ArrayDataset:
    """Fashion-MNIST (or MNIST) from the four IDX files in ``folder`` (raw or ``.gz``):
    ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
    ``t10k-labels-idx1-ubyte``. Images become ``(N, 28, 28, 1)`` float32, standardised."""
    folder = _existing_folder(folder)
    arrays = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = read_idx(_find(folder, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(_find(folder, f"{prefix}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match "
                "(expected (N, H, W) and (N,))."
            )
        arrays[split] = (images[..., None], labels.astype(np.int32))
    train_images, test_images = _standardise(arrays["train"][0], arrays["test"][0])
    return ArrayDataset(
        "fashion_mnist", train_images, arrays["train"][1], test_images, arrays["test"][1], 10
    )


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a data folder must not run code."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles from Python 3 store bytes
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: CIFAR-10 batches hold only dicts, lists, "
                "bytes and numpy arrays."
            )
        if module == "numpy.core.multiarray":  # numpy >= 2 warns on numpy.core; same objects
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _NumpyOnlyUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(batch).__name__}.")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(
            f"{path}: the dict needs 'data' and 'labels' keys, got {sorted(map(str, batch))}."
        )
    data = np.asarray(data, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int32)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(
            f"{path}: 'data' must be (N, 3072) uint8 with N labels, got {data.shape} and "
            f"{labels.shape}."
        )
    # Each row is three 32x32 planes (R, G, B): CHW -> HWC.
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def load_cifar10(folder: str | os.PathLike) -> ArrayDataset:
    """CIFAR-10 from the python batches (``data_batch_1`` .. ``data_batch_5``, ``test_batch``) in
    ``folder`` or in ``folder/cifar-10-batches-py``. Training uses the ``data_batch_*`` files
    present (at least one). Images become ``(N, 32, 32, 3)`` float32, standardised per channel.

    The batches are pickles; they are read with an unpickler that only builds numpy arrays and
    plain containers."""
    folder = _existing_folder(folder)
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    train_files = sorted(folder.glob("data_batch_[0-9]*"))
    if not train_files or not (folder / "test_batch").is_file():
        raise FileNotFoundError(
            f"{folder}: expected data_batch_1 .. data_batch_5 and test_batch (CIFAR-10 python "
            "version)."
        )
    parts = [_load_cifar_batch(path) for path in train_files]
    train_images = np.concatenate([images for images, _ in parts])
    train_labels = np.concatenate([labels for _, labels in parts])
    test_images, test_labels = _load_cifar_batch(folder / "test_batch")
    train_images, test_images = _standardise(train_images, test_images)
    return ArrayDataset("cifar10", train_images, train_labels, test_images, test_labels, 10)


def _existing_folder(folder: str | os.PathLike) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"`folder` must be an existing directory, got {str(folder)!r}.")
    return path


# --- offline real data: scikit-learn digits, byte-level text ----------------------------------

_SPLIT_KEY = 20251123  # fixed entropy for the train/test split of bundled datasets


def load_digits() -> ArrayDataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 grey images, 10 classes.

    The data ship inside the scikit-learn wheel (``sklearn.datasets.load_digits``): nothing is
    downloaded. Images become NHWC ``(N, 8, 8, 1)`` float32 standardised with the training
    mean/std; a fixed permutation (independent of any run seed) puts 1,438 images in the
    training split and 359 in the test split.

    Example:
      >>> data = load_digits()
      >>> data.train_images.shape, data.test_images.shape, data.num_classes
      ((1438, 8, 8, 1), (359, 8, 8, 1), 10)
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:  # pragma: no cover - scikit-learn is in the parity extra
        raise ImportError(
            "--data digits needs scikit-learn: pip install -c constraints.txt -e '.[parity]'."
        ) from error
    digits = sklearn_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(_SPLIT_KEY).permutation(len(labels))
    cut = len(labels) - len(labels) // 5
    train, test = order[:cut], order[cut:]
    train_images, test_images = _standardise(images[train], images[test])
    return ArrayDataset("digits", train_images, labels[train], test_images, labels[test], 10)


TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def default_text_path() -> Path:
    """The Python standard library's own sources: a corpus on every machine with Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_text(path: str | os.PathLike | None = None, *, max_bytes: int = 8 << 20) -> np.ndarray:
    """A byte-level corpus as uint8 ids (vocabulary 256).

    Args:
      path: a file, or a folder whose ``*.py``/``*.txt``/``*.md``/``*.rst`` files are read in
        sorted path order (a folder's own files first, then its subfolders'); default: the
        standard library folder (``sysconfig.get_paths()["stdlib"]``, its top-level ``*.py``
        files only).
      max_bytes: read at most this many bytes in all (only the last file is cut).

    Returns:
      uint8 array of the concatenated files, each followed by a newline.

    Raises:
      ValueError: no such path, unreadable, or under 1 KiB of text (added newlines not counted).

    Example:
      >>> corpus = load_text()
      >>> corpus.dtype, corpus.size > 1_000_000
      (dtype('uint8'), True)
    """
    max_bytes = _check_int("max_bytes", max_bytes, 1)
    if path is None:
        folder = default_text_path()
        files = sorted(p for p in folder.glob("*.py") if p.is_file())
    else:
        root = Path(path)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(
                (p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                key=lambda p: (len(p.relative_to(root).parts), str(p)),
            )
        else:
            raise ValueError(f"--data text:PATH: {str(root)!r} is neither a file nor a folder.")
    chunks, text_bytes = [], 0
    for file in files:
        room = max_bytes - text_bytes - len(chunks) // 2  # the newlines added so far take room
        try:
            with open(file, "rb") as handle:
                data = handle.read(room)
        except OSError as e:
            raise ValueError(f"--data text:PATH: cannot read {str(file)!r}: {e}") from None
        chunks += [data, b"\n"]
        text_bytes += len(data)
        if len(data) + 1 >= room:
            break
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if text_bytes < 1024:
        raise ValueError(
            f"--data text:PATH: {str(path or default_text_path())!r} holds {text_bytes} bytes of "
            f"text ({', '.join(TEXT_SUFFIXES)} files); give at least 1 KiB."
        )
    fraction = text_fraction(corpus)
    if fraction < MIN_TEXT_FRACTION:
        warnings.warn(
            f"--data text:PATH: only {fraction:.0%} of the bytes of "
            f"{str(path or default_text_path())!r} are text (valid UTF-8 without control "
            "characters); a byte-level language model on it learns the byte noise, not a "
            "language: give a text corpus",
            UserWarning,
            stacklevel=2,
        )
    return corpus


# A text corpus below this share of text bytes is mostly something else (binary data, random
# bytes): `load_text` warns naming the share. Source code and prose in any script are ~100%.
MIN_TEXT_FRACTION = 0.9


def text_fraction(data: np.ndarray | bytes) -> float:
    """The share of bytes that are text (to within a byte per invalid sequence): valid UTF-8 and not control characters (tab, newline,
    carriage return and form feed are text).

    Example:
      >>> text_fraction("naïve café, 日本語".encode())
      1.0
      >>> round(text_fraction(np.random.default_rng(0).integers(0, 256, 4096, np.uint8)), 1)
      0.5
    """
    raw = np.frombuffer(bytes(data), np.uint8) if isinstance(data, bytes) else np.asarray(data)
    if raw.size == 0:
        return 1.0
    controls = (raw < 0x20) & ~np.isin(raw, (0x09, 0x0A, 0x0C, 0x0D)) | (raw == 0x7F)
    # each byte that is not part of a valid UTF-8 sequence decodes to one U+FFFD
    invalid = raw.tobytes().decode("utf-8", errors="replace").count("\ufffd")
    return float(1.0 - (int(controls.sum()) + invalid) / raw.size)


def text_stream(
    corpus: np.ndarray,
    seed: int,
    batch_size: int,
    seq_len: int,
    task: str = "lm",
    *,
    num_eval_batches: int = 4,
) -> BatchStream:
    """Windows of a byte corpus: the first 90% trains, the last 10% is held out.

    ``task="lm"``: inputs ``(B, seq_len)`` int32 bytes, targets the next bytes. ``task=
    "classification"`` (2 classes): each window is reversed with probability 1/2 and the label
    says whether it was; reversed text has the same byte counts, so only the order tells (an
    LSTM or a transformer learns it, a bag of bytes cannot).

    Example:
      >>> stream = text_stream(load_text(), seed=0, batch_size=2, seq_len=8)
      >>> [a.shape for a in stream.batch(0)]
      [(2, 8), (2, 8)]
    """
    seq_len = _check_int("seq_len", seq_len, 2)
    if task not in ("lm", "classification"):
        raise ValueError(f"`task` must be 'lm' or 'classification', got {task!r}.")
    corpus = np.asarray(corpus, dtype=np.uint8)
    cut = int(corpus.size * 0.9)
    train, held_out = corpus[:cut], corpus[cut:]
    window = seq_len + 1
    if held_out.size <= window:
        raise ValueError(
            f"the text corpus ({corpus.size} bytes) is too short for seq_len={seq_len}."
        )

    def windows(part: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
        starts = rng.integers(0, part.size - window, size=size)
        return part[starts[:, None] + np.arange(window)].astype(np.int32)

    def make(part):
        def sample(rng: np.random.Generator, size: int) -> Batch:
            tokens = windows(part, rng, size)
            if task == "lm":
                return tokens[:, :-1], tokens[:, 1:]
            labels = rng.integers(0, 2, size=size).astype(np.int32)
            text = tokens[:, :-1]
            return np.where(labels[:, None] == 1, text[:, ::-1], text), labels

        return sample

    stream = BatchStream(
        make(train),
        seed=seed,
        batch_size=batch_size,
        task=task,
        num_classes=256 if task == "lm" else 2,
        input_shape=(seq_len,),
        num_eval_batches=num_eval_batches,
    )
    held_out_sampler = make(held_out)
    stream.eval_batches = lambda: [  # type: ignore[method-assign]
        held_out_sampler(np.random.default_rng([seed, _EVAL_STREAM, index]), batch_size)
        for index in range(num_eval_batches)
    ]
    return stream


DATA_KINDS = ("synthetic", "real", "digits", "text", "fashion-mnist", "cifar10")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A parsed ``--data`` value: ``synthetic``, ``digits``, ``text`` / ``text:PATH``,
    ``fashion-mnist:DIR``, ``cifar10:DIR``, or ``real``: bundled real data for every model
    (``digits`` for image models, ``text`` for token models), for a matrix over both kinds.

    Example:
      >>> DataSpec.parse("text:/tmp/corpus.txt")
      DataSpec(kind='text', path='/tmp/corpus.txt')
    """

    kind: str = "synthetic"
    path: str | None = None

    @classmethod
    def parse(cls, value: str) -> DataSpec:
        """Parses and validates a ``--data`` string (errors name the closest kind)."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"--data must be a string such as 'digits', got {value!r}.")
        kind, sep, path = value.partition(":")
        if kind not in DATA_KINDS:
            close = difflib.get_close_matches(kind, DATA_KINDS, n=1)
            raise ValueError(
                f"--data {value!r}: unknown kind {kind!r}; use one of synthetic, real, digits, "
                "text[:PATH], fashion-mnist:DIR, cifar10:DIR"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + "."
            )
        if kind in ("fashion-mnist", "cifar10", "text") and sep and not path:
            raise ValueError(f"--data {value!r}: no path after the colon; give {kind}:PATH.")
        if kind in ("fashion-mnist", "cifar10") and not path:
            raise ValueError(f"--data {kind} needs the folder with the files: {kind}:DIR.")
        if kind in ("synthetic", "real", "digits") and sep:
            raise ValueError(f"--data {kind} takes no path, got {value!r}.")
        return cls(kind, path or None)

    def __str__(self) -> str:
        return self.kind if self.path is None else f"{self.kind}:{self.path}"

    def resolve(self, image_model: bool) -> DataSpec:
        """``real`` -> ``digits`` (image models) or ``text`` (token models); others unchanged."""
        if self.kind != "real":
            return self
        return DataSpec("digits") if image_model else DataSpec("text")

    @property
    def modality(self) -> str:
        """``"images"``, ``"text"`` or ``"synthetic"`` (each model's own data)."""
        return {"synthetic": "synthetic", "text": "text"}.get(self.kind, "images")

    def dataset(self) -> ArrayDataset:
        """The image dataset (cached per process)."""
        return _image_dataset(self.kind, self.path)

    def corpus(self) -> np.ndarray:
        """The text corpus (cached per process)."""
        return _text_corpus(self.path)

    def check(self) -> None:
        """Loads the data (cached): unreadable data is one `ValueError` naming --data, early."""
        try:
            if self.kind == "text":
                self.corpus()
            elif self.kind not in ("synthetic", "real"):
                self.dataset()
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
            raise ValueError(f"--data {self}: {e}") from None


@functools.lru_cache(maxsize=4)
def _image_dataset(kind: str, path: str | None) -> ArrayDataset:
    if kind == "digits":
        return load_digits()
    if kind == "fashion-mnist":
        return load_fashion_mnist(path)
    return load_cifar10(path)


@functools.lru_cache(maxsize=4)
def _text_corpus(path: str | None) -> np.ndarray:
    return load_text(path)
