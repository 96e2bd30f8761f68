"""torch.autocast's op lists as data, one per torch device type, and their JAX counterparts.

The lists mirror torch 2.13.0:

* ``"cuda"``: the macros ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
  ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` and
  ``AT_FORALL_PROMOTE`` of ``torch/include/ATen/autocast_mode.h`` (shared by CUDA, XPU, MPS, ...),
  plus ``cudnn_convolution*`` (registered for CUDA only) and ``binary_cross_entropy`` (banned: it
  raises under CUDA autocast).
* ``"cpu"``: the ``KERNEL_CPU`` registrations of ``aten/src/ATen/autocast_mode.cpp``, which are not
  in the installed headers; ``tests/jaxamp/test_autocast_oplists.py`` checks this list against the ops
  torch registers for the ``AutocastCPU`` dispatch key and against
  ``torch.testing._internal.autocast_test_lists``, and runs the ops that have JAX counterparts.

torch op names are ``name`` or ``name.overload`` as torch's dispatcher spells them.

Categories (torch's ``CastPolicy``):

* ``"lower_precision_fp"``: floating inputs cast to the autocast dtype.
* ``"fp32"``: floating inputs cast to float32.
* ``"fp32_set_opt_dtype"``: computed in float32 and returned as float32 (unless the caller passed a
  dtype).
* ``"fp32_append_dtype"``: like ``fp32_set_opt_dtype`` for ops whose float32 overload differs.
* ``"promote"``: floating inputs cast to the widest floating input dtype.
* ``"banned"``: torch raises under autocast (we compute in float32).

Ops on no list keep their input dtypes ("keep").

Public access: ``jaxamp.autocast_op_list(device)`` returns the `OpList` for a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = [
    "AUTOCAST_CATEGORIES",
    "CATEGORIES",
    "CPU",
    "CUDA",
    "OP_LISTS",
    "OpList",
    "PRIMITIVE_COUNTERPARTS",
    "FUNCTION_COUNTERPARTS",
    "DIVERGENCES",
    "NO_JAX_COUNTERPART_NOTE",
]

TORCH_VERSION = "2.13.0"

CATEGORIES = (
    "lower_precision_fp",
    "fp32",
    "fp32_set_opt_dtype",
    "fp32_append_dtype",
    "promote",
    "banned",
)
# Categories a primitive can be given in autocast's ``overrides``: torch's, plus "keep" (no list).
AUTOCAST_CATEGORIES = (*CATEGORIES, "keep")


@dataclasses.dataclass(frozen=True)
class OpList:
    """torch.autocast's op lists for one torch device type.

    Attributes:
      device: torch device type, ``"cpu"`` or ``"cuda"``.
      torch_version: the torch version these lists mirror.
      source: where in torch the lists come from.
      default_dtype: torch's default autocast dtype on this device.
      ops: torch op name (``name`` or ``name.overload``) -> category.
    """

    device: str
    torch_version: str
    source: str
    default_dtype: str
    ops: Mapping[str, str]

    def category(self, torch_op: str) -> str | None:
        """The category of ``torch_op`` (any overload), or ``None`` if it is on no list."""
        if torch_op in self.ops:
            return self.ops[torch_op]
        base = torch_op.split(".")[0]
        for name, cat in self.ops.items():
            if name.split(".")[0] == base:
                return cat
        return None

    def names(self, category: str) -> frozenset[str]:
        """All torch op names (with overloads) in ``category``."""
        return frozenset(n for n, c in self.ops.items() if c == category)

    def primitives(self, torch_op: str) -> tuple[str, ...]:
        """The JAX primitives that implement ``torch_op`` (any overload); () if none."""
        return tuple(PRIMITIVE_COUNTERPARTS.get(torch_op.split(".")[0], ()))

    def functions(self, torch_op: str) -> tuple[str, ...]:
        """The JAX library functions (``module:qualname``) that implement ``torch_op`` as a
        composite; () if none."""
        found = FUNCTION_COUNTERPARTS.get(torch_op)
        if found is None:
            base = torch_op.split(".")[0]
            found = next(
                (v for k, v in FUNCTION_COUNTERPARTS.items() if k.split(".")[0] == base), ()
            )
        return tuple(found)


def _ops(**by_category: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for cat, names in by_category.items():
        for name in names.split():
            out[name] = cat
    return out


CUDA = OpList(
    device="cuda",
    torch_version=TORCH_VERSION,
    source="torch/include/ATen/autocast_mode.h (AT_FORALL_* macros); cudnn_convolution* and "
    "binary_cross_entropy from aten/src/ATen/autocast_mode.cpp",
    default_dtype="float16",
    ops=_ops(
        lower_precision_fp="""
            _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
            conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr
            matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
            linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
            rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
            scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose
        """,
        fp32="""
            acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
            pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
            rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim
            cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
            hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
            margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
            multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
            upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
            _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
            upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
            upsample_bicubic2d _upsample_bicubic2d_aa
        """,
        fp32_set_opt_dtype="""
            prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
            linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
        """,
        fp32_append_dtype="norm.Scalar norm.ScalarOpt_dim",
        promote="""
            addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
            scatter_add
        """,
        banned="binary_cross_entropy",
    ),
)

CPU = OpList(
    device="cpu",
    torch_version=TORCH_VERSION,
    source="aten/src/ATen/autocast_mode.cpp (KERNEL_CPU registrations), checked against the "
    "AutocastCPU dispatch key registrations and torch.testing._internal.autocast_test_lists",
    default_dtype="bfloat16",
    ops=_ops(
        lower_precision_fp="""
            conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
            linalg_vecdot baddbmm addmm addbmm linear _convolution.deprecated matmul conv_tbc
            mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu
            scaled_dot_product_attention _native_multi_head_attention _addmm_activation
        """,
        fp32="""
            avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile
            quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist trace
            view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr
            pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d
            reflection_pad2d replication_pad1d replication_pad2d replication_pad3d mse_loss
            cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss
            smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss
            soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss.IntList
            ctc_loss.Tensor kl_div multilabel_margin_loss binary_cross_entropy_with_logits fft_fft
            fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2
            fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str
            linalg_matrix_rank linalg_matrix_rank.atol_rtol_float
            linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.tol_tensor linalg_solve
            linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
            linalg_householder_product linalg_tensorinv linalg_tensorsolve
            fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
            fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
            multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
            linalg_eigh linalg_lstsq linalg_inv_ex grid_sampler_2d _grid_sampler_2d_cpu_fallback
            grid_sampler_3d
        """,
        promote="stack cat index_copy",
    ),
)

OP_LISTS: Mapping[str, OpList] = {"cpu": CPU, "cuda": CUDA}

# torch op (base name) -> the JAX primitives that implement it. A primitive takes the category of
# the torch ops that map to it; where torch ops that share a primitive disagree, DIVERGENCES says
# which one wins and why.
PRIMITIVE_COUNTERPARTS: Mapping[str, tuple[str, ...]] = {
    **{
        op: ("dot_general",)
        for op in (
            "mm bmm matmul linear addmm addbmm baddbmm addmv addr mv einsum chain_matmul "
            "linalg_multi_dot linalg_vecdot _addmm_activation dot vdot tensordot"
        ).split()
    },
    **{
        op: ("conv_general_dilated",)
        for op in (
            "conv1d conv2d conv3d convolution _convolution conv_tbc conv_transpose1d "
            "conv_transpose2d conv_transpose3d cudnn_convolution cudnn_convolution_transpose"
        ).split()
    },
    "exp": ("exp",),
    "expm1": ("expm1",),
    "log": ("log",),
    "log1p": ("log1p",),
    "acos": ("acos",),
    "asin": ("asin",),
    "cosh": ("cosh",),
    "sinh": ("sinh",),
    "tan": ("tan",),
    "erfinv": ("erf_inv",),
    "rsqrt": ("rsqrt",),
    # torch.square and x ** 2 are pow.Tensor_Scalar; lax.reciprocal is integer_pow(x, -1).
    "pow": ("pow", "integer_pow", "square"),
    "sum": ("reduce_sum",),
    "prod": ("reduce_prod",),
    "cumsum": ("cumsum",),
    "cumprod": ("cumprod",),
    "atan2": ("atan2",),
    "cat": ("concatenate",),
}

# torch op -> the JAX library functions (``module:qualname``) that implement it as a composite.
# Inside a call of such a function every equation follows the torch op's category (outermost
# match wins), and for ops on no list the results come back in the dtype of the first floating
# input, as torch's kernel returns them.
FUNCTION_COUNTERPARTS: Mapping[str, tuple[str, ...]] = {
    "linear": (
        "flax.linen:Dense.__call__",
        "flax.linen:DenseGeneral.__call__",
        "flax.nnx:Linear.__call__",
        "flax.nnx:LinearGeneral.__call__",
    ),
    "conv2d": (
        "flax.linen:Conv.__call__",
        "flax.linen:ConvTranspose.__call__",
        "flax.nnx:Conv.__call__",
        "flax.nnx:ConvTranspose.__call__",
    ),
    "einsum": ("flax.linen:Einsum.__call__", "flax.nnx:Einsum.__call__"),
    "layer_norm": ("flax.linen:LayerNorm.__call__", "flax.nnx:LayerNorm.__call__"),
    "rms_norm": ("flax.linen:RMSNorm.__call__", "flax.nnx:RMSNorm.__call__"),
    "group_norm": ("flax.linen:GroupNorm.__call__", "flax.nnx:GroupNorm.__call__"),
    "batch_norm": ("flax.linen:BatchNorm.__call__", "flax.nnx:BatchNorm.__call__"),
    "mse_loss": ("optax.losses:l2_loss", "optax.losses:squared_error"),
    "cross_entropy_loss": (
        "optax.losses:softmax_cross_entropy",
        "optax.losses:softmax_cross_entropy_with_integer_labels",
    ),
    "binary_cross_entropy_with_logits": ("optax.losses:sigmoid_binary_cross_entropy",),
    "huber_loss": ("optax.losses:huber_loss",),
    "kl_div": ("optax.losses:kl_divergence",),
    "cosine_similarity": ("optax.losses:cosine_similarity",),
    "softmax.int": ("jax.nn:softmax",),
    "log_softmax.int": ("jax.nn:log_softmax",),
    "logsumexp": ("jax.nn:logsumexp",),
    "softplus": ("jax.nn:softplus",),
    "gelu": ("jax.nn:gelu",),
    "mean": ("jax.numpy:mean",),
    "var": ("jax.numpy:var",),
    "std": ("jax.numpy:std",),
    "scaled_dot_product_attention": ("jax.nn:dot_product_attention",),
}

# Where one JAX primitive serves torch ops of different categories.
DIVERGENCES: Mapping[str, str] = {
    "dot": "cuda promote; JAX's dot_general follows matmul (lower_precision_fp)",
    "vdot": "cuda promote; JAX's dot_general follows matmul (lower_precision_fp)",
    "tensordot": "cuda promote; JAX's dot_general follows matmul (lower_precision_fp)",
    "_addmm_activation": "lower_precision_fp on cpu only; dot_general follows matmul",
}

NO_JAX_COUNTERPART_NOTE = (
    "torch ops that JAX implements as composites of primitives with no 1:1 counterpart (losses, "
    "norms, pooling, padding, upsampling, linear algebra, FFT, RNN cells) are matched by the "
    "library functions in FUNCTION_COUNTERPARTS where one exists, otherwise by the primitives they "
    "are built from."
)
