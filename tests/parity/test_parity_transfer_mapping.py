"""parity.pairs.mapping: the one torch <-> Flax mapping object (built-in pairs, transforms, gradients)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.models import MODEL_NAMES, get_model_pair  # noqa: E402
from parity.pairs.mapping import (  # noqa: E402
    MappingEntry,
    MappingError,
    WeightMapping,
    apply_transform,
    parse_transform,
    transform_shape,
)


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n != "resnet"])
def test_builtin_mapping_equals_hand_written_transfer(name):
    pair = get_model_pair(name, seed=0)
    assert isinstance(pair.mapping, WeightMapping)
    reference = pair.torch_to_flax()
    mapped = pair.mapping.to_flax(pair.torch_model)
    assert jax.tree.structure(reference) == jax.tree.structure(mapped)
    assert all(jax.tree.leaves(jax.tree.map(_bits_equal, reference, mapped)))
    pair.mapping.check_round_trip(pair.torch_model)


def test_to_torch_restores_every_tensor_bit_for_bit():
    pair = get_model_pair("cnn_bn", seed=0)
    variables = pair.mapping.to_flax(pair.torch_model)
    fresh = get_model_pair("cnn_bn", seed=1).torch_model
    pair.mapping.to_torch(variables, fresh)
    for key, value in pair.torch_model.state_dict().items():
        if key.endswith("num_batches_tracked"):
            continue
        assert torch.equal(value, fresh.state_dict()[key]), key


def test_mapping_json_round_trip():
    pair = get_model_pair("transformer", seed=0, num_layers=1)
    data = json.loads(json.dumps(pair.mapping.to_dict()))
    assert WeightMapping.from_dict(data) == pair.mapping
    assert ("blocks.0.attn", ("blocks_0", "attn")) in pair.mapping.module_pairs()


def test_element_index_names_each_flax_elements_torch_position():
    """The one reading of a mapping's element order (low-bit block order, step 0's pieces): each
    Flax element holds its torch tensor's flat position, so weights taken through the index equal
    the mapping's own transfer, split tensors (fused qkv) included."""
    pair = get_model_pair("transformer", seed=0, num_layers=1)
    tensors = {n: t.detach().numpy() for n, t in pair.torch_model.state_dict().items()}
    index = pair.mapping.element_index({n: t.shape for n, t in tensors.items()})
    flat = {
        tuple(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(pair.mapping.to_flax(tensors))[0]
    }
    assert set(index) == set(flat)
    split = [found for found in index.values() if found[0][0].endswith("in_proj_weight")]
    assert len(split) == 3  # query, key and value kernels from one torch tensor
    for path, found in index.items():
        assert len(found) == 1, path  # one torch tensor per leaf in this pair
        name, positions = found[0]
        assert positions.shape == flat[path].shape, path
        assert _bits_equal(tensors[name].reshape(-1)[positions], flat[path]), path
    assert pair.mapping.element_index({}) == {}


def test_grads_to_flax_matches_jax_gradients():
    """Transformer (fused qkv chunks, reshapes): torch grads through the mapping equal JAX's."""
    from parity.core.losses import loss_jax, loss_torch

    pair = get_model_pair("transformer", seed=0, num_layers=1, d_model=32, seq_len=16)
    stream = pair.make_data(seed=0, batch_size=4)
    inputs, targets = stream.batch(0)
    model = pair.torch_model
    loss = loss_torch(
        "lm", pair.torch_forward(model, torch.as_tensor(inputs), True), torch.as_tensor(targets)
    )
    loss.backward()
    grads = pair.mapping.grads_to_flax({n: p.grad for n, p in model.named_parameters()})
    variables = pair.torch_to_flax()

    def loss_fn(params):
        logits, _ = pair.flax_apply({"params": params}, jax.numpy.asarray(inputs), train=True)
        return loss_jax("lm", logits, jax.numpy.asarray(targets))

    with jax.default_matmul_precision("highest"):
        expected = jax.jit(jax.grad(loss_fn))(variables["params"])  # one program, not op by op
    assert jax.tree.structure(expected) == jax.tree.structure(grads["params"])
    # Scale by the largest gradient overall: the key bias's gradient is zero up to rounding.
    scale = max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(expected))
    for (path, want), got in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(grads["params"]), strict=True
    ):
        # float32 gradients of a 1-layer transformer: a few hundred ulps of the largest entry.
        np.testing.assert_allclose(got, want, atol=scale * 1e-4, rtol=0, err_msg=str(path))


def test_grads_of_a_module_resolve_parameters():
    pair = get_model_pair("mlp", seed=0, hidden=8, image_shape=(4, 4, 1))
    model = pair.torch_model
    model(torch.ones(2, 4, 4, 1)).sum().backward()
    from_module = pair.mapping.grads_to_flax(model)
    from_dict = pair.mapping.grads_to_flax({n: p.grad for n, p in model.named_parameters()})
    assert all(jax.tree.leaves(jax.tree.map(_bits_equal, from_module, from_dict)))
    with pytest.raises(MappingError, match="fc3.bias"):
        pair.mapping.grads_to_flax(
            {n: p.grad for n, p in model.named_parameters() if n != "fc3.bias"}
        )


@pytest.mark.parametrize(
    "transform, shape",
    [
        ("linear", (3, 5)),
        ("conv", (4, 2, 3, 3)),
        ("conv_transpose", (2, 4, 3, 3)),
        ("conv_transpose_t", (2, 4, 3)),
        ("chunk(0,1,3)|linear|reshape(4,2,2)", (12, 4)),
        ("linear|chw(2,2,3)", (5, 12)),
        ("perm(2,0,1)|flip(0)", (2, 3, 4)),
    ],
)
def test_transforms_invert_exactly(transform, shape):
    from parity.pairs.mapping import _adjoint_transform

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = apply_transform(transform, x)
    assert y.shape == transform_shape(transform, shape)
    if "chunk" in transform:
        # The adjoint of a slice places it back: the other pieces are zero.
        back = _adjoint_transform(transform, y, shape)
        np.testing.assert_array_equal(back[4:8], x[4:8])
        assert not back[:4].any() and not back[8:].any()
    else:
        assert _bits_equal(_adjoint_transform(transform, y, shape), x)


def test_bad_transform_names_the_closest_op():
    with pytest.raises(MappingError, match="'linear'"):
        parse_transform("lineer")
    with pytest.raises(MappingError, match="integers"):
        parse_transform("chunk(a,b)")
    with pytest.raises(MappingError, match="collection"):
        WeightMapping((MappingEntry("w", ("kernel",), "linear", "", ()),))


def test_summed_biases_split_evenly_and_gradients_are_not_doubled():
    """torch LSTM -> Flax LSTMCell: b_ih + b_hh go to one bias; going back each gets half."""
    from parity import transfer
    from parity.pairs import layer_entries

    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    mapping = WeightMapping(tuple(layer_entries.lstm_cell_entries("", "cell", lstm)))
    variables = mapping.to_flax(lstm)
    reference = transfer.lstm_to_flax(lstm)
    for gate in reference:
        for leaf, value in reference[gate].items():
            np.testing.assert_array_equal(variables["params"]["cell"][gate][leaf], value)
    mapping.check_round_trip(lstm)  # the sums round-trip bit for bit
    grads = {n: torch.full_like(p, 2.0) for n, p in lstm.named_parameters()}
    flax_grads = mapping.grads_to_flax(grads)
    np.testing.assert_array_equal(flax_grads["params"]["cell"]["hi"]["bias"], np.full(4, 2.0))
