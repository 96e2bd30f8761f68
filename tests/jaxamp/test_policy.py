"""Policies: preset names, jmp's grammar, "auto", jmp interop and float-only casting."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp._policy import PRESETS, Policy, auto_policy_name, cast_floating, get_policy

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
F64 = np.dtype(jnp.float64)

# The preset names and aliases of the public contract, plus the extra aliases the source documents.
EXPECTED_PRESETS = {
    # name: (param, compute, output)
    "fp32": (F32, F32, F32),
    "32-true": (F32, F32, F32),
    "no": (F32, F32, F32),
    "32": (F32, F32, F32),
    "float32": (F32, F32, F32),
    "bf16-mixed": (F32, BF16, F32),
    "mixed_bfloat16": (F32, BF16, F32),
    "bf16": (F32, BF16, F32),
    "fp16-mixed": (F32, F16, F32),
    "16-mixed": (F32, F16, F32),
    "mixed_float16": (F32, F16, F32),
    "fp16": (F32, F16, F32),
    "16": (F32, F16, F32),
    "bf16-true": (BF16, BF16, BF16),
    "fp16-true": (F16, F16, F16),
    "16-true": (F16, F16, F16),
}

# jmp's grammar: unspecified params are f32, compute follows params, output follows compute.
GRAMMAR = {
    "p=f32,c=bf16,o=f32": (F32, BF16, F32),
    "params=float32,compute=bfloat16,output=float32": (F32, BF16, F32),
    "p=f32,c=f16,o=f32": (F32, F16, F32),
    "c=f16": (F32, F16, F16),
    "c=bf16": (F32, BF16, BF16),
    "p=f16": (F16, F16, F16),
    "p=bf16": (BF16, BF16, BF16),
    "p=f32,c=bf16": (F32, BF16, BF16),
    "p=f16,c=bf16": (F16, BF16, BF16),
    "o=f16": (F32, F32, F16),
    "p=bf16,o=f32": (BF16, BF16, F32),
    "o=f32,c=bf16,p=f32": (F32, BF16, F32),
    "p=full,c=half,o=full": (F32, F16, F32),  # "half" is float16 off TPU
    "compute=float16": (F32, F16, F16),
    "p=f32,c=f32,o=f32": (F32, F32, F32),
    "f32": (F32, F32, F32),
    "full": (F32, F32, F32),
    "half": (F16, F16, F16),
    "f16": (F16, F16, F16),
    "float16": (F16, F16, F16),
    "bfloat16": (BF16, BF16, BF16),
    "f64": (F64, F64, F64),
}

# Strings jmp itself parses (no spaces, lower case, no aliases that jaxamp gives another meaning).
JMP_COMPATIBLE = [s for s in GRAMMAR if s not in ("float32",)]


def dtypes(policy):
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_names_and_aliases(name):
    policy = get_policy(name)
    assert isinstance(policy, Policy)
    assert dtypes(policy) == EXPECTED_PRESETS[name]
    assert all(isinstance(d, np.dtype) for d in dtypes(policy))


def test_presets_table_is_covered():
    assert set(PRESETS) <= set(EXPECTED_PRESETS)
    for name, triple in PRESETS.items():
        assert triple == EXPECTED_PRESETS[name]


@pytest.mark.parametrize(
    "name", [n for n in EXPECTED_PRESETS if "mixed" in n or n in ("bf16", "fp16")]
)
def test_mixed_presets_keep_params_and_outputs_float32(name):
    policy = get_policy(name)
    assert policy.param_dtype == F32 and policy.output_dtype == F32
    assert policy.compute_dtype in (F16, BF16)
    assert policy.is_mixed


@pytest.mark.parametrize("spec", sorted(GRAMMAR))
def test_jmp_grammar(spec):
    assert dtypes(get_policy(spec)) == GRAMMAR[spec]


@pytest.mark.parametrize("spec", JMP_COMPATIBLE)
def test_grammar_agrees_with_jmp(spec):
    theirs = jmp.get_policy(spec)
    ours = get_policy(spec)
    assert dtypes(ours) == tuple(
        np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    )


@pytest.mark.parametrize(
    "spec, expected",
    [
        (" P = F32 , C = BF16 , O = F32 ", (F32, BF16, F32)),
        ("Params=Float32,Compute=BFloat16", (F32, BF16, BF16)),
        ("\tBF16-Mixed\n", (F32, BF16, F32)),
        ("FP16-MIXED", (F32, F16, F32)),
        ("Mixed_Float16", (F32, F16, F32)),
        ("16 - true", (F16, F16, F16)),
        ("  no  ", (F32, F32, F32)),
    ],
)
def test_spaces_and_case_are_ignored(spec, expected):
    assert dtypes(get_policy(spec)) == expected


ALL_SPECS = sorted(EXPECTED_PRESETS) + sorted(GRAMMAR) + ["auto"]


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_str_round_trips(spec):
    policy = get_policy(spec)
    text = str(policy)
    assert text.startswith("p=") and ",c=" in text and ",o=" in text
    again = get_policy(text)
    assert again == policy
    assert str(again) == text
    assert repr(policy) == f"Policy({text!r})"


@settings(max_examples=30, deadline=None)
@given(st.tuples(*[st.sampled_from([F16, BF16, F32, F64])] * 3))
def test_str_round_trips_any_triple(triple):
    policy = Policy(*triple)
    assert get_policy(str(policy)) == policy
    assert dtypes(get_policy(str(policy))) == triple


def test_str_examples():
    assert str(get_policy("bf16-mixed")) == "p=f32,c=bf16,o=f32"
    assert str(get_policy("fp16-true")) == "p=f16,c=f16,o=f16"
    assert str(get_policy("fp32")) == "p=f32,c=f32,o=f32"


@pytest.mark.parametrize(
    "platform, capability, expected",
    [
        ("tpu", None, "bf16-mixed"),
        ("TPU", None, "bf16-mixed"),
        ("gpu", "7.0", "fp16-mixed"),
        ("gpu", "7.5", "fp16-mixed"),
        ("gpu", "8.0", "bf16-mixed"),
        ("gpu", "8.6", "bf16-mixed"),
        ("gpu", "9.0", "bf16-mixed"),
        ("cuda", "9.0", "bf16-mixed"),
        ("cuda", "7.0", "fp16-mixed"),
        ("gpu", None, "fp16-mixed"),  # unknown capability: the safe choice for older GPUs
        ("rocm", None, "bf16-mixed"),
        ("cpu", None, "fp32"),
        ("cpu", "9.0", "fp32"),
    ],
)
def test_auto_policy_name(platform, capability, expected):
    name = auto_policy_name(platform, capability)
    assert name == expected
    assert name in PRESETS


def test_auto_resolves_on_this_backend():
    device = jax.devices()[0]
    expected = {"cpu": "fp32", "tpu": "bf16-mixed", "rocm": "bf16-mixed"}.get(device.platform)
    if device.platform in ("gpu", "cuda"):
        major = int(str(device.compute_capability).split(".")[0])
        expected = "bf16-mixed" if major >= 8 else "fp16-mixed"
    assert auto_policy_name() == expected
    assert get_policy("auto") == get_policy(expected)
    assert get_policy(" AUTO ") == get_policy(expected)


def test_jmp_policy_accepted_and_ours_is_a_jmp_policy():
    theirs = jmp.Policy(
        param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, output_dtype=jnp.float32
    )
    ours = get_policy(theirs)
    assert type(ours) is Policy
    assert dtypes(ours) == (F32, BF16, F32)
    assert isinstance(ours, jmp.Policy)
    assert isinstance(get_policy("fp16-mixed"), jmp.Policy)
    assert get_policy(jmp.get_policy("p=f32,c=f16")) == get_policy("p=f32,c=f16,o=f16")
    # A Policy is returned as is.
    policy = get_policy("bf16-true")
    assert get_policy(policy) is policy


def test_policy_methods_match_jmp():
    ours = get_policy("p=f32,c=bf16,o=f16")
    theirs = jmp.get_policy("p=f32,c=bf16,o=f16")
    x = {"w": jnp.ones((2, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float16)}
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a, b = getattr(ours, method)(x), getattr(theirs, method)(x)
        assert jax.tree.map(lambda u: u.dtype, a) == jax.tree.map(lambda u: u.dtype, b)
    other = ours.with_output_dtype(jnp.float32)
    assert isinstance(other, Policy)
    assert dtypes(other) == (F32, BF16, F32)
    assert dtypes(ours) == (F32, BF16, F16)  # frozen: the original is unchanged


def test_policy_constructor_validates_dtypes():
    with pytest.raises(ValueError, match="compute_dtype"):
        Policy(jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(TypeError, match="output_dtype"):
        Policy(jnp.float32, jnp.float32, "not-a-dtype")
    with pytest.raises(ValueError, match="param_dtype"):
        Policy(jnp.bool_, jnp.float32, jnp.float32)


def test_policy_properties():
    assert get_policy("fp16-mixed").needs_loss_scaling
    assert get_policy("fp16-true").needs_loss_scaling
    assert not get_policy("bf16-mixed").needs_loss_scaling
    assert not get_policy("fp32").is_mixed
    assert not get_policy("bf16-true").is_mixed


# --- casting --------------------------------------------------------------------------------------


def _array_tree():
    return {
        "f32": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
        "f16": jnp.ones((3,), jnp.float16),
        "bf16": jnp.full((2,), 0.5, jnp.bfloat16),
        "scalar": jnp.float32(3.25),
        "int32": jnp.arange(4, dtype=jnp.int32),
        "uint8": jnp.arange(3, dtype=jnp.uint8),
        "bool": jnp.array([True, False]),
        "key": jax.random.key(0),
        "legacy_key": jax.random.PRNGKey(1),
    }


FLOAT_NAMES = ("f32", "f16", "bf16", "scalar")


def _check_cast(out, tree, target):
    for name in FLOAT_NAMES:
        assert out[name].dtype == target, name
        np.testing.assert_array_equal(
            np.asarray(out[name], np.float32), np.asarray(tree[name].astype(target), np.float32)
        )
    for name in ("int32", "uint8", "bool", "legacy_key"):
        assert out[name].dtype == tree[name].dtype, name
        np.testing.assert_array_equal(out[name], tree[name])
    assert out["legacy_key"].dtype == jnp.uint32
    assert jnp.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_cast_touches_floating_leaves_only(method, float_dtype, maybe_jit):
    policy = Policy(float_dtype, float_dtype, float_dtype)
    tree = _array_tree()
    python_leaf_types = []

    def cast(t):
        # Python numbers are closed over (as jit arguments they would become arrays).
        out = getattr(policy, method)({**t, "py_float": 1.5, "py_int": 3, "none": None})
        python_leaf_types.append((type(out["py_float"]), type(out["py_int"]), out["none"]))
        return {k: out[k] for k in t}

    out = maybe_jit(cast)(tree)
    _check_cast(out, tree, float_dtype)
    assert python_leaf_types[-1] == (float, int, None)


def test_cast_floating_numpy_and_identity(float_dtype):
    tree = {
        "np64": np.linspace(0, 1, 4),
        "np_int": np.arange(3),
        "np_bool": np.array([True]),
        "py": 2.5,
    }
    out = cast_floating(tree, float_dtype)
    assert out["np64"].dtype == float_dtype
    assert out["np_int"] is tree["np_int"]
    assert out["np_bool"] is tree["np_bool"]
    assert out["py"] == 2.5 and type(out["py"]) is float
    same = jnp.ones(2, float_dtype)
    assert cast_floating(same, float_dtype) is same


def test_cast_under_jit_does_not_recast_keys():
    policy = get_policy("bf16-true")

    @jax.jit
    def split_after_cast(tree):
        tree = policy.cast_to_compute(tree)
        return jax.random.split(tree["key"]), jax.random.split(tree["legacy"]), tree["x"]

    keys, legacy, x = split_after_cast(
        {"key": jax.random.key(3), "legacy": jax.random.PRNGKey(3), "x": jnp.ones(2)}
    )
    assert x.dtype == jnp.bfloat16
    assert legacy.dtype == jnp.uint32 and legacy.shape == (2, 2)
    assert keys.shape == (2,)


# --- malformed specs ------------------------------------------------------------------------------

BAD_SPECS = [
    "",
    "   ",
    "fp8",
    "bf16-mixedx",
    "p=",
    "=f32",
    "p=f32,",
    ",p=f32",
    "p=f32,,c=f16",
    "p=f32,p=f16",
    "x=f32",
    "p=f32=c",
    "p==f32",
    "p=f32;c=f16",
    "p=int32",
    "mixed",
    "p:f32",
    "c=bf16,compute=f16",
]


def _assert_lists_valid_forms(message):
    assert "Valid specs" in message
    for form in ("bf16-mixed", "fp16-mixed", "p=<dtype>", "auto"):
        assert form in message


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_malformed_specs_raise_value_error_listing_valid_forms(spec):
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    _assert_lists_valid_forms(str(info.value))
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize(
    "spec", [None, 3, 1.5, b"fp32", ["fp32"], {"p": "f32"}, jnp.float32, np.dtype("float32")]
)
def test_non_string_raises_type_error_naming_parameter(spec):
    with pytest.raises(TypeError, match=r"spec"):
        get_policy(spec)


FRAGMENTS = [
    "p",
    "c",
    "o",
    "params",
    "compute",
    "output",
    "p=",
    "c=",
    "o=",
    "=",
    ",",
    "bf16",
    "f16",
    "f32",
    "float32",
    "bfloat16",
    "half",
    "full",
    "fp16",
    "-mixed",
    "-true",
    "16",
    "32",
    "auto",
    "no",
    " ",
    "P",
    "BF16",
    "x",
    "==",
    ",,",
    "\t",
    "é",
]


def _parse_or_value_error(spec):
    try:
        policy = get_policy(spec)
    except ValueError as e:
        _assert_lists_valid_forms(str(e))
        return None
    assert isinstance(policy, Policy)
    assert get_policy(str(policy)) == policy
    return policy


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_fuzz_arbitrary_text(spec):
    _parse_or_value_error(spec)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join))
def test_fuzz_grammar_fragments(spec):
    _parse_or_value_error(spec)


@settings(max_examples=50, deadline=None)
@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.floats(),
        st.binary(max_size=8),
        st.lists(st.text(max_size=4), max_size=3),
    )
)
def test_fuzz_non_strings(spec):
    with pytest.raises(TypeError, match="spec"):
        get_policy(spec)


def test_public_names():
    assert jaxamp.Policy is Policy
    assert jaxamp.get_policy is get_policy
    assert jaxamp.cast_floating is cast_floating


# --- reduce_dtype (FSDP2's MixedPrecisionPolicy.reduce_dtype) -------------------------------------

# Presets reduce in their param dtype: mixed presets in float32 (what DDP and FSDP2 do with
# float32 params), *-true presets in their own dtype.
EXPECTED_REDUCE = {
    name: (BF16 if name == "bf16-true" else F16 if name in ("fp16-true", "16-true") else F32)
    for name in EXPECTED_PRESETS
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_reduce_dtype(name):
    policy = get_policy(name)
    assert policy.reduce_dtype == EXPECTED_REDUCE[name]
    assert isinstance(policy.reduce_dtype, np.dtype)
    # The default reduce dtype is not shown, so preset strings stay in jmp's grammar.
    assert ",r=" not in str(policy)
    assert jmp.get_policy(str(policy)).compute_dtype == policy.compute_dtype


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("p=f32,c=bf16,o=f32,r=bf16", (F32, BF16, F32, BF16)),
        ("p=f32,c=bf16,o=f32,reduce=float32", (F32, BF16, F32, F32)),
        ("r=f16", (F32, F32, F32, F16)),
        ("c=bf16,r=bf16", (F32, BF16, BF16, BF16)),
        ("reduce=bf16,p=f32,c=f16", (F32, F16, F16, BF16)),
        ("p=bf16", (BF16, BF16, BF16, BF16)),  # unspecified reduce follows params
        ("p=f16,c=f16,r=f32", (F16, F16, F16, F32)),
        (" R = BF16 , P = F32 ", (F32, F32, F32, BF16)),
        ("bfloat16", (BF16, BF16, BF16, BF16)),  # a single dtype name sets all four
    ],
)
def test_reduce_grammar(spec, expected):
    policy = get_policy(spec)
    assert (*dtypes(policy), policy.reduce_dtype) == expected


@settings(max_examples=40, deadline=None)
@given(st.tuples(*[st.sampled_from([F16, BF16, F32, F64])] * 4))
def test_str_round_trips_with_reduce(quad):
    policy = Policy(*quad)
    text = str(policy)
    assert (",r=" in text) == (quad[3] != quad[0])
    again = get_policy(text)
    assert again == policy and hash(again) == hash(policy)
    assert (*dtypes(again), again.reduce_dtype) == quad
    assert repr(policy) == f"Policy({text!r})"


def test_reduce_dtype_in_equality_and_hash():
    base = get_policy("bf16-mixed")
    narrow = get_policy("p=f32,c=bf16,o=f32,r=bf16")
    assert base != narrow
    assert len({base, narrow, get_policy("bf16-mixed")}) == 2
    # None and the param dtype are the same policy.
    assert Policy(F32, BF16, F32) == Policy(F32, BF16, F32, None) == Policy(F32, BF16, F32, F32)
    assert Policy(F32, BF16, F32, reduce_dtype="float32") == base
    assert base.with_reduce_dtype(jnp.bfloat16) == narrow
    assert narrow.with_reduce_dtype(None) == base
    # Other copies keep the reduce dtype.
    assert narrow.with_output_dtype(jnp.bfloat16).reduce_dtype == BF16
    assert isinstance(narrow, jmp.Policy)


def test_jmp_policy_converts_with_param_reduce():
    theirs = jmp.get_policy("p=bf16,c=bf16,o=f32")
    assert get_policy(theirs).reduce_dtype == BF16
    assert get_policy(jmp.get_policy("p=f32,c=f16")).reduce_dtype == F32


def test_cast_to_reduce(float_dtype, maybe_jit):
    policy = get_policy("p=f32,c=bf16,o=f32").with_reduce_dtype(float_dtype)
    tree = {"g": jnp.ones(3, jnp.bfloat16), "n": jnp.arange(2)}
    out = maybe_jit(policy.cast_to_reduce)(tree)
    assert out["g"].dtype == float_dtype and out["n"].dtype == jnp.int32


def test_reduce_dtype_validated():
    with pytest.raises(ValueError, match="reduce_dtype"):
        Policy(F32, BF16, F32, reduce_dtype=jnp.int32)
    with pytest.raises(TypeError, match="reduce_dtype"):
        Policy(F32, BF16, F32, reduce_dtype="nope")
    with pytest.raises(ValueError, match="reduce dtype given twice"):
        get_policy("r=f32,reduce=bf16")


# --- short errors with the closest name -----------------------------------------------------------


@pytest.mark.parametrize(
    "spec, suggestion",
    [
        ("bf16-mixd", "bf16-mixed"),
        ("fp16_mixed", "fp16-mixed"),
        ("bf16-ture", "bf16-true"),
        ("flaot32", "float32"),
        ("p=f32,c=bf61", "bf16"),
        ("p=f32,c=bfloat61", "bfloat16"),
        ("p=f32,comptue=bf16", "compute"),
        ("p=f32,reduc=bf16", "reduce"),
    ],
)
def test_error_names_closest_valid_spelling(spec, suggestion):
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    message = str(info.value)
    assert f"did you mean {suggestion!r}?" in message
    assert len(message) < 400  # short: the full list lives in get_policy's docstring
    _assert_lists_valid_forms(message)


def test_full_list_of_names_is_documented():
    from jaxamp._policy import _ALIASES, _NAME_TO_DTYPE

    doc = get_policy.__doc__
    for name in (*PRESETS, *_ALIASES, *_NAME_TO_DTYPE, "half", "auto", "r``/``reduce"):
        assert name in doc, name


@pytest.mark.parametrize("field", range(3))
def test_policy_rejects_none_and_bool_dtypes(field):
    # np.dtype(None) is float64: Policy(None, None, None) must not quietly become f64.
    for bad in (None, True):
        args = [F32, F32, F32]
        args[field] = bad
        with pytest.raises(TypeError, match=("param", "compute", "output")[field]):
            Policy(*args)


def test_policy_accepts_dtype_names():
    assert Policy("f32", "bf16", "float32", "full") == get_policy("bf16-mixed")
    with pytest.raises(TypeError, match="did you mean 'bf16'"):
        Policy("f32", "bf61", "f32")


def test_cast_floating_rejects_non_floating_targets():
    tree = {"w": jnp.ones(2)}
    for bad in ("int8", jnp.int32, np.bool_):
        with pytest.raises(ValueError, match="cast_floating"):
            cast_floating(tree, bad)
    with pytest.raises(TypeError, match="cast_floating"):
        cast_floating(tree, None)
    assert cast_floating(tree, "bf16")["w"].dtype == jnp.bfloat16
