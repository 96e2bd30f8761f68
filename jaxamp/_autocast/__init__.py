"""Op-level autocast: torch.autocast's per-op dtype rules as a jaxpr transform.

``autocast(fn)`` traces ``fn`` to a jaxpr and evaluates it again, equation by equation, with the
casts torch.autocast would insert: ops on torch's lower-precision list run in the autocast dtype,
ops on its float32 lists run in float32, everything else runs in the dtype of its inputs (with
JAX's standard promotion where a cast changed one input of an op and not another). The result is
an ordinary JAX function: it can be jitted, differentiated, vmapped, and costs nothing at run time
beyond the casts themselves.

One file per job:

* ``oplists``: torch.autocast's op lists as data, and their JAX counterparts;
* ``options``: argument checks (device, dtype, overrides);
* ``rules``: the rule tables built from the lists and the overrides (primitives, composites);
* ``interpreter``: the equation-by-equation evaluator, with the op-hook extension point;
* ``higher_order``: jit, remat, scan, while, cond, custom_jvp/vjp and shard_map;
* ``explicit_casts``: the user's same-dtype casts that JAX elides (the only JAX patching);
* ``api``: the public functions, re-exported as ``jaxamp.autocast`` etc.
"""

from jaxamp._autocast.api import autocast as autocast
from jaxamp._autocast.api import autocast_op_list as autocast_op_list
from jaxamp._autocast.api import autocast_trace as autocast_trace
from jaxamp._autocast.api import full_precision as full_precision
from jaxamp._autocast.interpreter import DtypeRecord as DtypeRecord
from jaxamp._autocast.oplists import AUTOCAST_CATEGORIES as AUTOCAST_CATEGORIES
from jaxamp._autocast.rules import autocast_rules as autocast_rules

__all__ = [
    "AUTOCAST_CATEGORIES",
    "DtypeRecord",
    "autocast",
    "autocast_op_list",
    "autocast_rules",
    "autocast_trace",
    "full_precision",
]
